"""Every tensor the framework creates names its device, or says why it lives on the host (docs/architecture.md, "Point-to-point order" and the README's GPU notes).

On a GPU a factory call without `device=` makes a CPU tensor, and NCCL rejects a CPU tensor in a
collective: the first step would fail. The scan reads the syntax tree (not text), so a call split
over several lines or written `torch . zeros` is still found; a `# host` comment on any line of
the call, or on the line just above it, marks a buffer that belongs on the host (the L2L store, data loading, offline tools).
"""

import ast

import pytest
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCANNED = ("strategies", "parallel", "cost", "layerwise")
FACTORIES = {"empty", "zeros", "ones", "full", "tensor", "arange", "rand", "randn", "randint",
             "randperm", "eye", "linspace"}


def unmarked_factory_calls(source: str, path: str) -> list:
    """`path:line torch.<factory>(...)` for each factory call with no device= and no # host mark."""
    lines = source.splitlines()
    found = []
    for node in ast.walk(ast.parse(source)):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and isinstance(node.func.value, ast.Name) and node.func.value.id == "torch"
                and node.func.attr in FACTORIES):
            continue
        if any(keyword.arg == "device" for keyword in node.keywords):
            continue
        span = lines[max(0, node.lineno - 2):node.end_lineno]  # the call, and the line above it
        if not any("# host" in line for line in span):
            found.append(f"{path}:{node.lineno} torch.{node.func.attr}(...)")
    return found


def test_every_factory_call_names_a_device_or_is_marked_host():
    offenders = []
    for package in SCANNED:
        for path in sorted((ROOT / package).rglob("*.py")):
            offenders += unmarked_factory_calls(path.read_text(), str(path.relative_to(ROOT)))
    assert not offenders, "tensor factories without device= or a '# host' reason:\n" + "\n".join(offenders)


def test_the_scan_finds_what_it_must():
    source = ("import torch\n"
              "a = torch.zeros(3)\n"
              "b = torch.empty(\n    4,\n)\n"
              "c = torch.ones(2, device=d)\n"
              "e = torch.tensor([1])  # host: a loader's batch\n"
              "f = torch.zeros_like(a)\n")
    assert unmarked_factory_calls(source, "x.py") == ["x.py:2 torch.zeros(...)", "x.py:3 torch.empty(...)"]


# ----- the root device each strategy hands Lightning under accelerator=gpu (issue 37, item 1)

def built_for_gpu(name: str):
    """`name`'s strategy as a GPU run builds it, with what Lightning's accelerator connector adds
    (_lazy_init_strategy): a parallel strategy's devices are CUDAAccelerator.get_parallel_devices."""
    from lightning.pytorch.accelerators import CUDAAccelerator
    from lightning.pytorch.strategies import ParallelStrategy

    from layerwise.config.validate import world_size
    from strategies.registry import strategy_entry
    from tests.ranks import compose_config

    extra = ["strategy.refresh_interval=2"] if name in ("kfac", "pipefisher") else []
    cfg = compose_config(f"strategy={name}", "hardware=dgx_h100", *extra)
    world = world_size(cfg)
    entry = strategy_entry(name)
    strategy = entry.build(cfg, 1 if entry.one_process else world)
    if isinstance(strategy, ParallelStrategy):
        strategy.parallel_devices = CUDAAccelerator.get_parallel_devices(list(range(8)))
    return strategy


def test_every_strategy_gives_lightning_a_cuda_device_with_an_index():
    """Lightning's CUDA accelerator calls torch.cuda.set_device(root_device), which refuses a
    device without an index (`torch.device("cuda")`): such a strategy cannot start on a GPU."""
    import torch.cuda._utils

    from strategies.registry import REGISTRY

    refused = {}
    for name in REGISTRY:
        root = built_for_gpu(name).root_device
        try:
            assert root.type == "cuda", f"{root} is not a CUDA device"
            torch.cuda._utils._get_device_index(root)
        except (ValueError, AssertionError) as error:
            refused[name] = f"{root}: {error}"
    assert not refused, refused


