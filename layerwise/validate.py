"""Cross-group checks, run once after composition and before any process starts.

Every message names the field, what is wrong, and the fix. All problems are collected and reported
together, so a user fixes a config in one round instead of one error per launch.
"""

import dataclasses
from pathlib import Path

from omegaconf import OmegaConf

from strategies import REGISTRY, strategy_entry
from strategies.checks import divisors, fp16_errors, gradient_clipping_errors, nearest_multiples

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
            "trainer.checkpoint_every_n_steps", "hardware.devices_per_node", "hardware.nodes")
POSITIVE_STRATEGY = ("micro_batches", "pipeline_degree")  # where the strategy's schema has them
SCHEMA_GROUPS = ("strategy", "model", "hardware", "data", "optimizer", "logger", "trainer")
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
    if strategy_entry(cfg.strategy.name).one_process:
        return 1
    return cfg.hardware.nodes * cfg.hardware.devices_per_node


def check_choices(cfg) -> list:
    errors = []
    for field, allowed in CHOICES.items():
        value = lookup(cfg, field)
        if value not in allowed:
            errors.append(f"{field}={value!r} is unknown. Fix: one of {', '.join(allowed)}.")
    if cfg.strategy.name not in REGISTRY:
        errors.append(f"strategy={cfg.strategy.name!r} is unknown. Fix: one of "
                      f"{', '.join(sorted(REGISTRY))}.")
    fields = POSITIVE + tuple(f"strategy.{name}" for name in POSITIVE_STRATEGY if name in cfg.strategy)
    for field in fields:
        if lookup(cfg, field) < 1:
            errors.append(f"{field}={lookup(cfg, field)} must be at least 1.")
    return errors


def check_schema_keys(cfg) -> list:
    """Keys a schema does not declare. Hydra rejects `strategy.micro_batches=4` for a strategy
    without micro-batches, and its message suggests `+strategy.micro_batches=4`, which would be
    accepted and then ignored: reject that here."""
    errors = []
    for group in SCHEMA_GROUPS:
        schema = OmegaConf.get_type(cfg[group])
        if not dataclasses.is_dataclass(schema):
            continue
        owner = f"{group}={cfg[group].name}" if "name" in cfg[group] else group
        declared = {field.name for field in dataclasses.fields(schema)}
        for key in sorted(set(cfg[group]) - declared):
            errors.append(f"{group}.{key}={cfg[group][key]} is not a setting of {owner} (schema "
                          f"{schema.__name__}), so it would be ignored. Fix: remove {group}.{key}.")
    return errors


def check_model(cfg) -> list:
    model, data, errors = cfg.model, cfg.data, []
    if model.heads >= 1 and model.hidden % model.heads:
        closest = sorted(divisors(model.hidden), key=lambda h: abs(h - model.heads))[:2]
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
    """This node has a CUDA device, asked without initialising CUDA: the ranks are started after
    this check, and forked children cannot use CUDA once the parent initialised it."""
    from layerwise.launch import local_gpu_count
    return local_gpu_count() > 0


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


def micro_batches(strategy) -> int:
    """Micro-batches per optimizer step. The one generic reader of a field not every schema has:
    a strategy without `micro_batches` (single, ddp, tensor parallel) runs its batch in one pass."""
    return strategy.micro_batches if "micro_batches" in strategy else 1


def check_strategy(cfg, world: int) -> list:
    if cfg.strategy.name not in REGISTRY:
        return []
    entry = strategy_entry(cfg.strategy.name)
    errors = (entry.check(cfg, world) + gradient_clipping_errors(cfg.strategy.name, cfg.trainer.gradient_clip_val)
              + fp16_errors(cfg.strategy.name, cfg.hardware.precision))
    if errors:
        return errors
    data_degree, micro = entry.degrees(cfg, world).data, micro_batches(cfg.strategy)
    batch = cfg.data.global_batch_size
    if batch % (data_degree * micro):
        errors.append(f"data.global_batch_size={batch} does not split into {data_degree} data-parallel "
                      f"ranks × {micro} micro-batches. Fix: data.global_batch_size="
                      f"{nearest_multiples(batch, data_degree * micro)}.")
    return errors


def validate(cfg, submitting: bool = False) -> int:
    """Raise ConfigError listing every problem; return the world size when the config is sound,
    and leave it read-only: what every rank runs is exactly what was validated.

    `submitting`: the run goes to a cluster (layerwise.slurm checks every point before submission),
    so this machine's own devices do not matter."""
    errors = check_choices(cfg) + check_schema_keys(cfg)
    if errors:  # later checks assume known names and declared keys
        raise ConfigError(errors)
    world = world_size(cfg)
    errors = (check_model(cfg) + check_hardware(cfg, world, submitting) + check_data(cfg)
              + check_strategy(cfg, world))
    if errors:
        raise ConfigError(errors)
    OmegaConf.set_readonly(cfg, True)
    return world
