"""The analytic memory of a pipeline-family rank (cost/step_time.py's memory half).

Per rank role, the largest of the moments of a training step (`stage_memory`): its start, its
first backward, the steady state, the data-parallel reduction and the optimizer's step (and, where
Lightning's closure zeroes the gradients, the forward's end), each with what the real code
holds then — parameters, gradients, optimizer state, the stash of the forwards in flight (the
blocks' saved tensors as autograd keeps them, autocast's weight copies, the head's softmax), a
backward's working set, the point-to-point buffers `StageWork` keeps, ZeRO's gathered stages —
traced against the meter action by action (docs/plan.md "Dry run"). `memory` reads the counts off a
built plan row; the search gives them in closed form (`closed_form_in_flight`, `closed_form_moments`).
"""

from __future__ import annotations

from collections import Counter
from functools import lru_cache

from strategies.schedule import (BACKWARD, BACKWARD_INPUT, BACKWARD_WEIGHT, FORWARD, RECV_GRADIENT, SEND_GRADIENT,
                                 add_communication, add_gradient_reductions, build_plan, release_points)
from strategies.schedule.generators import ZERO_BUBBLE
from strategies.schedule.ir import POST_RECV_ACTIVATION, POST_RECV_GRADIENT, SEND_ARROW, posted_receive
from cost.traffic import local_parameters, padded_buckets
from cost.inputs import BYTES, OPTIMIZER_STATE, Workload
from cost.experts import extra_saved_elements, local_expert_elements, zero_extra_shard
from cost.context import context_saved_elements, exchange_buffers, key_length


def stage_parameters(workload: "Workload", stage: int, stages: int) -> float:
    """Elements of stage `stage` (of `stages`) on one grid rank: its blocks, the embedding on the
    first, the head on the last (traffic.local_parameters)."""
    layout = workload.layout
    return local_parameters(layout.tensor_grid, layout.edge, workload.shape, stage == 0, workload.layers_per_stage,
                            stage == stages - 1)["all"] + workload.layers_per_stage * local_expert_elements(workload)  # + E/e experts


def block_saved_bytes(workload: "Workload", tokens: float, flash: bool) -> float:
    """Bytes a block keeps for its backward, per micro-batch, as autograd saves them: on the
    residual stream the two norms' inputs and outputs (x, N₁(x), x₂, N₂(x₂): 4h per token; the
    sub-layers' outputs feed only additions, which save nothing; RMSNorm also its normalised
    input, 6h: GptShape.norm_saves), RoPE's cos and sin (s·d per micro-batch), split by the grid the attention's
    q, k, v (k and v kv_heads·d wide under GQA; Llama's after RoPE) and context (`_attention_saved`),
    the MLP's wide activations (`_mlp_saved`: GELU's input and output 2·ffn; SwiGLU's gate, silu(gate),
    up and their product 4·ffn), and with the math attention kernel the softmax probabilities
    (heads × s per token; under GQA also K and V repeated per head, `_expanded_kv`), which
    selective recomputation (`recompute_attention`) reruns instead (strategies/recompute.py: the
    core keeps only q, k, v, counted here anyway). A 1-D grid keeps the residual stream whole on
    every rank (with sequence parallelism its 1/t: `stream_split`); 2-D/3-D grids split everything.
    (Dropout masks, 1 byte each, are left out.)"""
    shape, ranks = workload.shape, workload.tensor_ranks
    h = shape.hidden
    scores = 0 if flash or workload.recompute_attention else workload.heads * key_length(workload) + _expanded_kv(shape)
    if workload.layout.tensor_grid in ("2d", "3d"):
        return grid_block_saved_elements(workload, tokens, scores) * workload.activation_bytes
    residual = len(shape.block.norms) * shape.norm_saves * h / stream_split(workload)
    split = (_attention_saved(shape) + _mlp_saved(shape) + extra_saved_elements(workload) + scores) / ranks
    split += context_saved_elements(workload)  # context parallelism's own (cost/context.py), a rank's share
    return ((residual + split) * tokens + shape.rotary_elements()) * workload.activation_bytes


def stream_split(workload: "Workload") -> int:
    """Parts the residual stream (the norm regions: norms' inputs, outputs and statistics) is split
    into on a rank: none on a 1-D grid, whose ranks each keep it whole, but t with sequence
    parallelism (Korthikanti et al. 2022 §4.2.2: each rank keeps its s/t positions, and the column
    linears save the norm output's shard, gathering it again in the backward,
    strategies/tensor_parallel/sequence.py `GatheredInput`); every grid rank on 2-D/3-D."""
    grid = workload.layout.tensor_grid
    if grid == "1d":
        return workload.tensor_ranks if workload.sequence_parallel else 1
    return workload.tensor_ranks


def _expanded_kv(shape) -> int:
    """Per token: what the math attention kernel saves beyond q, k, v under grouped-query attention:
    K and V repeated to every query head (its products save the repeated copies; measured with the
    meter, tests/test_selective_recompute.py), 2·(heads − kv_heads)·d; 0 without GQA."""
    block = shape.block
    return 2 * (block.heads - block.kv_heads) * block.head_dim


def _attention_saved(shape) -> int:
    """Per token: q, k, v as the attention kernel saves them, and the context (the output product's input)."""
    block = shape.block
    return block.heads * block.head_dim + 2 * block.kv_heads * block.head_dim + shape.hidden


def _mlp_saved(shape, grid: bool = False) -> int:
    """Per token: the MLP's wide activations autograd keeps; on a 2-D/3-D grid the last (the down
    product's input) is saved gathered by its GridLinear instead."""
    return shape.mlp_width * ((4 if shape.block.gated else 2) - grid)


