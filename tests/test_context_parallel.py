"""Context parallelism's attention (strategies/context_parallel.py) at the model level, on forked gloo
ranks: for c = 2, 3 (ring) and 4 and each exchange (ring, all_gather), GPT and Llama with
grouped-query attention (kv_heads < heads), plain and packed rows, the sharded forward's logits
(gathered), the first backward's parameter gradients (the mean over the context ranks, as the
data_context reduction makes it) and the mean of the ranks' losses equal the one-process model's;
the bytes counted equal cost/traffic.py `context_traffic` kind by kind; the NCCL point-to-point order
check passes (and catches a ring issued send-first on every rank); both exchanges skip exactly the
key chunks wholly in the future and keep for the backward what `saved_bytes` says (no s × s
tensor); the head-tail shards balance the causal work (max/mean = 1.0 for c = 2, 4, 8, against
1.49/1.74/1.87 for a contiguous split).

Tolerances (fp32): the sharded model computes the same products with the softmax's sums split into
blocks and merged (online softmax) or over gathered keys, and the per-token parts unchanged, so each
logit differs by round-off only: a few ulp of its magnitude (~1) per layer. LOGIT_ATOL = 1e-5, as
tests/test_packing.py's same-products comparison, far below a wrong mask or position (≥ 1e-2). The
gradients use tests/tolerances.py's first-step gradient tolerances (GRADIENT_RTOL per element plus
GRADIENT_SCALE_ATOL of the tensor's largest |g|: reductions in another order carry round-off of the
tensor's scale), without the recovery term since .grad is compared directly.
Ids: c2/c4 = context ranks, gpt / llama_gqa (4 heads, 2 kv heads), packed = documents joined by EOS.
"""

import pytest
import torch
import torch.distributed as dist

from cost.traffic import context_traffic
from models import CoreAttention, build_model
from models.documents import documents_of
from parallel.comm import KINDS, Communicator, Group, IssuedOperation, first_order_mismatch
from parallel.dims import Layout
from parallel.layout import ParallelLayout
from strategies.context_parallel import (CAUSAL, TAG_GRADIENTS, TAG_KEYS_VALUES, BlockCounts, _Ring,
                                         apply_context_parallel, exact_block_backward, exact_block_forward,
                                         flash_block_backward, flash_block_forward, causal_pairs,
                                         context_parallel_batch, load_balance, saved_bytes, shard_indices,
                                         shard_sequence)
from tests.ranks import run_on_ranks
from tests.tolerances import EXACT_RTOL, GRADIENT_RTOL, GRADIENT_SCALE_ATOL, LOSS_RTOL

LOGIT_ATOL = 1e-5
# bf16 autocast, c = 1: the ring computes each block in fp32 from bf16 q, k, v and rounds its output
# once (≤ u/2 of it, u = 2^-8); the model's own attention rounds its products' inputs and outputs to
# bf16 (≤ u each). Each layer's attention output then differs by ≤ 2u of its scale, carried by the
# bf16 linears that follow (which round again, ≤ u) into the logits: 4u of the logits' scale.
# Measured: 1.95e-3 at scale 0.38 (1.3u, one bf16 step of the logit); in fp32, local positions in
# place of the global ones moved the logits by 0.4 (c2 ring, GPT), a mask without documents by 0.055.
BF16_ATTENTION_RTOL = 4 * 2.0 ** -8
VOCAB, LENGTH, ROWS, LAYERS, HIDDEN, HEADS, EOS = 32, 48, 2, 2, 32, 4, 0
MODELS = {"gpt": dict(architecture="gpt"), "llama_gqa": dict(architecture="llama", kv_heads=2)}
CASES = [f"{model}{packed}" for model in MODELS for packed in ("", "_packed")]


def build(case: str):
    shape = dict(MODELS[case.removesuffix("_packed")])
    return build_model(shape.pop("architecture"), vocab_size=VOCAB, sequence_length=LENGTH, layers=LAYERS,
                       hidden=HIDDEN, heads=HEADS, seed=3, **shape)


def batch(case: str):
    """(tokens, targets, documents): ROWS rows of LENGTH tokens; packed rows hold documents of uneven
    lengths whose boundaries fall inside chunks and across them (EOS = 0 ends each)."""
    generator = torch.Generator().manual_seed(11)
    tokens = torch.randint(1, VOCAB, (ROWS, LENGTH + 1), generator=generator)
    documents = None
    if case.endswith("_packed"):
        for row, ends in enumerate(((6, 7, 20, 31, 44), (2, 25, 40))):
            tokens[row, list(ends)] = EOS
        documents = documents_of(tokens[:, :-1], EOS)
    return tokens[:, :-1], tokens[:, 1:], documents


