"""Mixture-of-experts feed-forward: a router sends each token to k of E SwiGLU experts (no ranks here).

One MoE module replaces the SwiGLU `mlp` of a Llama block listed in `model.moe_layers`
(models/llama.py builds it). Its forward, for x[b, s, h] (n = b·s tokens):

1. route: logits = router(x) in float32 ([n, E]); the router kind picks k experts per token and
   their weights (`route`):
   - `softmax_topk` (Mixtral, Qwen3-MoE): p = softmax(logits); the k largest p; weights = those p,
     divided by their sum when `normalize` (router_normalize);
   - `sigmoid_bias` (DeepSeek-V3, arXiv 2412.19437 §2.1.2): s = sigmoid(logits); the k largest
     s + expert_bias are chosen (the bias steers the choice only); weights = the chosen s, divided
     by their sum when `normalize`. The bias moves after each optimizer step:
     bias_i += u·sign(mean load − load_i) (`update_expert_bias`, loads summed over the step's
     micro-batches and data ranks).
2. slots: the n·k (token, choice) pairs, numbered token-major (slot = t·k + j), sorted *stably* by
   global expert: within an expert the slots stay in token order. With `capacity_factor` cf each
   expert keeps its first C = ceil(cf·n·k/E) slots of this forward and drops the rest (they add 0;
   counted in `dropped`); without it routing is dropless.
3. experts: local (dispatcher None): `experts(x_sorted, counts)`. With a dispatcher (expert
   parallelism, strategies/expert_parallel.py) the contract is:
       x_local, counts_local = dispatcher.dispatch(x_sorted, counts)
           x_sorted [m, h]: the kept slots' token rows, grouped by global expert in expert order;
           counts [E] (LongTensor, on x's device): rows per global expert, Σ counts = m;
           x_local [m', h]: the rows of this rank's experts (experts.first ... first+E_local−1)
           from every rank of the expert group, grouped by local expert in order;
           counts_local [E_local]: rows per local expert, Σ = m'.
       y = experts(x_local, counts_local)                   [m', h]
       y_sorted = dispatcher.combine(y)                     [m, h], x_sorted's rows in x_sorted's order
   The router, the aux loss and the loads are computed before dispatch, on this rank's tokens.
4. combine: y_sorted row r scaled by its slot's weight, put back at its slot, summed over the k
   slots of each token (a fixed order: deterministic on every device), + shared(x) when a shared
   expert exists.

Auxiliary load-balancing loss (DeepSeek-V3's sequence-wise balance loss form, §2.3 of 2412.19437),
per sequence j of s tokens, with c_{j,i} the slots of sequence j routed to expert i (before drops)
and P_{j,t,i} the router's probability (softmax p; for sigmoid s normalised over the E experts):

    aux = mean_j  E/(k·s) · Σ_i c_{j,i} · mean_t P_{j,t,i}

A mean over sequences, so it decomposes over micro-batches and data ranks like the main loss: a
micro-batch whose loss enters the step's loss with weight `loss_scale` (1/m for m micro-batches;
LanguageModel.set_loss_scale) contributes α·loss_scale·∂aux. It reaches the gradient without a
change to any strategy's stage interface: `AttachAuxLoss` returns the MoE output unchanged in the
forward, and its backward hands aux the constant gradient α·loss_scale (the idea of Megatron-core's
MoEAuxLossAutoScaler, megatron/core/transformer/moe/moe_utils.py). Under fp16 loss scaling that
gradient would miss the scaler's factor: validation refuses 16-mixed with experts.

Each training forward records (detached, on the device) `load` [E] (slots per global expert,
before drops), `dropped` and aux·loss_scale; they accumulate over the step's micro-batches until
`reset_step` (the task calls it when a step starts). Recomputation in the backward
(activation checkpointing) records nothing again.
"""

import math
from dataclasses import dataclass, fields, replace

import torch
import torch.nn as nn
import torch.nn.functional as F

from models.transformer import INIT_STD, BlockDescription, LinearShape, SeededParameters, _normal, compute_dtype, derived_seed

ROUTERS = ("softmax_topk", "sigmoid_bias")


# ----------------------------------------------------------------------------- experts


