"""Context parallelism: each sequence split over the c ranks of the `context` group, attention exact.

Load balance (torchtitan's head-tail sharder, Megatron-core's `get_batch_on_this_cp_rank`): the s
tokens of a row are cut into 2c equal chunks of L = s/(2c) tokens; context rank i holds chunk i and
chunk 2c−1−i, in that order, as its s/c local tokens (`shard_indices`). Under the causal mask the
query-key pairs of chunk j number L²·j + L(L+1)/2, so rank i's two chunks hold L²(2c−1) + L(L+1)
pairs whatever i is: every rank does the same attention work (`causal_pairs`, `load_balance`;
a contiguous split gives rank c−1 about 2 − 1/c times the mean).

Everything outside the core attention is per token and runs on the local tokens unchanged. The
positions a token needs come from a `Documents` (models/documents.py) set on the model by
`context_parallel_batch`: ids = the local tokens' document numbers (all 0 without packing) and
positions = their global positions (their in-document positions when packed), so GPT's position
table and Llama's RoPE see what the one-process model sees. The attention mask between a query and a
key is models/documents.py's rule, `same document and position_q >= position_k`; the key side's ids
and positions are indexed from the full-row Documents every context rank holds (the data loader gives
each the whole rows), so nothing about documents travels. Packing therefore composes with context
parallelism: a key chunk is masked by the same rule as in the one-process model.

The core attention (models.transformer.CoreAttention, whose `context` hook calls
`ContextParallelAttention`) gets local q [b, heads, s/c, d] and k, v [b, kv_heads, s/c, d]. With
grouped-query attention only the kv_heads travel: K/V are never expanded before sending, and each
kv head serves its group of heads/kv_heads query heads in the products. Two exchanges:

ring (`strategy.context_parallel_comm=ring`; Liu et al. 2023, "Ring Attention"; Megatron-core's
    `p2p`): K and V, stacked into one buffer [2, b, kv_heads, s/c, d], pass around the ring (rank i
    sends to i+1 and receives from i−1, through the counted Communicator's send/receive). At step t
    rank i holds the block of rank i−t; the transfer of the next block is posted before the current
    block's attention is computed (overlap) and waited after it. The attention is blockwise over
    (query chunk, key chunk) pairs: a key chunk entirely after a query chunk is skipped (counted in
    `blocks`), and the partial results are merged with the online softmax: for a block with scores S
    (masked to −∞), lse_b = log Σ exp S, o_b = softmax(S)·V, and the running (o, lse) becomes
    lse' = log(e^lse + e^lse_b), o' = o·e^(lse−lse') + o_b·e^(lse_b−lse'). The backward is a custom
    autograd function: with the final lse saved, each block's probabilities are exp(S − lse); K and
    V travel the ring again (c−1 hops), and a dK/dV accumulator of each block travels with it: at
    step t rank i adds its contribution to the accumulator of rank i−t's block received from i−1 (its
    own at step 0) and passes it on to i+1; after the last step each accumulator has visited every
    rank and the last hop brings it home (c hops, torch's _templated_ring_attention_backward's and
    TransformerEngine's scheme).
all_gather (`strategy.context_parallel_comm=all_gather`; Llama 3's choice, Dubey et al. 2024 §3.3.2;
    Megatron-core's `all_gather`): K/V (one stacked buffer) all-gathered over the context group, the
    local queries attend to the whole row's keys by the same blocks as the ring's (the same skips,
    the same merge); in the backward the dK/dV of every rank's block are reduce-scattered back to
    their owners.

Memory per layer kept for the backward (what a flash kernel keeps): q, the local k and v, the output
in the compute dtype and the fp32 log-sum-exp [b, heads, s/c]; the all_gather exchange keeps the
gathered K/V [c, 2, b, kv_heads, s/c, d] in place of the local k, v (c times as large; re-gathering
in the backward, as TransformerEngine does, would trade that for a second all-gather). No s × s mask
or score matrix is kept: the masks are recomputed from the documents per block.

Bytes per layer and per micro-batch of b rows, one rank, with B = 2·b·kv_heads·(s/c)·d·e the
stacked K/V block of one rank (e bytes per element: the compute dtype; cost/traffic.py
`context_traffic` is the closed form the tests compare the counted bytes to):
    ring        forward  send_recv (c−1)·B          (K/V, c−1 hops)
                backward send_recv (c−1)·B + c·B    (K/V again, and the dK/dV accumulators, c hops)
    all_gather  forward  all_gather (c−1)/c · c·B   (the gathered [c, 2, b, kv_heads, s/c, d])
                backward reduce_scatter (c−1)/c · c·B
Under full recomputation (strategy.activation_recompute=full) a block's forward reruns in its
backward, exchange included (with the key side of its own micro-batch: strategies/recompute.py): the
forward's bytes once more per layer and micro-batch (`context_traffic(..., recomputed=True)`).

NCCL order (parallel/comm.py, checked by `check_point_to_point_order` in every multi-process test):
every ring exchange is one send to i+1 and one receive from i−1, issued send-first on even ranks and
receive-first on odd ranks, so a communicator that runs a rank's operations one after another still
completes them (each sender's partner posts its receive first); all ranks issue the same sequence of
exchanges: forward KV_1..KV_{c−1}; backward KV_1, dKV_0, KV_2, dKV_1, …, dKV_{c−1}.

Every block is computed in fp32 (inputs upcast, output rounded once to the compute dtype): on CPU by
torch's flash kernel for CPU, which returns the block's log-sum-exp and whose backward, given the
final output and lse, gives exactly the block's share of the gradients (tiled: no (s/2c)² scores are
held); elsewhere by explicit matrix products (scores of one (s/2c) × (s/2c) block at a time). The two
engines are equal block by block (tests/test_context_parallel.py). On a GPU the blocks would run the
CUDA flash kernels the same way (aten._scaled_dot_product_flash_attention / _efficient_attention and
their backwards, in bf16), or FlexAttention's block mask for packed rows, and the ring's send and
receive would be one batched group (ncclGroupStart/End, torch.distributed.batch_isend_irecv) so both
directions move at once. None of that has run on a GPU here: there the explicit engine runs.

The loss: each rank scores its s/c tokens of every row and takes their mean. Every shard holds the
same number of scored targets, so with gradients averaged over the `data_context` group the result is
the full-row mean's gradient. Ignored targets (BERT's −100) would give shards unequal counts and break
that; context parallelism is for causal models (strategies/context_layout.py refuses bert).
"""

