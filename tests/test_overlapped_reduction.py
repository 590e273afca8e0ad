"""Overlapped bucketed reduction (`strategy.overlap_reduction`, issue 56): gradients accumulate in
place in flat buckets (no whole-stage copy) and each bucket's all-reduce is posted from the stage's
last backward as soon as the bucket is final, not at REDUCE_GRADIENT.

1. On four gloo ranks (2 data replicas × 2 pipeline stages) one step of StageWork runs with the
   overlap on and off, watched by the flight record (parallel/flight.py), which names the plan
   action every operation was issued under: on, every data-parallel all-reduce is issued inside
   the stage's last B (1F1B) or W (ZB-H1), while that backward still runs; off, every one at
   REDUCE_GRADIENT. The gradients are bit-identical, the bytes and the number of all-reduces equal,
   and REDUCE_GRADIENT allocates nothing (the meter, parallel/memory.py): no flat copy.
2. A whole run with the overlap on and off under AdamW: losses and weights bit-identical (equality
   with `single` under SGD and AdamW: test_modular_pipeline's dp2 cases, which run it by default).
3. Memory: the meter's peak (the dry run of layerwise/tools/dry_run.py) within 5% of plan mode's
   on 2 replicas × 2 stages, and below what the flat copy cost; the optimizer's temporaries, which
   plan mode now prices at their own moment (cost/memory.py), measured.
"""

import pytest
import torch
import torch.distributed as dist

from layerwise.preflight import validate
from layerwise.run.fit import train
from models import build_model
from parallel.dims import Layout
from parallel.flight import FlightRecorder
from parallel.layout import ParallelLayout
from parallel.memory import ComputeMemoryMeter
from strategies.buckets import GradientBuckets, bucket_bytes
from strategies.schedule import (BACKWARD, BACKWARD_WEIGHT, REDUCE_GRADIENT, add_communication, add_gradient_reductions,
                                 build_plan, execute, validate_plan)
from strategies.stages import Peers, StageWork, keep_local_stages
from tests.ranks import QUICK, compose_config, run_on_ranks
from tests.references import consolidated_parameters
from tests.tolerances import assert_same_losses

SCHEDULES = ("one_f_one_b", "zero_bubble_h1")
MICRO_BATCHES = 4
BUCKET_MB = 0.004  # ~4 KiB: a stage of this model (hidden 16) cuts into several buckets


def plan_of(schedule: str):
    return validate_plan(add_gradient_reductions(add_communication(
        build_plan(schedule, pipeline_degree=2, stages=2, micro_batches=MICRO_BATCHES))))


def one_step(layout, plan, overlap: bool) -> dict:
    """One training step of this rank's stage; what the flight record and the meter saw."""
    pipeline, data = layout.group("pipeline"), layout.group("data")
    position = layout.index("pipeline")
    model = build_model("gpt", vocab_size=64, sequence_length=16, layers=plan.stages, hidden=16, heads=2, seed=0)
    keep_local_stages(model, list(plan.stages_on(position)), plan.stages, 1)
    peers = Peers([pipeline.ranks[r] for r in plan.placement], pipeline, data, layout.communicator)
    work = StageWork(model, plan.stages, 1, plan.micro_batches, peers, bucket_bytes=bucket_bytes(BUCKET_MB),
                     overlap_reduction=overlap)
    recorder = FlightRecorder(size=10_000)
    layout.communicator.recorder = recorder
    layout.communicator.reset()
    handlers, grown = work.handlers(), []

    def metered_reduction(action):  # what REDUCE_GRADIENT allocates (the flat copy it used to make)
        meter = ComputeMemoryMeter()
        meter.resident([p.grad for p in model.parameters() if p.grad is not None])
        before = meter.live_bytes
        with meter:
            work.reduce_gradient(action)
        grown.append(meter.peak_bytes - before)
    handlers[REDUCE_GRADIENT] = metered_reduction
    generator = torch.Generator().manual_seed(layout.index("data"))  # each replica its own tokens
    work.start({key: torch.randint(0, 64, (8, 16), generator=generator) for key in ("tokens", "targets")}, True)
    execute(plan.ranks[position], handlers, on_action=recorder.note_action)
    work.wait_for_reductions()
    layout.communicator.recorder = None
    buckets = [bucket for stage in work.gradients.layouts.values() for bucket in stage]
    return {"issued": [str(operation.action) for operation in recorder.operations
                       if operation.group == data.name and operation.kind == "all_reduce"],
            "gradients": {name: parameter.grad.clone() for name, parameter in model.named_parameters()},
            "views": all(parameter.grad.untyped_storage().data_ptr() == bucket.flat.untyped_storage().data_ptr()
                         for bucket in buckets for parameter in bucket.parameters),
            "buckets": len(buckets), "bytes": layout.communicator.snapshot(), "reduction_growth": grown,
            "last_backward": [str(action) for action in last_accumulation(plan.ranks[position])],
            "reductions": [str(action) for action in plan.ranks[position]
                           if action is not None and action.kind == REDUCE_GRADIENT]}


