"""layerwise: compose a strategy, a model and a hardware profile, validate, then check or fit.

    python train.py                                  the default experiment
    python train.py strategy=single model=bert_tiny  one run, overridden
    python train.py -m strategy=single,ddp           a sweep: one run directory per point
    python train.py mode=check                       compose and validate only
    python train.py --help                           the config groups and their options
"""

import os
import sys

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import OmegaConf

from layerwise.config import register_schemas
from layerwise.validate import ConfigError, validate

register_schemas()
os.environ.setdefault("WANDB_MODE", "offline")  # nothing leaves the machine unless asked


def finish_config(cfg) -> None:
    """Fill what only the launcher knows: the sweep becomes the W&B group of its points."""
    hydra_config = HydraConfig.get()
    if cfg.logger.group is None and hydra_config.mode.name == "MULTIRUN":
        cfg.logger.group = os.path.basename(hydra_config.sweep.dir)
    if hydra_config.mode.name == "MULTIRUN" and hydra_config.job.override_dirname:
        cfg.run_name = hydra_config.job.override_dirname  # the point's overrides name its W&B run


@hydra.main(config_path="conf", config_name="config", version_base="1.3")
def main(cfg) -> float:
    finish_config(cfg)
    try:
        world_size = validate(cfg)  # before any process starts
    except ConfigError as error:
        print(f"layerwise: {error}", file=sys.stderr)
        sys.exit(2)
    run_directory = HydraConfig.get().runtime.output_dir
    if int(os.environ.get("SLURM_PROCID", 0)) == 0:  # under srun every rank gets here: one writes
        OmegaConf.save(cfg, os.path.join(run_directory, "config.yaml"), resolve=True)
    print(f"[layerwise] {cfg.strategy.name} × {cfg.model.name} × {cfg.hardware.name}: "
          f"{world_size} rank(s), run directory {run_directory}", flush=True)
    if cfg.mode == "check":
        print("[layerwise] configuration is valid; mode=check starts nothing", flush=True)
        return 0.0
    from layerwise.run import train
    summary = train(cfg, run_directory, world_size)
    print(f"[layerwise] {summary['status']}: validation loss {summary['initial_val_loss']:.4f} -> "
          f"{summary['final_val_loss']:.4f} nats/token, {summary['tokens_per_s_median']:.0f} "
          f"tokens/s; evidence in {run_directory}", flush=True)
    if cfg.logger.name == "wandb" and cfg.logger.mode == "offline":
        print(f"[layerwise] upload the W&B run with: wandb sync {run_directory}/wandb/offline-run-*",
              flush=True)
    return summary["final_val_loss"]


if __name__ == "__main__":
    main()