from dataclasses import dataclass, field

import torch

from models.documents import Documents
from models.transformer import CoreAttention
from parallel.comm import Communicator, Group

EXCHANGES = ("ring", "all_gather")
TAG_KEYS_VALUES, TAG_GRADIENTS = 7001, 7002  # ring messages; NCCL ignores tags, gloo and the order check do not


# ----------------------------------------------------------------------------- the load balance


def chunks_of(index: int, degree: int) -> tuple:
    """The two chunks (of 2·degree) context rank `index` holds: head chunk index, tail chunk 2c−1−index."""
    return index, 2 * degree - 1 - index


def check_length(length: int, degree: int) -> None:
    if length % (2 * degree):
        raise ValueError(f"data.sequence_length={length} does not split into 2 × strategy.context_parallel="
                         f"{degree} equal chunks (a head and a tail chunk per context rank). Fix: "
                         f"data.sequence_length a multiple of {2 * degree}.")


def shard_indices(length: int, index: int, degree: int, device=None) -> torch.Tensor:
    """Global positions (LongTensor [length/degree]) of the tokens context rank `index` holds: chunk
    `index` then chunk 2·degree−1−index of the row's 2·degree equal chunks."""
    check_length(length, degree)
    size = length // (2 * degree)
    return torch.cat([torch.arange(chunk * size, (chunk + 1) * size, device=device)
                      for chunk in chunks_of(index, degree)])


def shard_sequence(tensor: torch.Tensor, index: int, degree: int, dim: int = 1) -> torch.Tensor:
    """The part of `tensor` (a row's tokens along `dim`) context rank `index` holds."""
    return tensor.index_select(dim, shard_indices(tensor.shape[dim], index, degree, tensor.device))