def last_accumulation(row) -> list:
    """The plan's last B or W of each stage of this row: its last accumulation into the gradients."""
    last = {}
    for action in row:
        if action is not None and action.kind in (BACKWARD, BACKWARD_WEIGHT):
            last[action.stage] = action
    return list(last.values())


def steps_on_rank(rank: int):
    """Both schedules with the overlap on and off; plain values back (tensors compared here: a
    returned tensor's shared memory would outlive the forked rank)."""
    dist.init_process_group("gloo")
    layout = ParallelLayout(Layout(data=2, pipeline=2), rank=rank)
    results = {}
    for schedule in SCHEDULES:
        on, off = (one_step(layout, plan_of(schedule), overlap) for overlap in (True, False))
        gradients = on.pop("gradients"), off.pop("gradients")
        same = gradients[0].keys() == gradients[1].keys() and all(
            torch.equal(gradients[0][name], gradients[1][name]) for name in gradients[0])
        results[schedule] = {True: on, False: off, "bit_identical": same}
    return results


def assert_posted_from_the_last_backward(result: dict) -> None:
    """Every data-parallel all-reduce issued under the stage's last B/W (while it runs), none later."""
    assert result["issued"] and set(result["issued"]) <= set(result["last_backward"]), \
        f"all-reduces issued under {sorted(set(result['issued']))}, not {result['last_backward']}"


@pytest.fixture(scope="module")
def ranks():
    return run_on_ranks(steps_on_rank, 4)


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_buckets_are_posted_inside_the_last_backward_and_reduce_the_same_numbers(ranks, schedule):
    for rank, results in enumerate(ranks):
        on, off = results[schedule][True], results[schedule][False]
        assert_posted_from_the_last_backward(on)
        assert set(off["issued"]) == set(off["reductions"])  # off: at the plan's REDUCE_GRADIENT
        with pytest.raises(AssertionError, match="all-reduces issued under"):
            assert_posted_from_the_last_backward(off)  # the check tells the two apart
        assert len(on["issued"]) == len(off["issued"]) == on["buckets"] > 2  # one all-reduce per bucket
        assert on["bytes"] == off["bytes"] and on["bytes"]["all_reduce"] > 0
        assert results[schedule]["bit_identical"]
        assert on["views"] and off["views"]  # each .grad a view of its bucket: accumulated in place
        assert on["reduction_growth"] == off["reduction_growth"] == [0]  # REDUCE_GRADIENT copies nothing
        print(f"{schedule} rank {rank}: {on['buckets']} buckets, posted under {sorted(set(on['issued']))}"
              f" (off: {sorted(set(off['issued']))}), {on['bytes']['all_reduce']:.0f} bytes each way")


def test_a_whole_run_with_and_without_overlap_is_bit_identical(tmp_path):
    """AdamW, 2 replicas × 2 stages (looped, 2 stages per rank): the same losses and weights."""
    runs = {}
    for overlap in ("true", "false"):
        cfg = compose_config(*QUICK, "trainer.max_steps=2", "trainer.val_check_interval=2", "model.layers=4",
                             "strategy=modular_pipeline", "strategy.pipeline_degree=2", "hardware.devices_per_node=4",
                             "strategy.bucket_mb=0.01", f"strategy.overlap_reduction={overlap}")
        summary = train(cfg, tmp_path / overlap, validate(cfg))
        assert summary["status"] == "completed" and summary["world_size"] == 4
        runs[overlap] = summary, consolidated_parameters(tmp_path / overlap, "modular_pipeline")
    (on, on_weights), (off, off_weights) = runs["true"], runs["false"]
    assert on["losses"] == off["losses"]
    assert all(torch.equal(on_weights[name], off_weights[name]) for name in off_weights)