def grouped_products_available(x: torch.Tensor, weights: tuple) -> bool:
    """Whether F.grouped_mm can run these products (checked on CPU with torch 2.11 and 2.13):
    fp32/bf16/fp16 on CPU, bf16 on CUDA devices of compute capability 9.0 and later (the kernel torch
    ships for Hopper; not run here: no GPU), every row stride a multiple of 16 bytes ("strides should
    be multiple of 16 bytes"); float64 never; under torch.compile bf16 only. Elsewhere: the loop."""
    if not hasattr(F, "grouped_mm"):
        return False
    if torch.compiler.is_compiling() and x.dtype != torch.bfloat16:
        return False  # compiled, grouped_mm takes bf16 only ("Expected inputs of BF16 type", TORCH.md)
    if x.device.type == "cuda":  # torch's CUDA kernel: bf16 on Hopper (sm90) and later; else the loop
        if x.dtype != torch.bfloat16 or torch.cuda.get_device_capability(x.device) < (9, 0):
            return False
    elif x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return False
    return all(weight.dtype == x.dtype and weight.shape[-1] * weight.element_size() % 16 == 0
               and weight.shape[-2] * weight.element_size() % 16 == 0 for weight in weights)


class _ContiguousGradient(torch.autograd.Function):
    """Identity whose backward makes the incoming gradient contiguous: grouped_mm's backward
    refuses an expanded one ("Invalid strides/sizes, got [0, 0]", /work/shared/notes/TORCH.md)."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, gradient):
        return gradient.contiguous()


class Experts(SeededParameters):
    """E_local SwiGLU experts held as three stacked Parameters, gate, up [E_local, h, f] and
    down [E_local, f, h]: expert e maps a row x to down_e(silu(x @ gate_e) ⊙ (x @ up_e)).

    `first` is the global index of this module's first expert, `total` the model's E: a rank of an
    expert-parallel group builds only experts [first, first + E_local), and each expert is drawn
    from its own generator seeded by (seed, block, global expert), so it holds exactly the values
    the whole model's expert has (`initialize_seeded`)."""

    def __init__(self, hidden: int, width: int, count: int, first: int = 0, total: int = None):
        super().__init__()
        self.hidden, self.width, self.first = hidden, width, first
        self.total = total if total is not None else count
        self.gate = nn.Parameter(torch.empty(count, hidden, width))
        self.up = nn.Parameter(torch.empty(count, hidden, width))
        self.down = nn.Parameter(torch.empty(count, width, hidden))

    @property
    def count(self) -> int:
        return self.gate.shape[0]

    @torch.no_grad()
    def initialize_seeded(self, seed: int, name, residual_std: float) -> None:
        """gate, up ~ N(0, 0.02), down ~ N(0, residual_std) (it writes the residual stream, like
        fc_out), expert e of the model from generator (seed, "<name>/expert/<e>"), in float32 on
        the CPU: the values do not depend on which rank builds which experts."""
        if self.gate.device.type == "meta":
            return
        for local in range(self.count):
            generator = torch.Generator(device="cpu").manual_seed(
                derived_seed(seed, f"{name}/expert/{self.first + local}"))
            for parameter, std in ((self.gate, INIT_STD), (self.up, INIT_STD), (self.down, residual_std)):
                _normal(parameter[local], std, generator)  # initialize's draw: float32 on the CPU, copied

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """x [m, h], rows grouped by local expert in order, counts [E_local] rows each -> [m, h]."""
        dtype = compute_dtype(x)
        x = x.to(dtype).contiguous()
        gate, up, down = (weight.to(dtype) for weight in (self.gate, self.up, self.down))
        if grouped_products_available(x, (gate, up, down)):
            return self._grouped(x, counts, gate, up, down)
        return self._loop(x, counts, gate, up, down)

    @staticmethod
    def _grouped(x, counts, gate, up, down) -> torch.Tensor:
        """Three grouped products; group g's rows end at offsets[g] = Σ_{e≤g} counts_e."""
        offsets = torch.cumsum(counts, 0).to(torch.int32)
        products = (_ContiguousGradient.apply(F.grouped_mm(x, weight, offs=offsets)) for weight in (gate, up))
        hidden = F.silu(next(products)) * next(products)
        return _ContiguousGradient.apply(F.grouped_mm(hidden, down, offs=offsets))

    @staticmethod
    def _loop(x, counts, gate, up, down) -> torch.Tensor:
        """One expert at a time (the reference the grouped products equal; float64, CUDA fp32)."""
        pieces = x.split(counts.tolist())  # a host sync on CUDA: the fallback's price
        outputs = [(F.silu(piece @ gate[e]) * (piece @ up[e])) @ down[e] for e, piece in enumerate(pieces)]
        return torch.cat(outputs) if outputs else x.new_zeros(0, down.shape[-1])


# ----------------------------------------------------------------------------- routing


