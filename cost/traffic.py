"""Logical bytes one rank moves per optimizer step, as the sum of its layout's parts' formulas.

A composed layout (data × pipeline × tensor grid) moves, per rank and step:
  pipeline  its plan row's sends × the activation piece it holds (grids.local_activation_shape), in
            the message's bytes per element (2: strategy.message_dtype=compute under bf16/fp16),
            ÷ t where each tensor rank sends its slice (scatter/gather; sequence parallelism), and
            with scatter/gather each receive's all-gather of the t slices over the tensor group;
  tensor    per forward-and-backward of a block, the grid's collectives (docs/strategies/three_d.md):
              1d  4 all-reduces of the micro-batch's activation (Megatron's f and g, twice); with
                  sequence parallelism (strategies/tensor_parallel/sequence.py) 4 reduce-scatters
                  (fp32 partial sums) and 6 all-gathers (the compute dtype: the 4 that replace the
                  all-reduces and the backward's second gather of each norm output), and once per
                  stage the partial gradients of the pieces the sequence shard leaves whole (norms,
                  row-parallel biases, tables) all-reduced over t;
              2d  per linear, a gather of X along the row and of W along the column, and their
                  reduce-scatters in the backward: (q−1)/q²·(N_X + N_W) each;
              3d  per linear (q−1)/q³·(N_X + N_W + N_Y) gathered and as much reduce-scattered;
            plus the split LayerNorms' sums, the head's linear and the vocabulary-parallel loss;
            once per stage and step, the gradients of pieces the grid replicates, summed;
  data      the stage's gradient all-reduced over n replicas, 2(n−1)/n·P; under the distributed
            optimizer reduce-scattered and the weights all-gathered back, (n−1)/n of its buckets
            padded to multiples of n each; or under ZeRO each gather and reduce-scatter of the
            padded flat shards, (n−1)/n·P each (the plan says how many);
  loss      one fp32 broadcast over the pipeline.
  context   per layer and micro-batch, the keys and values of a sequence's c shards: passed around
            the ring (send/recv) or all-gathered and their gradients reduce-scattered (`context_traffic`).
Counts come from the plan (how many sends, gathers, forwards per stage), sizes from the model's
shape: nothing here runs a model. Volumes use parallel.comm.ring_factor, as the Communicator does.
"""

from collections import Counter

from cost.inputs import BYTES, GptShape, activation_piece
from parallel.comm import ring_factor
from parallel.dims import Layout, tensor_ranks
from strategies.context_parallel import EXCHANGES
from strategies.schedule import (FORWARD, RECV_ACTIVATION, RECV_GRADIENT, REDUCE_GRADIENT, SEND_ACTIVATION,
                                 SEND_GRADIENT)
from strategies.schedule.zero import GATHERS, REDUCE_SCATTER
from strategies.tensor_parallel.grids import grid_of


def all_reduce(elements: float, group: int) -> float:
    return ring_factor("all_reduce", group) * elements * BYTES


def all_gather(elements: float, group: int) -> float:
    return ring_factor("all_gather", group) * elements * BYTES


# ----- one tensor grid: collectives of a block, the head and loss, the replicated gradients

def linear_traffic(grid: str, q: int, rows: int, shape: GptShape, fan_in: int, fan_out: int) -> Counter:
    """Forward and backward of one grid linear on `rows` sequences (the 1-D ones are in block_traffic)."""
    tokens = rows * shape.length
    if grid == "2d":
        moved = all_gather(tokens / q * fan_in + fan_in * fan_out / q, q)
    else:  # 3d: gathered pieces are 1/q² of the full tensors, so (q−1)/q³ of N per tensor
        moved = all_gather((tokens * fan_in + fan_in * fan_out + tokens * fan_out) / q ** 2, q)
    return Counter(all_gather=moved, reduce_scatter=moved)


def norm_traffic(grid: str, q: int, rows: int, shape: GptShape) -> Counter:
    """A norm over split features: LayerNorm's two sums (mean, variance), RMSNorm's one (mean
    square), forward and again backward, over q."""
    if grid == "1d":
        return Counter()
    local_rows = rows // grid_of(grid, tensor_ranks(grid, q), 0).input_rows()[1]
    return Counter(all_reduce=2 * shape.norm_vectors * all_reduce(local_rows * shape.length, q))


