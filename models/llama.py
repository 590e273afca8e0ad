"""Llama: a causal decoder with RMSNorm, rotary positions, SwiGLU and grouped-query attention.

Llama 2/3 (Touvron et al. 2023; Dubey et al. 2024, §3.1), with `qkv_bias` Qwen2, with `qk_norm`
(and usually `head_dim` ≠ hidden/heads) Qwen3 (Yang et al. 2025, §2: QK-Norm replaces QKV-bias). The parts
protocol is the GPT's (`embed`, `blocks` "0".."L-1", `head`); module names follow it where the
role is the same (`norm_attention`, `attention.proj`, `norm_mlp`, `mlp.fc_out`, `head.norm`,
`head.output`), so pipelines, ZeRO, FSDP and the tensor-parallel plan find them. Q, K, V and the
SwiGLU gate/up are separate linears: each splits by whole heads / whole features on its own.
"""

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from models.moe import MoeSettings
from models.transformer import BlockDescription, CoreAttention, LanguageModel, LinearShape


def describe_llama_block(hidden: int, heads: int, kv_heads: int = None, ffn_hidden: int = None,
                         mlp_ratio: int = 4, qkv_bias: bool = False, head_dim: int = None,
                         qk_norm: bool = False, **_) -> BlockDescription:
    """The Llama block (`LlamaBlock`) as data: q/k/v column linears (k, v kv_heads·d wide, d =
    head_dim, default hidden/heads), the output projection and SwiGLU's down row linears, gate/up
    column linears; `qk_norm`: two RMSNorm weights of d each (Qwen3's q_norm, k_norm)."""
    kv, ffn, d = kv_heads or heads, ffn_hidden or mlp_ratio * hidden, head_dim or hidden // heads
    return BlockDescription(
        norms=("norm_attention", "norm_mlp"), norm="rms",
        linears=(LinearShape("attention.q", hidden, heads * d, "column", bias=qkv_bias),
                 LinearShape("attention.k", hidden, kv * d, "column", bias=qkv_bias),
                 LinearShape("attention.v", hidden, kv * d, "column", bias=qkv_bias),
                 LinearShape("attention.proj", heads * d, hidden, "row", bias=False),
                 LinearShape("mlp.gate", hidden, ffn, "column", bias=False),
                 LinearShape("mlp.up", hidden, ffn, "column", bias=False),
                 LinearShape("mlp.fc_out", ffn, hidden, "row", bias=False)),
        hidden=hidden, heads=heads, kv_heads=kv, mlp_width=ffn, gated=True, rotary=True,
        head_dim=d, qk_norm=qk_norm)


def rotary_frequencies(head_dim: int, theta: float, scaling=None) -> torch.Tensor:
    """θ^(-2i/d) for i < d/2 (Su et al. 2021, RoFormer §3.2), optionally with Llama 3.1's
    long-context rescaling: wavelengths above original_max/low_freq_factor are stretched by
    `factor`, below original_max/high_freq_factor kept, and smoothly interpolated between."""
    inverse = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    if not scaling:
        return inverse
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    original = scaling["original_max_position_embeddings"]
    wavelength = 2 * math.pi / inverse
    smooth = (original / wavelength - low) / (high - low)
    mixed = (1 - smooth) * inverse / factor + smooth * inverse
    return torch.where(wavelength > original / low, inverse / factor,
                       torch.where(wavelength < original / high, inverse, mixed))


