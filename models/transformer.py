"""The pieces every language model here is made of: embedding, pre-LayerNorm block, seeded init.

A model is a sequence of layers: `embed`, then `blocks` (a ModuleDict keyed "0".."L-1" so parameter
names survive partitioning), then `head`. Each part is initialised from its own generator, seeded by
(seed, "embed"), (seed, block index) or (seed, "head"), so a process that builds only some parts gets
exactly the weights those parts have in the full model. A model built on the `meta` device holds
shapes only; `materialise` gives chosen parts storage and their seeded values, one part at a time.
"""

import abc
import hashlib
import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from models.documents import Documents, packed_attention

INIT_STD = 0.02  # GPT-2 / BERT initial standard deviation of every weight matrix
IGNORE_INDEX = -100  # targets equal to this are not scored (padding, unmasked BERT positions)


# ----------------------------------------------------------------------------- deterministic init


def derived_seed(seed: int, name) -> int:
    """A 63-bit seed for the part `name` of a model seeded with `seed`, equal in every process."""
    # hashlib rather than hash(): Python salts str hashes per process.
    digest = hashlib.sha256(f"{seed}/{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


class SeededParameters(nn.Module, metaclass=abc.ABCMeta):
    """A module whose own Parameters (not Linear/Embedding/norm children) `initialize` cannot draw:
    it draws them itself in `initialize_seeded(seed, name, residual_std)` (models/moe.py Experts:
    one generator per expert, so a rank holding some experts gets the full model's values).
    nn.Module's metaclass is `type`, so ABCMeta (a subclass of it) is its compatible metaclass."""

    @abc.abstractmethod
    def initialize_seeded(self, seed: int, name, residual_std: float) -> None:
        """Draw this module's own Parameters (and reset its buffers) from (seed, name)."""


def compute_dtype(tensor: torch.Tensor) -> torch.dtype:
    """The dtype a matrix product of `tensor` runs in: autocast's where it is on, else the tensor's
    own. Whoever casts by hand what autocast would cast reads it here: the experts (F.grouped_mm is not
    in autocast's lists, models/moe.py) and the tensor grids' collectives (strategies/tensor_parallel)."""
    device = tensor.device.type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else tensor.dtype


@torch.no_grad()
def initialize(module: nn.Module, *, seed: int, name, residual_std: float = INIT_STD) -> None:
    """Overwrite every parameter of `module` from a generator seeded with (seed, name).

    Linear/Embedding weights ~ N(0, 0.02); residual-output projections (`proj`, `fc_out`)
    ~ N(0, residual_std); biases 0; LayerNorm weight 1, bias 0. Values are drawn in float32 on
    the CPU and then copied, so the result does not depend on the default device or dtype.
    """
    generator = torch.Generator(device="cpu").manual_seed(derived_seed(seed, name))
    for module_name, child in module.named_modules():
        if isinstance(child, (nn.LayerNorm, nn.RMSNorm)):
            _fill(child.weight, 1.0)
            _fill(getattr(child, "bias", None), 0.0)
        elif isinstance(child, (nn.Linear, nn.Embedding)):
            is_residual_output = module_name.split(".")[-1] in ("proj", "fc_out")
            std = residual_std if is_residual_output else INIT_STD
            _normal(child.weight, std, generator)
            _fill(getattr(child, "bias", None), 0.0)
        elif isinstance(child, SeededParameters):  # its own generators: the shared one's draws stay as they were
            child.initialize_seeded(seed, name, residual_std)


def _normal(parameter: nn.Parameter, std: float, generator: torch.Generator) -> None:
    if parameter.device.type == "meta":
        return  # shapes only: a planner's full-size model on meta would stall drawing 175B numbers
    values = torch.empty(parameter.shape, dtype=torch.float32, device="cpu")
    values.normal_(0.0, std, generator=generator)
    parameter.copy_(values)


def _fill(parameter, value: float) -> None:
    if parameter is not None:
        parameter.fill_(value)


def residual_init_std(layers: int) -> float:
    """GPT-2's scaled init: each of the 2L residual additions gets std 0.02/sqrt(2L)."""
    return INIT_STD / math.sqrt(2 * layers)


# ----------------------------------------------------------------------------- the block as data


@dataclass(frozen=True)
class LinearShape:
    """One linear of a block: its module name, fan-in, fan-out, whether it has a bias, and its role
    in Megatron's pair (Shoeybi et al. 2019, §3): "column" splits its outputs (its input whole),
    "row" its inputs (after a column linear, whose split output it consumes). `fused` outputs sit
    side by side ([Q|K|V] = 3) and are split each on its own."""

    name: str
    fan_in: int
    fan_out: int
    role: str
    fused: int = 1
    bias: bool = True


@dataclass(frozen=True)
class BlockDescription:
    """A transformer block as data: its norms, its linears, its attention heads, its MLP.

    The tensor-parallel plan (strategies/tensor_parallel), the FLOP count and the parameter count
    derive from it, so each architecture is a description, not a code path. `mlp_width` is the
    activation's width (ffn); `gated`: SwiGLU (two column linears feed it) or GELU. `head_dim`: each
    head's width (0: hidden/heads; Qwen3 sets it apart); `qk_norm`: RMSNorm weights of head_dim on q
    and k (Qwen3), two more vectors per block.
    """

    norms: tuple
    norm: str  # "layer" (LayerNorm: weight and bias) | "rms" (RMSNorm: weight)
    linears: tuple
    hidden: int
    heads: int
    kv_heads: int
    mlp_width: int
    gated: bool
    rotary: bool
    # mixture of experts (models/moe.py): E experts of width expert_width (each a SwiGLU: 3·h·width
    # weights), k per token, shared ones every token uses (their linears, like the router's, are in
    # `linears`); 0 experts: a dense block
    experts: int = 0
    experts_per_token: int = 0
    shared_experts: int = 0
    expert_width: int = 0
    head_dim: int = 0
    qk_norm: bool = False

    def __post_init__(self):
        if not self.head_dim:  # frozen: the derived default is set once, here
            object.__setattr__(self, "head_dim", self.hidden // self.heads)

    def matmul_weights(self) -> int:
        """Weights that take part in a matrix product, per block (an MoE block: all its experts)."""
        return sum(linear.fan_in * linear.fan_out for linear in self.linears) + self.experts * self.expert_weights()

    def active_matmul_weights(self) -> int:
        """The matrix-product weights one token uses: the linears (attention, router, shared experts)
        and its k routed experts. Equal to matmul_weights for a dense block."""
        return (sum(linear.fan_in * linear.fan_out for linear in self.linears)
                + self.experts_per_token * self.expert_weights())

    def expert_weights(self) -> int:
        """One routed expert's weights: gate and up h×width, down width×h."""
        return 3 * self.hidden * self.expert_width

    def parameters(self) -> int:
        norm_width = 2 if self.norm == "layer" else 1
        return (self.matmul_weights() + sum(linear.fan_out for linear in self.linears if linear.bias)
                + len(self.norms) * norm_width * self.hidden + (2 * self.head_dim if self.qk_norm else 0))


def describe_gpt_block(hidden: int, heads: int, mlp_ratio: int = 4, **_) -> BlockDescription:
    """The pre-LayerNorm GPT/BERT block (`Block`) as data."""
    wide = mlp_ratio * hidden
    return BlockDescription(
        norms=("norm_attention", "norm_mlp"), norm="layer",
        linears=(LinearShape("attention.qkv", hidden, 3 * hidden, "column", fused=3),
                 LinearShape("attention.proj", hidden, hidden, "row"),
                 LinearShape("mlp.fc_in", hidden, wide, "column"),
                 LinearShape("mlp.fc_out", wide, hidden, "row")),
        hidden=hidden, heads=heads, kv_heads=heads, mlp_width=wide, gated=False, rotary=False)


# ----------------------------------------------------------------------------- layers


class Embedding(nn.Module):
    """Tokens [b, s] -> vectors [b, s, h].

    x = token_embedding[tokens] + position_embedding[0..s-1]; x = dropout(x).
    """

    def __init__(self, vocab_size: int, sequence_length: int, hidden: int, dropout: float):
        super().__init__()
        self.token = nn.Embedding(vocab_size, hidden)
        self.position = nn.Embedding(sequence_length, hidden)
        self.dropout = nn.Dropout(dropout)
        self.documents = None  # a Documents while a packed micro-batch runs (LanguageModel.set_documents)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        length = tokens.shape[1]
        if length > self.position.num_embeddings:
            raise ValueError(
                f"data.sequence_length: sequences of {length} tokens exceed the model's "
                f"{self.position.num_embeddings} positions; raise model.max_sequence_length"
            )
        # Packed documents (models/documents.py): each document's positions restart at 0
        positions = torch.arange(length, device=tokens.device) if self.documents is None else self.documents.positions
        return self.dropout(self.token(tokens) + self.position(positions))


class CoreAttention(nn.Module):
    """The core attention, y = softmax(q kᵀ / sqrt(d) [causal mask]) v per head: Q·Kᵀ, the softmax and
    scores·V, on q[b, heads, s, d] and k, v[b, kv_heads, s, d]. No weights, no dropout.

    Its own (parameter-free) module so that a strategy can treat it on its own: selective activation
    recomputation (Korthikanti et al. 2022 §5; strategies/recompute.py) reruns just this in the
    backward rather than keeping its tensors. Grouped-query attention when k and v hold fewer heads
    than q, read off the shapes: a tensor-parallel rank holds a share of both. With `documents` set
    (packed rows, models/documents.py) a token attends only to earlier tokens of its own document.
    """

    def __init__(self, causal: bool):
        super().__init__()
        self.causal = causal
        self.documents = None  # a Documents while a packed micro-batch runs (LanguageModel.set_documents)
        # A callable (query, key, value, documents) -> output computing this attention over a sequence
        # split across ranks (strategies/context_parallel.py installs it); None: the attention is local.
        self.context = None

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        if self.context is not None:
            return self.context(query, key, value, self.documents)
        if self.documents is not None:
            return packed_attention(query, key, value, self.documents)
        return F.scaled_dot_product_attention(query, key, value, is_causal=self.causal,
                                              enable_gqa=key.shape[1] != query.shape[1])


class Attention(nn.Module):
    """Multi-head self-attention with a fused query/key/value projection.

    q, k, v = split(qkv(x)) into heads; y = core_attention(q, k, v) = softmax(q kᵀ / sqrt(d)) v
    (causal mask for GPT); out = dropout(proj(merge heads(y))).
    """

    def __init__(self, hidden: int, heads: int, dropout: float, causal: bool):
        super().__init__()
        if hidden % heads != 0:
            raise ValueError(f"model.heads: hidden {hidden} is not divisible by heads {heads}")
        self.heads = self.kv_heads = heads
        self.causal = causal
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.core_attention = CoreAttention(causal)
        self.proj = nn.Linear(hidden, hidden)
        # Dropout on the output only, as an nn.Dropout: scaled_dot_product_attention's dropout_p
        # would draw from the global RNG inside a fused kernel, which RNG replay cannot reproduce.
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length = x.shape[:2]
        # [b, s, heads·d] -> [b, heads, s, d], the layout scaled_dot_product_attention expects. Widths
        # come from `heads`, not x: a tensor-parallel rank holds fewer heads (and features of x).
        query, key, value = (t.view(batch, length, self.heads, -1).transpose(1, 2)
                             for t in self.qkv(x).chunk(3, dim=-1))
        y = self.core_attention(query, key, value)
        return self.dropout(self.proj(y.transpose(1, 2).reshape(batch, length, -1)))


class MLP(nn.Module):
    """Position-wise feed-forward: out = dropout(fc_out(gelu(fc_in(x)))), width mlp_ratio × h."""

    def __init__(self, hidden: int, mlp_ratio: int, dropout: float):
        super().__init__()
        self.fc_in = nn.Linear(hidden, mlp_ratio * hidden)
        self.activation = nn.GELU(approximate="tanh")  # GPT-2's choice; BERT's erf differs < 1e-3
        self.fc_out = nn.Linear(mlp_ratio * hidden, hidden)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.fc_out(self.activation(self.fc_in(x))))


class Block(nn.Module):
    """One pre-LayerNorm transformer layer, x[b, s, h] -> x[b, s, h].

    x = x + attention(norm_attention(x)); x = x + mlp(norm_mlp(x)).
    """

    def __init__(self, hidden: int, heads: int, mlp_ratio: int = 4, dropout: float = 0.0,
                 causal: bool = True):
        super().__init__()
        self.norm_attention = nn.LayerNorm(hidden)
        self.attention = Attention(hidden, heads, dropout, causal)
        self.norm_mlp = nn.LayerNorm(hidden)
        self.mlp = MLP(hidden, mlp_ratio, dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.norm_attention(x))
        return x + self.mlp(self.norm_mlp(x))


def initialize_block(block: Block, *, seed: int, index: int, layers: int) -> None:
    """Initialise block `index` of an L-layer model seeded with `seed`, alone."""
    initialize(block, seed=seed, name=index, residual_std=residual_init_std(layers))


def seeded_module(make, device, *, seed: int, name, residual_std: float = INIT_STD) -> nn.Module:
    """`make()` with the values `initialize` gives it, on `device` (on "meta": shapes only).

    The module is first built on meta, where constructors draw nothing: the global RNG (which
    dropout uses afterwards) stays as it was on every device, however many parts a rank builds,
    and no default initialisation is computed only to be overwritten.
    """
    with torch.device("meta"):
        module = make()
    device = torch.device(device) if device is not None else torch.get_default_device()
    if device.type != "meta":
        module.to_empty(device=device)
        initialize(module, seed=seed, name=name, residual_std=residual_std)
    return module


def build_block(*, hidden: int, heads: int, mlp_ratio: int, dropout: float, causal: bool,
                seed: int, index: int, layers: int, device=None) -> Block:
    """Block `index` exactly as the full model built with `seed` holds it; global RNG untouched."""
    return seeded_module(lambda: Block(hidden, heads, mlp_ratio, dropout, causal), device,
                         seed=seed, name=index, residual_std=residual_init_std(layers))


def keep_local_experts(block: nn.Module, shard) -> nn.Module:
    """`block` (on meta, just built) with each MoE layer's experts cut to shard = (index, parts):
    experts [index·E/parts, (index+1)·E/parts) only, `first` saying where they start. Their seeded
    values equal the whole model's (each expert draws from its own generator: models/moe.py
    Experts.initialize_seeded), so a rank never builds the experts it does not own."""
    if shard is None:
        return block
    index, parts = shard
    for module in block.modules():
        experts = getattr(module, "experts", None)
        if isinstance(experts, SeededParameters) and hasattr(experts, "total"):
            local = experts.total // parts
            module.experts = type(experts)(experts.hidden, experts.width, local, first=index * local,
                                           total=experts.total)
    return block


def on_meta(module: nn.Module) -> bool:
    """Whether any parameter or buffer of `module` is still shapes only."""
    tensors = list(module.parameters()) + list(module.buffers())
    return any(tensor.device.type == "meta" for tensor in tensors)


# ----------------------------------------------------------------------------- the model


class LanguageModel(nn.Module):
    """embed -> blocks "0".."L-1" -> head, with a cross-entropy loss; GPT and BERT subclass it.

    Subclasses set `causal` and implement `make_head` (Llama also `make_block`, `make_embed`). forward is a plain loop over blocks, so a
    strategy can run any contiguous or looping subset of layers by indexing `blocks` by name.
    Built with device="meta" the model holds shapes only, and a process materialises just the
    parts it owns (`materialise`), or builds a part's seeded values alone (`build_part`).
    """

    causal: bool = True
    # (index, parts): this process holds experts [index·E/parts, (index+1)·E/parts) of every MoE
    # block and builds no other (expert parallelism, strategies/expert_parallel.py); None: all of them
    expert_shard = None

    def __init__(self, *, vocab_size: int, sequence_length: int, layers: int, hidden: int,
                 heads: int, mlp_ratio: int = 4, dropout: float = 0.0,
                 tie_embeddings: bool = False, seed: int = 0, device=None, weights=None):
        super().__init__()
        if layers < 1:
            raise ValueError(f"model.layers: need at least one block, got {layers}")
        self.vocab_size = vocab_size
        self.sequence_length = sequence_length
        self.layers = layers  # the whole model's depth: residual init scales by it on every rank
        self.hidden, self.heads, self.mlp_ratio, self.dropout = hidden, heads, mlp_ratio, dropout
        self.tie_embeddings = tie_embeddings
        self.seed = seed
        # None: seeded values. Else a callable (part, module) filling a part's empty storage, e.g.
        # from a Hugging Face checkpoint (models/hf.py PartWeights): every strategy materialises
        # through build_part, so each process reads only the parts it owns.
        self.weights = weights
        self.dropped = frozenset()  # names of the blocks this training step skips (LayerDrop)
        self.embed = self.build_part("embed", "meta")
        self.head = self.build_part("head", "meta")  # registered before the blocks: parameter order
        self.blocks = nn.ModuleDict({str(index): self.build_part(f"blocks.{index}", "meta")
                                     for index in range(layers)})
        self._tie()
        device = torch.device(device) if device is not None else torch.get_default_device()
        if device.type != "meta":
            self.materialise(device)

    # ----- parts: "embed", "blocks.<index>", "head"
    def part_names(self) -> list:
        """The parts this model still holds, in forward order (a pipeline rank drops some)."""
        names = ["embed"] if self.embed is not None else []
        names += [f"blocks.{index}" for index in self.blocks]
        return names + (["head"] if self.head is not None else [])

    def build_part(self, part: str, device) -> nn.Module:
        """The part named `part`, alone, with the values it has in the full model seeded `seed`
        (or, with a `weights` hook, the values the hook fills in)."""
        if self.weights is not None and torch.device(device).type != "meta":
            module = self.build_part(part, "meta").to_empty(device=device)
            self.weights(part, module)
            return module
        if part.startswith("blocks."):
            index = int(part.removeprefix("blocks."))  # the block knows its index (model.moe_layers)
            return seeded_module(lambda: keep_local_experts(self.make_block(index), self.expert_shard), device,
                                 seed=self.seed, name=index, residual_std=residual_init_std(self.layers))
        makers = {"embed": self.make_embed, "head": lambda: self.make_head(self.hidden, self.vocab_size)}
        if part not in makers:
            raise ValueError(f"unknown part {part!r}: embed, blocks.<index> or head")
        return seeded_module(makers[part], device, seed=self.seed, name=part)

    def materialise(self, device, parts=None) -> None:
        """Give each named part still on meta (default: every part) storage on `device` and its
        seeded values, one part at a time; parts that already hold values are left as they are."""
        for part in self.part_names() if parts is None else parts:
            current = self.get_submodule(part)
            if on_meta(current):
                replacement = self.build_part(part, device).train(current.training)
                parent, _, child = part.rpartition(".")
                setattr(self.get_submodule(parent) if parent else self, child, replacement)
        self._tie()

    def _tie(self) -> None:
        # After the head's own init, so the shared Parameter keeps the embedding's values.
        if self.tie_embeddings and self.embed is not None and self.head is not None:
            self.head.output.weight = self.embed.token.weight

    def make_block(self, index: int = None) -> nn.Module:
        """Block `index` (every GPT/BERT block is alike; Llama's MoE blocks are those in moe_layers)."""
        return Block(self.hidden, self.heads, self.mlp_ratio, self.dropout, self.causal)

    def make_embed(self) -> nn.Module:
        return Embedding(self.vocab_size, self.sequence_length, self.hidden, self.dropout)

    def make_head(self, hidden: int, vocab_size: int) -> nn.Module:
        raise NotImplementedError

    def set_documents(self, documents) -> None:
        """Packed rows (models/documents.py): from now on the embedding's positions, RoPE and the core
        attention of every block this model holds read `documents` (a Documents for the micro-batch
        about to run, or None for plain causal rows). A context on the model, not an argument, so
        that every strategy's `blocks[name](hidden)` call stays as it is; a strategy sets it before
        each micro-batch's forward (and so cannot recompute a block after the next one is set)."""
        for module in self.modules():
            if hasattr(module, "documents"):
                module.documents = documents

    def set_loss_scale(self, scale: float) -> None:
        """The share the micro-batch about to run has in the step's loss (1/m for m micro-batches;
        1 for a whole batch): the MoE blocks' auxiliary loss enters the gradient with it
        (models/moe.py). A context on the model like `set_documents`, set where micro-batches run."""
        for module in self.modules():
            if hasattr(module, "loss_scale"):
                module.loss_scale = scale

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.running_blocks():
            x = block(x)
        return self.head(x)

    # ----- dynamic depth (docs/strategies/l2l.md, "Dynamic architectures")
    def drop_blocks(self, names) -> None:
        """Skip the blocks named `names` in training forwards until the next call (LayerDrop's mask):
        a dropped block is the identity. Evaluation (`eval()`) always runs every block."""
        unknown = set(names) - set(self.blocks)
        if unknown:
            raise ValueError(f"drop_blocks: no blocks {sorted(unknown)} in a {len(self.blocks)}-block model")
        self.dropped = frozenset(names)

    def running_blocks(self) -> list:
        """The blocks a forward runs now, in order: all of them, less the dropped ones in training."""
        return [block for name, block in self.blocks.items() if not (self.training and name in self.dropped)]

    @torch.no_grad()
    def grow(self, count: int) -> list:
        """Progressive stacking (Gong et al. 2019; docs/strategies/l2l.md): append `count` blocks,
        new block L + i a copy of block i mod L (count = L stacks the whole model on itself, as the
        paper does). Returns the new blocks' parameters, for the caller's optimizer (fresh state)."""
        if any(on_meta(block) for block in self.blocks.values()):
            raise ValueError("grow: every block must hold values (a pipeline rank holds only some)")
        depth, added = len(self.blocks), []
        for offset in range(count):
            source = self.blocks[str(offset % depth)]
            block = self.make_block_like(source, offset % depth)
            block.load_state_dict(source.state_dict())
            self.blocks[str(depth + offset)] = block
            added += list(block.parameters())
        self.layers = len(self.blocks)
        return added

    def make_block_like(self, source: nn.Module, index: int = None) -> nn.Module:
        """A new block with `source`'s device, dtype and training mode (values: the caller's), of the
        kind of block `index` (source's: dense or MoE)."""
        parameter = next(source.parameters())
        with torch.device("meta"):
            block = self.make_block(index)
        return block.to_empty(device=parameter.device).to(parameter.dtype).train(source.training)

    def loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean cross-entropy in nats over the positions whose target is not -100."""
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(),
                               targets.reshape(-1), ignore_index=IGNORE_INDEX)


# ----------------------------------------------------------------------------- LayerDrop


def layer_drop_mask(seed: int, step: int, layers: int, p: float) -> frozenset:
    """Names of the blocks step `step` drops (LayerDrop, Fan et al. 2019; docs/strategies/l2l.md):
    each block but the first and the last independently with probability p, from a generator seeded
    by (seed, step) alone, so every rank, every strategy and every rerun draws the same mask."""
    if p == 0 or layers <= 2:
        return frozenset()
    generator = torch.Generator(device="cpu").manual_seed(derived_seed(seed, f"layer_drop/{step}"))
    draws = torch.rand(layers, generator=generator)  # all L drawn: the mask of block i depends on i only
    return frozenset(str(index) for index in range(1, layers - 1) if draws[index] < p)


# ----------------------------------------------------------------------------- accounting


def parameter_count(model: nn.Module) -> int:
    """Number of distinct parameters (a tied embedding counts once)."""
    return sum(parameter.numel() for parameter in model.parameters())


def model_flops_per_token(layers: int, hidden: int, sequence_length: int, vocab_size: int,
                          mlp_ratio: int = 4, block: BlockDescription = None, blocks: list = None) -> int:
    """Training FLOPs per token: 6·N for the matrix multiplies plus 12·L·h·s for attention.

    N counts the weights that take part in a matmul: the block's linears (GPT: (4 + 2·mlp_ratio)·h²;
    Llama: 2h² for q/o, 2·h·kv·d for k/v, 3·h·ffn for SwiGLU; `block`'s description) and the h·V
    output projection (embedding lookups are free). The attention term is PaLM's (Chowdhery et al.
    2022, appendix B): QKᵀ and AV, forward and backward, without discounting the causal mask
    (grouped-query attention shares K/V, not these products).
    """
    # a mixture of experts counts the weights a token uses (MFU of active parameters): `blocks`, one
    # description per layer (models.blocks_of), where MoE and dense blocks mix
    per_block = block.active_matmul_weights() if block is not None else (4 + 2 * mlp_ratio) * hidden**2
    stacked = sum(each.active_matmul_weights() for each in blocks) if blocks is not None else layers * per_block
    matmul_weights = stacked + hidden * vocab_size
    # QKᵀ and AV are heads·d wide: hidden, unless the block sets head_dim apart (Qwen3)
    width = block.heads * block.head_dim if block is not None else hidden
    return 6 * matmul_weights + 12 * layers * width * sequence_length
