"""Context parallelism in the cost model and plan mode (issue 57, items 4 and 5).

The exchange's bytes against hand counts (cost/traffic.py `context_traffic`, the formula the
strategies' counted bytes are compared against), ...
"""

import pytest

from cost.traffic import context_step_traffic, context_traffic


# b=2 sequences of s=1024 tokens over c=4 ranks, 2 kv heads of 64: a K block is 2·256·2·64 = 65,536
# elements, 131,072 bytes in bf16.
BLOCK_BYTES = 2 * 256 * 2 * 64 * 2


def test_ring_moves_k_and_v_c_minus_1_hops_forward_and_3c_minus_2_in_all():
    forward = context_traffic("ring", 4, 2, 1024, 2, 64, element_bytes=2, backward=False)
    assert forward == {"send_recv": 2 * 3 * BLOCK_BYTES}  # K and V, 3 hops each
    both = context_traffic("ring", 4, 2, 1024, 2, 64, element_bytes=2)
    # + K/V round again (3 hops) + dK/dV home (4 hops): 2·(3 + 3 + 4) blocks = 2,621,440 B
    assert both == {"send_recv": 2 * (3 + 3 + 4) * BLOCK_BYTES} == {"send_recv": 2_621_440}


def test_all_gather_gathers_k_and_v_and_reduce_scatters_their_gradients():
    full = 4 * BLOCK_BYTES  # K of the whole sequence
    assert context_traffic("all_gather", 4, 2, 1024, 2, 64, element_bytes=2) == {
        "all_gather": 2 * 3 / 4 * full, "reduce_scatter": 2 * 3 / 4 * full}
    assert context_traffic("all_gather", 2, 1, 8, 1, 4, element_bytes=4, backward=False) == {
        "all_gather": 2 * 1 / 2 * (8 * 4 * 4)}


def test_one_context_rank_moves_nothing_and_a_step_multiplies_layers_and_micro_batches():
    assert context_traffic("ring", 1, 2, 1024, 2, 64) == {}
    assert context_traffic("all_gather", 1, 2, 1024, 2, 64) == {}
    step = context_step_traffic("ring", 2, 1, 16, 1, 8, layers=3, micro_batches=2)
    assert step == {"send_recv": 3 * 2 * 2 * (1 + 1 + 2) * (1 * 8 * 1 * 8 * 4)}


def test_an_unknown_exchange_is_named():
    with pytest.raises(ValueError, match="context_parallel_comm"):
        context_traffic("a2a", 2, 1, 16, 1, 8)