def grid_block_saved_elements(workload: "Workload", tokens: float, scores: float) -> float:
    """A 2-D/3-D block: each GridLinear saves the *gathered* X and W its product used
    (collectives.GatherMatmulScatter: X gathered over q ranks to tokens·in/q (2-D) or tokens·in/q²
    (3-D), W to in·out/q or in·out/q²), per micro-batch; the split norms save two pieces each
    (LayerNorm: centred and normalised; RMSNorm: input and normalised), attention its q, k, v and
    output pieces, the MLP its wide pieces but the down product's input (GELU's input; SwiGLU's gate,
    silu(gate), up). A piece is 1/(grid ranks) of the full activation."""
    shape, q, ranks = workload.shape, workload.layout.edge, workload.tensor_ranks
    h = shape.hidden
    gather = q if workload.layout.tensor_grid == "2d" else q * q
    linears = sum(tokens * fan_in / gather + fan_in * fan_out / gather for fan_in, fan_out, _, _ in shape.linears())
    pieces = tokens * (2 * 2 * h + _attention_saved(shape) + _mlp_saved(shape, grid=True) + scores) / ranks
    return linears + pieces + shape.rotary_elements()


def block_extra_bytes(workload: "Workload", tokens: float) -> float:
    """Bytes a block keeps per micro-batch besides `block_saved_bytes`' activations in the compute
    dtype (that count stays the elements the time model prices), traced with the meter:
    each LayerNorm's mean and reciprocal deviation (RMSNorm: its reciprocal root mean square) and
    flash attention's log-sum-exp (fp32, 2·2 (2·1) + heads per token); and under autocast (activation_bytes 2) the norms' inputs x and x₂, which
    stay fp32 (2h per token, 2 bytes more each), and the matrices: Lightning's autocast runs with
    cache_enabled=False, so every forward casts each weight to the compute dtype and autograd keeps
    that copy until the micro-batch's backward ((4 + 2r)h²/t per block). 2-D/3-D grids save the
    gathered weights already (`grid_block_saved_elements`); their split norms are left as counted."""
    if workload.layout.tensor_grid in ("2d", "3d"):
        return 0.0
    shape, ranks = workload.shape, workload.tensor_ranks
    h = shape.hidden
    norm_statistics = len(shape.block.norms) * shape.norm_vectors  # LayerNorm: mean, 1/σ; RMSNorm: 1/rms
    log_sum_exp = 0 if workload.recompute_attention else workload.heads / ranks  # selective: rerun
    statistics = tokens * (norm_statistics / stream_split(workload) + log_sum_exp) * BYTES
    if workload.activation_bytes >= BYTES:
        return statistics
    # each norm's fp32 tensors: its input (LayerNorm), also its normalised input (RMSNorm)
    fp32 = len(shape.block.norms) * (shape.norm_saves - 1)
    residual = fp32 * h * tokens / stream_split(workload)
    weights = shape.block.matmul_weights() / ranks
    return statistics + residual * (BYTES - workload.activation_bytes) + weights * workload.activation_bytes


def head_saved_bytes(workload: "Workload", tokens: float) -> float:
    """Bytes the last stage's head keeps per micro-batch until its backward: the final norm's fp32
    input and statistics and its output in the compute dtype (the head product's input), the cast
    output matrix under autocast, and the loss's softmax (log-probabilities, or the vocabulary-
    parallel softmax: fp32, split by vocabulary) — one per micro-batch in flight, not one per step."""
    shape, ranks = workload.shape, workload.tensor_ranks
    whole = stream_split(workload)  # sequence parallelism: the final norm runs on the shard too
    fp32 = 1 if workload.layout.tensor_grid in ("2d", "3d") else shape.norm_saves - 1  # GptShape.norm_saves
    norm = tokens * (shape.hidden / whole * (fp32 * BYTES + workload.activation_bytes) + shape.norm_vectors * BYTES
                     / (whole if workload.sequence_parallel else 1))
    cast = shape.vocabulary * shape.hidden / ranks * workload.activation_bytes if workload.activation_bytes < BYTES else 0
    if workload.layout.tensor_grid in ("2d", "3d"):  # the head's GridLinear saves its gathered X and W
        cast = (tokens + shape.vocabulary) * shape.hidden / _gathered(workload) * workload.activation_bytes
    return norm + cast + tokens * shape.vocabulary / ranks * BYTES


def _gathered(workload: "Workload") -> int:
    """What a 2-D (q) or 3-D (q²) grid's GatherMatmulScatter divides a gathered operand by."""
    return workload.layout.edge ** (1 if workload.layout.tensor_grid == "2d" else 2)


def backward_working_bytes(workload: "Workload", tokens: float, head: bool) -> float:
    """The peak a backward adds on top of what it starts with (traced): in a block, at the MLP's
    output product — the wide activation's gradient, fc_out's weight gradient (compute dtype) and,
    under autocast, the incoming gradient's cast; on the last stage the larger of that and the
    loss's gradient and the logits' (2 × tokens × vocabulary fp32, split by vocabulary). A 2-D/3-D grid's product gathers the
    output gradient and computes the gathered input and weight gradients before reduce-scattering
    them (collectives.GatherMatmulScatter). With recomputation the block's forward runs again
    first, so its saved tensors are there too."""
    shape, ranks, a = workload.shape, workload.tensor_ranks, workload.activation_bytes
    grid = workload.layout.tensor_grid in ("2d", "3d")
    if head:  # the larger of the loss's forward (logits, their fp32 copy, and a grid's shifted logits and
        logits = tokens * shape.vocabulary / ranks  # exponentials beside the kept softmax) and its backward
        forward = a + (BYTES if a < BYTES else 0) + (2 * BYTES if workload.layout.tensor_grid else 0)
        product = _gathered_gradients(workload, tokens, shape.hidden, shape.vocabulary) if grid else 0
        return max(logits * max(forward, 2 * BYTES), product, backward_working_bytes(workload, tokens, False))
    if grid:  # GatherMatmulScatter's backward of the MLP's product
        block = _gathered_gradients(workload, tokens, shape.mlp_width, shape.hidden)
    else:
        block = (tokens * shape.mlp_width + shape.mlp_width * shape.hidden) * a / ranks
        block += tokens * shape.hidden * a / (1 if workload.layout.tensor_grid == "1d" else ranks) if a < BYTES else 0
    if workload.recompute:
        block += block_saved_bytes(workload, tokens, True) + block_extra_bytes(workload, tokens)
    return block