def test_the_meter_agrees_with_the_plan_on_two_replicas_of_two_stages_without_the_flat_copy():
    """Short sequences: the gradients outweigh the stash, so the reduction's flat copy of a stage
    was each rank's peak (meter 34.21 / 32.98 MB before, the plan 34.21 / 32.98). Now the peak is
    the first backward or the optimizer's step, 10% lower, and the plan follows it."""
    from layerwise.planning.inputs import training_plan_of, workload_of
    from layerwise.planning.result import plan_result
    from layerwise.tools.cross_check import cross_check
    from cost.memory import memory, stage_parameters
    from cost.inputs import BYTES
    cfg = compose_config(*QUICK, "hardware.devices_per_node=4", "mode=plan", "strategy=one_f_one_b", "model.layers=4",
                         "model.hidden=256", "data.sequence_length=16", "data.global_batch_size=8",
                         "strategy.micro_batches=2")
    workload, plan = workload_of(cfg, 4), training_plan_of(cfg)
    for entry in cross_check(cfg, 4, plan_result(cfg, 4)):
        rank = entry["pipeline_rank"]
        assert abs(entry["ratio"] - 1) <= 0.05, entry
        assert memory(workload, plan, rank, moment=True) != "reduction"
        resident = sum(memory(workload, plan, rank).values()) - memory(workload, plan, rank)["activations"] \
            - memory(workload, plan, rank)["buffers"]  # parameters, gradients, optimizer state
        stage = stage_parameters(workload, rank, plan.stages) * BYTES
        assert entry["dry_run_peak_compute_bytes"] < resident + stage  # the old reduction moment's size
        print(f"rank {rank}: meter {entry['dry_run_peak_compute_bytes']:.0f} B, plan "
              f"{entry['analytic_peak_compute_bytes']:.0f} B ({memory(workload, plan, rank, moment=True)}), "
              f"flat copy's moment was {resident + stage:.0f} B")


@pytest.mark.parametrize("name", ["adamw", "sgd", "lamb"])
def test_the_optimizer_temporaries_are_what_the_plan_prices(name):
    """cost/memory.py OPTIMIZER_TEMPORARIES: the meter's growth over the resident state while each
    optimizer steps three equal tensors (AdamW's loop variable keeps the previous denominator)."""
    from cost.memory import OPTIMIZER_TEMPORARIES
    from layerwise.run.optim import Lamb
    parameters = [torch.nn.Parameter(torch.randn(300, 300)) for _ in range(3)]
    optimizer = {"adamw": lambda: torch.optim.AdamW(parameters, lr=1e-3, foreach=False),
                 "sgd": lambda: torch.optim.SGD(parameters, lr=1e-3, momentum=0.9),
                 "lamb": lambda: Lamb(parameters, lr=1e-3)}[name]()
    for parameter in parameters:
        parameter.grad = torch.randn_like(parameter)
    optimizer.step()  # the state exists from the first step on
    meter = ComputeMemoryMeter()
    meter.resident(parameters + [p.grad for p in parameters] +
                   [value for state in optimizer.state.values() for value in state.values() if torch.is_tensor(value)])
    before = meter.live_bytes
    with meter:
        optimizer.step()
    assert (meter.peak_bytes - before) / (300 * 300 * 4) == OPTIMIZER_TEMPORARIES[name]


@pytest.mark.parametrize("strategy", ["modular_pipeline", "gpipe", "one_f_one_b", "interleaved_1f1b", "pipefisher"])
def test_the_switch_reaches_every_pipeline_strategys_stage_work(strategy):
    """strategy.overlap_reduction (default true) from the config to StageWork's keyword arguments."""
    from strategies.registry import strategy_entry
    for value in (True, False):
        cfg = compose_config(*QUICK, f"strategy={strategy}", "model.layers=4", "hardware.devices_per_node=2",
                             f"strategy.overlap_reduction={str(value).lower()}")
        built = strategy_entry(strategy).build(cfg, 2)
        assert built.stage_precision()["overlap_reduction"] is value
        assert built.stage_precision()["gradient_buckets"] is True  # no distributed optimizer
    assert compose_config(*QUICK, f"strategy={strategy}").strategy.overlap_reduction is True