def causal_pairs(length: int, index: int, degree: int, balanced: bool = True) -> int:
    """Query-key pairs under the causal mask (query position >= key position) for the queries
    context rank `index` holds: Σ over its global positions q of (q + 1). `balanced`: the head-tail
    shards; else a contiguous split (rank i holds [i·s/c, (i+1)·s/c)), for contrast.
    The attention FLOPs of a rank are 4·heads·d per pair forward (QKᵀ and PV), twice that backward."""
    if balanced:
        positions = shard_indices(length, index, degree)
    else:
        size = length // degree
        positions = torch.arange(index * size, (index + 1) * size)  # host: a count, never on the device
    return int((positions + 1).sum())


def load_balance(length: int, degree: int, balanced: bool = True) -> float:
    """max/mean over the context ranks of `causal_pairs` (1.0: perfectly even)."""
    pairs = [causal_pairs(length, index, degree, balanced) for index in range(degree)]
    return max(pairs) / (sum(pairs) / degree)


def saved_bytes(comm: str, degree: int, rows: int, length: int, heads: int, kv_heads: int, head_dim: int,
                element_bytes: int) -> int:
    """Bytes one context rank's attention keeps for the backward per layer and micro-batch of `rows`
    rows of `length` tokens (module docstring, "Memory"): q and the output [b, heads, s/c, d] in the
    compute dtype, the fp32 log-sum-exp [b, heads, s/c], and K/V [2, b, kv_heads, s/c, d]: the local
    block (ring) or all c blocks (all_gather)."""
    local = length // degree
    blocks = 2 * rows * kv_heads * local * head_dim * (degree if comm == "all_gather" else 1)
    return (2 * rows * heads * local * head_dim + blocks) * element_bytes + rows * heads * local * 4


# ----------------------------------------------------------------------------- the key side


@dataclass
class KeySide:
    """The documents of one micro-batch's rows as the context ranks hold them: for each context rank
    r, its tokens' document ids and positions ([b, s/c] each), indexed from the full rows. Kept by
    the autograd functions of every layer that ran on this micro-batch (a pipeline runs the backward
    of one micro-batch after the forward of the next)."""

    index: int
    degree: int
    shards: list  # [Documents] by context rank
    packed: bool = False  # rows of several documents: masks from the documents, not from chunk order alone

    def chunk(self, rank: int, half: int) -> Documents:
        """Documents of chunk `half` (0 head, 1 tail) of context rank `rank`'s tokens."""
        documents, size = self.shards[rank], self.shards[rank].ids.shape[1] // 2
        cut = slice(half * size, (half + 1) * size)
        return Documents(ids=documents.ids[:, cut], positions=documents.positions[:, cut])


def key_side(documents, rows: int, length: int, index: int, degree: int, device) -> KeySide:
    """The KeySide of full-row `documents` (None: plain causal rows, one document, global positions)."""
    packed = documents is not None
    if not packed:
        positions = torch.arange(length, device=device).expand(rows, length)
        documents = Documents(ids=torch.zeros_like(positions), positions=positions)
    shards = [Documents(ids=shard_sequence(documents.ids, rank, degree),
                        positions=shard_sequence(documents.positions, rank, degree)) for rank in range(degree)]
    return KeySide(index, degree, shards, packed=packed)


CAUSAL = "causal"  # a block mask: query chunk = key chunk of one document, query position >= key position


def mask_of(keys: KeySide, half: int, source: int, key_half: int):
    """The mask of query chunk `half` of this rank against key chunk `key_half` of rank `source`
    (the key chunk not wholly in the future): None (every query sees every key: an earlier chunk
    of plain rows), CAUSAL (the same chunk of plain rows) or, for packed rows, `block_mask`'s."""
    if keys.packed:
        return block_mask(keys.chunk(keys.index, half), keys.chunk(source, key_half))
    same = chunks_of(keys.index, keys.degree)[half] == chunks_of(source, keys.degree)[key_half]
    return CAUSAL if same else None


