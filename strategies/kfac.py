"""K-FAC (Martens & Grosse 2015) as PipeFisher's reference uses it (docs/strategies/pipefisher.md), single process.

Only the linear layers inside transformer blocks are preconditioned; everything else keeps the
outer optimizer's plain gradient. This file holds the math (`KFAC`, no torch.distributed: factor
sync is the caller's job) and `KFACStrategy`, the one-process oracle PipeFisher is held to.

Factors per tensor shard (PipeFisher × a 1-D tensor grid of T ranks): a rank holding a
column-parallel linear's output rows keeps A whole (its input is whole) and the B block of its
rows; a row-parallel linear's rank keeps the A block of its input columns and B whole. So the
preconditioner is K-FAC with the split factor block-diagonal over the T shards; π-damping uses the
whole factors' traces (one scalar summed over the tensor group), so replicated row-parallel biases
stay identical. The oracle is this class with `factor_blocks=T`: whole factors, the split one
inverted block by block.
"""

import math

import torch
from lightning.pytorch.strategies import SingleDeviceStrategy
from torch import nn
from typing_extensions import override

from parallel.dims import Layout
from parallel.layout import ParallelLayout
from strategies.hooks import RunHooks
from strategies.checkpoint.portable import PortableCheckpoints
from strategies.plain import one_process_device
from strategies.compile import KFAC_HOOKS, always_eager
from strategies.registry import StrategyEntry
from strategies.tensor_parallel.layers import MegatronLinear
from strategies.tensor_parallel.parallelize import BLOCK_PLAN


def block_linears(model: nn.Module) -> dict:
    """Every linear inside a block (plain, or this rank's 1-D shard of it), by its name in the
    model ("blocks.0.attention.qkv", ...)."""
    return {f"blocks.{block}.{name}": module for block, body in model.blocks.items()
            for name, module in body.named_modules() if isinstance(module, (nn.Linear, MegatronLinear))}


def split_factor(name: str) -> tuple:
    """(the factor a 1-D grid splits, how many outputs the linear fuses) for a block linear's name:
    a "first" (column-parallel) linear splits B by output rows, a "second" one A by input columns."""
    style = BLOCK_PLAN[name.split(".", 2)[2]]
    return ("B" if style.position == "first" else "A"), style.fused


def shard_indices(size: int, blocks: int, fused: int, device=None) -> list:
    """Index sets of the `blocks` shards of a factor of `size`: contiguous chunks, or for a fused
    [Q|K|V] output the chunk of each part (grids.interleave_fused's order)."""
    part, width = size // fused, size // fused // blocks
    return [torch.cat([torch.arange(width, device=device) + j * part + t * width for j in range(fused)])
            for t in range(blocks)]


def block_diagonal_inverse(factor: torch.Tensor, index_sets: list, damping: float) -> torch.Tensor:
    """The damped inverse of each diagonal block (rows and columns in `index_sets`), zero elsewhere:
    what the ranks holding the blocks apply, as one matrix for the one-process oracle."""
    inverse = torch.zeros_like(factor, device=factor.device)
    for indices in index_sets:
        block = factor[indices][:, indices]
        inverse[indices.unsqueeze(1), indices] = damped_inverse(block, damping)
    return inverse


def refresh_phase(step: int, refresh_interval: int) -> tuple:
    """(capture, promote) for optimizer step `step` (0-based).

    Step 0 is one synchronous K-FAC step (capture, invert, use). Afterwards steps 1.. form cycles
    of k: curvature is captured in a cycle's first step only, and the inverses built from it are
    used from the cycle's last step on, so the preconditioner is up to k−1 steps stale (§2).
    """
    if step == 0:
        return True, True
    phase = (step - 1) % refresh_interval
    return phase == 0, phase == refresh_interval - 1


def damped_inverse(factor: torch.Tensor, damping: float) -> torch.Tensor:
    """(factor + damping·I)⁻¹ by Cholesky, in float64 so equal factors summed in another order
    (pipeline vs single process) give inverses equal to far below the tests' tolerance."""
    eye = torch.eye(factor.shape[0], dtype=torch.float64, device=factor.device)
    cholesky = torch.linalg.cholesky(factor.double() + damping * eye)
    return torch.cholesky_inverse(cholesky).to(factor.dtype)