def test_a_tied_weight_is_reduced_once_after_its_last_accumulation(tmp_path):
    """model.tie_embeddings on one pipeline rank × 2 replicas: the head's weight is the embedding's,
    in the last stage and in stage 0. It belongs to stage 0's bucket only (StageWork._lay_out): were
    it in both, the head stage's bucket would be all-reduced before stage 0 accumulated the rest, and
    step 1's head part summed twice (the loss at step 2 was 5.2985 against single's 5.2704, with the
    old flat copy too)."""
    adamw = ["model.tie_embeddings=true", "optimizer=adamw", "optimizer.warmup_steps=0", "optimizer.lr=0.01",
             "optimizer.lr_schedule=constant", "model.layers=4", "data.global_batch_size=16",
             "trainer.limit_val_batches=0", "trainer.max_steps=2", "trainer.val_check_interval=2"]
    single = train_quick(tmp_path / "single", "strategy=single", *adamw)
    pipeline = train_quick(tmp_path / "pipeline", "strategy=modular_pipeline", "strategy.pipeline_degree=1",
                           "hardware.devices_per_node=2", *adamw)
    assert_same_losses(pipeline["losses"], single["losses"])


def train_quick(directory, *overrides):
    cfg = compose_config(*QUICK, *overrides)
    summary = train(cfg, directory, validate(cfg))
    assert summary["status"] == "completed", summary.get("error")
    return summary


def test_a_2d_grid_with_replicas_sums_its_replicated_gradients_before_the_data_reduction(tmp_path, tmp_path_factory):
    """A 2-D grid (q = 2) replicates norms, biases and tables over its columns: their buckets are
    late (apart from the others, posted at REDUCE_GRADIENT after the tensor-group sum), the rest
    posted from the backward; × 2 data replicas on one pipeline rank, equal to single under SGD."""
    from tests.references import SgdComparison, SgdRun, sgd_reference
    expected = sgd_reference(tmp_path_factory)
    actual = SgdRun(tmp_path, "strategy=modular_pipeline", "strategy.pipeline_degree=1", "strategy.tensor_parallel=2d",
                    "strategy.tensor_grid=2", "hardware.devices_per_node=8", "strategy.micro_batches=2")
    assert actual.summary["layout"]["data"] == 2 and actual.summary["world_size"] == 8
    SgdComparison(actual, expected).check()


class RecordingCommunicator:
    """Stands in for the counted communicator: records each all-reduce's size, completes at once."""

    def __init__(self):
        self.sizes = []

    def all_reduce(self, tensor, group, async_op=False):
        self.sizes.append(tensor.numel())
        return None


def test_buckets_are_posted_in_layout_order_whatever_order_their_gradients_finish_in():
    """A split backward's W reports its weights in an order taken from sets of autograd nodes, which
    differs between processes: two replicas finishing the same buckets in two orders must still
    issue the same sequence of all-reduces (the layout's), or gloo aborts ("Received data size
    doesn't match expected size", seen on ZB-H1 × 2 replicas) and NCCL would mix buckets."""
    sequences = []
    for order in ([0, 1, 2, 3, 4, 5], [5, 3, 1, 4, 0, 2]):
        parameters = [torch.nn.Parameter(torch.zeros(size)) for size in (3, 5, 7, 11, 13, 17)]
        communicator = RecordingCommunicator()
        buckets = GradientBuckets(capacity_bytes=4 * 12, communicator=communicator, group=None, overlap=True)
        buckets.lay_out(0, parameters, late=set())
        buckets.start()
        with buckets.accumulating(0, micro_batches=1):
            for index in order:
                for bucket in buckets.layouts[0]:
                    GradientBuckets.attach(bucket)
                buckets.accumulated(parameters[index])
        buckets.post_rest(0)
        sequences.append(communicator.sizes)
    assert len(buckets.layouts[0]) > 2 and sequences[0] == sequences[1], sequences