def block_mask(queries: Documents, keys: Documents) -> torch.Tensor:
    """models/documents.py's rule between a query chunk and a key chunk, bool [b, 1, 1, Lq, Lk]
    (broadcast over kv heads and the query heads of each)."""
    same = queries.ids.unsqueeze(2) == keys.ids.unsqueeze(1)
    earlier = queries.positions.unsqueeze(2) >= keys.positions.unsqueeze(1)
    return (same & earlier)[:, None, None]


# ----------------------------------------------------------------------------- one block
#
# A block is one (query chunk, key chunk) pair: grouped queries q [b, kv, g, Lq, d] (kv head j serves
# its g = heads/kv_heads query heads), k, v [b, kv, Lk, d], and the block's mask (`mask_of`): None,
# CAUSAL, or the documents' mask bool [b, 1, 1, Lq, Lk].
# Two engines, equal to rounding (tests/test_context_parallel.py checks them block by block): explicit
# fp32 products (`exact_block_forward`/`_backward`, any device; scores of the whole block) and, on CPU,
# torch's flash kernel for CPU (aten._scaled_dot_product_flash_attention_for_cpu and its backward: tiled,
# so no Lq × Lk scores are held; it returns the log-sum-exp, and its backward takes the final output and
# lse, which is exactly one block's share of the gradient).


def _scores(query, key, mask, scale):
    """Masked fp32 scores [b, kv, g, Lq, Lk]."""
    scores = torch.matmul(query, key.unsqueeze(2).transpose(-1, -2)) * scale
    if mask is None:
        return scores
    if isinstance(mask, str):  # CAUSAL
        mask = torch.ones(scores.shape[-2:], dtype=torch.bool, device=scores.device).tril()
    return scores.masked_fill(~mask, float("-inf"))


def _finite(lse):
    """−∞ (a row with no key in this block) read as 0, so exp(S − lse) is 0 there, not nan."""
    return torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)


def exact_block_forward(query, key, value, mask, scale):
    """(o_b [b, kv, g, Lq, d], lse_b [b, kv, g, Lq]) of one block; lse_b = −∞ and o_b = 0 on a row
    with no key in the block."""
    scores = _scores(query, key, mask, scale)
    lse = torch.logsumexp(scores, dim=-1)
    probabilities = torch.exp(scores - _finite(lse).unsqueeze(-1))
    return torch.matmul(probabilities, value.unsqueeze(2)), lse


def exact_block_backward(query, key, value, mask, scale, grad_output, output, lse):
    """(dq, dk, dv) of one block given the final output and lse (FlashAttention-2's backward, Dao 2023,
    Algorithm 2): P = exp(S − lse), dV = Pᵀ dO, dS = P ⊙ (dO Vᵀ − rowsum(dO ⊙ O)), dQ = dS K·scale,
    dK = dSᵀ Q·scale; dk, dv summed over the query heads of each kv head."""
    delta = (grad_output * output).sum(-1, keepdim=True)
    probabilities = torch.exp(_scores(query, key, mask, scale) - lse.unsqueeze(-1))
    grad_value = torch.matmul(probabilities.transpose(-1, -2), grad_output).sum(2)
    grad_scores = probabilities * (torch.matmul(grad_output, value.unsqueeze(2).transpose(-1, -2)) - delta)
    grad_query = torch.matmul(grad_scores, key.unsqueeze(2)) * scale
    grad_key = torch.matmul(grad_scores.transpose(-1, -2), query).sum(2) * scale
    return grad_query, grad_key, grad_value


def _per_head(query, key, value):
    """[b, heads, L, d] operands for the kernel: K/V repeated over each kv head's query heads here,
    on this rank (what travels is never expanded)."""
    groups = query.shape[2]
    return (query.flatten(1, 2).contiguous(), key.repeat_interleave(groups, 1).contiguous(),
            value.repeat_interleave(groups, 1).contiguous())


