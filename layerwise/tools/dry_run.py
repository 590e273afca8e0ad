"""Dry run: one rank's real setup and training steps at the full world size, in this process.

Issue 16 item 2: plan mode's second estimator (layerwise/tools/cross_check.py compares it with the plan).
The rank runs the same code as in `fit` (the strategy from the registry, the task, the data module,
a Lightning Trainer) against torch's fake process group
(`torch.testing._internal.distributed.fake_pg.FakeStore`, backend "fake"): every collective and
point-to-point call returns at once and leaves its buffers as they were, so receives deliver
uninitialised memory. Losses are therefore meaningless (NaN is fine); what is real is what the rank
*issues* and what it *holds*:

1. `collectives`: every call the rank's counted Communicator makes (parallel/comm.py), with kind,
   group family, group size, elements, element size and logical bytes, split by phase
   ("setup": materialising, synchronising replicas, first contacts; "warm-up": the first step;
   "step": the measured second step, DryRunProbe says why);
2. `raw_calls`: every c10d operator the rank issued, seen by a dispatch mode below the
   Communicator (an independent record: what the Communicator does not count shows up here,
   e.g. the pipeline's evidence `all_gather_object`);
3. `bytes_by_kind`: the step's logical bytes per kind, what a real run's `comm_bytes_per_step`
   holds for this rank (a real run's summary reports the maximum over ranks);
4. `peak_compute_bytes`: the step's compute-side peak from parallel/memory.py's meter, set up as
   layerwise/run/evidence.py sets it up (resident tensors of the strategy, then every storage an
   operator creates); `setup_peak_bytes` as the strategy measures it while materialising.

The Trainer is built with the arguments layerwise/run/fit.py's `build_trainer` uses, minus what a dry run
must not do: loggers, checkpoints (they would write the run directory), the non-finite guard (losses
are garbage by construction) and validation. Rendezvous variables are set for the call and restored
after; the fake process group is destroyed on the way out.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections import Counter, defaultdict
from dataclasses import asdict, dataclass

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from layerwise.run import data as data_lib
from layerwise.run.launch import RENDEZVOUS_VARIABLES
from layerwise.run.task import LanguageModelData, LanguageModelTask, objective_of
from parallel.comm import KINDS
from parallel.memory import ComputeMemoryMeter
from strategies import strategy_entry
from strategies.float8 import lightning_precision


MEASURED_STEP = 1  # the step measured (0-based): the first with gradients and optimizer state (DryRunProbe)


@dataclass(frozen=True)
class Collective:
    """One counted call of the Communicator, as this rank issued it."""

    phase: str  # "setup" | "warm-up" | "step" (the measured one)
    kind: str  # parallel.comm.KINDS
    group: str  # the group's family name (data, pipeline, tensor, a grid family, ...)
    group_size: int
    elements: int
    element_size: int
    bytes: float  # logical volume: elements × element size × ring factor (parallel/comm.py)


class RawCollectiveLog(TorchDispatchMode):
    """Every c10d operator issued inside the block (collectives, sends, receives, barriers), with
    the process group it ran on: an independent record below the Communicator."""

    def __init__(self, phase: dict, group_names: dict):
        super().__init__()
        self.phase = phase
        self.group_names = group_names  # ProcessGroup.group_name -> the layout's family name
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "c10d":
            self.calls.append((self.phase["name"], func.overloadpacket.__name__, self._group_of(args)))
        return func(*args, **(kwargs or {}))

    def _group_of(self, args) -> str:
        """The family of the process group among the operator's arguments (a boxed ScriptObject)."""
        for argument in args:
            if isinstance(argument, torch.ScriptObject):
                try:
                    group = dist.ProcessGroup.unbox(argument)
                except RuntimeError:  # a ReduceOp or a Work, not a group
                    continue
                if group is dist.group.WORLD:
                    return "world"
                return self.group_names.get(group.group_name, f"unnamed group of {group.size()}")
        return "none"


