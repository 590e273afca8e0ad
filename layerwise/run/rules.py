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
    if cfg.mode != "fit" or hardware.accelerator != "gpu" or submitting:
        return []
    if not gpu_available():
        return [f"hardware={hardware.name} needs CUDA GPUs and this machine has none. "
                f"Fix: hardware=cpu here, or submit with hydra/launcher=slurm."]
    from layerwise.run.launch import launched_externally, local_gpu_count
    return [] if launched_externally() else local_launch_problems(cfg, local_gpu_count())


def local_launch_problems(cfg, gpus: int) -> list:
    """What train.py's own launcher (layerwise/run/launch.py) would do wrong on this machine's `gpus`
    GPUs: rank r takes GPU r mod devices_per_node, so emulated nodes share GPUs (NCCL refuses
    duplicates) and more ranks per node than GPUs name a device that does not exist."""
    from strategies.registry import strategy_entry
    hardware = cfg.hardware
    if strategy_entry(cfg.strategy.name).one_process:
        return []
    if hardware.nodes > 1:
        return [f"hardware.nodes={hardware.nodes} without Slurm or torchrun: the local launcher would "
                f"start {hardware.nodes} emulated nodes here, whose ranks would share this machine's "
                f"GPUs (NCCL: duplicate GPU). Fix: hardware.nodes=1 with hardware.devices_per_node="
                f"{gpus} or fewer, or one torchrun per node, or hydra/launcher=slurm."]
    if hardware.devices_per_node > gpus:
        return [f"hardware.devices_per_node={hardware.devices_per_node} ranks on this machine's {gpus} "
                f"GPUs (NVML's count, after CUDA_VISIBLE_DEVICES). Fix: "
                f"hardware.devices_per_node={gpus} or fewer."]
    return []


HF_FIELDS = ("architecture", "layers", "hidden", "heads", "mlp_ratio", "kv_heads", "ffn_hidden", "norm_eps",
             "rope_theta", "rope_scaling", "qkv_bias", "tie_embeddings", "max_sequence_length", "vocab_size",
             "head_dim", "qk_norm", "experts", "experts_per_token", "shared_experts", "moe_ffn_hidden", "moe_layers",
             "router", "router_normalize", "aux_loss_coefficient", "capacity_factor")  # MoE: models/hf_moe.py


def fill_hf_model(cfg) -> list:
    """model.path set (model=hf): the architecture and shape come from the directory's config.json
    (models/hf.py hf_shape), written into cfg.model so every later rule, the plan and each rank see
    the model that will be built; a field we cannot honour is an error naming it."""
    if "path" in cfg.model and OmegaConf.is_missing(cfg.model, "path"):
        return [f"model.path is not set: model={cfg.model.name} reads a Hugging Face model directory. "
                f"Fix: model.path=/path/to/dir (config.json + *.safetensors)."]
    path = cfg.model.get("path")
    if not path:
        return []
    from models.hf import hf_shape, read_config
    try:
        shape = hf_shape(read_config(path), cfg.data.sequence_length)
    except (FileNotFoundError, ValueError, KeyError) as error:
        return [f"{error}".strip("'")]
    for name in HF_FIELDS:
        cfg.model[name] = shape.get(name) if name in shape else (None if name in ("kv_heads", "ffn_hidden") else cfg.model[name])
    corpus_vocabulary = {"token_bin": cfg.data.vocab_size, "text": 0}.get(cfg.data.corpus, 256)  # text: the
    # tokenizer's ids, compared with the model's by layerwise/config/validate.py check_vocabulary
    if corpus_vocabulary > shape["vocab_size"]:
        return [f"data={cfg.data.name} gives token ids up to {corpus_vocabulary - 1}, beyond the "
                f"{shape['vocab_size']} of model.path's config.json vocab_size. Fix: tokenize with the "
                f"model's own tokenizer (data=text data.tokenizer=DIR)."]
    return []


def check_data(cfg) -> list:
    """The data group's files exist; plan mode without a dry run reads none (it needs only
    data.vocab_size, so a Llama 3 plan can price its 128,256-token vocabulary with no corpus here)."""
    if cfg.mode == "plan" and not cfg.plan.dry_run:
        return []
    data, errors = cfg.data, []
    if data.corpus == "text":
        return text_data_errors(data)
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


def text_data_errors(data) -> list:
    """data=text: the text and the tokenizer directory exist (layerwise/run/text.py reads them)."""
    errors = []
    if OmegaConf.is_missing(data, "path") or not data.path:
        errors.append("data.path is not set: data=text reads your .txt/.jsonl/.parquet files. "
                      "Fix: data.path=/a/file/or/directory.")
    elif not Path(str(data.path)).expanduser().exists():
        errors.append(f"data.path={data.path!r} does not exist. Fix: data.path=/a/file/or/directory of text.")
    if OmegaConf.is_missing(data, "tokenizer") or not data.get("tokenizer"):
        errors.append("data.tokenizer is not set: data=text tokenizes with a Hugging Face tokenizer. "
                      "Fix: data.tokenizer=/a/directory holding tokenizer.json (a model directory will do).")
    elif not (Path(str(data.tokenizer)).expanduser() / "tokenizer.json").is_file():
        errors.append(f"data.tokenizer={data.tokenizer!r} holds no tokenizer.json. Fix: point it at a "
                      f"Hugging Face tokenizer or model directory.")
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
    from strategies.checkpoint.portable import persistent_buffers, resume_errors

    def expected_shapes(vocabulary: int) -> dict:
        arguments = model_arguments(cfg.model, vocabulary, cfg.seed)
        arguments["layers"] = resumed_depth(cfg)
        model = build_model(cfg.model.architecture, device="meta", **arguments)
        # what a portable checkpoint holds: the parameters and the persistent buffers (an MoE's expert bias)
        return {name: tuple(tensor.shape) for name, tensor in [*model.named_parameters(), *persistent_buffers(model)]}
    return resume_errors(cfg.resume_from, expected_shapes)


def resumed_depth(cfg) -> int:
    """The depth `resume_from` continues at: the checkpoint's recorded depth when this config's
    growth schedule (strategy.grow_at, grow_by) reaches it, else model.layers."""
    from layerwise.run.task import depths
    from strategies.checkpoint.portable import read_sidecar, resolve_portable
    depth = read_sidecar(resolve_portable(cfg.resume_from)).get("model_depth", cfg.model.layers)
    return depth if depth in depths(cfg) else cfg.model.layers
