"""Cross-group checks, run once after composition and before any process starts.

Every message names the field, what is wrong, and the fix. All problems are collected and reported
together, so a user fixes a config in one round instead of one error per launch.
"""

from pathlib import Path

from omegaconf import OmegaConf

from strategies import ONE_PROCESS, STRATEGIES, strategy_module

CHOICES = {
    "mode": ("fit", "check"),
    "model.architecture": ("gpt", "bert"),
    "data.corpus": ("stdlib", "text_files", "token_bin"),
    "hardware.accelerator": ("cpu", "gpu"),
    "hardware.process_group_backend": ("gloo", "nccl"),
    "optimizer.name": ("adamw", "lamb", "sgd"),
    "optimizer.lr_schedule": ("cosine", "constant"),
    "logger.name": ("wandb", "csv", "tensorboard", "none"),
    "logger.mode": ("offline", "online", "disabled"),
    "trainer.progress": ("auto", "bar", "lines", "none"),
}
CPU_PRECISIONS = ("32-true", "32", "bf16-mixed", "bf16-true")
POSITIVE = ("model.layers", "model.hidden", "model.heads", "data.global_batch_size",
            "data.sequence_length", "trainer.max_steps", "trainer.val_check_interval",
            "trainer.checkpoint_every_n_steps", "hardware.devices_per_node", "hardware.nodes",
            "strategy.micro_batches", "strategy.pipeline_degree")
BYTES_PER_PARAMETER = 16  # fp32 weight + gradient + two Adam moments


class ConfigError(ValueError):
    """One or more configuration problems; `problems` lists them, the message shows them all."""

    def __init__(self, problems):
        self.problems = list(problems)
        lines = "\n".join(f"  - {problem}" for problem in self.problems)
        super().__init__(f"invalid configuration ({len(self.problems)} problem"
                         f"{'s' if len(self.problems) > 1 else ''}):\n{lines}")


def lookup(cfg, dotted: str):
    node = cfg
    for key in dotted.split("."):
        node = node[key]
    return node


def world_size(cfg) -> int:
    """Processes in the job: nodes × devices per node; one-process strategies always use one."""
    if cfg.strategy.name in ONE_PROCESS:
        return 1
    return cfg.hardware.nodes * cfg.hardware.devices_per_node


def check_choices(cfg) -> list:
    errors = []
    for field, allowed in CHOICES.items():
        value = lookup(cfg, field)
        if value not in allowed:
            errors.append(f"{field}={value!r} is unknown. Fix: one of {', '.join(allowed)}.")
    if cfg.strategy.name not in STRATEGIES:
        errors.append(f"strategy={cfg.strategy.name!r} is unknown. Fix: one of "
                      f"{', '.join(sorted(STRATEGIES))}.")
    for field in POSITIVE:
        if lookup(cfg, field) < 1:
            errors.append(f"{field}={lookup(cfg, field)} must be at least 1.")
    return errors


def check_model(cfg) -> list:
    model, data, errors = cfg.model, cfg.data, []
    if model.heads >= 1 and model.hidden % model.heads:
        near = [h for h in range(1, model.hidden + 1) if model.hidden % h == 0]
        closest = sorted(near, key=lambda h: abs(h - model.heads))[:2]
        errors.append(f"model.hidden={model.hidden} is not divisible by model.heads={model.heads}. "
                      f"Fix: model.heads={' or '.join(map(str, sorted(closest)))}.")
    if data.sequence_length > model.max_sequence_length:
        errors.append(f"data.sequence_length={data.sequence_length} exceeds the model's "
                      f"model.max_sequence_length={model.max_sequence_length}. Fix: lower "
                      f"data.sequence_length or raise model.max_sequence_length.")
    if model.planning_only and cfg.mode == "fit":
        errors.append(f"model={model.name} is a planning-only shape ({model.layers} layers × "
                      f"{model.hidden} wide): it cannot be trained on this machine. Fix: "
                      f"mode=check, or a trainable model such as model=gpt_small.")
    return errors