def block_traffic(grid: str, q: int, rows: int, shape: GptShape, sequence_parallel: bool = False,
                  gather_bytes: int = BYTES, sum_bytes: int = BYTES) -> Counter:
    """One block's forward and backward on one micro-batch of `rows` sequences; `sequence_parallel`
    (1-D only): `sequence_traffic`'s 2 norm regions, each all-gather `gather_bytes` per element. A
    1-D grid's sums (all-reduces, reduce-scatters) move `sum_bytes` per element
    (strategy.tensor_collective_dtype); 2-D/3-D grids' stay fp32."""
    if grid == "1d" and sequence_parallel:
        return sequence_traffic(2, 2, q, rows * shape.length * shape.hidden, gather_bytes, sum_bytes)
    if grid == "1d":
        return Counter(all_reduce=4 * all_reduce(rows * shape.length * shape.hidden, q) * sum_bytes / BYTES)
    traffic = Counter()
    for fan_in, fan_out, _, _ in shape.linears():
        traffic += linear_traffic(grid, q, rows, shape, fan_in, fan_out)
    return traffic + norm_traffic(grid, q, rows, shape) + norm_traffic(grid, q, rows, shape)


def sequence_traffic(gathered: int, reduced: int, t: int, activation: float, gather_bytes: int,
                     sum_bytes: int = BYTES) -> Counter:
    """Sequence parallelism's collectives of `gathered` norm outputs and `reduced` row-parallel
    linears on one micro-batch's `activation` elements (strategies/tensor_parallel/sequence.py):
    each norm output all-gathered in the forward (GatherSequence, cast to the compute dtype first:
    `gather_bytes`), its gradient reduce-scattered in the backward (`sum_bytes`: fp32, or the compute
    dtype with strategy.tensor_collective_dtype=compute), and gathered again in the backward for the
    column linears' weight gradients (GatheredInput: they saved the shard); each row linear's partial
    sums reduce-scattered (ReduceScatterSequence, `sum_bytes`) and its gradient all-gathered back in
    the compute dtype. (t−1)/t of the activation each (parallel.comm.ring_factor)."""
    moved = ring_factor("all_gather", t) * activation
    return Counter(all_gather=(2 * gathered + reduced) * moved * gather_bytes,
                   reduce_scatter=(gathered + reduced) * moved * sum_bytes)


def grid_collectives(grid: str, blocks: int, head: bool, shape: GptShape = None,
                     sequence_parallel: bool = False) -> int:
    """Collectives one micro-batch's forward and backward issue on a grid rank (each pays a latency):
    1-D: per block the attention's and the MLP's all-reduce, forward and backward (4); 2-D: per
    linear X and W gathered forward, dX and dW reduce-scattered backward (4), 3-D: also Y scattered
    forward and dY gathered backward (6); 2-D/3-D split norms sum mean and variance both ways (4 per
    norm, 2 norms). The head: its linear (1-D: the input gradient's all-reduce) and norm as above,
    plus the vocabulary-parallel loss's 3 all-reduces and, on 2-D/3-D, the loss's sum over batch splits.
    1-D with `sequence_parallel`: per block 6 all-gathers and 4 reduce-scatters, the head 2 and 1
    (`sequence_traffic`)."""
    if not grid:
        return 0
    if grid == "1d" and sequence_parallel:
        return blocks * 10 + ((2 + 1 + 3) if head else 0)
    shape = shape or GptShape(1, 1, 1, 1, 1)
    per_linear = {"1d": 0, "2d": 4, "3d": 6}[grid]
    norm = 0 if grid == "1d" else 2 * shape.norm_vectors
    block = 4 if grid == "1d" else len(shape.linears()) * per_linear + 2 * norm
    head_count = (1 if grid == "1d" else per_linear + norm + 1) + 3
    return blocks * block + (head_count if head else 0)