def reference(case: str) -> dict:
    """The one-process model's logits and first-backward gradients."""
    model = build(case)
    tokens, targets, documents = batch(case)
    model.set_documents(documents)
    logits = model(tokens)
    loss = model.loss(logits, targets)
    loss.backward()
    return dict(logits=logits.detach(), loss=loss.item(),
                grads={name: p.grad.clone() for name, p in model.named_parameters()})


def measure_saved(model, attention) -> list:
    """Install a wrapper on the model's core attentions that records the bytes each context-parallel
    attention call saves for its backward (one entry per layer); returns the list it fills."""
    saved = []

    def measured(query, key, value, documents):
        def pack(tensor):
            saved[-1] += tensor.numel() * tensor.element_size()
            return tensor
        saved.append(0)
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            return attention(query, key, value, documents)
    for module in model.modules():
        if isinstance(module, CoreAttention):
            module.context = measured
    return saved


def cases_on_rank(rank: int, c: int, comm: str) -> dict:
    dist.init_process_group("gloo")
    layout = ParallelLayout(Layout(context=c), rank=rank)
    communicator = layout.communicator
    communicator.record_point_to_point()
    results = {}
    for case in CASES:
        model = build(case)
        attention = apply_context_parallel(model, layout.group("context"), communicator, comm)
        saved = measure_saved(model, attention)
        tokens, targets, documents = batch(case)
        communicator.reset()
        attention.blocks = BlockCounts()
        local_tokens, local_targets = context_parallel_batch(model, tokens, targets, documents,
                                                             layout.index("context"), c)
        logits = model(local_tokens)
        loss = model.loss(logits, local_targets)
        loss.backward()
        # numpy arrays travel to the test by value (a tensor would by a shared-memory handle that dies with the rank)
        results[case] = dict(logits=logits.detach().numpy(), loss=loss.item(), bytes=communicator.snapshot(),
                             saved=saved, grads={name: p.grad.numpy() for name, p in model.named_parameters()},
                             blocks=(attention.blocks.computed, attention.blocks.skipped),
                             checked=communicator.check_point_to_point_order())
    return results


def kv_heads(case: str) -> int:
    return MODELS[case.removesuffix("_packed")].get("kv_heads", HEADS)