# ----- a resume puts K-FAC's state back on the model's device (issue 37, item 3)

def kfac_state_on(device: str, seed: int = 0) -> "KFAC":
    """A K-FAC over one linear on `device` with factors, fresh and active inverses and a capture."""
    import torch
    from torch import nn

    from strategies.kfac import KFAC

    torch.manual_seed(seed)
    linear = nn.Linear(4, 4, device=device)
    kfac = KFAC({"blocks.0.mlp.fc_in": linear}, damping=1e-3)
    if device != "meta":
        kfac.capturing = True
        with torch.enable_grad():
            linear(torch.randn(2, 4, device=device)).sum().backward()
        kfac.accumulate("A", ["blocks.0.mlp.fc_in"], 0, 1.0)
        kfac.invert("A", ["blocks.0.mlp.fc_in"])
        kfac.promote()
        kfac.invert("A", ["blocks.0.mlp.fc_in"])
    return kfac


def tensors_in(state) -> list:
    import torch
    if isinstance(state, torch.Tensor):
        return [state]
    if isinstance(state, dict):
        return [tensor for value in state.values() for tensor in tensors_in(value)]
    return []


def test_kfac_state_loaded_from_a_cpu_checkpoint_lands_on_the_models_device():
    """Checkpoints load with map_location="cpu" (strategies/checkpoint/safe_load.py); on a GPU the
    next step would multiply CUDA gradients by CPU inverses. `meta` stands for the GPU here."""
    saved = kfac_state_on("cpu").state_dict()
    assert {"fresh", "inverses", "captured"} <= {key for key, value in saved.items() if value}
    restored = kfac_state_on("meta")
    restored.load_state_dict(saved)
    devices = {str(tensor.device) for tensor in tensors_in(restored.state_dict())}
    assert devices == {"meta"}, f"K-FAC state on {devices} after a resume onto meta"


# ----- device synchronisations per step, per strategy (issue 37, item 11)

SYNC_RUN = ["logger=none", "trainer.progress=none", "trainer.limit_val_batches=1", "trainer.val_check_interval=100",
            "data.global_batch_size=8", "data.sequence_length=32", "model.layers=2", "model.hidden=32",
            "model.heads=2", "data.max_bytes=2000000", "trainer.max_steps=3"]
# strategy -> (its overrides, syncs per step allowed on its busiest rank). One per step is the
# loss: the non-finite guard reads it before the optimizer, so a bad step is never applied.
SYNC_BUDGET = {
    "single": ([], 1),
    "ddp": ([], 1),
    "modular_pipeline": ([], 1),
    "zero_layered": ([], 1),
    "fsdp2": ([], 1),
    "tp_1d": (["strategy.tensor_grid=2"], 1),
    "l2l": ([], 1),
    "kfac": (["strategy.refresh_interval=2", "optimizer=lamb"], 1),
    "pipefisher": (["strategy.refresh_interval=2", "optimizer=lamb", "strategy.micro_batches=4", "model.layers=4"], 1),
}


def _count_syncs(name: str, directory) -> None:
    """In a forked child: the counter installed, a 3-step run of `name`, every rank's counts in
    syncs.jsonl. A child, so that nothing the counter's run leaves in the process (it ran one-process
    strategies in it) reaches the tests that follow: a bf16 `single` after it once lost 0.12 nats."""
    import json

    from layerwise.config.validate import world_size
    from layerwise.run.fit import train
    from tests.fake_gpu import DeviceSyncCounter
    from tests.ranks import compose_config

    def sink(rank, step, counts):
        with open(directory / "syncs.jsonl", "a") as file:
            file.write(json.dumps({"rank": rank, "step": step, **counts}) + "\n")

    patches = pytest.MonkeyPatch()
    DeviceSyncCounter().install(patches.setattr, sink)
    cfg = compose_config(*SYNC_RUN, f"strategy={name}", *SYNC_BUDGET[name][0])
    train(cfg, directory, world_size(cfg))