class DryRunProbe(pl.Callback):
    """Records the Communicator's calls by phase and measures the last step as RunEvidence does.

    The measured step is the second (`MEASURED_STEP`): on the first, gradients and the optimizer's
    state do not exist yet (Adam creates its moments in its first update), so its peak is not a
    training step's; from the second on they are resident, as in every step a real run measures."""

    def __init__(self, sampled: bool = True):
        self.sampled = sampled  # what measure_this_step tells the strategy (its evidence gathers)
        self.phase = {"name": "setup"}
        self.collectives = []
        self.step_seconds = None
        self.peak_compute_bytes = None
        self.matrix_product_dtypes = {}
        self.most_sends_held = None  # a pipeline rank's most sends held at once in the measured step
        self._meter = None
        self._started = None

    def setup(self, trainer, pl_module, stage):
        communicator = trainer.strategy.communicator()  # the layout exists: setup_environment ran
        if communicator is None:
            return
        count = communicator.count

        def recording_count(kind, group_name, elements, element_size, group_size):
            before = communicator.bytes_by_kind[kind]
            count(kind, group_name, elements, element_size, group_size)
            self.collectives.append(Collective(self.phase["name"], kind, group_name, group_size, int(elements),
                                               int(element_size), communicator.bytes_by_kind[kind] - before))
        communicator.count = recording_count  # this instance only; every counted call passes here

    def on_train_batch_start(self, trainer, module, batch, batch_index):
        if trainer.global_step < MEASURED_STEP:  # the warm-up step: counted apart, not measured
            self.phase["name"] = "warm-up"
            trainer.strategy.measure_this_step(False)
            return
        self.phase["name"] = "step"
        communicator = trainer.strategy.communicator()
        if communicator is not None:
            communicator.reset()
        trainer.strategy.measure_this_step(self.sampled)
        self._meter = ComputeMemoryMeter()
        self._meter.resident(trainer.strategy.compute_resident_tensors())
        self._meter.__enter__()
        self._started = time.perf_counter()

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_index):
        if self._meter is None:  # the warm-up step
            return
        self.step_seconds = time.perf_counter() - self._started
        self._meter.__exit__(None, None, None)
        self.peak_compute_bytes = float(self._meter.peak_bytes)
        self.matrix_product_dtypes = dict(self._meter.matrix_product_dtypes)
        state = getattr(getattr(trainer.strategy, "work", None), "state", None)  # a pipeline's StageWork
        self.most_sends_held = getattr(state, "most_held", None)
        self._meter = None
        self.phase["name"] = "after"


@contextlib.contextmanager
def fake_world(rank: int, world_size: int, ranks_per_node: int):
    """The fake process group as `rank` of `world_size`, with the rendezvous variables a launched
    rank would see (Lightning then starts no processes and reuses the initialised group)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore
    if dist.is_initialized():
        raise RuntimeError("a process group is already initialised in this process")
    saved = {name: os.environ.get(name) for name in RENDEZVOUS_VARIABLES}
    # Lightning's strategy stores the rank on its rank-zero-only guards (set_world_ranks): left at
    # the dry-run rank, every later rank_zero_* call in this process would stay silent.
    guards = _rank_zero_guards()
    ranks = [getattr(guard, "rank", None) for guard in guards]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29500", WORLD_SIZE=str(world_size),
                      RANK=str(rank), LOCAL_RANK=str(rank % ranks_per_node),
                      NODE_RANK=str(rank // ranks_per_node))
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        for guard, rank_before in zip(guards, ranks):
            if rank_before is None:
                vars(guard).pop("rank", None)
            else:
                guard.rank = rank_before
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def _rank_zero_guards() -> list:
    """The distinct rank_zero_only functions Lightning sets a rank on (fabric's, lightning_utilities')."""
    from lightning.fabric.utilities import rank_zero as fabric_rank_zero
    from lightning_utilities.core import rank_zero as utilities_rank_zero
    guards = []
    for guard in (fabric_rank_zero.rank_zero_only, utilities_rank_zero.rank_zero_only):
        if all(guard is not known for known in guards):
            guards.append(guard)
    return guards


def node_split(cfg, world_size: int) -> tuple:
    """(nodes, ranks per node) for Lightning: the hardware's node size when it divides the world."""
    per_node = cfg.hardware.devices_per_node
    if world_size % per_node == 0:
        return world_size // per_node, per_node
    return 1, world_size