def pi_damping(a_mean: torch.Tensor, b_mean: torch.Tensor, damping: float) -> tuple:
    """Factored Tikhonov damping from the factors' mean eigenvalues tr/dim:
    π = √((tr A/dim A)/(tr B/dim B)), λ_A = √λ·π, λ_B = √λ/π. On the factors' device, in float64:
    a host read of each trace would stop the GPU twice per layer per refresh."""
    a_mean, b_mean = torch.as_tensor(a_mean, dtype=torch.float64), torch.as_tensor(b_mean, dtype=torch.float64)
    positive = (a_mean > 0) & (b_mean > 0)
    pi = torch.where(positive, torch.sqrt(a_mean / torch.where(positive, b_mean, 1.0)), 1.0)
    return math.sqrt(damping) * pi, math.sqrt(damping) / pi


def local_trace(name: str, factor: str, matrix: torch.Tensor) -> tuple:
    """(trace as a float64 tensor, dimension) of a factor held whole on this process."""
    return matrix.trace().double(), matrix.shape[0]


class KFAC:
    """Kronecker-factored curvature of some Linear layers, and the preconditioning it gives.

    1. capture: a forward hook keeps each Linear's input a; a hook on its output keeps the output gradient g;
    2. curvature: A += aᵀa/N and B += (N_local·g)ᵀ(N_local·g)/N, per micro-batch, summed over the step;
    3. inversion: A⁻¹, B⁻¹ by Cholesky with π-damping; they become active when `promote` is called;
    4. preconditioning: ∇W ← B⁻¹ ∇W A⁻¹ and ∇b ← B⁻¹ ∇b (bias is not folded into A).
    """

    def __init__(self, linears: dict, damping: float, factor_blocks: int = 1, whole_trace=local_trace):
        self.linears = linears
        self.damping = damping
        # The oracle of a 1-D grid of `factor_blocks` ranks: each layer's split factor (split_factor)
        # is inverted block by block. `whole_trace(name, factor, matrix)`: (trace, dim) of the
        # whole factor, which a rank holding one block gets by summing over its tensor group.
        self.factor_blocks = factor_blocks
        self.whole_trace = whole_trace
        self.capturing = False
        self.micro_batch = 0  # the caller says which micro-batch the next forward is
        self.captured = {}  # ("a" | "g", name, micro_batch) -> tensor, kept until its curvature unit runs
        self.factors = {name: {"A": self._square(linear.weight.shape[1], linear),
                               "B": self._square(linear.weight.shape[0], linear)}
                        for name, linear in linears.items()}
        self.fresh = {}  # name -> {"A": inverse, "B": inverse}, built this cycle
        self.inverses = {}  # name -> {"A": inverse, "B": inverse}, used by precondition
        self._handles = [linear.register_forward_hook(self._hook(name)) for name, linear in linears.items()]

    @staticmethod
    def _square(size: int, like: nn.Module) -> torch.Tensor:
        return torch.zeros(size, size, dtype=like.weight.dtype, device=like.weight.device)

    # ----- capture
    def _hook(self, name: str):
        def keep(module, inputs, output):
            if not (self.capturing and torch.is_grad_enabled()):
                return
            micro_batch = self.micro_batch
            self.captured[("a", name, micro_batch)] = inputs[0].detach()
            output.register_hook(lambda grad: self.captured.__setitem__(("g", name, micro_batch), grad.detach()))
        return keep

    # ----- curvature, one work unit per (factor, micro-batch)
    @torch.no_grad()
    def accumulate(self, factor: str, names, micro_batch: int, scale: float, chunks: int = 1,
                   half: int | None = None) -> None:
        """Add this micro-batch's aᵀa (factor "A") or gᵀg ("B"), times `scale`, then drop the capture.

        `chunks` splits one captured batch into micro-batches summed in order (the one-process
        oracle captures the whole batch at once but must add the same terms as the pipeline).
        `half` 0 / 1 adds only the head / tail half of the tokens (a unit split to fit a small
        bubble): aᵀa is a sum over tokens, so head + tail is the whole; the tail drops the capture.
        """
        for name in names:
            key = ("a" if factor == "A" else "g", name, micro_batch)
            captured = self.captured[key] if half == 0 else self.captured.pop(key)
            for chunk in captured.chunk(chunks):
                flat = chunk.reshape(-1, chunk.shape[-1])
                if half is not None:
                    flat = torch.tensor_split(flat, 2)[half]  # two pieces even for one token
                self.factors[name][factor].add_(flat.T @ flat, alpha=scale)

    def reset(self, names) -> None:
        """Zero the factors before a new cycle's curvature (no moving average, §2)."""
        for name in names:
            for factor in self.factors[name].values():
                factor.zero_()

    # ----- inversion and use
    @torch.no_grad()
    def invert(self, factor: str, names) -> None:
        """Damped inverse of factor "A" or "B" of each layer (π needs both factors, already synced)."""
        for name in names:
            means = {f: trace / dimension for f, (trace, dimension) in
                     ((f, self.whole_trace(name, f, self.factors[name][f])) for f in "AB")}
            dampings = dict(zip("AB", pi_damping(means["A"], means["B"], self.damping)))
            matrix = self.factors[name][factor]
            split, fused = split_factor(name)
            if self.factor_blocks > 1 and factor == split:
                indices = shard_indices(matrix.shape[0], self.factor_blocks, fused, matrix.device)
                inverse = block_diagonal_inverse(matrix, indices, dampings[factor])
            else:
                inverse = damped_inverse(matrix, dampings[factor])
            self.fresh.setdefault(name, {})[factor] = inverse

    def promote(self) -> None:
        """The inverses built in this cycle replace the ones in use."""
        self.inverses.update(self.fresh)
        self.fresh = {}

    @torch.no_grad()
    def precondition(self, names=None) -> None:
        """∇W ← B⁻¹ ∇W A⁻¹, ∇b ← B⁻¹ ∇b, in place, for every layer with inverses."""
        for name in self.inverses if names is None else names:
            linear, inverse = self.linears[name], self.inverses[name]
            if linear.weight.grad is not None:
                linear.weight.grad.copy_(inverse["B"] @ linear.weight.grad @ inverse["A"])
            if linear.bias is not None and linear.bias.grad is not None:
                linear.bias.grad.copy_(inverse["B"] @ linear.bias.grad)

    # ----- checkpoint: factors, inverses and pending captures, so a resume is bit-identical
    def state_dict(self) -> dict:
        return {"factors": self.factors, "fresh": self.fresh, "inverses": self.inverses,
                "captured": self.captured}

    def load_state_dict(self, state: dict) -> None:
        """Restore a checkpoint's state onto each layer's device: checkpoints load with
        map_location="cpu", and a CPU inverse would meet a CUDA gradient in `precondition`."""
        for name, factors in state["factors"].items():
            for factor, value in factors.items():
                self.factors[name][factor].copy_(value)
        self.fresh = {name: self._on_device(name, inverses) for name, inverses in state["fresh"].items()}
        self.inverses = {name: self._on_device(name, inverses) for name, inverses in state["inverses"].items()}
        self.captured = {key: value.to(self.linears[key[1]].weight.device)
                         for key, value in state["captured"].items()}

    def _on_device(self, name: str, tensors: dict) -> dict:
        return {key: value.to(self.linears[name].weight.device) for key, value in tensors.items()}