def _kernel_mask(mask) -> dict:
    """The kernel's arguments for `mask`: is_causal for CAUSAL (whole tiles above the diagonal skipped),
    no mask where every query sees every key, else an additive 0 / −∞ mask [b, 1, Lq, Lk]."""
    if isinstance(mask, str):
        return dict(is_causal=True, attn_mask=None)
    if mask is None or bool(mask.all()):
        return dict(is_causal=False, attn_mask=None)
    additive = torch.zeros(mask.shape, device=mask.device).masked_fill(~mask, float("-inf"))[:, 0]
    return dict(is_causal=False, attn_mask=additive)


def flash_block_forward(query, key, value, mask, scale):
    """`exact_block_forward` by the CPU flash kernel (which gives lse 0 on a row with no key: set to −∞)."""
    arguments = _kernel_mask(mask)
    output, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        *_per_head(query, key, value), 0.0, arguments["is_causal"], attn_mask=arguments["attn_mask"], scale=scale)
    lse = lse.reshape(query.shape[:-1])
    if isinstance(mask, torch.Tensor):
        lse = lse.masked_fill(~mask.any(-1), float("-inf"))
    return output.reshape(query.shape), lse


def flash_block_backward(query, key, value, mask, scale, grad_output, output, lse):
    """`exact_block_backward` by the CPU flash kernel's backward."""
    batch, kv_heads, groups = query.shape[:3]
    arguments = _kernel_mask(mask)
    grad_query, grad_key, grad_value = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        grad_output.flatten(1, 2).contiguous(), *_per_head(query, key, value), output.flatten(1, 2).contiguous(),
        lse.flatten(1, 2).contiguous(), 0.0, arguments["is_causal"], attn_mask=arguments["attn_mask"], scale=scale)
    per_kv_head = (batch, kv_heads, groups, *grad_key.shape[2:])
    return (grad_query.reshape(query.shape), grad_key.reshape(per_kv_head).sum(2),
            grad_value.reshape(per_kv_head).sum(2))


def block_forward(query, key, value, mask, scale):
    """One block's (o_b, lse_b): the flash kernel on CPU, the explicit products elsewhere."""
    engine = flash_block_forward if query.device.type == "cpu" else exact_block_forward
    return engine(query, key, value, mask, scale)


def block_backward(query, key, value, mask, scale, grad_output, output, lse):
    """One block's (dq, dk, dv) given the final output and lse: as `block_forward` chooses."""
    engine = flash_block_backward if query.device.type == "cpu" else exact_block_backward
    return engine(query, key, value, mask, scale, grad_output, output, lse)


def merge(output, lse, block_output, block_lse):
    """The online-softmax merge of a block's (o_b, lse_b) into the running (o, lse)."""
    if output is None:
        return block_output, block_lse
    merged = torch.logaddexp(lse, block_lse)
    safe = _finite(merged)
    old, new = torch.exp(lse - safe).unsqueeze(-1), torch.exp(block_lse - safe).unsqueeze(-1)
    return output * old + block_output * new, merged


# ----------------------------------------------------------------------------- the ring


class _Ring:
    """One ring's sends and receives: rank i sends to i+1 and receives from i−1 (module docstring:
    send-first on even ranks, receive-first on odd ones)."""

    def __init__(self, group: Group, communicator: Communicator, index: int):
        self.group, self.communicator, self.index = group, communicator, index
        degree = group.size
        self.next, self.previous = group.ranks[(index + 1) % degree], group.ranks[(index - 1) % degree]

    def exchange(self, outgoing: torch.Tensor, tag: int):
        """Post the send of `outgoing` and the receive of the same-shaped block; returns
        (incoming buffer, work handles)."""
        incoming = torch.empty_like(outgoing)
        send = lambda: self.communicator.send(outgoing, self.next, self.group, tag=tag)  # noqa: E731
        receive = lambda: self.communicator.receive(incoming, self.previous, self.group, tag=tag)  # noqa: E731
        works = [send(), receive()] if self.index % 2 == 0 else [receive(), send()]
        return incoming, works

    @staticmethod
    def wait(works) -> None:
        for work in works:
            work.wait()