def dry_trainer(cfg, strategy, probe, nodes: int, per_node: int) -> pl.Trainer:
    """layerwise/run/fit.py build_trainer's arguments, without loggers, checkpoints, guard, validation."""
    return pl.Trainer(
        accelerator="cpu", devices=per_node, num_nodes=nodes, strategy=strategy,
        # fp8-mixed: Lightning's bf16-mixed; the dry run keeps the blocks' linears unconverted (bf16's memory)
        precision=lightning_precision(cfg.hardware.precision), max_steps=MEASURED_STEP + 1, limit_val_batches=0, num_sanity_val_steps=0,
        check_val_every_n_epoch=None, val_check_interval=None, logger=False, callbacks=[probe],
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        use_distributed_sampler=False, gradient_clip_val=cfg.trainer.gradient_clip_val or None,
        default_root_dir=None, accumulate_grad_batches=1)


def dry_run(cfg, rank: int, world_size: int, fake_tensors: bool = False) -> dict:
    """Set up `rank` of `world_size` for cfg's strategy and run two training steps under the fake
    process group; return what it issued and held in the second (module docstring).

    fake_tensors: materialise and step under FakeTensorMode (shapes, dtypes and storages' sizes,
    no data): for models that do not fit this machine. The batch stays real (it is small: token
    ids), the corpus is synthetic when the model is `planning_only` (its vocabulary is
    data.vocab_size, not the bytes of the default corpus)."""
    torch.set_flush_denormal(True)  # garbage receive buffers: denormals would make matmuls crawl
    nodes, per_node = node_split(cfg, world_size)
    started = time.perf_counter()
    with fake_world(rank, world_size, per_node):
        result = one_rank_step(cfg, world_size, emulate_object_broadcast=True, fake_tensors=fake_tensors,
                               emulate_nccl_completion=cfg.hardware.process_group_backend == "nccl")
    result["seconds"] = time.perf_counter() - started
    return result


def one_rank_step(cfg, world_size: int, emulate_object_broadcast: bool = False,
                  fake_tensors: bool = False, emulate_nccl_completion: bool = False) -> dict:
    """This process's rank (from the rendezvous variables): build, set up and run two steps,
    recording as the module docstring says. Under the fake group (dry_run) or a real one (a rank
    started by layerwise.run.launch.run_ranks: the per-rank reference a dry run is checked against).
    emulate_nccl_completion: the pipeline's sends report completion where NCCL's would
    (`_completing_as_nccl`), not only in `wait()` as the fake group's do."""
    nodes, per_node = node_split(cfg, world_size)
    entry = strategy_entry(cfg.strategy.name)
    pl.seed_everything(cfg.seed, workers=False, verbose=False)
    corpus = synthetic_corpus(cfg) if cfg.model.get("planning_only") else data_lib.configured_corpus(cfg)
    vocabulary = data_lib.model_vocab_size(corpus, objective_of(cfg.model))
    task = LanguageModelTask(cfg, vocabulary)
    strategy = entry.build(cfg, world_size)
    # Under fake tensors the pipeline's evidence (all_gather_object of executed records) would read
    # pickled sizes from fake tensors: an unsampled step skips it, as real runs do between samples.
    probe = DryRunProbe(sampled=not fake_tensors)
    trainer = dry_trainer(cfg, strategy, probe, nodes, per_node)
    raw = RawCollectiveLog(probe.phase, {})
    emulated = Counter()
    if emulate_object_broadcast:
        strategy.broadcast = _local_object_broadcast(strategy, emulated)
    if emulate_nccl_completion and hasattr(strategy, "_execute"):  # the pipelines' executor
        _completing_as_nccl(strategy, emulated)
    if fake_tensors:
        _under_fake_tensors(strategy, emulated)
        # Lightning moves the module to the root device after setup and to the CPU at teardown:
        # FakeTensor parameters cannot be swapped by nn.Module._apply (the mode holds weak
        # references to them), and they already live on the root device.
        task.to = lambda *args, **kwargs: task
        task.cpu = lambda: task
    with _naming_groups(strategy, raw), raw:
        trainer.fit(task, datamodule=LanguageModelData(cfg, corpus))
    layout = strategy.layout
    return {
        "rank": trainer.global_rank, "world_size": world_size, "strategy": cfg.strategy.name,
        "layout": layout.degrees.as_dict() if layout is not None else None,
        # the axes the layout lists (context and the expert split only where they split something)
        "coordinates": ({axis: index for axis, index in layout.coordinates.items() if axis in layout.degrees.as_dict()}
                        if layout is not None else None),
        "vocabulary": vocabulary,
        "collectives": [asdict(c) for c in probe.collectives],
        "bytes_by_kind": by_kind(probe.collectives, "step"),
        "setup_bytes_by_kind": by_kind(probe.collectives, "setup"),
        "bytes_by_group": by_group(probe.collectives, "step"),
        "calls_by_kind": dict(Counter(c.kind for c in probe.collectives if c.phase == "step")),
        "raw_calls": raw_summary(raw.calls),
        "emulated": dict(emulated),
        "peak_compute_bytes": probe.peak_compute_bytes,
        "setup_peak_bytes": strategy.setup_peak_bytes,
        "matrix_product_dtypes": probe.matrix_product_dtypes,
        "most_sends_held": probe.most_sends_held,
        "steps": trainer.global_step,
        "step_seconds": probe.step_seconds,
    }