def expected_bytes(case: str, c: int, comm: str) -> dict:
    per_layer = context_traffic(comm, c, ROWS, LENGTH, kv_heads(case), HIDDEN // HEADS, element_bytes=4)
    return {kind: LAYERS * per_layer.get(kind, 0.0) for kind in KINDS}


@pytest.mark.parametrize("c, comm", [(2, "ring"), (2, "all_gather"), (3, "ring"), (4, "ring"), (4, "all_gather")])
def test_sharded_model_equals_one_process(c, comm):
    """c3: an odd ring (its wrap-around joins two even ranks) under the same order check."""
    by_rank = run_on_ranks(cases_on_rank, c, c, comm)
    for case in CASES:
        expected = reference(case)
        logits = torch.empty_like(expected["logits"])
        for rank, results in enumerate(by_rank):
            logits[:, shard_indices(LENGTH, rank, c)] = torch.from_numpy(results[case]["logits"])
        logit_error = (logits - expected["logits"]).abs().max().item()
        worst = 0.0
        for name, full in expected["grads"].items():
            mean = sum(torch.from_numpy(results[case]["grads"][name]) for results in by_rank) / c  # data_context mean
            bound = GRADIENT_RTOL * full.abs() + GRADIENT_SCALE_ATOL * full.abs().max()
            worst = max(worst, ((mean - full).abs() / bound).max().item())
        print(f"c{c} {comm} {case}: |logit error| {logit_error:.1e}, gradients {worst:.3f} of the tolerance, "
              f"bytes {by_rank[0][case]['bytes']}, blocks {[r[case]['blocks'] for r in by_rank]}")
        assert logit_error <= LOGIT_ATOL, case
        # each rank's mean over its s/c targets; their mean is the rows' mean (equal counts per shard)
        assert sum(results[case]["loss"] for results in by_rank) / c == pytest.approx(expected["loss"], rel=LOSS_RTOL)
        assert worst <= 1.0, case
        predicted = expected_bytes(case, c, comm)
        for rank, results in enumerate(by_rank):
            for kind in KINDS:
                assert results[case]["bytes"][kind] == pytest.approx(predicted[kind], rel=EXACT_RTOL, abs=0), (
                    case, rank, kind)
            # every layer's ring issues (c−1) K/V sends forward; backward c−1 more and c accumulators,
            # a receive for each: 2·(3c−2) operations per layer, all checked
            assert results[case]["checked"] == (2 * LAYERS * (3 * c - 2) if comm == "ring" else 0)
            saved = saved_bytes(comm, c, ROWS, LENGTH, HEADS, kv_heads(case), HIDDEN // HEADS, 4)
            assert results[case]["saved"] == [saved] * LAYERS, (case, rank)
            # per layer, 4c (query chunk, key chunk) pairs: 2c+1 computed, 2c−1 skipped (both exchanges)
            assert results[case]["blocks"] == (LAYERS * (2 * c + 1), LAYERS * (2 * c - 1)), (case, rank)


def interleaved_on_rank(rank: int, c: int) -> dict:
    """Two micro-batches (packed rows, then plain rows) run as a pipeline's 1F1B may: both forwards,
    then the backwards in order, each backward with its own micro-batch's key side."""
    dist.init_process_group("gloo")
    layout = ParallelLayout(Layout(context=c), rank=rank)
    layout.communicator.record_point_to_point()
    results = {}
    for comm in ("ring", "all_gather"):
        model = build("llama_gqa")
        apply_context_parallel(model, layout.group("context"), layout.communicator, comm)
        losses = []
        for case in ("llama_gqa_packed", "llama_gqa"):
            tokens, targets, documents = batch(case)
            local = context_parallel_batch(model, tokens, targets, documents, layout.index("context"), c)
            losses.append(model.loss(model(local[0]), local[1]))
        for loss in losses:
            loss.backward()
        layout.communicator.check_point_to_point_order()
        results[comm] = {name: p.grad.numpy() for name, p in model.named_parameters()}
    return results


def test_interleaved_micro_batches_keep_their_own_key_side():
    c = 2
    by_rank = run_on_ranks(interleaved_on_rank, c, c)
    expected = {name: first + second for (name, first), second in zip(
        reference("llama_gqa_packed")["grads"].items(), reference("llama_gqa")["grads"].values())}
    for comm in ("ring", "all_gather"):
        worst = 0.0
        for name, full in expected.items():
            mean = sum(torch.from_numpy(results[comm][name]) for results in by_rank) / c
            bound = GRADIENT_RTOL * full.abs() + GRADIENT_SCALE_ATOL * full.abs().max()
            worst = max(worst, ((mean - full).abs() / bound).max().item())
        print(f"{comm}: two interleaved micro-batches, gradients {worst:.3f} of the tolerance")
        assert worst <= 1.0, comm


@pytest.mark.parametrize("comm", ["ring", "all_gather"])
def test_one_context_rank_is_the_exact_attention_also_under_bf16(comm):
    """c = 1 in one process: the blockwise fp32 path (ring) and the gathered path equal the model's own
    attention (fp32: LOGIT_ATOL; gradients as above), and under bf16 autocast they return bf16 and stay
    within BF16_ATTENTION_RTOL of the logits' scale of it."""
    for case in ("llama_gqa_packed", "gpt"):
        expected = reference(case)
        model = build(case)
        apply_context_parallel(model, None, Communicator(), comm)
        tokens, targets, documents = batch(case)
        local_tokens, local_targets = context_parallel_batch(model, tokens, targets, documents, 0, 1)
        logits = model(local_tokens)
        model.loss(logits, local_targets).backward()
        assert (logits - expected["logits"]).abs().max().item() <= LOGIT_ATOL
        for name, parameter in model.named_parameters():
            full = expected["grads"][name]
            bound = GRADIENT_RTOL * full.abs() + GRADIENT_SCALE_ATOL * full.abs().max()
            assert ((parameter.grad - full).abs() <= bound).all(), name
        plain = build(case)
        plain.set_documents(documents)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            own = plain(tokens)  # the model's own attention under bf16 ...
            sharded = model(local_tokens)  # ... and the context-parallel one
            sharded.float().sum().backward()
        scale = expected["logits"].abs().max().item()
        print(f"{comm} {case} bf16: |sharded − own| {(sharded.float() - own.float()).abs().max().item():.2e}, "
              f"scale {scale:.2f}")
        assert sharded.dtype == own.dtype == torch.bfloat16
        assert (sharded.float() - own.float()).abs().max().item() <= BF16_ATTENTION_RTOL * scale


def test_flash_blocks_equal_the_explicit_products():
    """The two block engines (strategies/context_parallel.py "one block"): the CPU flash kernel and the
    explicit fp32 products give the same (o_b, lse_b) and the same (dq, dk, dv) from a final (O, lse),
    with 2 query heads per kv head, on a dense block, a causal (diagonal) block, each as the mask
    names them (None, CAUSAL: the kernel's is_causal) and as tensors, and a packed block whose rows 5
    and 6 see no key (lse_b = −∞, o_b = 0). fp32, a softmax over 24 keys: round-off only."""
    generator = torch.Generator().manual_seed(5)
    batch_size, kv, groups, length, width = 2, 2, 2, 24, 8
    query = torch.randn(batch_size, kv, groups, length, width, generator=generator)
    key, value = (torch.randn(batch_size, kv, length, width, generator=generator) for _ in range(2))
    grad = torch.randn(query.shape, generator=generator)
    causal = torch.ones(length, length, dtype=torch.bool).tril().expand(batch_size, 1, 1, length, length)
    packed = causal.clone()
    packed[..., 5:7, :] = False
    final = exact_block_forward(query, key, value, torch.ones_like(causal), width ** -0.5)  # a finite (O, lse)
    for name, mask in (("dense", None), ("dense_tensor", torch.ones_like(causal)), ("causal", CAUSAL),
                       ("causal_tensor", causal), ("packed", packed)):
        exact = exact_block_forward(query, key, value, mask, width ** -0.5)
        flash = flash_block_forward(query, key, value, mask, width ** -0.5)
        assert torch.equal(torch.isinf(exact[1]), torch.isinf(flash[1])), name
        assert (exact[0] - flash[0]).abs().max().item() <= LOGIT_ATOL, name
        finite = torch.isfinite(exact[1])
        assert (exact[1][finite] - flash[1][finite]).abs().max().item() <= LOGIT_ATOL, name
        gradients = [engine(query, key, value, mask, width ** -0.5, grad, *final)
                     for engine in (exact_block_backward, flash_block_backward)]
        for exact_gradient, flash_gradient in zip(*gradients):
            scale = exact_gradient.abs().max().item()
            assert (exact_gradient - flash_gradient).abs().max().item() <= LOGIT_ATOL * max(scale, 1.0), name


class RecordingCommunicator:
    """Records what `_Ring.exchange` issues, as the strict mode does, without sending anything."""

    def __init__(self):
        self.issued = []

    def send(self, tensor, destination, group, tag=0):
        self.issued.append(IssuedOperation("send", destination, tensor.numel(), str(tensor.dtype), tag))

    def receive(self, tensor, source, group, tag=0):
        self.issued.append(IssuedOperation("receive", source, tensor.numel(), str(tensor.dtype), tag))


def test_a_ring_issued_send_first_on_every_rank_is_caught():
    """The ring's exchange (strategies/context_parallel.py `_Ring`: send-first on even ranks,
    receive-first on odd) passes the NCCL order check for even and odd c; the same exchange issued
    send-first on every rank waits in a cycle (c ≥ 3) or mismatches (c = 2), as the check says."""
    def issued(c: int, send_first_everywhere: bool) -> list:
        group, block = Group("context", tuple(range(c))), torch.zeros(2, 3)
        ranks = []
        for rank in range(c):
            communicator = RecordingCommunicator()
            ring = _Ring(group, communicator, rank)
            ring.index = 0 if send_first_everywhere else rank  # the parity the order follows
            for tag in (TAG_KEYS_VALUES, TAG_GRADIENTS):
                ring.exchange(block, tag)
            ranks.append(communicator.issued)
        return ranks
    for c in (2, 3, 4, 5, 8):
        assert first_order_mismatch(issued(c, send_first_everywhere=False)) is None, c
        problem = first_order_mismatch(issued(c, send_first_everywhere=True))
        print(f"c{c} send-first everywhere: {problem[:90]}")
        assert problem is not None and ("cycle" in problem or "mismatch" in problem)


def test_head_tail_shards_balance_the_causal_work():
    figures = {}
    for c in (2, 4, 8):
        length = 16 * 2 * c
        figures[c] = (load_balance(length, c), load_balance(length, c, balanced=False))
        assert sum(causal_pairs(length, i, c) for i in range(c)) == length * (length + 1) // 2
    print("max/mean head-tail vs contiguous:", {c: (round(a, 3), round(b, 3)) for c, (a, b) in figures.items()})
    assert all(balanced <= 1.05 for balanced, _ in figures.values())
    assert all(contiguous > 1.3 for _, contiguous in figures.values())


def test_shards_cover_the_row_and_refuse_uneven_lengths():
    c, length = 4, 16
    pieces = [shard_indices(length, i, c) for i in range(c)]
    assert pieces[0].tolist() == [0, 1, 14, 15] and pieces[3].tolist() == [6, 7, 8, 9]
    assert sorted(torch.cat(pieces).tolist()) == list(range(length))
    tokens = torch.arange(2 * length).view(2, length)
    assert shard_sequence(tokens, 1, c).tolist() == [[2, 3, 12, 13], [18, 19, 28, 29]]
    with pytest.raises(ValueError, match=r"data.sequence_length=18 .*Fix: data.sequence_length a multiple of 8"):
        shard_indices(18, 0, c)