def unit_scales(tokens_local: int, tokens_global: int) -> dict:
    """Scale of aᵀa and gᵀg so the factors are per-token averages over the whole step (§2).

    g is ∂(mean loss over this process's tokens)/∂output, i.e. per-token gradient / N_local.
    """
    return {"A": 1.0 / tokens_global, "B": tokens_local ** 2 / tokens_global}


class KFACInCheckpoint:
    """Strategy mixin: K-FAC's factors, inverses and pending captures travel in every checkpoint.

    A checkpoint may be read before `setup` builds `self.kfac` (one-process strategies restore
    first) or after it (per-rank strategies): `restore_kfac()` applies it whichever comes second.
    A portable checkpoint (another layout: strategies/checkpoint/portable.py) carries no K-FAC state; the
    first resumed step is then a synchronous K-FAC step, like step 0 (`curvature_phase`).
    """

    kfac = None
    _restored = None
    rebuild_step = None  # the step whose curvature rebuilds factors and inverses after a portable resume

    def curvature_phase(self, step: int) -> tuple:
        """(capture, promote) of optimizer step `step`: refresh_phase, or both when rebuilding."""
        return (True, True) if step == self.rebuild_step else refresh_phase(step, self.refresh_interval)

    def save_checkpoint(self, checkpoint, filepath, storage_options=None) -> None:
        checkpoint["kfac"] = self.kfac.state_dict()
        super().save_checkpoint(checkpoint, filepath, storage_options)

    def load_checkpoint(self, checkpoint_path, weights_only=None) -> dict:
        checkpoint = super().load_checkpoint(checkpoint_path, weights_only)  # read safely below it
        self._restored = checkpoint.get("kfac")
        if self._restored is None:  # a portable checkpoint: K-FAC state does not move between layouts
            self.rebuild_step = checkpoint["global_step"]
            if self.global_rank == 0:
                print(f"[layerwise] K-FAC factors and inverses are not carried between layouts: rebuilt "
                      f"by a synchronous K-FAC step at step {self.rebuild_step}", flush=True)
        self.restore_kfac()
        return checkpoint

    def restore_kfac(self) -> None:
        if self.kfac is not None and self._restored is not None:
            self.kfac.load_state_dict(self._restored)


