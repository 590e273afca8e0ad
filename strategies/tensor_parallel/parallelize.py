"""The plan (module name -> Style) of a plain GPT or Llama and the functions that apply it on a grid.

    form = parallelize_3d(model, layout, device)   # or parallelize_1d / parallelize_2d

replaces the planned modules in place by their parallel forms, cut from the plain model's own
(seeded) weights, so the parallel run starts exactly from the reference weights. A model on the
meta device is materialised one part at a time (the embedding, a block, the head), cut, and that
part's plain weights dropped: a rank never holds more than one full part besides its shards.
"""

from dataclasses import dataclass
from typing import Callable, Dict, Tuple

import torch
import torch.nn as nn

from models import DESCRIPTIONS, describe_block, on_meta
from strategies.tensor_parallel.grids import Style, grid_of, interleave_fused
from strategies.tensor_parallel.layers import (
    ColumnParallelLinear,
    CopyToGroup,
    GridLinear,
    ParallelEmbedding,
    ParallelNorm,
    RowParallelLinear,
    VocabularyParallelLoss,
)
from strategies.tensor_parallel.sequence import GatherToSequence, SequenceRegion, ShardDropout


def block_plan(description) -> Dict[str, Style]:
    """Module name -> Style of one block, from its description (models.BlockDescription): a
    column linear is the "first" of a pair, a row linear the "second" — the explicit argument
    that alternates the 3-D axis roles and picks Megatron's column/row form in 1-D."""
    plan = {name: Style("norm") for name in description.norms}
    plan.update({linear.name: Style("linear", "first" if linear.role == "column" else "second",
                                    fused=linear.fused) for linear in description.linears})
    if description.qk_norm:  # after q and k's column linears, on whole heads: kept whole (1-D grid only)
        plan.update({name: Style("head_norm") for name in ("attention.q_norm", "attention.k_norm")})
    return plan


# Every architecture's block plan in one: their linears' names differ (GPT's fused qkv and fc_in,
# Llama's q/k/v and gate/up), so a parameter's name alone finds its style (checkpoints, K-FAC).
BLOCK_PLAN = {name: style for architecture in DESCRIPTIONS
              for name, style in block_plan(describe_block(architecture, hidden=8, heads=2, qk_norm=True)).items()}


def plan_of_parts(parts, model: nn.Module = None) -> Dict[str, Style]:
    """Module name -> Style for the named parts of a model ("embed", "blocks.<i>", "head"): a
    pipeline rank holds only its stages' parts. The head is a "first" linear. With `model`: only
    the modules it has (BLOCK_PLAN names every architecture's)."""
    plan = {}
    for part in parts:
        if part == "embed":
            plan["embed"] = Style("embedding")
        elif part == "head":
            plan.update({"head.norm": Style("norm"), "head.output": Style("linear", "first")})
        else:
            plan.update({f"{part}.{name}": style for name, style in BLOCK_PLAN.items()
                         if model is None or _has(model, f"{part}.{name}")})
    return plan


def _has(model: nn.Module, name: str) -> bool:
    try:
        model.get_submodule(name)
        return True
    except AttributeError:
        return False


@dataclass
class TensorParallelForm:
    """A parallelised model, its loss, and the groups each replicated parameter's gradient spans."""

    model: nn.Module
    loss: Callable
    gradient_groups: Dict[str, Tuple]  # parameter name -> Groups to sum its gradient over
    grid: object = None  # this rank's grid (its activation pieces: grids.local_activation_shape)


