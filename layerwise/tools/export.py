"""Export a run's model as one plain file anything can load.

    python -m layerwise.export RUN_DIR --out model.safetensors [--checkpoint last]
    python -m layerwise.export RUN_DIR --format hf --out DIR    a directory transformers loads

Writes the plain model's state dict — the names and shapes `models.build_model` gives, whatever
strategy trained it — with the model's config in the file's metadata, so
`load_exported(path)` (or any safetensors reader) gets the model back. The portable checkpoint
beside `last.ckpt` (`checkpoints/last`, strategies/checkpoint/portable.py) is read when it is there: it
already holds every tensor under its plain name, so only the model's tensors are read, never the
optimizer state. Otherwise per-rank checkpoints are read one pipeline position at a time (a rank file also holds its optimizer state, 3× its weights
under AdamW): only the plain model is ever whole in memory. Merging uses each strategy's own
`consolidate` (strategies/registry.py), the function the tests hold to `single`.
"""

import argparse
import json
import math
import sys
from pathlib import Path

from omegaconf import OmegaConf

from models.hf import follow_umask
from strategies import strategy_entry
from strategies.checkpoint.per_rank import CheckpointError, read_checkpoint_file
from strategies.checkpoint.portable import is_portable, portable_path, read_portable
from strategies.checkpoint.safe_load import UnsafeCheckpointError, read_dcp_tensors

PREFIX = "model."
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "vocab.json", "merges.txt", "tokenizer.model")  # what transformers' tokenizers read


def checkpoint_path(run_directory: Path, checkpoint: str) -> Path:
    path = Path(run_directory) / "checkpoints" / f"{checkpoint}.ckpt"
    if not path.exists():
        raise FileNotFoundError(f"{path} does not exist: export needs a run directory with a checkpoint "
                                f"(trainer.checkpoint_every_n_steps, or the one written at the end of fit)")
    return path


def run_config(run_directory):
    """The resolved config train.py saved in the run directory."""
    path = Path(run_directory) / "config.yaml"
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist: export reads the run's resolved config, which "
                                f"train.py writes there")
    config = OmegaConf.load(path)
    # train.py writes it resolved, so an interpolation means the file was edited: `${oc.env:...}`
    # would copy an environment variable (a W&B key) into the exported metadata.
    if "${" in OmegaConf.to_yaml(config):
        raise ValueError(f"{path} holds an interpolation (${{...}}), which a config train.py wrote never "
                         f"does: it was edited by hand. Fix: restore the run's config.yaml, or write the "
                         f"values in plainly.")
    return config


def plain_state(run_directory, checkpoint: str = "last") -> dict:
    """The plain model's state dict (models/ names) from any strategy's checkpoint."""
    path = checkpoint_path(Path(run_directory), checkpoint)
    if is_portable(portable_path(path)):
        path = portable_path(path)
    merged = merged_state(path, run_config(run_directory).strategy.name)
    return {name[len(PREFIX):]: value.detach().clone() for name, value in merged.items() if name.startswith(PREFIX)}


def merged_state(path: Path, strategy_name: str) -> dict:
    """The whole LightningModule state dict ("model." names) of one checkpoint, whatever the strategy
    (the tests compare it with `single`'s)."""
    path = Path(path)
    if is_portable(path):  # any strategy: the plain names already
        return read_portable(path)
    if path.is_file():  # single, ddp: one Lightning file
        state = read_checkpoint_file(path)["state_dict"]
        return {name.removeprefix("module."): value for name, value in state.items()}
    if (path / ".metadata").is_file():  # fsdp2: torch.distributed.checkpoint
        return _load_distributed_checkpoint(path)
    return _merge_positions(path, strategy_entry(strategy_name).consolidate)


def _load_distributed_checkpoint(path: Path) -> dict:
    """fsdp2's DCP directory: its model tensors ("state_dict.model.*"), read without running code."""
    prefix = "state_dict."
    return {key[len(prefix):]: value for key, value in read_dcp_tensors(path, prefix).items()}