def synthetic_corpus(cfg) -> data_lib.Corpus:
    """Random token ids over data.vocab_size: a planning-only model has no corpus to train on."""
    generator = torch.Generator().manual_seed(cfg.seed)
    size = 4 * (cfg.data.sequence_length + 1)
    # host: a corpus lives on the host, as layerwise.run.data's do; batches are moved per step
    train, validation = (torch.randint(0, cfg.data.vocab_size, (size,), generator=generator, device="cpu")
                         for _ in range(2))
    return data_lib.Corpus(train, validation, cfg.data.vocab_size, "synthetic")


class UpperBoundNonzero(TorchDispatchMode):
    """aten.nonzero's output size depends on values, which fake tensors do not have (the
    vocabulary-parallel loss's backward takes the rows whose target is on this rank). Answer with
    the upper bound, every element: its int64 index tensor is counted at most (rows × dims × 8 bytes
    more than a real run holds, a few KiB), and the step goes on."""

    def __init__(self, emulated: Counter):
        super().__init__()
        self.emulated = emulated

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.nonzero.default:
            self.emulated["aten.nonzero (upper bound: every element)"] += 1
            source = args[0]
            return torch.empty((source.numel(), source.dim()), dtype=torch.long, device=source.device)
        return func(*args, **(kwargs or {}))