def _gathered_gradients(workload: "Workload", tokens: float, fan_in: int, fan_out: int) -> float:
    """A 2-D/3-D GridLinear's backward at its peak: the gathered output gradient, input gradient
    and weight gradient, then their reduce-scattered pieces (collectives.GatherMatmulScatter)."""
    gathered = (tokens * (fan_in + fan_out) + fan_in * fan_out) / _gathered(workload)
    return (gathered + (tokens + fan_out) * fan_in / workload.tensor_ranks) * workload.activation_bytes


RELEASES = (BACKWARD, BACKWARD_WEIGHT)  # the action after which a micro-batch's stash is gone
STARTS_BACKWARD = (BACKWARD, BACKWARD_INPUT)  # the action that sends its input gradient


def in_flight(row, stages=None) -> int:
    """Most forwards (of `stages`, default all) alive at once in a plan row: run, backward not yet.
    Counted over time on the whole row, since different stages' peaks need not coincide
    (interleaved 1F1B). A split backward's micro-batch stays alive until its W (Qi et al. 2023 §3.1
    count it so: W still needs the saved inputs of the stage's linears)."""
    alive = peak = 0
    for action in row:
        if action is None or (stages is not None and action.stage not in stages):
            continue
        alive += action.kind == FORWARD
        alive -= action.kind in RELEASES
        peak = max(peak, alive)
    return peak


def _backward_starts(row):
    """Each action of a plan row that starts a backward (B, or a split backward's I), with what is
    alive just before it: (the action, the row's stages, forwards in flight per stage, Is of stages
    > 0 whose W has not run — this one included —, whether every stage of the row started a backward
    before it). Stage 0's I records nothing (its input gradient has no consumer: StageWork runs its
    whole backward at the W). The counter is live: read it before the next item."""
    computed = [a for a in row if a is not None and a.kind in (FORWARD, *STARTS_BACKWARD, *RELEASES)]
    stages, started, alive, pending = {a.stage for a in computed}, set(), Counter(), 0
    for action in computed:
        pending += action.kind == BACKWARD_INPUT and action.stage > 0
        if action.kind in STARTS_BACKWARD:
            yield action, stages, alive, pending, started == stages
            started.add(action.stage)
        alive[action.stage] += (action.kind == FORWARD) - (action.kind in RELEASES)
        pending -= action.kind == BACKWARD_WEIGHT and action.stage > 0


def pending_weight_gradients(row) -> int:
    """Most micro-batches of stages > 0 between their I and their W at once in a plan row: each holds
    the gradients its I recorded for its W (strategies/split_backward.py). The count rises only at
    an I, so its peak is at one."""
    return max((pending for _, _, _, pending, _ in _backward_starts(row)), default=0)


def pending_moments(row) -> tuple:
    """A split backward's pending Ws where the stash peaks, for `stage_memory`: (pending at the row's
    first I; each (forwards in flight, pending) at an I once every local stage has run one, the
    pairs no other pair bounds). One maximum of each, taken apart, can overstate a rank: ZBV's table
    order (each W right behind its I) holds 4 stage-micro-batches with 1 pending at one I of rank 1
    (p = 2, m = 4) and 3 pending only in the cool-down, where 2 are in flight."""
    first, pairs = None, set()
    for _, _, alive, pending, every_stage in _backward_starts(row):
        first = pending if first is None else first
        if every_stage:
            pairs.add((sum(alive.values()), pending))
    frontier = tuple(sorted(pair for pair in pairs
                            if not any(other != pair and other[0] >= pair[0] and other[1] >= pair[1] for other in pairs)))
    return first or 0, frontier


def recorded_gradient_bytes(workload: Workload, tokens: float) -> float:
    """What one stage-micro-batch between I and W holds besides its stash: the gradient at every
    weighted operator's output (strategies/split_backward.py), per block each product's output in the
    compute dtype (a 1-D grid's column-parallel ones split, its row-parallel partial sums whole; a 2-D/
    3-D grid's all split) and each norm's in fp32 (split with the stream). On the last stage the head
    product's gradient (tokens × vocabulary) takes the place of the log-probabilities its I freed, so
    the head adds nothing here (its final norm's output, one feature-wide tensor, is left out)."""
    shape, ranks, grid = workload.shape, workload.tensor_ranks, workload.layout.tensor_grid
    split_all = grid in ("2d", "3d")
    products = sum(fan_out / (ranks if split_all or position == "first" else 1)
                   for _, fan_out, position, _ in shape.linears())
    stream = shape.hidden / (ranks if split_all or workload.sequence_parallel else 1)
    per_block = products * workload.activation_bytes + 2 * stream * BYTES
    return tokens * workload.layers_per_stage * per_block


def in_flight_moments(row) -> tuple:
    """(forwards of the last stage held here in flight at the row's first backward — the head's
    log-probabilities then; most forwards in flight at a backward once every stage of the row has
    run one — the stash beside all the row's gradients, 0 if there is none; gradient receives
    issued before the first backward — their buffers, strategies/schedule/point_to_point.py)."""
    first, later = None, 0
    for action, stages, alive, _, every_stage in _backward_starts(row):
        if first is None or action.kind == BACKWARD_INPUT:  # split: Ws deferred, the last stage's stash grows
            first = max(first or 0, alive[max(stages)])
        if every_stage:
            later = max(later, sum(alive.values()))
    issued = next((index for index, a in enumerate(row) if a is not None and a.kind in STARTS_BACKWARD), len(row))
    posted = sum(a is not None and a.kind in (RECV_GRADIENT, POST_RECV_GRADIENT) for a in row[:issued])
    return first or 0, later, posted