def head_traffic(grid: str, q: int, rows: int, shape: GptShape, sequence_parallel: bool = False,
                 gather_bytes: int = BYTES, sum_bytes: int = BYTES) -> Counter:
    """The head (norm, vocabulary-split linear) and the vocabulary-parallel loss on one micro-batch:
    3 all-reduces of the rows' max, Σexp and target logit, and the loss's sum over batch splits;
    with `sequence_parallel` its norm output gathered (`sequence_traffic`: one norm region, no row
    linear) in place of its input gradient's all-reduce."""
    grid_object = grid_of(grid, tensor_ranks(grid, q), 0)
    logit_rows = rows // grid_object.logit_rows()[1] * shape.length
    if grid == "1d" and sequence_parallel:
        traffic = sequence_traffic(1, 0, q, rows * shape.length * shape.hidden, gather_bytes, sum_bytes)
        batch_split = 1
    elif grid == "1d":  # column-parallel head: its input's gradient is summed in the backward
        traffic = Counter(all_reduce=all_reduce(rows * shape.length * shape.hidden, q) * sum_bytes / BYTES)
        batch_split = 1
    else:
        traffic = linear_traffic(grid, q, rows, shape, shape.hidden, shape.vocabulary)
        traffic += norm_traffic(grid, q, rows, shape)
        batch_split = q if grid == "2d" else q * q
    traffic["all_reduce"] += 3 * all_reduce(logit_rows, q) + all_reduce(1, batch_split)
    return traffic


def local_parameters(grid, q: int, shape: GptShape, embed: bool, blocks: int, head: bool,
                     sequence_parallel: bool = False) -> dict:
    """Elements this grid position holds: {"all": every parameter, "replicated": those whose
    gradients are summed over the grid} (1-D replicates norms and row-parallel biases too, but its
    copies see identical gradients, so nothing is summed — unless `sequence_parallel`: each copy
    then sees its rank's positions only, and the norms', row-parallel biases' and tables' partial
    gradients are summed over t, strategies/tensor_parallel/grids.py `Grid1D.replicated_over`)."""
    ranks = tensor_ranks(grid, q)
    split = 1 if grid in (None, "1d") else q  # 2-D/3-D split biases, norms and tables by q
    h = shape.hidden
    weights = sum(fan_in * fan_out for fan_in, fan_out, _, _ in shape.linears()) / ranks
    biases = sum(fan_out / (ranks if grid == "1d" and position == "first" else split)
                 for _, fan_out, position, bias in shape.linears() if bias)
    norms = shape.norm_vectors * h / split  # one norm's vectors
    vectors = blocks * (biases + len(shape.block.norms) * norms) + (norms if head else 0)
    tables = shape.table_rows * h / split if embed else 0
    total = blocks * weights + vectors + tables + (h * shape.vocabulary / ranks if head else 0)
    replicated = 0 if grid in (None, "1d") else vectors + tables
    if grid == "1d" and sequence_parallel:  # the column linears' biases are split, so not partial
        rows_biases = sum(fan_out for _, fan_out, position, bias in shape.linears() if bias and position == "second")
        replicated = blocks * (rows_biases + len(shape.block.norms) * norms) + (norms if head else 0) + tables
    return {"all": total, "replicated": replicated}


def model_parameters(shape: GptShape, layers: int) -> float:
    """The whole model's parameter count (every block, the tables and the head): the one count. An
    MoE block's routed experts are not among its linears: added (every block taken as `shape.block`)."""
    return local_parameters(None, 1, shape, True, layers, True)["all"] + layers * shape.block.experts * shape.block.expert_weights()


# ----- context parallelism: the keys and values of a sequence's shards exchanged every layer

def context_block(rows: int, length: int, kv_heads: int, head_dim: int, context: int) -> float:
    """Elements of one key (or value) block a context rank holds: b · (s/c) · kv_heads · head_dim (its
    head and tail chunks together; with GQA only the kv heads, and under a 1-D tensor grid the
    kv_heads/t this rank computes)."""
    return rows * length / context * kv_heads * head_dim