def _under_fake_tensors(strategy, emulated: Counter) -> None:
    """Run the strategy's materialisation and its optimizer step (closure: training_step, backward;
    then reductions and the update) under one FakeTensorMode, and the optimizers' set-up (the
    distributed optimizer's flat buffers, strategies/distributed_optimizer.py). Data loading stays
    outside it (it reads values: offsets.tolist()); real batches enter the mode as constants."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    for name in ("shard_lightning_module", "setup_optimizers", "optimizer_step"):
        method = getattr(strategy, name)

        def under_mode(*args, _method=method, **kwargs):
            with mode, _fake_to_empty(), UpperBoundNonzero(emulated):
                return _method(*args, **kwargs)
        setattr(strategy, name, under_mode)


@contextlib.contextmanager
def _fake_to_empty():
    """models/transformer.py builds each part on meta, then `to_empty(device)`. Under FakeTensorMode
    the meta parameters are FakeTensors, which nn.Module._apply must swap in place, and the mode's
    own weak references forbid the swap. While the mode is on, replace the parameters instead (what
    to_empty means: new storage, no values; `initialize` then fills them as in a real run)."""
    original = torch.nn.Module.to_empty

    def to_empty(self, *, device, recurse=True):
        for module in self.modules() if recurse else [self]:
            for key, parameter in list(module._parameters.items()):
                if parameter is not None:
                    module._parameters[key] = torch.nn.Parameter(torch.empty_like(parameter, device=device),
                                                                 requires_grad=parameter.requires_grad)
            for key, buffer in list(module._buffers.items()):
                if buffer is not None:
                    module._buffers[key] = torch.empty_like(buffer, device=device)
        return self
    torch.nn.Module.to_empty = to_empty
    try:
        yield
    finally:
        torch.nn.Module.to_empty = original


class CompletesWhenReceived:
    """A fake group's send work that reports completion where NCCL's would: from the slot of the
    sender's row at which the plan's peer has issued the matching receive (schedule
    `send_completions`; docs/strategies/pipeline_memory.md). The fake group's own work never
    completes before `wait()`; everything else is delegated to it."""

    def __init__(self, work, completes_at, progress: dict):
        self.work, self.completes_at, self.progress = work, completes_at, progress

    def is_completed(self) -> bool:
        return self.completes_at is not None and self.progress["slot"] >= self.completes_at

    def __getattr__(self, name):
        return getattr(self.work, name)


def _completing_as_nccl(strategy, emulated: Counter) -> None:
    """Issue 28 item 1: "emulate completion in the dry run ... model when the matching receive is
    posted, which the plan knows". For each executed plan, the handlers record which slot of the
    row runs, and each pipeline send's work is a `CompletesWhenReceived` — the executor itself is
    unchanged (StageWork.release_sends asks `is_completed()` as it does on NCCL)."""
    from strategies.schedule import FINISH, send_completions
    execute_plan = strategy._execute

    def _execute(plan, batch, training):
        rank = strategy.layout.index("pipeline")
        slots = {action: slot for slot, action in enumerate(plan.ranks[rank]) if action is not None}
        completions, progress = send_completions(plan)[rank], {"slot": -1, "action": None}
        handlers, communicator = strategy.handlers, strategy.layout.communicator
        send = communicator.send

        def tracked(handler):
            def run(action):
                progress["slot"], progress["action"] = slots[action], action
                return handler(action)
            return run

        def completing_send(tensor, destination, group, tag=0):
            emulated["pipeline send completes when received (NCCL)"] += 1
            return CompletesWhenReceived(send(tensor, destination, group, tag=tag),
                                         completions.get(progress["action"]), progress)
        strategy.handlers = lambda: {kind: handler if kind == FINISH else tracked(handler)
                                     for kind, handler in handlers().items()}
        communicator.send = completing_send
        try:
            return execute_plan(plan, batch, training)
        finally:
            del strategy.handlers, communicator.send
    strategy._execute = _execute


def _local_object_broadcast(strategy, emulated: Counter):
    """Lightning's `strategy.broadcast(obj, src)` pickles through broadcast_object_list, whose size
    message a fake group never delivers: a rank other than `src` would allocate a garbage size.
    Lightning broadcasts only values every rank computes alike (log_dir, checkpoint paths), so the
    dry run keeps the local object and counts the call."""
    def broadcast(obj, src: int = 0):
        emulated["lightning strategy.broadcast (object)"] += 1
        return obj
    return broadcast


@contextlib.contextmanager
def _naming_groups(strategy, raw: RawCollectiveLog):
    """Once the layout exists, name its process groups in the raw log (by the family they serve)."""
    original = strategy.setup_environment

    def setup_environment():
        original()
        if strategy.layout is not None:
            for name, group in strategy.layout.groups.items():
                if group is not None and group.process_group not in (None, dist.group.WORLD):
                    raw.group_names[group.process_group.group_name] = name
    strategy.setup_environment = setup_environment
    try:
        yield
    finally:
        del strategy.setup_environment


def by_kind(collectives, phase: str) -> dict:
    totals = {kind: 0.0 for kind in KINDS}
    for c in collectives:
        if c.phase == phase:
            totals[c.kind] += c.bytes
    return totals


def by_group(collectives, phase: str) -> dict:
    totals = defaultdict(float)
    for c in collectives:
        if c.phase == phase:
            totals[c.group] += c.bytes
    return dict(totals)


def raw_summary(calls) -> dict:
    """{phase: {"op on group": count}} of the c10d operators issued."""
    summary = defaultdict(Counter)
    for phase, op, group in calls:
        summary[phase][f"{op} on {group}"] += 1
    return {phase: dict(counts) for phase, counts in summary.items()}