def route(logits: torch.Tensor, k: int, kind: str, normalize: bool, bias: torch.Tensor = None) -> tuple:
    """(weights [n, k], chosen [n, k] global experts, probabilities [n, E] for the aux loss) from
    float32 router logits [n, E]; see the module docstring for the two kinds."""
    if kind == "softmax_topk":
        probabilities = logits.softmax(dim=-1)
        weights, chosen = probabilities.topk(k, dim=-1)
    elif kind == "sigmoid_bias":
        scores = logits.sigmoid()
        _, chosen = (scores + bias.to(scores.dtype)).topk(k, dim=-1)  # the bias chooses, never weighs
        weights = scores.gather(-1, chosen)
        probabilities = scores / scores.sum(dim=-1, keepdim=True)  # DeepSeek-V3's s' of the balance loss
    else:
        raise ValueError(f"model.router: unknown {kind!r}; choose one of {', '.join(ROUTERS)}")
    if normalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, chosen, probabilities


def balance_loss(probabilities: torch.Tensor, chosen: torch.Tensor, sequences: int, experts: int) -> torch.Tensor:
    """aux = mean_j E/(k·s) Σ_i c_{j,i} · mean_t P_{j,t,i} over the `sequences` rows (module docstring);
    the counts c carry no gradient, P does."""
    k = chosen.shape[-1]
    per_sequence = probabilities.reshape(sequences, -1, experts)  # [b, s, E]
    length = per_sequence.shape[1]
    counts = F.one_hot(chosen.reshape(sequences, -1), experts).sum(dim=1).to(probabilities.dtype)  # [b, E]
    return (experts / (k * length) * (counts * per_sequence.mean(dim=1)).sum(dim=-1)).mean()


class AttachAuxLoss(torch.autograd.Function):
    """output unchanged in the forward; in the backward aux receives the gradient `weight`
    (α·loss_scale), as if α·loss_scale·aux had been added to the step's loss."""

    @staticmethod
    def forward(ctx, output, aux, weight: float):
        ctx.weight, ctx.aux_meta = weight, (aux.shape, aux.dtype, aux.device)
        return output

    @staticmethod
    def backward(ctx, gradient):
        shape, dtype, device = ctx.aux_meta
        return gradient, torch.full(shape, ctx.weight, dtype=dtype, device=device), None


def capacity(factor: float, tokens: int, k: int, experts: int) -> int:
    """Slots an expert keeps per forward: ceil(cf·n·k/E)."""
    return math.ceil(factor * tokens * k / experts)


def sort_slots(chosen: torch.Tensor, experts: int, capacity_slots: int = None) -> tuple:
    """(order, counts, dropped): `order` [m] the kept slots (slot = t·k + j), sorted stably by global
    expert; `counts` [E] kept slots per expert; `dropped` the slots beyond each expert's capacity
    (first come in token order; a 0-d tensor)."""
    flat = chosen.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=experts)
    if capacity_slots is None:
        return order, counts, counts.new_zeros(())
    starts = torch.cumsum(counts, 0) - counts
    position = torch.arange(flat.numel(), device=flat.device) - starts[flat[order]]
    kept = counts.clamp(max=capacity_slots)
    return order[position < capacity_slots], kept, (counts - kept).sum()


# ----------------------------------------------------------------------------- the layer