def rotary_angles(length: int, frequencies: torch.Tensor, dtype, device, positions=None) -> tuple:
    """(cos, sin) of position·frequency_i, [s, 1, d/2] (or [b, s, 1, d/2] for per-row `positions`
    [b, s], packed documents restarting at 0): computed once per forward, shared by q and k
    (autograd then keeps one pair per block, not one per use)."""
    if positions is None:
        positions = torch.arange(length, dtype=torch.float64, device=device)
    angles = positions.to(torch.float64).unsqueeze(-1) * frequencies.to(device)
    return angles.cos().to(dtype).unsqueeze(-2), angles.sin().to(dtype).unsqueeze(-2)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate each (x_i, x_{i+d/2}) pair of x[b, s, n, d] by angle position·frequency_i (the
    half-split pairing of the Hugging Face Llama; Meta's interleaved pairing differs by a
    permutation of the q/k weights' rows). Applied in [b, s, n, d] so attention's output keeps
    that layout and merging the heads is a view, as in the GPT (no copy for autograd to keep)."""
    first, second = x.chunk(2, dim=-1)
    return torch.cat((first * cos - second * sin, second * cos + first * sin), dim=-1)


class GroupedQueryAttention(nn.Module):
    """Causal attention with `kv_heads` key/value heads shared by groups of heads/kv_heads queries.

    q = rope(q(x)), k = rope(k(x)), v = v(x) split into heads of `head_dim` (default hidden/heads);
    with `qk_norm` (Qwen3) q = rope(rmsnorm_d(q(x))), k = rope(rmsnorm_d(k(x))): one RMSNorm over each
    head's d features, its d weights shared by all heads (transformers' Qwen3Attention q_norm,
    k_norm); y = core_attention(q, k, v) =
    softmax(q kᵀ/√d) v with each kv head serving its group (scaled_dot_product_attention's
    enable_gqa: K/V not repeated);
    out = proj(merge(y)). `heads`/`kv_heads` are the heads this module holds: tensor parallelism
    keeps a contiguous share of both (strategies/tensor_parallel), the widths follow.
    """

    causal = True

    def __init__(self, hidden: int, heads: int, kv_heads: int, rope_theta: float, rope_scaling,
                 qkv_bias: bool, head_dim: int = None, qk_norm: bool = False, norm_eps: float = 1e-6):
        super().__init__()
        if (head_dim is None and hidden % heads) or heads % kv_heads:
            raise ValueError(f"model.heads/kv_heads: hidden {hidden} must split into heads {heads} "
                             f"(or set model.head_dim), and heads into kv_heads {kv_heads} groups")
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim or hidden // heads
        self.rope_theta, self.rope_scaling = rope_theta, rope_scaling
        self.q = nn.Linear(hidden, heads * self.head_dim, bias=qkv_bias)
        self.k = nn.Linear(hidden, kv_heads * self.head_dim, bias=qkv_bias)
        self.v = nn.Linear(hidden, kv_heads * self.head_dim, bias=qkv_bias)
        self.core_attention = CoreAttention(causal=True)
        self.proj = nn.Linear(heads * self.head_dim, hidden, bias=False)
        if qk_norm:  # before RoPE, per head: the norm sees one head's d features whatever the shard
            self.q_norm = nn.RMSNorm(self.head_dim, eps=norm_eps)
            self.k_norm = nn.RMSNorm(self.head_dim, eps=norm_eps)
        self.documents = None  # a Documents while a packed micro-batch runs: RoPE takes its positions

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length = x.shape[:2]
        query, key, value = (linear(x).view(batch, length, heads, self.head_dim)
                             for linear, heads in ((self.q, self.heads), (self.k, self.kv_heads),
                                                   (self.v, self.kv_heads)))
        if hasattr(self, "q_norm"):
            query, key = self.q_norm(query), self.k_norm(key)
        cos, sin = rotary_angles(length, rotary_frequencies(self.head_dim, self.rope_theta, self.rope_scaling),
                                 query.dtype, x.device,
                                 None if self.documents is None else self.documents.positions)
        # [b, s, n, d] -> [b, n, s, d], the layout scaled_dot_product_attention expects
        query, key, value = (apply_rotary(query, cos, sin).transpose(1, 2),
                             apply_rotary(key, cos, sin).transpose(1, 2), value.transpose(1, 2))
        y = self.core_attention(query, key, value)
        return self.proj(y.transpose(1, 2).reshape(batch, length, -1))


class SwiGLU(nn.Module):
    """out = fc_out(silu(gate(x)) ⊙ up(x)) (Shazeer 2020, "GLU Variants Improve Transformer"), no biases."""

    def __init__(self, hidden: int, ffn_hidden: int):
        super().__init__()
        self.gate = nn.Linear(hidden, ffn_hidden, bias=False)
        self.up = nn.Linear(hidden, ffn_hidden, bias=False)
        self.fc_out = nn.Linear(ffn_hidden, hidden, bias=False)  # "down"; residual init by its name

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc_out(F.silu(self.gate(x)) * self.up(x))


class LlamaBlock(nn.Module):
    """x = x + attention(rmsnorm(x)); x = x + swiglu(rmsnorm(x)). No dropout (Llama has none)."""

    def __init__(self, hidden: int, heads: int, kv_heads: int, ffn_hidden: int, norm_eps: float,
                 rope_theta: float, rope_scaling=None, qkv_bias: bool = False, head_dim: int = None,
                 qk_norm: bool = False):
        super().__init__()
        self.norm_attention = nn.RMSNorm(hidden, eps=norm_eps)
        self.attention = GroupedQueryAttention(hidden, heads, kv_heads, rope_theta, rope_scaling, qkv_bias,
                                               head_dim, qk_norm, norm_eps)
        self.norm_mlp = nn.RMSNorm(hidden, eps=norm_eps)
        self.mlp = SwiGLU(hidden, ffn_hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.norm_attention(x))
        return x + self.mlp(self.norm_mlp(x))


class TokenEmbedding(nn.Module):
    """Tokens [b, s] -> token vectors [b, s, h]; positions enter through RoPE in every block."""

    def __init__(self, vocab_size: int, hidden: int):
        super().__init__()
        self.token = nn.Embedding(vocab_size, hidden)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.token(tokens)


class LlamaHead(nn.Module):
    """x[b, s, h] -> logits[b, s, V]: final RMSNorm, bias-free projection to the vocabulary."""

    def __init__(self, hidden: int, vocab_size: int, norm_eps: float):
        super().__init__()
        self.norm = nn.RMSNorm(hidden, eps=norm_eps)
        self.output = nn.Linear(hidden, vocab_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.output(self.norm(x))


class Llama(LanguageModel):
    """Causal language model: token embedding, L Llama blocks, LlamaHead.

    Trained like the GPT (targets = tokens shifted left by one). `kv_heads` < `heads` is
    grouped-query attention (Ainslie et al. 2023); `ffn_hidden` the SwiGLU width; `rope_scaling`
    Llama 3.1's frequency rescaling ({factor, low_freq_factor, high_freq_factor,
    original_max_position_embeddings}) or None; `head_dim` each head's width (default hidden/heads;
    Qwen3: 128 whatever the width); `qk_norm` Qwen3's per-head RMSNorm of q and k.
    """

    causal = True

    def __init__(self, *, kv_heads: int = None, ffn_hidden: int = None, norm_eps: float = 1e-5,
                 rope_theta: float = 10000.0, rope_scaling=None, qkv_bias: bool = False,
                 head_dim: int = None, qk_norm: bool = False, **kwargs):
        heads, hidden = kwargs["heads"], kwargs["hidden"]
        self.head_dim, self.qk_norm = head_dim or hidden // heads, bool(qk_norm)
        self.kv_heads = kv_heads or heads
        self.ffn_hidden = ffn_hidden or kwargs.get("mlp_ratio", 4) * hidden
        self.norm_eps, self.rope_theta, self.qkv_bias = norm_eps, rope_theta, qkv_bias
        # mixture of experts (models/moe.py): experts, experts_per_token, moe_layers, router, ...
        self.moe = MoeSettings.pop_from(kwargs)
        self.rope_scaling = dict(rope_scaling) if rope_scaling else None
        super().__init__(**kwargs)

    def make_block(self, index: int = None) -> nn.Module:
        """Block `index`: its SwiGLU is an MoE (models/moe.py) where `moe` says block `index` is one."""
        block = self.make_dense_block()
        if self.moe.is_moe(index):
            block.mlp = self.moe.build(self.hidden, self.ffn_hidden, lambda width: SwiGLU(self.hidden, width))
        return block

    def make_dense_block(self) -> nn.Module:
        return LlamaBlock(self.hidden, self.heads, self.kv_heads, self.ffn_hidden, self.norm_eps,
                          self.rope_theta, self.rope_scaling, self.qkv_bias, self.head_dim, self.qk_norm)

    def make_embed(self) -> nn.Module:
        return TokenEmbedding(self.vocab_size, self.hidden)

    def make_head(self, hidden: int, vocab_size: int) -> nn.Module:
        return LlamaHead(hidden, vocab_size, self.norm_eps)