def held_sends(plan, rank: int, completes_when_received: bool = False) -> tuple:
    """(most at a backward once every local stage has run one; at the row's end) boundary buffers
    `StageWork` holds that nothing else keeps: sent input gradients, sent outputs whose own
    backward has run, and (at a backward) activation receives posted and not yet waited for. A send
    is held until the executor drops it (schedule `release_points`): once a later message proves its
    receive issued (gloo, the fake group) or, `completes_when_received` (NCCL), once the peer has
    issued its receive in the plan's timeline (docs/strategies/pipeline_memory.md); an output
    awaiting its backward is counted with the forwards in flight, a received input once waited for
    with the stash. `stage_memory` adds the first to the stash's own peak: exact where both are
    steady (1F1B), an upper bound under breadth-first schedules, whose held sends grow while their
    stash drains."""
    releases = release_points(plan, rank, completes_when_received)
    row = [action for action in plan.ranks[rank] if action is not None]
    stages = {action.stage for action in row if action.kind == FORWARD}
    held, done, started, posted, later = set(), set(), set(), set(), 0
    for action in row:
        if action.kind in STARTS_BACKWARD:
            if started == stages:
                later = max(later, _extra(held, done) + len(posted))
            started.add(action.stage)
            done.add((action.stage, action.micro_batch))
        held.difference_update(releases.get(action, ()))  # the executor drops them before its own send
        if action.info.arrow == SEND_ARROW:
            held.add(action)
        if action.kind == POST_RECV_ACTIVATION:  # gradient receives: `later` of them, counted apart
            posted.add(posted_receive(action))
        posted.discard(action)
    return later, _extra(held, done)


def _extra(held: set, done: set) -> int:
    return sum(send.kind == SEND_GRADIENT or (send.stage, send.micro_batch) in done for send in held)


def memory(workload: Workload, plan, pipeline_rank: int, flash: bool = True, temporaries: bool = True,
           moment: bool = False) -> dict:
    """Bytes by kind on one rank of pipeline position `pipeline_rank` (the parts it holds);
    `temporaries=False` leaves gloo's reduce-scatter temporaries out (the fake group makes none);
    `moment`: the name of the peak moment instead (`stage_memory`)."""
    row = [action for action in plan.ranks[pipeline_rank] if action is not None]
    stages = sorted({action.stage for action in row if action.kind == FORWARD})
    last_alive, later, posted = in_flight_moments(row)
    pending = pending_moments(row) if any(action.kind == BACKWARD_WEIGHT for action in row) else 0
    return stage_memory(workload, stages, plan.stages, in_flight(row), flash, later, last_alive, posted,
                        held_sends(plan, pipeline_rank, completes_when_received=not workload.gloo), temporaries,
                        pending, moment)