def _child(name: str, directory) -> None:
    import os

    import torch
    # One thread: GNU OpenMP cannot start a parallel region in a child forked after the parent ran
    # one (this file alone hung here, its earlier tests having run multi-threaded products).
    torch.set_num_threads(1)
    code = 1
    try:
        _count_syncs(name, directory)
        code = 0
    finally:
        os._exit(code)  # no atexit handlers of the parent's pytest run in the child


def syncs_per_step(name: str, directory) -> dict:
    """{kind: the most any rank did in one step after the first} over a 3-step run of `name`."""
    import json
    import multiprocessing

    from tests.fake_gpu import DeviceSyncCounter

    child = multiprocessing.get_context("fork").Process(target=_child, args=(name, directory))
    child.start()
    child.join(timeout=600)
    if child.exitcode is None:
        child.kill()
    assert child.exitcode == 0, f"the counted run of {name} failed (exit {child.exitcode})"
    records = [json.loads(line) for line in (directory / "syncs.jsonl").read_text().splitlines()]
    later = [record for record in records if record["step"] > 1]  # step 1 builds lazy state
    return {kind: max(record[kind] for record in later) for kind in DeviceSyncCounter.KINDS}


@pytest.mark.parametrize("name", list(SYNC_BUDGET))
def test_device_syncs_per_step_stay_within_the_strategys_budget(name, tmp_path):
    counts = syncs_per_step(name, tmp_path)
    print(f"SYNCS {name}: {counts}")
    assert sum(counts.values()) <= SYNC_BUDGET[name][1], counts
    assert counts["scalar_read"] >= 1, "the loss is read once per step: a counter that misses it is blind"


def test_a_portable_resume_keeps_the_optimizers_step_counter_where_torch_keeps_it():
    """torch keeps AdamW's `step` on the host (unless capturable or fused) and reads it with
    .item() per parameter: restored onto the device, each read would be a device sync (item 11)."""
    import torch

    from strategies.checkpoint.portable import _initialise_optimizer_state

    parameter = torch.nn.Parameter(torch.zeros(3, device="meta"))
    plain, capturable = torch.optim.AdamW([parameter]), torch.optim.AdamW([parameter], capturable=True)
    _initialise_optimizer_state([plain], [["exp_avg", "step"]])
    assert plain.state[parameter]["exp_avg"].device.type == "meta"
    assert plain.state[parameter]["step"].device.type == "cpu"
    _initialise_optimizer_state([capturable], [["step"]])
    assert capturable.state[parameter]["step"].device.type == "meta"


# ----- the executor's clock on CUDA (issue 37, item 9)

class FakeDevice:
    """A GPU's timeline: handlers queue work (`run`) and return at once, as kernel launches do."""

    def __init__(self):
        self.now = 0.0

    def run(self, seconds: float) -> None:
        self.now += seconds

    def event_class(self):
        device = self

        class Event:
            def __init__(self, enable_timing=False):
                self.at = None

            def record(self, stream=None):
                self.at = device.now

            def synchronize(self):
                pass

            def elapsed_time(self, later) -> float:
                return (later.at - self.at) * 1000.0  # milliseconds, as CUDA's
        return Event


def test_measured_pipeline_actions_are_timed_by_the_device_not_the_hosts_launches(monkeypatch):
    """On NCCL, work.wait() and kernel launches return before the GPU has run anything: a host clock
    around each action measures launch time, and the measured bubble would be meaningless."""
    import torch

    import strategies.modular_pipeline as modular_pipeline
    from strategies.schedule.execute import execute
    from strategies.schedule.ir import Action

    device = FakeDevice()
    monkeypatch.setattr(torch.cuda, "Event", device.event_class())
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    clock = modular_pipeline.EventClock(torch.device("cuda", 0))
    actions = [Action("FORWARD", 0, 0), Action("BACKWARD", 0, 0)]
    records = clock.resolve(execute(actions, {"FORWARD": lambda a: device.run(1.0),
                                              "BACKWARD": lambda a: device.run(2.0)}, clock=clock))
    durations = [record.end - record.start for record in records]
    assert durations == pytest.approx([1.0, 2.0]) and records[1].start == pytest.approx(records[0].end)
