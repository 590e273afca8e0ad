"""Context parallelism (strategy.context_parallel = c) in the cost model: a rank's share of each
sequence, its attention, the exchange of keys and values, and the buffers the exchange keeps.

A context rank holds s/c tokens of every sequence (a head chunk and a tail chunk, so that the causal
work is balanced: strategies/context_parallel.py). Plan mode and the search give the cost model a
workload whose shape is the rank's (`sharded_shape`: GptShape.length = s/c), so everything that
grows with the tokens — the linears, the norms and element-wise operators, the saved activations,
the pipeline messages, the tensor grid's collectives, the loss — is already a rank's. What is not:
  attention   each local query attends the keys of the whole sequence (`key_length` = c · length):
              a rank does 1/c of the sequence's attention (the FLOP count's 4·s·h per token with s
              the key length; the head/tail split balances the causal half, so every rank does the
              same 1/c), and the math kernel's scores are (s/c) × s per head;
  exchange    per layer, cost/traffic.py `context_traffic`'s bytes over the context group (members
              t ranks apart: inside a node where t·c devices fit in one), priced by `exchange_seconds`:
              ring   each hop's K/V block travels while the rank computes attention on the block it
                     holds (Liu et al. 2023, Ring Attention; Megatron-core's p2p CP): per hop only what
                     outlasts 1/c of the layer's attention is exposed (backward: 2/c, the block's
                     backward is twice its forward), and all of it where the device does not overlap
                     communication; the backward's last hop (dK/dV home) is always exposed;
              all_gather  K and V gathered before the attention and dK/dV reduce-scattered after it:
                     exposed whole (Megatron-core's all_gather CP issues them on the critical path);
  buffers     the K/V blocks the exchange holds while one layer's attention runs (`exchange_buffers`);
  reduction   the gradients are reduced over the data replicas × the context shards
              (parallel.dims.Layout.data_context).
"""

from dataclasses import replace

from cost.inputs import GptShape, Workload
from cost.traffic import context_block, context_kv_heads, context_traffic