class KFACStrategy(RunHooks, KFACInCheckpoint, PortableCheckpoints, SingleDeviceStrategy):
    """K-FAC on one process: the oracle of PipeFisher (same k, staleness and damping).

    1. steps that capture (refresh_phase) record a, g and build A, B from m micro-batch chunks;
    2. steps that promote invert the factors (π-damped Cholesky) and start using the inverses;
    3. every step preconditions the block Linears' gradients, then runs the outer optimizer.
    """

    strategy_name = "kfac"

    def __init__(self, damping: float, refresh_interval: int, micro_batches: int, device: str = "cpu",
                 factor_blocks: int = 1):
        super().__init__(device=torch.device(device))
        self.damping, self.refresh_interval, self.micro_batches = damping, refresh_interval, micro_batches
        self.factor_blocks = factor_blocks  # > 1: the oracle of PipeFisher over a 1-D grid of that many
        self.layout = ParallelLayout(Layout(), rank=0)

    @override
    def setup(self, trainer) -> None:
        super().setup(trainer)
        self.kfac = KFAC(block_linears(self.lightning_module.model), self.damping, self.factor_blocks)
        self.restore_kfac()

    @override
    def training_step(self, *args, **kwargs):
        capture, _ = self.curvature_phase(self.lightning_module.global_step)
        self.kfac.capturing = capture
        self.tokens = args[0]["tokens"].numel()
        try:
            output = super().training_step(*args, **kwargs)
        finally:
            self.kfac.capturing = False
        return self.loss_ready(output)

    @override
    def optimizer_step(self, optimizer, closure, model=None, **kwargs):
        closure_result = closure()  # forward + backward (captures a and g on capture steps)
        self._curvature_and_inversion()
        self.kfac.precondition()
        optimizer.step()
        return closure_result

    def _curvature_and_inversion(self) -> None:
        capture, promote = self.curvature_phase(self.lightning_module.global_step)
        names, scales = list(self.kfac.linears), unit_scales(self.tokens, self.tokens)
        if capture:
            self.kfac.reset(names)
            for factor in ("A", "B"):
                self.kfac.accumulate(factor, names, 0, scales[factor], chunks=self.micro_batches)
        if promote:
            self.kfac.invert("A", names)
            self.kfac.invert("B", names)
            self.kfac.promote()



# ----- the registry interface (see strategies/__init__.py)

def degrees(cfg, world_size: int) -> Layout:
    return Layout()


def check(cfg, world_size: int) -> list:
    errors = kfac_errors(cfg.strategy)
    blocks = cfg.strategy.factor_blocks
    if blocks < 1 or cfg.model.hidden % blocks or cfg.model.heads % blocks:
        errors.append(f"strategy.factor_blocks={blocks}: the blocks are a 1-D grid's shards, so model.hidden="
                      f"{cfg.model.hidden} and model.heads={cfg.model.heads} must split into them. Fix: "
                      f"strategy.factor_blocks=1 (plain K-FAC) or a common divisor such as 2.")
    return errors


def kfac_errors(strategy) -> list:
    """Checks shared with PipeFisher: damping and refresh interval."""
    errors = []
    if not strategy.damping > 0:
        errors.append(f"strategy.damping={strategy.damping} must be positive (Cholesky needs A + λ_A·I "
                      f"positive definite). Fix: strategy.damping=1e-3 (paper) or 1e-2 (code default).")
    if strategy.refresh_interval is not None and strategy.refresh_interval < 1:
        errors.append(f"strategy.refresh_interval={strategy.refresh_interval} must be at least 1. "
                      f"Fix: strategy.refresh_interval=1 (refresh every step).")
    return errors


def build(cfg, world_size: int):
    return KFACStrategy(cfg.strategy.damping, cfg.strategy.refresh_interval, cfg.strategy.micro_batches,
                        one_process_device(cfg.hardware.accelerator), cfg.strategy.factor_blocks)


KFAC_ORACLE = StrategyEntry(check=check, degrees=degrees, build=build, one_process=True, scales_fp16_loss=False,
                           eager_blocks=always_eager(KFAC_HOOKS))