def stage_memory(workload: Workload, stages: list, total_stages: int, alive: int, flash: bool = True,
                 later: int = None, last_alive: int = None, posted: int = None, sends_held: tuple = (0, 0),
                 temporaries: bool = True, pending: int = 0, moment: bool = False) -> dict:
    """Bytes by kind on a rank holding `stages` (of `total_stages`) at its peak (`moment`: the
    name of the peak moment instead): what `memory` reads
    off a built plan, and what the search gives in closed form (`closed_form_in_flight`,
    `closed_form_moments`). Parameters and optimizer state stay; the step starts with
    `zero_grad(set_to_none=True)`, so gradients are created by the backward: by autograd one tensor
    at a time, or in the pipeline stages' buckets (`gradient_buckets`) one bucket at a time, a
    bucket's flat buffer made when the backward first reaches it. The largest of:
      start       last step's gradients (with `gradients_through_forward`, also beside the whole
                  forward's stash and the loss's working set);
      first backward  `alive` forwards' stash (`last_alive` of the last stage with the head's
                  saved tensors), their outputs (sent, or handed to the next stage), the `posted`
                  gradient receives, and the backward creating its stage's gradients block by
                  block (up to a bucket ahead) as it frees that micro-batch's saved tensors;
      later       every gradient, `later` forwards' stash and outputs, the sends still held and
                  the receives posted (`sends_held[0]`, `held_sends`), a backward's working set;
      optimizer   every gradient and the optimizer's temporaries as it steps one tensor at a time
                  (`optimizer_temporaries`; where the reduction copies no more, this can be the peak);
      reduction   every gradient, the sends held at the end (`sends_held[1]`), and, where the
                  reduction copies (the one-stage strategies' own: `gradients_through_forward`), a
                  stage's flat copy; the pipeline stages' buckets are reduced in place, so their
                  reduction adds nothing. ZeRO adds its gathered stages to each moment (below).
    A split backward's `pending` stage-micro-batches between I and W add their recorded gradients to
    the first backward and later moments: a count (`pending_weight_gradients`, the closed form: an
    upper bound, its peak need not coincide with the stash's), or `pending_moments`' (at the first I;
    (in flight, pending) pairs at the later Is), each later pair priced as that moment's stash and
    outputs in flight.
    Boundary buffers: an output is the fp32 stream's piece, kept for its backward (and on gloo beside
    its send's own cast or slice); a posted receive and a held send are messages
    (`boundary_message_bytes`: 16-bit, 1/t where scattered). Under the distributed optimizer
    (`workload.distributed_optimizer`) the gradients are the stages' flat buckets, there at every
    moment (the first backward and the forward's end included: nothing is created), and the
    optimizer state and its step's temporaries are 1/d of the replicated optimizer's.
    `later`, `last_alive`, `posted` default to one group of `alive` micro-batches on one stage:
    alive − 1, alive, one receive per sent output; `sends_held` to none (`closed_form_held` gives
    the search's)."""
    layout, shape, per_stage = workload.layout, workload.shape, workload.layers_per_stage
    later = max(alive - 1, 0) if later is None else later
    last_alive = alive if last_alive is None else last_alive
    part = {stage: stage_parameters(workload, stage, total_stages) * BYTES for stage in stages}
    held, largest = sum(part.values()), max(part.values())
    sharded = held / layout.data_context if layout.zero else held
    sharded += zero_extra_shard(workload, len(stages) * per_stage) * BYTES  # MoE experts: over d/e (cost/experts.py)
    # ZeRO (strategies/zero_layered.py): a stage's weights are gathered whole for each run, the next
    # run's gather posted one ahead (two stages; the same one twice when a rank holds one), and its
    # backward installs a whole flat gradient at once, in flight until the next stage's reduce-
    # scatter settles it (a looping rank's current and previous stage).
    two = largest + sorted(part.values())[-2] if len(stages) > 1 else 2 * largest
    full = (two - largest if len(stages) > 1 else largest) if layout.zero else 0
    gradients = sharded + full
    # The distributed optimizer (strategies/distributed_optimizer.py): each stage's weights and
    # gradients live in flat buckets padded to a multiple of d, made at setup and zeroed, never
    # freed, each step (the gradients are there at every moment); the optimizer state is 1/d of it.
    persistent = workload.distributed_optimizer and not layout.zero
    if persistent:
        sharded = gradients = sum(distributed_buckets(workload, part[stage] / BYTES) * BYTES for stage in stages)
    state = sharded / (layout.data_context if persistent else 1)
    tokens = workload.micro_batch_rows * shape.length
    block = block_saved_bytes(workload, tokens, flash) + block_extra_bytes(workload, tokens)
    piece = workload.piece * BYTES  # the stream's fp32 piece: an output kept for its backward, an input arrived
    message = boundary_message_bytes(workload)  # a posted receive's buffer, a held send's tensor
    # On gloo an output's send holds its own cast or slice until a later message proves it received
    # (its backward's gradient, at the latest), beside the kept output; NCCL's completes once the
    # peer has posted the receive, before the moments below (the dry run's emulation of both).
    output = piece + (message if message != piece and workload.gloo else 0)
    kept = piece if workload.recompute else per_stage * block  # recompute: stage inputs
    loops, last = len(stages), total_stages - 1 in stages
    head = head_saved_bytes(workload, tokens) if last else 0.0
    # a backward's working set, or the K/V blocks context parallelism's exchange holds in a layer's
    # attention backward, after that layer's MLP has freed its saved tensors (cost/context.py)
    working = max(backward_working_bytes(workload, tokens, last), exchange_buffers(workload))
    pipelined = layout.pipeline > 1  # sends are kept until proven received, receives from their post
    sent_first = (alive - (last_alive if last else 0)) * pipelined
    # gloo's reduce-scatter temporaries live inside a backward's wait() (`gloo_temporaries`): beside the
    # first backward's start, the head's product's on the last stage; beside a block's backward, the
    # largest block product's. None at the forward's end (where a one-stage tensor-grid plan peaks,
    # beside last step's gradients), at the step's start or at the data-parallel reduction.
    block_copies = gloo_temporaries(workload, tokens) if temporaries else 0.0
    start_copies = gloo_temporaries(workload, tokens, head=True) if temporaries and last else block_copies
    if layout.zero:
        growth = part[max(stages)] + working + block_copies
    elif persistent:  # nothing to create: the backward accumulates into the buckets
        growth = working + start_copies
    else:
        at_start, during, end = _first_backward_growth(workload, tokens, stages, total_stages, block, working,
                                                       gradient_buckets(workload))
        growth = max(at_start + start_copies, during + block_copies, end + block_copies)
    posted = sent_first if posted is None else posted
    per_pending = recorded_gradient_bytes(workload, tokens)
    pending_first, pairs = (pending, ((later, pending),)) if isinstance(pending, int) else pending
    first_backward = (alive * kept + last_alive * head + sent_first * output + posted * message + growth
                      + pending_first * per_pending)
    senders = (loops - last) * pipelined

    def later_moment(in_flight: int, waiting: int) -> tuple:  # (activations, buffers) beside every gradient
        buffers = in_flight * senders / loops * (output + message) + sends_held[0] * pipelined * message  # outputs
        # in flight and their gradient receives, the held sends and activation receives
        return in_flight * kept + waiting * per_pending + later / loops * head + working, buffers
    later_activations, later_buffers = max((later_moment(*pair) for pair in pairs), key=sum, default=later_moment(later, 0))
    every_send = sends_held[1] * pipelined * message
    # Only the one-stage strategies' own reductions copy (three_d's sum_over_groups, DDP's buckets);
    # ZeRO's gathered buffers are counted below, the pipeline stages' buckets are reduced in place.
    flat = largest if layout.data_context > 1 and not layout.zero and workload.gradients_through_forward else 0
    forward = alive * kept + last_alive * head + working if workload.gradients_through_forward or persistent else 0
    moments = {"start": (gradients, 0, 0), "first backward": (gradients if persistent else 0, first_backward, 0),
               "forward": (gradients, forward, 0),
               "later": (gradients, later_activations, later_buffers + block_copies),
               "reduction": (gradients, 0, every_send + flat),
               "optimizer": (gradients, 0, 0 if layout.zero else optimizer_temporaries(workload, stages, total_stages))}
    if moment:
        return max(moments, key=lambda name: sum(moments[name]))
    kept_gradients, activations, buffers = max(moments.values(), key=sum)
    return {"parameters": sharded, "gradients": kept_gradients,
            "optimizer": OPTIMIZER_STATE.get(workload.optimizer, 2) * state,
            "activations": activations,
            "buffers": buffers + (two if layout.zero else 0)}