def sharded_shape(shape: GptShape, context: int) -> GptShape:
    """The shape a context rank computes: `length` the s/c tokens of each sequence it holds (the
    position table's rows, max_length, stay the model's)."""
    if context <= 1:
        return shape
    if shape.length % (2 * context):
        raise ValueError(f"data.sequence_length={shape.length} must split into 2·c = {2 * context} equal chunks "
                         "(a head and a tail chunk per context rank). Fix: a multiple of 2·strategy.context_parallel.")
    return replace(shape, length=shape.length // context)


def key_length(workload: Workload) -> int:
    """Keys a query attends to, at most: the whole sequence, c × the rank's `shape.length`."""
    return workload.shape.length * workload.layout.context


def local_kv_heads(workload: Workload) -> float:
    """Key (and value) heads this rank computes (cost.traffic.context_kv_heads)."""
    return context_kv_heads(workload.layout, workload.shape)


def exchange_bytes(workload: Workload, backward: bool = True) -> dict:
    """`context_traffic` of one layer on one micro-batch of this workload, in the dtype K/V travel
    in (the compute dtype: `activation_bytes`)."""
    return context_traffic(workload.context_comm, workload.layout.context, workload.micro_batch_rows,
                           key_length(workload), local_kv_heads(workload), workload.shape.block.head_dim,
                           workload.activation_bytes, backward)


def exchange_seconds(workload: Workload, device, transfer, attention_seconds: float) -> tuple:
    """(forward, backward) exposed seconds of the exchange for one micro-batch through a stage of
    `layers_per_stage` layers. `transfer(device, bytes, extent, count, stride)` prices `count`
    messages or collectives moving `bytes` in all (cost.step_time.collective_seconds, passed in: this
    module sits below the time model); `attention_seconds`: one layer's attention forward on this rank
    (cost.step_time.core_attention_seconds), which the ring's hops hide behind."""
    c = workload.layout.context
    if c <= 1:
        return 0.0, 0.0
    forward_bytes = sum(exchange_bytes(workload, backward=False).values())
    backward_bytes = sum(exchange_bytes(workload).values()) - forward_bytes
    t = workload.tensor_ranks
    if workload.context_comm == "all_gather":  # K and V gathered, dK and dV reduce-scattered: two each way
        forward = transfer(device, forward_bytes, t * c, 2, t)
        backward = transfer(device, backward_bytes, t * c, 2, t)
    else:
        block = forward_bytes / (2 * (c - 1))  # one K (or V) block's bytes
        hop = transfer(device, 2 * block, t * c, 2, t * c)  # K and V to the next rank: one device's link
        back_hop = transfer(device, 4 * block, t * c, 4, t * c)  # K, V and the dK, dV accumulators
        home = transfer(device, 2 * block, t * c, 2, t * c)  # the last hop: dK, dV back to their owner
        assert abs((c - 1) * 4 * block + 2 * block - backward_bytes) <= 1e-6 * backward_bytes
        hidden = 1.0 if device.overlaps_communication else 0.0
        forward = (c - 1) * max(hop - hidden * attention_seconds / c, 0.0)
        backward = (c - 1) * max(back_hop - hidden * 2 * attention_seconds / c, 0.0) + home
    return workload.layers_per_stage * forward, workload.layers_per_stage * backward


def context_saved_elements(workload: Workload) -> float:
    """Elements per local token a layer keeps for its backward beyond what cost/memory.py counts for a
    flash kernel (q, k, v, the output and the log-sum-exp), measured with the meter
    (benchmarks/context_memory.py): the exchange returns its output head-major ([b, heads, s/c, d],
    strategies/context_parallel.py), so merging the heads for the output projection copies it and the
    projection keeps that copy beside the attention's own (heads·d, a rank's heads; one process's
    kernel returns it token-major and the merge is a view); and the all_gather exchange keeps the
    gathered K/V of all c blocks in place of the local k, v, (c − 1)·2·kv_heads·d more (its
    `saved_bytes`)."""
    c = workload.layout.context
    if c <= 1:
        return 0.0
    block = workload.shape.block
    heads = block.heads / (workload.tensor_ranks if workload.layout.tensor_grid else 1)
    gathered = (c - 1) * 2 * local_kv_heads(workload) * block.head_dim if workload.context_comm == "all_gather" else 0
    return heads * block.head_dim + gathered


def exchange_buffers(workload: Workload) -> float:
    """Bytes the exchange holds beside the saved activations while one layer's attention runs (its
    backward, the larger): ring — two stacked K/V blocks in flight (the one computed on, the next
    arriving) and, in the backward, a dK/dV accumulator travelling with them; all_gather — in the
    backward the gradients of the whole sequence's K and V before the reduce-scatter (the gathered
    K/V themselves are kept for the backward: `context_saved_elements`). They live while a layer's
    attention runs its backward, after its MLP's saved tensors and working set are gone, so cost/memory.py
    takes the larger of them and a backward's working set."""
    c = workload.layout.context
    if c <= 1:
        return 0.0
    block = context_block(workload.micro_batch_rows, key_length(workload), local_kv_heads(workload),
                          workload.shape.block.head_dim, c) * workload.activation_bytes  # one K (or V) block
    if workload.context_comm == "all_gather":
        return 2 * c * block
    return 2 * 2 * block + 2 * block


def data_context_span(workload: Workload, device) -> tuple:
    """(extent, stride) of the gradient reduction's group, the data replicas × the context shards, as
    cost.step_time.link_bandwidth reads a group: the whole world's extent; without context shards the
    data ranks t × p apart, with them as many members per node as the context shards a node holds."""
    layout = workload.layout
    if layout.context == 1:
        return layout.world_size, workload.tensor_ranks * layout.pipeline
    members = max(1, min(layout.context, device.devices_per_node // workload.tensor_ranks))
    return layout.world_size, max(1, device.devices_per_node // members)