def cut(grid, style: Style, name: str, full: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a plain parameter (fused outputs interleaved first)."""
    if full is None:
        return None
    if style.kind == "linear":
        full = interleave_fused(full, style.fused, grid.output_parts)
    return grid.cut(style, name, full)


def parallel_module(module: nn.Module, style: Style, grid, layout, shard=None, region=None,
                    narrow: bool = False) -> nn.Module:
    """The parallel form of one plain module, holding this rank's shards. `shard(path, leaf, full)`
    gives the shard of the parameter at `path` (default: cut from the materialised `full`).
    `region`: the 1-D grid's sequence-parallel region (sequence.py), or None. `narrow`: the 1-D
    grid's all-reduces in the compute dtype (collectives.wire_dtype)."""
    shard = shard or (lambda path, leaf, full: cut(grid, style, leaf, full))
    if style.kind == "embedding":
        position = getattr(module, "position", None)  # Llama has none: RoPE in every block
        return ParallelEmbedding(shard("token.weight", "weight", module.token.weight),
                                 None if position is None else shard("position.weight", "weight", position.weight),
                                 getattr(getattr(module, "dropout", None), "p", 0.0), grid.input_rows(), region)
    if style.kind == "head_norm":  # whole on every rank; its gradient is summed over "tensor"
        return module
    weight = shard("weight", "weight", module.weight)
    bias = None if getattr(module, "bias", None) is None else shard("bias", "bias", module.bias)
    if style.kind == "norm":
        if grid.norm_family is None:  # 1-D: features whole, the plain LayerNorm / RMSNorm is right;
            # its output feeds column linears: Megatron's f, or the sequence gather that replaces it
            module.register_forward_hook(CopyToGroup(layout, narrow) if region is None else GatherToSequence(region))
            return module
        return ParallelNorm(weight, bias, module.eps, layout, grid.norm_family)
    if grid.name != "1d":
        return GridLinear(weight, bias, layout, grid.linear_specs(style.position))
    linear = ColumnParallelLinear if style.position == "first" else RowParallelLinear
    return linear(weight, bias, layout, region, narrow)


def shard_dropouts(block: nn.Module, region) -> None:
    """A block's dropouts (GPT: after the attention's and the MLP's row-parallel products) act on the
    sequence shard under sequence parallelism: each becomes a `ShardDropout` of the same p."""
    for name, child in list(block.named_modules()):
        if isinstance(child, nn.Dropout):
            parent, _, leaf = name.rpartition(".")
            setattr(block.get_submodule(parent) if parent else block, leaf, ShardDropout(child.p, region))


TENSOR_COLLECTIVE_DTYPES = ("compute", "fp32")  # strategy.tensor_collective_dtype


def gradient_groups(model: nn.Module, plan, grid, layout) -> Dict[str, Tuple]:
    """Parameter name -> groups over which its copies' gradients are summed (data excluded)."""
    groups = {}
    for module_name, style in plan.items():
        for name, _ in model.get_submodule(module_name).named_parameters():
            families = grid.replicated_over(style, name.rsplit(".", 1)[-1])
            groups[f"{module_name}.{name}"] = tuple(layout.group(f) for f in families)
    return groups


@torch.no_grad()
def parallelize(model: nn.Module, layout, device=None, parts=None, loss_over_data: bool = True,
                sequence_parallel: bool = False, tensor_overlap: bool = False,
                tensor_collective_dtype: str = "compute") -> TensorParallelForm:
    """Turn a plain GPT or Llama into its form on `layout.tensor_grid`, in place (torchtitan-style), part
    by part; parts still on meta are first materialised on `device` with their seeded values.

    `parts`: only these (default: every part the model holds; a pipeline rank holds its stages').
    `loss_over_data`: the loss is normalised over the whole data group's batch (gradients then
    summed over data); false: over this data rank's batch (a pipeline averages over data itself).
    `sequence_parallel` (1-D only): the residual stream split along the sequence between the parallel
    regions; `tensor_overlap`: its gathers and reduce-scatters chunked under the products (sequence.py).
    `tensor_collective_dtype` (1-D only; the 2-D/3-D grids keep fp32 sums: schema.py says why):
    compute = partial sums all-reduced / reduce-scattered in the compute dtype under mixed precision.
    """
    if model.embed is not None and model.head is not None and model.head.output.weight is model.embed.token.weight:
        raise ValueError("model.tie_embeddings=true is not supported by tensor parallelism")
    if tensor_overlap and not sequence_parallel:
        raise ValueError("tensor_overlap chunks the sequence-parallel gathers and reduce-scatters: it needs sequence_parallel")
    grid = grid_of(layout.tensor_grid, layout.degrees.tensor, layout.index("tensor"), sequence_parallel)
    if tensor_collective_dtype not in TENSOR_COLLECTIVE_DTYPES:
        raise ValueError(f"strategy.tensor_collective_dtype={tensor_collective_dtype}: need one of "
                         f"{', '.join(TENSOR_COLLECTIVE_DTYPES)}. Fix: strategy.tensor_collective_dtype=compute.")
    narrow = tensor_collective_dtype == "compute" and grid.name == "1d"
    region = SequenceRegion(layout, overlap=tensor_overlap, narrow=narrow) if sequence_parallel else None
    parts = model.part_names() if parts is None else parts
    plan = plan_of_parts(parts, model)  # names found on meta: parts are materialised one by one below
    # A weights hook that reads shards (models/hf.py PartWeights.read_cut) fills each parameter's
    # shard straight from its file: the full part is never in memory.
    read_cut = getattr(getattr(model, "weights", None), "read_cut", None)
    for part in parts:
        if read_cut is None:
            model.materialise(device, [part])
        for name, style in plan.items():
            if name == part or name.startswith(part + "."):
                parent, _, child = name.rpartition(".")
                shard = None if read_cut is None else (
                    lambda path, leaf, full, name=name, style=style: read_cut(
                        f"{name}.{path}", full.shape, lambda t: cut(grid, style, leaf, t), device,
                        full.dtype))  # the master dtype, whatever the file's (bf16 checkpoints)
                module = model.get_submodule(name)
                replacement = parallel_module(module, style, grid, layout, shard, region, narrow)
                if replacement is module and on_meta(module):  # kept whole (1-D norms): filled whole
                    model.weights(name, module.to_empty(device=device))
                setattr(model.get_submodule(parent) if parent else model, child, replacement)
        if part.startswith("blocks."):  # heads are split with q/k/v's output chunks: a share of each
            attention = model.get_submodule(part).attention
            attention.heads, attention.kv_heads = (attention.heads // grid.head_parts,
                                                   attention.kv_heads // grid.head_parts)
            if region is not None:
                shard_dropouts(model.get_submodule(part), region)
    # the ranks whose rows or chunks make up the batch: data replicas × context shards (data alone without CP)
    data = layout.group("data_context") if loss_over_data else None
    return TensorParallelForm(model, VocabularyParallelLoss(layout, grid, data),
                              gradient_groups(model, plan, grid, layout), grid)


def _check_grid(layout, expected: str):
    if layout.tensor_grid != expected:
        raise ValueError(f"parallelize_{expected} needs a layout with tensor_grid={expected!r}, "
                         f"got {layout.tensor_grid!r}")


def parallelize_1d(model, layout, device=None, sequence_parallel: bool = False,
                   tensor_overlap: bool = False, tensor_collective_dtype: str = "compute") -> TensorParallelForm:
    """Megatron 1-D: column-parallel linears (qkv, fc_in; q, k, v, gate, up) and head, row-parallel
    proj and fc_out; optionally sequence-parallel between them (Korthikanti et al. 2022 §4.2.2)."""
    _check_grid(layout, "1d")
    return parallelize(model, layout, device, sequence_parallel=sequence_parallel, tensor_overlap=tensor_overlap,
                       tensor_collective_dtype=tensor_collective_dtype)


def parallelize_2d(model, layout, device=None) -> TensorParallelForm:
    """SUMMA 2-D on a q×q grid (all-gather form of its row and column broadcasts)."""
    _check_grid(layout, "2d")
    return parallelize(model, layout, device)


def parallelize_3d(model, layout, device=None) -> TensorParallelForm:
    """3-D on a q³ grid (Bian et al. 2021; docs/strategies/three_d.md)."""
    _check_grid(layout, "3d")
    return parallelize(model, layout, device)


def _style_of(parameter_name: str, plan) -> Tuple[Style, str]:
    for module_name, style in plan.items():
        if parameter_name.startswith(module_name + "."):
            return style, parameter_name.rsplit(".", 1)[-1]
    return None, None


def consolidate(rank_states, described: dict, prefix: str = "model.") -> dict:
    """Full plain state dict from the tensor block of data/pipeline replica 0.

    Each shard is placed by cutting an index tensor of the full shape exactly as the weight was
    cut, so consolidation cannot disagree with sharding.
    """
    tensor, tensor_grid = described["tensor"], described["tensor_grid"]
    names = [n for n in rank_states[0] if n.startswith(prefix)]
    blocks = sorted({n.split(".")[2] for n in names if n.startswith(prefix + "blocks.")}, key=int)
    plan, full = plan_of_parts(["embed", *(f"blocks.{block}" for block in blocks), "head"]), {}
    for name in names:
        style, leaf = _style_of(name[len(prefix):], plan)
        if style is None:
            full[name] = rank_states[0][name].clone()
            continue
        shape = grid_of(tensor_grid, tensor, 0).full_shape(style, leaf, rank_states[0][name].shape)
        values = torch.empty(shape, dtype=rank_states[0][name].dtype)  # host: offline consolidation
        index = torch.arange(values.numel()).reshape(shape)  # host: offline consolidation
        for local in range(tensor):
            where = cut(grid_of(tensor_grid, tensor, local), style, leaf, index)
            values.view(-1)[where.reshape(-1)] = rank_states[local][name].reshape(-1)
        full[name] = values
    return full