def _merge_positions(path: Path, consolidate) -> dict:
    """One pipeline position at a time: its ranks' files (the data replicas and context shards too
    when they hold ZeRO shards, else data replica 0's context shard 0's tensor block; rank = t + T·(k +
    C·(p + P·d)), parallel/layout.py), merged by the strategy's consolidate."""
    layout = json.loads((path / "layout.json").read_text())
    data, pipeline, tensor = layout["data"], layout["pipeline"], layout.get("tensor", 1)
    context = layout.get("context", 1)
    merged = {}
    for position in range(pipeline):
        first_rank = tensor * context * position
        first = _load_rank(path, first_rank)
        sharded = any(name.startswith(PREFIX + "zero_shards.") for name in first)
        replicas, contexts = (data, context) if sharded else (1, 1)
        ranks = [t + tensor * (k + context * (position + pipeline * d))
                 for d in range(replicas) for k in range(contexts) for t in range(tensor)]
        states = [first if rank == first_rank else _load_rank(path, rank) for rank in ranks]
        merged.update(consolidate(states, {**layout, "data": replicas, "context": contexts, "pipeline": 1}))
        del first, states  # the next position's files replace these
    return merged


def _load_rank(path: Path, rank: int) -> dict:
    return read_checkpoint_file(path / f"rank{rank}.pt")["state_dict"]


def export(run_directory, out, checkpoint: str = "last") -> dict:
    """Write `out` (safetensors) and return the state dict written."""
    from safetensors.torch import save_file
    state = {name: value.contiguous() for name, value in plain_state(run_directory, checkpoint).items()}
    cfg, vocabulary = run_config(run_directory), state["embed.token.weight"].shape[0]
    metadata = {"model": json.dumps(OmegaConf.to_container(cfg.model, resolve=True)),
                "vocab_size": str(vocabulary), "seed": str(cfg.seed), "strategy": cfg.strategy.name,
                "checkpoint": checkpoint}
    save_file(state, str(out), metadata=metadata)
    follow_umask([out])  # safetensors writes 0600
    return state


def part_states(run_directory, checkpoint: str, layers: int):
    """The plain model's state dict one part at a time (embed, blocks.0, ..., head) from the
    portable checkpoint (only that part's tensors are read); from per-rank files, whole (merged
    one pipeline position at a time by plain_state)."""
    path = checkpoint_path(Path(run_directory), checkpoint)
    if not is_portable(portable_path(path)):
        yield plain_state(run_directory, checkpoint)
        return
    for part in ["embed", *(f"blocks.{index}" for index in range(layers)), "head"]:
        state = read_portable(portable_path(path), f"{PREFIX}{part}.")  # the dot: blocks.1 is not blocks.10
        yield {name[len(PREFIX):]: value for name, value in state.items()}


def special_tokens(cfg) -> dict:
    """{"bos", "eos", "pad"}: ids (or None) of the run's tokenizer (data.tokenizer: the EOS that
    joined its documents), else of model=hf's source config.json (bos/eos/pad_token_id, else its
    generation_config.json's); all None for byte corpora, which have none."""
    from models.hf import SPECIAL_TOKENS, tokenizer_facts
    tokenizer = cfg.data.get("tokenizer") if cfg.data.corpus == "text" else None
    if tokenizer and (Path(tokenizer).expanduser() / "tokenizer.json").is_file():
        facts = tokenizer_facts(tokenizer)
        return {kind: facts[kind] for kind in SPECIAL_TOKENS}
    found = dict.fromkeys(SPECIAL_TOKENS)
    source = Path(cfg.model.path).expanduser() if cfg.model.get("path") else None
    for name in ("generation_config.json", "config.json"):  # config.json's wins: read last
        file = source / name if source else None
        if file and file.is_file():
            fields = json.loads(file.read_text())
            found.update({kind: fields[f"{kind}_token_id"] for kind in SPECIAL_TOKENS
                          if fields.get(f"{kind}_token_id") is not None})
    return found


MOE_FIELDS = ("experts", "experts_per_token", "shared_experts", "moe_ffn_hidden", "moe_layers", "router",
              "router_normalize", "aux_loss_coefficient", "capacity_factor")