def context_traffic(comm: str, context: int, rows: int, length: int, kv_heads: int, head_dim: int,
                    element_bytes: int = BYTES, backward: bool = True, recomputed: bool = False) -> Counter:
    """Logical bytes by kind one context rank moves in ONE layer's attention on one micro-batch of
    `rows` sequences of `length` tokens (the whole sequence, before the split over c = `context`
    ranks), forward and (`backward`) backward, each element `element_bytes` (the dtype K/V and their
    gradients travel in: the compute dtype). Counted as parallel.comm counts: a send N, an all-gather
    or reduce-scatter of a full tensor of N elements on g ranks (g−1)/g·N (receives are not counted).
    With B = `context_block` (one K or one V block of b·(s/c)·kv·d elements):
      ring        forward: c−1 hops, each sending the K and V blocks it holds to the next rank: 2(c−1)·B;
                  backward: the K/V blocks go round again (c−1 hops, 2(c−1)·B), and the dK/dV
                  accumulators travel with them one hop further, back to their owner (c hops, 2c·B):
                  2(3c−2)·B per layer in all;
      all_gather  forward: K and V all-gathered over the c ranks (full tensors of c·B each):
                  2·(c−1)/c·c·B = 2(c−1)·B of all_gather; backward: dK and dV reduce-scattered back
                  to their owners, as much again of reduce_scatter.
    `recomputed` (strategy.activation_recompute=full, with `backward`): the block's forward reruns in
    its backward (strategies/recompute.py), exchange included, so the forward's bytes travel twice.
    c = 1 moves nothing. Multiply by the layers and the micro-batches a rank runs for a step
    (`context_step_traffic`)."""
    if comm not in EXCHANGES:
        raise ValueError(f"strategy.context_parallel_comm: {comm!r} is not one of {EXCHANGES}")
    block = context_block(rows, length, kv_heads, head_dim, context) * element_bytes
    if context <= 1:
        return Counter()
    forwards = 2 if backward and recomputed else 1
    if comm == "ring":
        hops = forwards * (context - 1) + ((context - 1) + context if backward else 0)
        return Counter(send_recv=2 * hops * block)
    full = context * block  # K (or V) of the whole sequence
    traffic = Counter(all_gather=forwards * 2 * ring_factor("all_gather", context) * full)
    if backward:
        traffic["reduce_scatter"] = 2 * ring_factor("reduce_scatter", context) * full
    return traffic


def context_kv_heads(layout: Layout, shape: GptShape) -> float:
    """Key (and value) heads a rank computes, so exchanges: kv_heads over the tensor grid's head split
    (1-D: t)."""
    parts = grid_of(layout.tensor_grid, layout.tensor, 0).head_parts if layout.tensor_grid else 1
    return shape.block.kv_heads / parts


def context_step_traffic(comm: str, context: int, rows: int, length: int, kv_heads: int, head_dim: int,
                         layers: int, micro_batches: int, element_bytes: int = BYTES,
                         recomputed: bool = False) -> Counter:
    """`context_traffic` of every layer a rank holds (`layers`) on each of its `micro_batches`
    (`recomputed`: each layer's forward exchange once more, in its backward)."""
    per_layer = context_traffic(comm, context, rows, length, kv_heads, head_dim, element_bytes,
                                recomputed=recomputed)
    return Counter({kind: volume * layers * micro_batches for kind, volume in per_layer.items()})


# ----- mixtures of experts: the tokens' rows dispatched to their experts' ranks and combined back


def expert_dispatch_traffic(tokens: float, hidden: int, experts_per_token: int, expert_parallel: int,
                            element_bytes: int = BYTES) -> float:
    """Bytes one rank sends to the other members of its expert group in ONE all-to-all (a dispatch or
    a combine; the backward's are the same with the splits swapped) of one MoE block, expected under
    uniform routing: its `tokens` × k routed rows of `hidden` values, each row's expert on one of the
    e = `expert_parallel` members with equal chance, so (e − 1)/e of them leave the rank — what
    parallel.comm counts of an all-to-all (the rows a rank keeps never leave it). e = 1 moves nothing.
    Skewed routing moves more from the busiest rank (cost/experts.py `rank_imbalance`)."""
    if expert_parallel <= 1:
        return 0.0
    return tokens * experts_per_token * hidden * (expert_parallel - 1) / expert_parallel * element_bytes


COUNT_BYTES = 8  # the per-expert row counts travel as int64 (strategies/expert_parallel.py)


