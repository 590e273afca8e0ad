"""The run's own pre-flight rules: what a rank would refuse after start-up, found before any starts.

layerwise/preflight.py collects these with every other room's rules into one ConfigError.
"""

import os
from pathlib import Path

from omegaconf import OmegaConf

from layerwise.run.data import TOKEN_BIN_FILES


def gpu_available() -> bool:
    """This node has a CUDA device, asked without initialising CUDA: the ranks are started after
    this check, and forked children cannot use CUDA once the parent initialised it."""
    from layerwise.run.launch import local_gpu_count
    return local_gpu_count() > 0


def gpu_errors(cfg, submitting: bool = False) -> list:
    """A GPU profile to fit here needs a GPU here; submitting (hydra/launcher=slurm): the GPUs are on
    the cluster's nodes, not on this machine."""
    hardware = cfg.hardware
    if cfg.mode == "fit" and hardware.accelerator == "gpu" and not submitting and not gpu_available():
        return [f"hardware={hardware.name} needs CUDA GPUs and this machine has none. "
                f"Fix: hardware=cpu here, or submit with hydra/launcher=slurm."]
    return []


def check_data(cfg) -> list:
    """The data group's files exist; plan mode without a dry run reads none (it needs only
    data.vocab_size, so a Llama 3 plan can price its 128,256-token vocabulary with no corpus here)."""
    if cfg.mode == "plan" and not cfg.plan.dry_run:
        return []
    data, errors = cfg.data, []
    holding = "text files" if data.corpus == "text_files" else "train.bin and val.bin"
    if data.corpus in ("text_files", "token_bin"):
        if OmegaConf.is_missing(data, "path") or data.path is None:
            errors.append(f"data.path is not set: data={data.name} reads your files. "
                          f"Fix: data.path=/a/directory holding your {holding}.")
        elif not Path(str(data.path)).expanduser().exists():
            errors.append(f"data.path={data.path!r} does not exist. Fix: data.path=/a/directory "
                          f"holding your {holding}.")
        else:
            errors += data_path_errors(data, Path(str(data.path)).expanduser())
    return errors


def data_path_errors(data, directory: Path) -> list:
    """What layerwise/run/data.py would refuse in every rank after start-up, found here first."""
    fix = f"Fix: data.path=/a/directory holding your {'text files' if data.corpus == 'text_files' else 'train.bin and val.bin'}."
    if not directory.is_dir():
        return [f"data.path={data.path!r} is a file, not a directory. {fix}"]
    if data.corpus == "text_files":
        has_text = any(not name.startswith(".") and (Path(folder) / name).stat().st_size
                       for folder, _, names in os.walk(directory) for name in names)
        return [] if has_text else [f"data.path={data.path!r} holds no non-empty files. {fix}"]
    errors = []
    for name in TOKEN_BIN_FILES:
        file = directory / name
        if not file.is_file():
            errors.append(f"data.path={data.path!r} has no {name} (nanoGPT's uint16 token file). {fix}")
        elif file.stat().st_size == 0 or file.stat().st_size % 2:
            errors.append(f"data.path={data.path!r}: {name} holds {file.stat().st_size} bytes, not a "
                          f"non-empty uint16 array. Fix: re-export {name} as uint16 tokens.")
    return errors


def check_resume_from(cfg) -> list:
    """`resume_from`: an existing portable checkpoint of this model's shape (strategies/checkpoint/portable.py)."""
    if not cfg.get("resume_from"):
        return []
    from layerwise.run.task import model_arguments  # Lightning: imported only when a run resumes
    from models import build_model
    from strategies.checkpoint.portable import resume_errors

    def expected_shapes(vocabulary: int) -> dict:
        arguments = model_arguments(cfg.model, vocabulary, cfg.seed)
        arguments["layers"] = resumed_depth(cfg)
        model = build_model(cfg.model.architecture, device="meta", **arguments)
        return {name: tuple(parameter.shape) for name, parameter in model.named_parameters()}
    return resume_errors(cfg.resume_from, expected_shapes)


def resumed_depth(cfg) -> int:
    """The depth `resume_from` continues at: the checkpoint's recorded depth when this config's
    growth schedule (strategy.grow_at, grow_by) reaches it, else model.layers."""
    from layerwise.run.task import depths
    from strategies.checkpoint.portable import read_sidecar, resolve_portable
    depth = read_sidecar(resolve_portable(cfg.resume_from)).get("model_depth", cfg.model.layers)
    return depth if depth in depths(cfg) else cfg.model.layers
