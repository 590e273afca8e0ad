"""A finished run's charts: plan mode's files for the run's own config, and every chart as an image in
W&B and TensorBoard (the evidence callback calls these on rank 0 at the end of a run)."""

import io
from contextlib import redirect_stdout
from pathlib import Path


def write_plan_charts(cfg, world_size: int, run_directory: Path, charts: bool = True) -> list:
    """For a planned strategy, plan mode's files for the run's own config in its directory
    (plan.json, and with `charts` the predicted step `plan.png` and the memory per rank role
    `plan_memory.png`); returns the charts' paths (none for other strategies or without charts)."""
    from layerwise.planning.inputs import PLANNED
    from layerwise.planning.mode import plan
    if cfg.strategy.name not in PLANNED:
        return []
    with redirect_stdout(io.StringIO()):  # plan mode's terminal table: the run has its own lines
        plan(cfg, world_size, run_directory, charts=charts)
    return [Path(run_directory) / "plan_memory.png", Path(run_directory) / "plan.png"] if charts else []


def log_run_evidence(loggers, images: list, summary: dict) -> None:
    """A finished run's charts as images (W&B and TensorBoard, keyed by file name) and its
    summary.json values under their own names in the W&B run summary."""
    from lightning.pytorch.loggers import TensorBoardLogger, WandbLogger
    for logger in loggers:
        if isinstance(logger, WandbLogger):
            for path in images:
                logger.log_image(key=Path(path).stem, images=[str(path)])
            # the per-step `losses` are the history's `loss`; everything else as summary.json names it
            logger.experiment.summary.update({k: v for k, v in summary.items() if k != "losses"})
        elif isinstance(logger, TensorBoardLogger):
            import numpy
            from PIL import Image
            for path in images:
                pixels = numpy.asarray(Image.open(path).convert("RGB"))
                logger.experiment.add_image(Path(path).stem, pixels, global_step=summary["steps"],
                                            dataformats="HWC")
            logger.experiment.flush()