def expert_exchange_traffic(rows_to_others: int, rows_from_others: int, hidden: int, local_experts: int,
                            expert_parallel: int, element_bytes: int = BYTES, backward: bool = True) -> float:
    """all_to_all bytes one rank counts for ONE MoE layer on one micro-batch, from the routing it saw
    (strategies/expert_parallel.py AllToAllDispatcher): the counts' exchange, (e − 1)·E/e int64 to
    the other members; the dispatch, its `rows_to_others` rows (slots routed to experts on other
    members); the combine, the `rows_from_others` rows other members sent it, back to them; and in
    the backward the same two with the splits swapped (`backward`): each row `hidden` values of
    `element_bytes`. Uniform routing's expectation of one of these all-to-alls is
    `expert_dispatch_traffic`."""
    if expert_parallel <= 1:
        return 0.0
    rows = (rows_to_others + rows_from_others) * (2 if backward else 1)
    return (expert_parallel - 1) * local_experts * COUNT_BYTES + rows * hidden * element_bytes


# ----- a whole step of one rank


def replicated_group(layout: Layout) -> int:
    """Ranks holding copies of a piece a 2-D (a column: q) or 3-D grid (a union of two axes: q²)
    replicates; 1-D (the tensor group: t) only sums them under sequence parallelism."""
    return layout.edge if layout.tensor_grid in ("1d", "2d") else layout.edge ** 2


def step_traffic(plan, layout: Layout, pipeline_rank: int, shape: GptShape, layers_per_stage: int,
                 micro_batch_rows: int, message_bytes: int = BYTES, message_split: int = 1,
                 gathered: bool = False, distributed_optimizer: bool = False, sequence_parallel: bool = False,
                 gather_bytes: int = BYTES, bucket_elements: int = 0, sum_bytes: int = BYTES,
                 reduction_bytes: int = BYTES, context_comm: str = "ring", context_recomputed: bool = False) -> Counter:
    """Logical bytes by kind (parallel.comm.KINDS) one rank at `pipeline_rank` moves in one step. A
    boundary message carries `message_bytes` per element and 1/`message_split` of the rank's piece
    (cost.inputs.Workload.message_elements); `gathered`: each receive then all-gathers the slices
    over the tensor group (scatter/gather, Narayanan et al. 2021 §4.1; not under sequence
    parallelism, whose shard is the stream itself). `distributed_optimizer`: each stage reduction is
    a reduce-scatter of the fp32 gradients and the updated fp32 parameters are all-gathered, (n−1)/n
    of the stage each, padded to a multiple of n per bucket of `bucket_elements` (`padded_buckets`),
    in place of the all-reduce's 2(n−1)/n. `sequence_parallel` (1-D): the grid's collectives of
    `sequence_traffic`, its all-gathers in `gather_bytes` per element (the compute dtype), and the
    boundary piece is the rank's sequence shard (cost.inputs.activation_piece). `sum_bytes`: a 1-D
    grid's sums of activations per element (`block_traffic`); `reduction_bytes`: the data-parallel
    gradient's (its all-reduce, or the distributed optimizer's reduce-scatter; the weights it
    gathers back stay fp32). The loss's scalars and the partial gradients summed over a grid stay fp32.
    Under context parallelism (layout.context = c; `shape.length` the rank's s/c tokens) each forward
    and backward of a block adds `context_traffic` of `context_comm` in `gather_bytes` per element
    (K and V in the compute dtype; the forward's once more per backward when `context_recomputed`,
    full recomputation), and the gradients are reduced over data × context ranks."""
    row = [action for action in plan.ranks[pipeline_rank] if action is not None]
    traffic = Counter()
    sends = sum(action.kind in (SEND_ACTIVATION, SEND_GRADIENT) for action in row)
    piece = activation_piece(layout, micro_batch_rows, shape, sequence_parallel)
    traffic["send_recv"] += sends * piece / message_split * message_bytes
    if gathered:
        receives = sum(action.kind in (RECV_ACTIVATION, RECV_GRADIENT) for action in row)
        traffic["all_gather"] += receives * ring_factor("all_gather", message_split) * piece * message_bytes
    traffic["broadcast"] += BYTES if layout.pipeline > 1 else 0  # the loss, from the last stage
    for stage in sorted({action.stage for action in row if action.kind == FORWARD}):
        traffic += _stage_traffic(row, stage, plan.stages, layout, shape, layers_per_stage, micro_batch_rows,
                                  distributed_optimizer, sequence_parallel, gather_bytes, bucket_elements, sum_bytes,
                                  reduction_bytes)
        forwards = sum(action.kind == FORWARD and action.stage == stage for action in row)
        traffic += context_step_traffic(context_comm, layout.context, micro_batch_rows, shape.length * layout.context,
                                        context_kv_heads(layout, shape), shape.block.head_dim, layers_per_stage,
                                        forwards, gather_bytes, context_recomputed)
    return traffic