def approximate_parameters(model) -> int:
    """12·L·h² for the blocks (attention 4h², MLP 2·r·h²) plus embeddings; enough for a limit."""
    blocks = model.layers * (4 + 2 * model.mlp_ratio) * model.hidden ** 2
    return blocks + (256 + model.max_sequence_length) * model.hidden


def check_hardware(cfg, world: int, submitting: bool = False) -> list:
    hardware, errors = cfg.hardware, []
    if hardware.accelerator == "cpu" and hardware.precision not in CPU_PRECISIONS:
        errors.append(f"hardware.precision={hardware.precision!r} is not supported on CPU. "
                      f"Fix: hardware.precision=32-true (or bf16-mixed).")
    if hardware.accelerator == "cpu" and hardware.process_group_backend != "gloo":
        errors.append("hardware.process_group_backend must be gloo on CPU. Fix: "
                      "hardware.process_group_backend=gloo.")
    # submitting (hydra/launcher=slurm): the GPUs are on the cluster's nodes, not on this machine
    if cfg.mode == "fit" and hardware.accelerator == "gpu" and not submitting and not gpu_available():
        errors.append(f"hardware={hardware.name} needs CUDA GPUs and this machine has none. "
                      f"Fix: hardware=cpu here, or submit with hydra/launcher=slurm.")
    budget = hardware.device_memory_bytes if hardware.accelerator == "gpu" else hardware.host_memory_bytes
    needed = approximate_parameters(cfg.model) * BYTES_PER_PARAMETER
    if cfg.mode == "fit" and not cfg.model.planning_only and budget and needed > budget:
        errors.append(f"model={cfg.model.name} needs about {needed / 1e9:.1f} GB for weights, "
                      f"gradients and Adam state, more than hardware.{'device' if hardware.accelerator == 'gpu' else 'host'}"
                      f"_memory_bytes={budget / 1e9:.1f} GB. Fix: a smaller model or a sharding "
                      f"strategy.")
    return errors


def gpu_available() -> bool:
    import torch
    return torch.cuda.is_available()


def check_data(cfg) -> list:
    data, errors = cfg.data, []
    holding = "text files" if data.corpus == "text_files" else "train.bin and val.bin"
    if data.corpus in ("text_files", "token_bin"):
        if OmegaConf.is_missing(data, "path") or data.path is None:
            errors.append(f"data.path is not set: data={data.name} reads your files. "
                          f"Fix: data.path=/a/directory holding your {holding}.")
        elif not Path(str(data.path)).exists():
            errors.append(f"data.path={data.path!r} does not exist. Fix: data.path=/a/directory "
                          f"holding your {holding}.")
    return errors


def check_strategy(cfg, world: int) -> list:
    if cfg.strategy.name not in STRATEGIES:
        return []
    module = strategy_module(cfg.strategy.name)
    errors = module.check(cfg, world)
    if errors:
        return errors
    data_degree = module.degrees(cfg, world).data
    per_step = data_degree * cfg.strategy.micro_batches
    if cfg.data.global_batch_size % per_step:
        lower = cfg.data.global_batch_size // per_step * per_step or per_step
        errors.append(f"data.global_batch_size={cfg.data.global_batch_size} does not split into "
                      f"{data_degree} data-parallel ranks × {cfg.strategy.micro_batches} micro-batches. "
                      f"Fix: data.global_batch_size={lower} or {lower + per_step}.")
    return errors


def validate(cfg, submitting: bool = False) -> int:
    """Raise ConfigError listing every problem; return the world size when the config is sound.

    `submitting`: the run goes to a cluster (layerwise.slurm checks every point before submission),
    so this machine's own devices do not matter."""
    errors = check_choices(cfg)
    if errors:  # later checks assume known names
        raise ConfigError(errors)
    world = world_size(cfg)
    errors = (check_model(cfg) + check_hardware(cfg, world, submitting) + check_data(cfg)
              + check_strategy(cfg, world))
    if errors:
        raise ConfigError(errors)
    return world