def distributed_buckets(workload: Workload, elements: float) -> int:
    """Elements of a stage's flat buckets under the distributed optimizer: its `elements` padded to
    a multiple of d per bucket of strategy.bucket_mb (cost.traffic.padded_buckets)."""
    return padded_buckets(elements, workload.layout.data_context, workload.gradient_bucket_bytes // BYTES)


def boundary_message_bytes(workload: Workload) -> float:
    """Bytes of one boundary message's buffer (strategies/stages.py `StageWork.message`,
    `_post_receive`): a posted receive's, in `message_bytes` (bf16/fp16 under
    strategy.message_dtype=compute), of this rank's 1/t slice where messages are scattered
    (`Workload.message_elements`); and a held send's tensor, that cast or slice copied out (its
    source, an input gradient, is dropped), or the very fp32 tensor where neither applies: the same
    bytes either way."""
    return workload.message_elements * workload.message_bytes


def gloo_temporaries(workload: Workload, tokens: float, head: bool = False) -> float:
    """On gloo, a 2-D/3-D grid's reduce-scatter of a backward partial (dX or dW, fp32) makes two
    full-size temporaries inside `wait()` on the calling thread (found by the dry run: NCCL and the
    fake group have none): two of the largest such partial of a block's products, which a block's
    backward holds at its peak, or (`head`) of the head's product, the first a last stage's backward
    reduce-scatters (three_d q2 here: the real gloo run's peak is the dry run's + 0.49 MiB, the head's
    0.5 MiB, not a block's 2 MiB). The plan of a gloo run (this machine's) counts them; a GPU plan does not."""
    if not workload.gloo or workload.layout.tensor_grid not in ("2d", "3d"):
        return 0.0
    q = workload.layout.edge
    gather = q if workload.layout.tensor_grid == "2d" else q * q
    products = [(workload.shape.hidden, workload.shape.vocabulary)] if head else \
        [(fan_in, fan_out) for fan_in, fan_out, _, _ in workload.shape.linears()]
    largest = max(max(tokens * fan_in, fan_in * fan_out) / gather for fan_in, fan_out in products)
    return 2 * largest * BYTES


# Temporaries an optimizer step holds at once, in tensors of the largest parameter's size
# (layerwise/run/optim.py): AdamW with foreach=False computes sqrt(v̂) and its division while its
# loop variable still holds the previous tensor's denominator (3); LAMB 5; SGD updates in place.
# Measured with parallel/memory.py's meter on three 1000 × 1000 tensors
# (tests/test_overlapped_reduction.py).
OPTIMIZER_TEMPORARIES = {"adamw": 3, "lamb": 5, "sgd": 0}


def optimizer_temporaries(workload: Workload, stages: list, total_stages: int) -> float:
    """Bytes the optimizer step holds beside every gradient: OPTIMIZER_TEMPORARIES of the largest
    parameter tensor of this grid position (a block's largest product, the token table on the first
    stage, the head on the last), the optimizer stepping one tensor at a time; under the distributed
    optimizer one piece of this rank's slice of a bucket at a time, at most ⌈bucket / d⌉ elements."""
    layout, shape = workload.layout, workload.shape
    ranks = layout.tensor
    split = 1 if layout.tensor_grid in (None, "1d") else layout.edge
    largest = max(fan_in * fan_out for fan_in, fan_out, _, _ in shape.linears()) / ranks
    if 0 in stages:
        largest = max(largest, shape.vocabulary * shape.hidden / split)
    if total_stages - 1 in stages:
        largest = max(largest, shape.hidden * shape.vocabulary / ranks)
    if workload.distributed_optimizer and not layout.zero:  # it steps this rank's slice of each bucket
        stage = max(stage_parameters(workload, stage, total_stages) for stage in stages)
        bucket = min(stage, workload.gradient_bucket_bytes // BYTES or stage)
        largest = min(largest, -(-bucket // layout.data_context))
    return OPTIMIZER_TEMPORARIES.get(workload.optimizer, 2) * largest * BYTES


def gradient_buckets(workload: Workload) -> float:
    """Bytes of one gradient bucket the pipeline stages make at once (strategies/buckets.py
    GradientBuckets: a bucket's flat buffer is made when the backward first reaches it): 0 where
    autograd creates each gradient itself (the one-stage strategies, run through Lightning's
    closure), under ZeRO (its own flat buffers, counted apart) and under the distributed optimizer
    (its own buffers, strategies/distributed_optimizer.py)."""
    if workload.gradients_through_forward or workload.layout.zero or workload.distributed_optimizer:
        return 0.0
    return float(workload.gradient_bucket_bytes)


def _first_backward_growth(workload: Workload, tokens: float, stages: list, total_stages: int, block: float,
                           working: float, bucket: float = 0.0) -> float:
    """What the rank's first backward (its last local stage's) adds at its peak, as it creates that
    stage's gradients (full size) and frees the micro-batch's saved tensors: the working set at its
    start (the head's, on the last stage); its last block's working set beside the other blocks'
    gradients (and the head's) less what they freed; or, at its end, every gradient of the stage,
    the embedding's last, less everything the micro-batch kept: (at its start, during, at its end).
    With gradient buckets of `bucket` bytes, the buffers run up to one bucket ahead of the gradients
    autograd would have created by then (never past the stage's), beside the last block's working
    set (during); the working set at the start is past its peak when the first gradient arrives."""
    stage, per_stage = max(stages), workload.layers_per_stage
    shape, layout, last = workload.shape, workload.layout, max(stages) == total_stages - 1
    block_gradients = local_parameters(layout.tensor_grid, layout.edge, shape, False, 1, False)["all"] * BYTES
    head = (local_parameters(layout.tensor_grid, layout.edge, shape, False, 0, True)["all"] * BYTES
            - head_saved_bytes(workload, tokens)) if last else 0
    embedding = local_parameters(layout.tensor_grid, layout.edge, shape, True, 0, False)["all"] * BYTES if stage == 0 else 0
    freed = 0 if workload.recompute else block  # recomputation: the block's tensors are its working set
    others = (per_stage - 1) * (block_gradients - freed) + head
    during = others + backward_working_bytes(workload, tokens, False)
    end = others + block_gradients - freed + embedding - (workload.piece * BYTES if workload.recompute else 0)
    stage_gradients = per_stage * block_gradients + (head + head_saved_bytes(workload, tokens) if last else 0) + embedding
    created = (per_stage - 1) * block_gradients + (head + head_saved_bytes(workload, tokens) if last else 0)
    return working, during + min(bucket, stage_gradients - created), end


def closed_form_in_flight(schedule: str, pipeline_degree: int, loops: int, breadth_first: int, rank: int) -> int:
    """`in_flight` of pipeline rank `rank` without building the plan (strategies/schedule/generators.py;
    depth-first groups drain before the next, so one breadth-first group's peak is the row's):
      gpipe                  all bf forwards before the first backward;
      one_f_one_b            p − 1 − r warm-up forwards, then one more before each backward: min(p − r, bf);
      looped_breadth_first   every local stage's bf forwards before any backward: v·bf;
      interleaved_one_f_one_b  2(p − 1 − r) + (v − 1)p warm-up forwards, + 1 in the steady state, ≤ v·bf."""
    p, v, bf = pipeline_degree, loops, breadth_first
    if schedule == "zero_bubble_h1":  # p − 1 − r warm-up, then W lags I by r: p alive on every rank
        return min(p, bf)
    if schedule in ZERO_BUBBLE:  # ZBV, ZB-H2: off the built plan
        return _split_backward_row(in_flight, schedule, p, bf, bf, rank)
    if schedule == "gpipe":
        return bf
    if schedule == "one_f_one_b":
        return min(p - rank, bf)
    if schedule == "interleaved_one_f_one_b":
        return min(2 * (p - 1 - rank) + (v - 1) * p + 1, v * bf)
    return v * bf  # looped_breadth_first, layered


def closed_form_pending(schedule: str, pipeline_degree: int, breadth_first: int, micro_batches: int, rank: int):
    """The `pending` `memory` gives `stage_memory` for pipeline rank `rank`, without the plan: none
    but under a split backward; ZB-H1's rank r > 0 runs r + 1 Is before its first W (W lags I by r),
    and holds them beside its whole stash; ZB-H2's and ZBV's `pending_moments` off the built plan."""
    if schedule == "zero_bubble_h1":
        return min(rank + 1, breadth_first) if rank > 0 else 0
    if schedule in ZERO_BUBBLE:
        return _split_backward_row(pending_moments, schedule, pipeline_degree, breadth_first, micro_batches, rank)
    return 0


def closed_form_moments(schedule: str, pipeline_degree: int, loops: int, breadth_first: int, micro_batches: int,
                        rank: int) -> tuple:
    """`in_flight_moments` of pipeline rank `rank` without the plan (the last stage's value is
    read only on the rank holding it, p − 1): the head's forwards in flight at the first backward
    are a breadth-first group's bf under GPipe and looped schedules, 1 under the 1F1B ones (a
    backward follows each forward there). The stash is back at its peak beside every gradient when
    a steady state of one forward per backward follows (1F1B: bf > p − r; interleaved: bf > p) or
    a later group refills it (m > bf); else the second backward of a single group sees bf − 1."""
    p, bf = pipeline_degree, breadth_first
    if schedule in ZERO_BUBBLE:
        return _split_backward_row(in_flight_moments, schedule, p, bf, micro_batches, rank)
    alive = closed_form_in_flight(schedule, p, loops, bf, rank)
    steady = micro_batches > bf or (schedule == "one_f_one_b" and bf > p - rank) \
        or (schedule == "interleaved_one_f_one_b" and bf > p)
    breadth = schedule in ("gpipe", "looped_breadth_first")
    return (bf if breadth else 1), (alive if steady else bf - 1), _posted_receives(schedule, p, loops, bf, rank)


def _posted_receives(schedule: str, p: int, loops: int, bf: int, rank: int) -> int:
    """Gradient receives a rank has issued at its first backward (point_to_point.add_receive_posts:
    each right after the rank's previous operation in the plan's one message order). None on the
    last rank. A rank with one peer (rank 0 without loops, both ranks at p = 2) posts as early as
    that pair's order allows: a breadth-first rank one per forward in flight (GPipe: bf), a 1F1B rank
    in its steady state one (else bf); at p = 2 a looping rank 0 min(2, bf − 1), its gradient sends
    holding the rest back. A rank between two peers posts each only after its operations toward the
    other: in a chain (one stage per rank) 1; on a ring (looping, p ≥ 3) looped 1, rank 0 2 once a
    group is longer than p; interleaved 2, but 1 on the first half of the ranks when bf = p. Found on
    the built plans (tests/test_plan_search.py, tests/test_point_to_point.py), not proven."""
    if p == 1 or rank == p - 1:
        return 0
    if loops == 1 and rank == 0:
        return 1 if schedule == "one_f_one_b" and bf > p else bf
    if p == 2:
        return min(2, bf - 1)
    if loops == 1 or (schedule != "interleaved_one_f_one_b" and rank > 0):
        return 1
    if schedule == "interleaved_one_f_one_b":
        return 2 if bf > p or rank >= p // 2 else 1
    return 2 if bf > p else 1


def closed_form_held(schedule: str, pipeline_degree: int, loops: int, breadth_first: int, micro_batches: int,
                     rank: int, completes_when_received: bool = False) -> tuple:
    """`held_sends` of pipeline rank `rank` without the plan: (sends held + activation receives
    posted, at the worst steady backward; sends held at the end) — tests/test_plan_search.py holds
    them equal to the built plans'. Rank 0 sends no input gradient, and each of its outputs is
    proven received by that micro-batch's returning gradient before its backward, so only a looping
    rank 0 holds sends: its later stages' gradients toward rank p − 1. Otherwise a rank holds the
    input gradients its peer cannot prove received before the next forward message arrives:
      gpipe                  a group's bf − 1 at its last backward, bf at its end;
      one_f_one_b            min(p − r, bf − 1), + 1 at the end (the drain's);
      interleaved_one_f_one_b  its warm-up count, min(2(p − 1 − r) + (v − 1)p + 1, v·bf − 1), + 1 at
                             the end; rank 0 (v − 1)p; at p = 2 the one peer proves them early: 1, 2;
      looped_breadth_first   v·bf − 1, v·bf at the end, rank 0 (v − 1)·bf; at p = 2, where one peer
                             takes both directions, rank 1 max(bf − 2, 1) and one more at the end in
                             a single group (or bf = 2), else bf − 1 and bf − 1, rank 0 then 1, 0.
    Activation receives posted ahead of a steady backward (point_to_point.add_receive_posts): 1F1B's
    last rank one (bf ≥ 3); interleaved at p = 2 (bf > p) one on rank 1 and, when m > 2p, on rank 0.
    A looping rank 0 at p ≥ 3 posts none: its peers form a ring, and it posts the next group's inputs
    from rank p − 1 only after its previous operation in the plan's one message order.
    With `completes_when_received` (NCCL): add_receive_posts issues each receive one pair operation
    ahead, so on the built plans a send completes by the executor's next check or the one after and
    a rank holds at most one input gradient at a backward and at the end (rank 0 none unless it
    loops). That bound is used (found on the plans, not proven in general): above the built plans'
    `held_sends(..., completes_when_received=True)` by at most one piece (tests/test_pipeline_memory.py
    checks both sides on every tested (schedule, p, v, m, bf))."""
    if schedule in ZERO_BUBBLE:
        return _split_backward_held(schedule, pipeline_degree, breadth_first, micro_batches, rank, completes_when_received)
    if completes_when_received:
        later = end = int(pipeline_degree > 1 and (rank > 0 or loops > 1))  # a looping rank 0 sends gradients
    else:
        later, end = _held_sends(schedule, pipeline_degree, loops, breadth_first, micro_batches, rank)
    return later + _posted_activations(schedule, pipeline_degree, loops, breadth_first, micro_batches, rank), end


def _held_sends(schedule: str, p: int, v: int, bf: int, micro_batches: int, rank: int) -> tuple:
    if p == 1:
        return 0, 0
    if schedule in ("gpipe", "one_f_one_b") or v == 1:
        later = 0 if rank == 0 else (bf - 1 if schedule == "gpipe" else min(p - rank, bf - 1))
        return later, later + (rank > 0)
    if schedule == "interleaved_one_f_one_b":
        if p == 2:
            return (0, 0) if rank == 0 else (1, 2)
        if rank == 0:
            return (v - 1) * p, (v - 1) * p
        later = min(2 * (p - 1 - rank) + (v - 1) * p + 1, v * bf - 1)
        return later, later + 1
    if p == 2 and (micro_batches == bf or bf == 2):  # looped_breadth_first, layered: one peer both ways
        return (0, 0) if rank == 0 else (max(bf - 2, 1), max(bf - 2, 1) + 1)
    if p == 2:
        return (1, 0) if rank == 0 else (bf - 1, bf - 1)
    return ((v - 1) * bf,) * 2 if rank == 0 else (v * bf - 1, v * bf)


def _posted_activations(schedule: str, p: int, v: int, bf: int, micro_batches: int, rank: int) -> int:
    if p == 1:
        return 0
    if schedule == "one_f_one_b" or (v == 1 and schedule != "gpipe"):
        return int(rank == p - 1 and bf >= 3)
    if schedule == "interleaved_one_f_one_b" and p == 2:
        return int(bf > p and (rank == 1 or micro_batches > 2 * p))
    return 0


# The split-backward schedules (Qi et al. 2023; strategies/schedule/generators.py) have no closed form
# here for their moments and held sends (ZB-H1's W lag and ZBV's list schedule make them irregular
# per rank): the search reads them (ZB-H2's and ZBV's in-flight peak too) off the built plan, which depends only on (p, bf, m) — cached,
# so a search builds each once. Their in-flight peak: ZB-H1's min(p, bf) above; ZBV's off the plan.
# Past its warm-up each schedule repeats one micro-batch's pattern, so every count read off its plan
# stops changing at STEADY_MICRO_BATCHES(p) micro-batches (found on the built plans: p 2–24, m up to
# 6p; tests/test_plan_search.py checks it): the counts are read off that plan, not one of m = 10,240.
STEADY_MICRO_BATCHES = {"zero_bubble_h1": lambda p: p + 1, "zbv": lambda p: 2 * p, "zero_bubble_h2": lambda p: 3 * p - 2}


def counted_micro_batches(schedule: str, pipeline_degree: int, breadth_first: int, micro_batches: int) -> tuple:
    """(bf, m) of the plan a split schedule's counts are read off: m capped at its steady state."""
    if breadth_first != micro_batches:
        return breadth_first, micro_batches
    steady = min(micro_batches, STEADY_MICRO_BATCHES[schedule](pipeline_degree))
    return steady, steady


@lru_cache(maxsize=256)
def split_backward_plan(schedule: str, pipeline_degree: int, breadth_first: int, micro_batches: int):
    """The plan `fit` runs for a split-backward schedule (compute, transfers, reductions): one stage
    per rank for ZB-H1, two (the V) for ZBV."""
    stages = 2 * pipeline_degree if schedule == "zbv" else pipeline_degree
    return add_gradient_reductions(add_communication(build_plan(
        schedule, pipeline_degree=pipeline_degree, stages=stages, micro_batches=micro_batches,
        breadth_first_micro_batches=breadth_first)))


@lru_cache(maxsize=4096)
def _split_backward_row(count, schedule: str, pipeline_degree: int, breadth_first: int, micro_batches: int,
                        rank: int):
    """`count` (a function of one plan row) of a split-backward plan's rank: the search asks once per
    layout, and many layouts share a (schedule, p, bf, m)."""
    counted = counted_micro_batches(schedule, pipeline_degree, breadth_first, micro_batches)
    return count(split_backward_plan(schedule, pipeline_degree, *counted).ranks[rank])


@lru_cache(maxsize=4096)
def _split_backward_held(schedule: str, pipeline_degree: int, breadth_first: int, micro_batches: int, rank: int,
                         completes_when_received: bool) -> tuple:
    counted = counted_micro_batches(schedule, pipeline_degree, breadth_first, micro_batches)
    return held_sends(split_backward_plan(schedule, pipeline_degree, *counted), rank, completes_when_received)