def padded_buckets(elements: float, n: int, bucket_elements: int = 0) -> int:
    """Elements of a stage's flat buckets under the distributed optimizer, each zero-padded to a
    multiple of the n data ranks (strategies/distributed_optimizer.py `Bucket`): one bucket of the
    whole stage where `bucket_elements` is 0 or holds it (exact), else full buckets of
    `bucket_elements` and the rest (the real ones are cut at parameter boundaries: < n elements of
    padding per bucket either way)."""
    elements = int(elements)
    if not bucket_elements or bucket_elements >= elements:
        return -(-elements // n) * n
    full, rest = divmod(elements, bucket_elements)
    return full * (-(-bucket_elements // n) * n) + (-(-rest // n) * n)


def _stage_traffic(row, stage: int, stages: int, layout: Layout, shape: GptShape, layers_per_stage: int, rows: int,
                   distributed_optimizer: bool = False, sequence_parallel: bool = False, gather_bytes: int = BYTES,
                   bucket_elements: int = 0, sum_bytes: int = BYTES, reduction_bytes: int = BYTES) -> Counter:
    grid, q, n = layout.tensor_grid, layout.edge, layout.data_context
    forwards = sum(action.kind == FORWARD and action.stage == stage for action in row)
    parameters = local_parameters(grid, q, shape, stage == 0, layers_per_stage, stage == stages - 1, sequence_parallel)
    traffic = Counter()
    if grid:
        block = block_traffic(grid, q, rows, shape, sequence_parallel, gather_bytes, sum_bytes)
        per_micro_batch = Counter({k: v * layers_per_stage for k, v in block.items()})
        if stage == stages - 1:
            per_micro_batch += head_traffic(grid, q, rows, shape, sequence_parallel, gather_bytes, sum_bytes)
        traffic += Counter({kind: forwards * volume for kind, volume in per_micro_batch.items()})
    if not layout.zero:
        reductions = sum(action.kind == REDUCE_GRADIENT and action.stage == stage for action in row)
        traffic["all_reduce"] += reductions * all_reduce(parameters["replicated"], replicated_group(layout))
        if distributed_optimizer:  # ZeRO-1: the gradient reduce-scattered, the parameters gathered back
            padded = padded_buckets(parameters["all"], n, bucket_elements) if n > 1 else 0
            traffic["reduce_scatter"] += reductions * all_gather(padded, n) * reduction_bytes / BYTES
            traffic["all_gather"] += reductions * all_gather(padded, n)
        else:
            traffic["all_reduce"] += reductions * all_reduce(parameters["all"], n) * reduction_bytes / BYTES
        return traffic
    return traffic + _zero_traffic(row, stage, stages, layout, shape, layers_per_stage)


def _zero_traffic(row, stage, stages, layout, shape, layers_per_stage) -> Counter:
    """Gathers and reduce-scatters of the stage's two flat shards ("matrices", "vectors"), each
    padded to a multiple of n (strategies/sharding.py); before each reduce-scatter, the grid's
    replicated pieces summed over the tensor groups holding them."""
    n, grid, q = layout.data_context, layout.tensor_grid, layout.edge
    ranks = layout.tensor
    split = 1 if grid in (None, "1d") else q
    parameters = local_parameters(grid, q, shape, stage == 0, layers_per_stage, stage == stages - 1)
    matrices = layers_per_stage * sum(i * o for i, o, _, _ in shape.linears()) / ranks
    matrices += (shape.table_rows * shape.hidden / split if stage == 0 else 0)
    matrices += (shape.hidden * shape.vocabulary / ranks if stage == stages - 1 else 0)
    padded = sum(-(-int(size) // n) * n for size in (matrices, parameters["all"] - matrices) if size)
    count = Counter(action.kind for action in row if action.stage == stage)
    gathers, scatters = sum(count[kind] for kind in GATHERS), count[REDUCE_SCATTER]
    volume = all_gather(padded, n)
    replicated = all_reduce(parameters["replicated"], replicated_group(layout))
    return Counter(all_gather=gathers * volume, reduce_scatter=scatters * volume, all_reduce=scatters * replicated)