def _grouped(query, kv_heads):
    """q [b, heads, n, d] -> [b, kv_heads, heads/kv_heads, n, d] (kv head j serves heads j·g..j·g+g−1,
    as scaled_dot_product_attention's enable_gqa)."""
    batch, heads, length, width = query.shape
    return query.reshape(batch, kv_heads, heads // kv_heads, length, width)


def _ring_steps(ring, blocks, degree: int):
    """(step, the K/V block [2, b, kv, n, d] of rank index−step) for step 0..c−1, passed around the ring:
    the next block's transfer is posted before a block is handed out (computed on) and waited after."""
    for step in range(degree):
        last = step == degree - 1
        if not last:
            incoming, works = ring.exchange(blocks, TAG_KEYS_VALUES)
        yield step, blocks
        if not last:
            ring.wait(works)
            blocks = incoming


def _gathered_steps(gathered, index: int, degree: int):
    """(step, the K/V block of rank index−step) out of the gathered [c, 2, b, kv, n, d]: the ring's order."""
    for step in range(degree):
        yield step, gathered[(index - step) % degree]


def _attend(attention, q, keys, steps) -> tuple:
    """The merged fp32 (output [b, kv, g, n, d], lse [b, kv, g, n]) of the grouped queries q against
    every block `steps` hands out (online softmax per query chunk, head and tail)."""
    running = [(None, None), (None, None)]
    for step, blocks in steps:
        for half in (0, 1):
            for block_output, block_lse in attention.blocks_of(q, blocks, keys, step, half):
                running[half] = merge(*running[half], block_output, block_lse)
    return (torch.cat([merged for merged, _ in running], dim=3),
            torch.cat([merged_lse for _, merged_lse in running], dim=3))


class _RingAttention(torch.autograd.Function):
    """Ring attention's forward and backward (module docstring), exact in fp32."""

    @staticmethod
    def forward(ctx, query, key, value, attention, keys):
        with torch.autocast(query.device.type, enabled=False):
            q = _grouped(query.float(), key.shape[1])
            blocks = torch.stack((key, value))  # one message: K and V of this rank, kv heads only
            output, lse = _attend(attention, q, keys, _ring_steps(attention.ring(keys.index), blocks, keys.degree))
            output = output.to(query.dtype)
        # What a flash kernel keeps: q, k, v, the output in the compute dtype and the fp32 log-sum-exp
        ctx.save_for_backward(query, key, value, output, lse)
        ctx.attention, ctx.keys = attention, keys
        return output.flatten(1, 2)

    @staticmethod
    def backward(ctx, grad_output):
        query, key, value, output, lse = ctx.saved_tensors
        attention, keys = ctx.attention, ctx.keys
        ring, degree = attention.ring(keys.index), keys.degree
        with torch.autocast(query.device.type, enabled=False):
            q = _grouped(query.float(), key.shape[1])
            grad = grad_output.float().reshape(output.shape)
            grad_query = torch.zeros_like(q)
            pending = None  # (incoming accumulator, works) posted after the previous step
            for step, blocks in _ring_steps(ring, torch.stack((key, value)), degree):
                accumulator = attention.block_gradients(q, blocks, keys, step, grad, output.float(), lse, grad_query)
                if pending is not None:  # rank i−step's accumulator from i−1, every earlier rank's share in
                    ring.wait(pending[1])
                    accumulator += pending[0].float()
                if degree > 1:  # on to i+1; after the last step that is the block's owner
                    pending = ring.exchange(accumulator.to(key.dtype), TAG_GRADIENTS)
            if degree > 1:  # after c hops: this rank's own dK/dV, every rank's share summed
                ring.wait(pending[1])
                accumulator = pending[0]
            grad_key, grad_value = accumulator.unbind(0)
        return (grad_query.flatten(1, 2).to(query.dtype), grad_key.to(key.dtype), grad_value.to(value.dtype),
                None, None)


class _GatheredAttention(torch.autograd.Function):
    """All-gather attention (module docstring): K/V [2, b, kv, n, d] all-gathered to [c, 2, b, kv, n, d]
    and kept for the backward, the same blocks as the ring's computed from it; the backward's dK/dV of
    every rank's block reduce-scattered to their owners."""

    @staticmethod
    def forward(ctx, query, key, value, attention, keys):
        blocks = torch.stack((key, value))
        gathered = blocks.unsqueeze(0)
        if keys.degree > 1:
            gathered = blocks.new_empty((keys.degree, *blocks.shape))
            attention.communicator.all_gather(gathered.view(-1), blocks.view(-1), attention.group)
        with torch.autocast(query.device.type, enabled=False):
            q = _grouped(query.float(), key.shape[1])
            output, lse = _attend(attention, q, keys, _gathered_steps(gathered, keys.index, keys.degree))
            output = output.to(query.dtype)
        ctx.save_for_backward(query, gathered, output, lse)
        ctx.attention, ctx.keys = attention, keys
        return output.flatten(1, 2)

    @staticmethod
    def backward(ctx, grad_output):
        query, gathered, output, lse = ctx.saved_tensors
        attention, keys = ctx.attention, ctx.keys
        with torch.autocast(query.device.type, enabled=False):
            q = _grouped(query.float(), gathered.shape[3])
            grad = grad_output.float().reshape(output.shape)
            grad_query = torch.zeros_like(q)
            grad_gathered = torch.zeros(gathered.shape, dtype=torch.float32, device=gathered.device)
            for step, blocks in _gathered_steps(gathered, keys.index, keys.degree):
                source = (keys.index - step) % keys.degree
                grad_gathered[source] = attention.block_gradients(q, blocks, keys, step, grad, output.float(), lse,
                                                                  grad_query)
            grad_gathered = grad_gathered.to(gathered.dtype)
            mine = grad_gathered[0]
            if keys.degree > 1:
                mine = grad_gathered.new_empty(gathered.shape[1:])
                attention.communicator.reduce_scatter(mine.view(-1), grad_gathered.view(-1), attention.group)
            grad_key, grad_value = mine.unbind(0)
        return grad_query.flatten(1, 2).to(query.dtype), grad_key, grad_value, None, None


# ----------------------------------------------------------------------------- the hook


@dataclass
class BlockCounts:
    """(query chunk, key chunk) blocks computed and skipped (key chunk wholly in the future), forwards."""

    computed: int = 0
    skipped: int = 0


@dataclass(eq=False)
class ContextParallelAttention:
    """The core attention over a sequence split on `group` (module docstring), installed on every
    CoreAttention of a model by `apply_context_parallel`; `context_parallel_batch` hands it each
    micro-batch's key side. Called as CoreAttention's `context(query, key, value, documents)`.
    A plain object (no parameters): the model's parameter names and state dict stay as they are."""

    group: Group
    communicator: Communicator
    comm: str = "ring"
    keys: KeySide = None
    blocks: BlockCounts = field(default_factory=BlockCounts)

    def __post_init__(self):
        if self.comm not in EXCHANGES:
            raise ValueError(f"strategy.context_parallel_comm={self.comm}: choose one of {', '.join(EXCHANGES)}")

    @property
    def degree(self) -> int:
        return 1 if self.group is None else self.group.size

    def ring(self, index: int) -> _Ring:
        """The ring of this rank (None on one context rank: nothing is exchanged)."""
        return None if self.degree == 1 else _Ring(self.group, self.communicator, index)

    def __call__(self, query, key, value, documents=None):
        keys = self.keys
        if keys is None:
            raise RuntimeError("context parallel attention without a batch: call "
                               "strategies.context_parallel.context_parallel_batch before the forward")
        if (query.shape[0], query.shape[2]) != tuple(keys.shards[0].ids.shape):
            raise RuntimeError(f"context parallel attention: local q of {query.shape[2]} tokens × {query.shape[0]} "
                               f"rows, but the batch cut by context_parallel_batch holds "
                               f"{keys.shards[0].ids.shape[1]} × {keys.shards[0].ids.shape[0]}")
        exchange = _RingAttention if self.comm == "ring" else _GatheredAttention
        return exchange.apply(query, key, value, self, keys)

    # ----- ring blocks
    def blocks_of(self, q, blocks, keys: KeySide, step: int, half: int):
        """(o_b, lse_b) of query chunk `half` of this rank against each key chunk of the block of rank
        index−step that is not wholly in its future (those are skipped and counted)."""
        source = (keys.index - step) % keys.degree
        query_chunk, size = chunks_of(keys.index, keys.degree)[half], q.shape[3] // 2
        for key_half, key_chunk in enumerate(chunks_of(source, keys.degree)):
            if key_chunk > query_chunk:  # wholly in the future of every query of the chunk (packed too)
                self.blocks.skipped += 1
                continue
            self.blocks.computed += 1
            cut = slice(key_half * size, (key_half + 1) * size)
            mask = mask_of(keys, half, source, key_half)
            yield block_forward(q[:, :, :, half * size:(half + 1) * size], blocks[0][:, :, cut].float(),
                                blocks[1][:, :, cut].float(), mask, q.shape[-1] ** -0.5)

    def block_gradients(self, q, blocks, keys: KeySide, step, grad, output, lse, grad_query):
        """dK/dV [2, b, kv, n, d] (fp32) of the block of rank index−step from this rank's queries, given
        the final output and lse; adds their dQ into `grad_query`."""
        source = (keys.index - step) % keys.degree
        size = q.shape[3] // 2
        contribution = torch.zeros((2, *blocks.shape[1:]), dtype=torch.float32, device=blocks.device)
        for half, query_chunk in enumerate(chunks_of(keys.index, keys.degree)):
            rows = slice(half * size, (half + 1) * size)
            for key_half, key_chunk in enumerate(chunks_of(source, keys.degree)):
                if key_chunk > query_chunk:
                    continue
                cut = slice(key_half * size, (key_half + 1) * size)
                mask = mask_of(keys, half, source, key_half)
                dq, dk, dv = block_backward(q[:, :, :, rows], blocks[0][:, :, cut].float(),
                                            blocks[1][:, :, cut].float(), mask, q.shape[-1] ** -0.5,
                                            grad[:, :, :, rows], output[:, :, :, rows], lse[:, :, :, rows])
                grad_query[:, :, :, rows] += dq
                contribution[0][:, :, cut] += dk
                contribution[1][:, :, cut] += dv
        return contribution


# ----------------------------------------------------------------------------- the entry points


def apply_context_parallel(model, group: Group, communicator: Communicator,
                           comm: str = "ring") -> ContextParallelAttention:
    """Install one ContextParallelAttention (exchange `comm`: ring | all_gather) over `group` on every
    CoreAttention the model holds (a pipeline rank: its own blocks); returns it. The model keeps its
    parameters, names and state dict; its forward now expects `context_parallel_batch`'s local tokens."""
    attention = ContextParallelAttention(group, communicator, comm)
    for module in model.modules():
        if isinstance(module, CoreAttention):
            module.context = attention
    model.context_parallel = attention  # where context_parallel_batch finds it (also on a rank without blocks)
    return attention


def context_parallel_batch(model, tokens: torch.Tensor, targets: torch.Tensor, documents, index: int,
                           degree: int) -> tuple:
    """This context rank's (local_tokens, local_targets) [b, s/c] of full rows tokens/targets [b, s]
    (chunks index and 2c−1−index), with the model set for them: its Documents (local document ids,
    all 0 unpacked, and global positions, or in-document positions when packed: `documents` is the
    full rows' Documents or None) and the key side its context-parallel attention masks with.
    Call it before each micro-batch's forward, as `LanguageModel.set_documents`. The loss is then the
    model's own mean over the local targets (module docstring: equal counts per shard)."""
    rows, length = tokens.shape
    check_length(length, degree)
    keys = key_side(documents, rows, length, index, degree, tokens.device)
    attention = getattr(model, "context_parallel", None)
    if attention is not None:
        if attention.degree != degree:
            raise ValueError(f"strategy.context_parallel={degree}, but the attention was installed over "
                             f"{attention.degree} context ranks")
        attention.keys = keys
    model.set_documents(keys.shards[index])
    return shard_sequence(tokens, index, degree), shard_sequence(targets, index, degree)