class MoE(SeededParameters):
    """The mixture-of-experts MLP of a block: x [b, s, h] -> [b, s, h] (module docstring).

    Children: `router` (Linear h -> E, no bias), `experts` (Experts), `shared` (a SwiGLU every token
    passes through, or None); buffer `expert_bias` [E] float32 (sigmoid_bias's steering bias,
    saved with the model). `dispatcher` None runs all experts here; expert parallelism sets it."""

    def __init__(self, hidden: int, expert_width: int, experts: int, experts_per_token: int,
                 router: str = "softmax_topk", normalize: bool = True, aux_loss_coefficient: float = 0.0,
                 bias_update_rate: float = 0.0, capacity_factor: float = None, shared: nn.Module = None,
                 first: int = 0, local_experts: int = None):
        super().__init__()
        if router not in ROUTERS:
            raise ValueError(f"model.router: unknown {router!r}; choose one of {', '.join(ROUTERS)}")
        if not 0 < experts_per_token <= experts:
            raise ValueError(f"model.experts_per_token: {experts_per_token} must lie in [1, experts={experts}]")
        self.total, self.k = experts, experts_per_token
        self.kind, self.normalize = router, normalize
        self.aux_loss_coefficient, self.bias_update_rate = aux_loss_coefficient, bias_update_rate
        self.capacity_factor = capacity_factor
        self.router = nn.Linear(hidden, experts, bias=False)
        self.experts = Experts(hidden, expert_width, experts if local_experts is None else local_experts,
                               first=first, total=experts)
        self.shared = shared
        self.register_buffer("expert_bias", torch.zeros(experts, dtype=torch.float32))
        self.dispatcher = None
        self.loss_scale = 1.0  # this micro-batch's share of the step's loss (LanguageModel.set_loss_scale)
        self.reset_step()

    @torch.no_grad()
    def initialize_seeded(self, seed: int, name, residual_std: float) -> None:
        """The expert bias starts at 0 (its parameters are drawn by `initialize`: the router with the
        block's generator, the experts with their own): a part materialised with to_empty would
        otherwise keep whatever memory it got."""
        if self.expert_bias.device.type != "meta":
            self.expert_bias.zero_()

    def _apply(self, fn, recurse=True):
        """Keep `expert_bias` in float32 through a module-wide cast (bf16-true): sums of ±u steps
        would round away in 16 bits. Moves (device, to_empty) still apply to it."""
        before = self.expert_bias
        super()._apply(fn, recurse)
        if self.expert_bias.dtype != torch.float32:
            kept = before if before.device.type != "meta" else self.expert_bias
            self.expert_bias = kept.to(device=self.expert_bias.device, dtype=torch.float32)
        return self

    # ----- the step's record
    def reset_step(self) -> None:
        """Forget the loads, drops and aux loss recorded so far (a new optimizer step begins)."""
        self.load = self.dropped = self.aux = None

    def _record(self, load, dropped, aux) -> None:
        if not self.training or not torch.is_grad_enabled() or torch._C._current_graph_task_id() != -1:
            return  # evaluation, a forward without a graph, or a recomputation inside the backward
        aux = aux.detach() * self.loss_scale
        if self.load is None:
            self.load, self.dropped, self.aux = load.detach(), dropped.detach(), aux
        else:
            self.load, self.dropped, self.aux = self.load + load, self.dropped + dropped, self.aux + aux

    # ----- forward
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        tokens = x.reshape(-1, shape[-1])
        with torch.autocast(x.device.type, enabled=False):  # routing in float32 under any precision
            logits = F.linear(tokens.float(), self.router.weight.float())
        weights, chosen, probabilities = route(logits, self.k, self.kind, self.normalize, self.expert_bias)
        slots = None if self.capacity_factor is None else capacity(self.capacity_factor, tokens.shape[0],
                                                                   self.k, self.total)
        order, counts, dropped = sort_slots(chosen, self.total, slots)
        x_sorted = tokens[order // self.k]
        if self.dispatcher is None:
            y_sorted = self.experts(x_sorted, counts)
        else:
            x_local, counts_local = self.dispatcher.dispatch(x_sorted, counts)
            y_sorted = self.dispatcher.combine(self.experts(x_local, counts_local))
        scaled = y_sorted * weights.reshape(-1)[order].unsqueeze(-1).to(y_sorted.dtype)
        # each kept slot's row at its slot (dropped slots stay 0), then the k slots of a token summed
        slotted = scaled.new_zeros(tokens.shape[0] * self.k, shape[-1]).index_copy(0, order, scaled)
        output = slotted.view(tokens.shape[0], self.k, -1).sum(dim=1)
        if self.shared is not None:
            output = output + self.shared(tokens)
        output = output.view(*shape[:-1], -1)
        aux = balance_loss(probabilities, chosen, shape[0] if x.dim() == 3 else 1, self.total)
        self._record(torch.bincount(chosen.reshape(-1), minlength=self.total), dropped, aux)
        if self.training and self.aux_loss_coefficient and aux.requires_grad:
            output = AttachAuxLoss.apply(output, aux, self.aux_loss_coefficient * self.loss_scale)
        return output

    @torch.no_grad()
    def update_expert_bias(self, load: torch.Tensor) -> None:
        """sigmoid_bias: bias_i += u·sign(mean(load) − load_i) with `load` [E] the step's slots per
        expert summed over micro-batches and data ranks (DeepSeek-V3 §2.1.2); other routers: nothing."""
        if self.kind != "sigmoid_bias" or not self.bias_update_rate:
            return
        load = load.to(self.expert_bias.device, torch.float32)
        self.expert_bias += self.bias_update_rate * torch.sign(load.mean() - load)


def moe_modules(model: nn.Module) -> list:
    """(name, MoE) for every MoE module `model` holds, in forward order."""
    return [(name, module) for name, module in model.named_modules() if isinstance(module, MoE)]


def update_expert_biases(model: nn.Module, sum_over_data) -> None:
    """After an optimizer step: every sigmoid_bias module's step loads, summed over data ranks by
    `sum_over_data` (one collective for all blocks: the concatenated loads), move its bias."""
    steering = [module for _, module in moe_modules(model)
                if module.kind == "sigmoid_bias" and module.bias_update_rate]
    if not steering:
        return
    loads = [module.load if module.load is not None else module.expert_bias.new_zeros(module.total)
             for module in steering]
    summed = sum_over_data(torch.cat([load.to(torch.float32) for load in loads]))
    for module, load in zip(steering, summed.split([module.total for module in steering])):
        module.update_expert_bias(load)


# ----------------------------------------------------------------------------- the model's settings


@dataclass(frozen=True)
class MoeSettings:
    """The model config's mixture-of-experts fields (layerwise/config/schema.py ModelConfig, same
    names), as a Llama takes them: `experts` 0 is a dense model."""

    experts: int = 0
    experts_per_token: int = 2
    shared_experts: int = 0
    moe_ffn_hidden: int = None
    moe_layers: tuple = None
    router: str = "softmax_topk"
    router_normalize: bool = True
    aux_loss_coefficient: float = 0.01
    bias_update_rate: float = 0.001
    capacity_factor: float = None

    @classmethod
    def pop_from(cls, arguments: dict) -> "MoeSettings":
        """The settings named in `arguments` (keyword arguments of a model), removed from it."""
        found = {item.name: arguments.pop(item.name) for item in fields(cls) if item.name in arguments}
        found = {name: value for name, value in found.items() if value is not None or name in NULLABLE}
        if found.get("moe_layers") is not None:
            found["moe_layers"] = tuple(int(index) for index in found["moe_layers"])
        return cls(**found)

    def is_moe(self, index: int) -> bool:
        """Whether block `index` is an MoE block: experts > 0 and index in moe_layers (null: every block)."""
        return self.experts > 0 and (self.moe_layers is None or (index is not None and index in self.moe_layers))

    def width(self, ffn_hidden: int) -> int:
        """One expert's SwiGLU width: moe_ffn_hidden, or the dense ffn_hidden."""
        return self.moe_ffn_hidden or ffn_hidden

    def build(self, hidden: int, ffn_hidden: int, make_shared=None) -> MoE:
        """An MoE module with every expert; `make_shared(width)` builds the shared expert's SwiGLU."""
        width = self.width(ffn_hidden)
        shared = make_shared(self.shared_experts * width) if self.shared_experts else None
        return MoE(hidden, width, self.experts, self.experts_per_token, self.router, self.router_normalize,
                   self.aux_loss_coefficient, self.bias_update_rate, self.capacity_factor, shared)


NULLABLE = ("moe_ffn_hidden", "moe_layers", "capacity_factor")


# ----------------------------------------------------------------------------- the block as data


def describe_moe_block(dense: BlockDescription, experts: int, experts_per_token: int, shared_experts: int = 0,
                       expert_width: int = None) -> BlockDescription:
    """An MoE block as data, from its dense block's description: the attention linears stay, the
    SwiGLU's are replaced by the router (h -> E) and the shared experts' SwiGLU
    (mlp.shared.gate/up/fc_out, shared_experts·width wide); the E routed experts (3·h·width weights
    each) are counted by `experts`, `experts_per_token`, `expert_width`."""
    width = expert_width or dense.mlp_width
    hidden = dense.hidden
    linears = tuple(linear for linear in dense.linears if not linear.name.startswith("mlp."))
    linears += (LinearShape("mlp.router", hidden, experts, "column", bias=False),)
    if shared_experts:
        wide = shared_experts * width
        linears += (LinearShape("mlp.shared.gate", hidden, wide, "column", bias=False),
                    LinearShape("mlp.shared.up", hidden, wide, "column", bias=False),
                    LinearShape("mlp.shared.fc_out", wide, hidden, "row", bias=False))
    return replace(dense, linears=linears, mlp_width=width, experts=experts, experts_per_token=experts_per_token,
                   shared_experts=shared_experts, expert_width=width)


def start_step(model: nn.Module) -> None:
    """A training step begins: every MoE module forgets the last step's loads, drops and aux loss."""
    for _, module in moe_modules(model):
        module.reset_step()