def export_hf(run_directory, out, checkpoint: str = "last") -> dict:
    """Write `out` as a Hugging Face model directory that transformers.AutoModelForCausalLM loads,
    reading the checkpoint one part at a time: config.json (with the run's BOS/EOS/pad ids:
    `special_tokens`), generation_config.json, model.safetensors or shards past 5 GB with their
    index, and the run's tokenizer files when it used one (data.tokenizer), each file's mode
    0o666 & ~umask; return the shapes written (our names)."""
    import shutil

    from models.hf import ShardWriter, hf_config, hf_tensors, write_config, write_generation_config
    from models.hf_moe import moe_family
    cfg = run_config(run_directory)
    fields = {name: cfg.model.get(name) for name in ("layers", "hidden", "heads", "mlp_ratio", "tie_embeddings",
                                                     "kv_heads", "ffn_hidden", "norm_eps", "rope_theta",
                                                     "rope_scaling", "qkv_bias", "max_sequence_length",
                                                     "head_dim", "qk_norm", *MOE_FIELDS)}
    fields["rope_scaling"] = OmegaConf.to_container(cfg.model.rope_scaling) if cfg.model.get("rope_scaling") else None
    fields["moe_layers"] = list(cfg.model.moe_layers) if cfg.model.get("moe_layers") is not None else None
    # Mixtral or Qwen3-MoE (models/hf_moe.py), refused by name before a byte is written
    moe = moe_family(**{name: value for name, value in fields.items() if value is not None}) \
        if fields.get("experts") else None
    shapes, writer = {}, ShardWriter(out)
    for state in part_states(run_directory, checkpoint, cfg.model.layers):
        for name, tensor in hf_tensors(cfg.model.architecture, state.items(), bool(cfg.model.tie_embeddings), moe):
            writer.add(name, tensor)
        shapes.update({name: value.shape for name, value in state.items()})
        del state  # the next part replaces it
    config = hf_config(cfg.model.architecture, vocab_size=shapes["embed.token.weight"][0],
                       special_tokens=special_tokens(cfg),
                       **{name: value for name, value in fields.items() if value is not None})
    writer.close()
    written = [*writer.written, write_config(out, config), write_generation_config(out, config)]
    tokenizer = cfg.data.get("tokenizer") if cfg.data.corpus == "text" else None
    if tokenizer:
        for name in TOKENIZER_FILES:
            if (Path(tokenizer).expanduser() / name).is_file():
                written.append(Path(shutil.copyfile(Path(tokenizer).expanduser() / name, Path(out) / name)))
    follow_umask(written)
    return shapes


def load_exported(path):
    """(the plain model with the exported weights, its model config) from an exported file."""
    from safetensors import safe_open
    from safetensors.torch import load_file

    from layerwise.run.task import model_arguments
    from models import build_model
    with safe_open(str(path), framework="pt") as handle:
        metadata = handle.metadata()
    model_config = OmegaConf.create(json.loads(metadata["model"]))
    model = build_model(model_config.architecture,
                        **model_arguments(model_config, int(metadata["vocab_size"]), int(metadata["seed"])))
    model.load_state_dict(load_file(str(path)))
    return model, model_config


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("run_directory", type=Path, help="a run directory (runs/<run_name>)")
    parser.add_argument("--out", type=Path, required=True,
                        help="the .safetensors file to write (--format hf: the directory)")
    parser.add_argument("--format", choices=("layerwise", "hf"), default="layerwise",
                        help="layerwise: one .safetensors file with the config in its metadata (default); "
                             "hf: a Hugging Face model directory transformers loads")
    parser.add_argument("--checkpoint", default="last", help="which checkpoint: last (default) or a step name")
    arguments = parser.parse_args()
    try:
        write = export_hf if arguments.format == "hf" else export
        state = write(arguments.run_directory, arguments.out, arguments.checkpoint)
    except (FileNotFoundError, CheckpointError, UnsafeCheckpointError) as error:  # nothing was written
        print(f"layerwise: {error}", file=sys.stderr)
        sys.exit(2)
    parameters = sum(math.prod(getattr(value, "shape", value)) for value in state.values())
    print(f"[layerwise] exported {len(state)} tensors ({parameters:,} parameters) to {arguments.out}")


if __name__ == "__main__":
    main()
