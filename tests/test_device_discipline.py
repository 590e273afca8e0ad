"""Every tensor the framework creates names its device, or says why it lives on the host (docs/architecture.md, "Point-to-point order" and the README's GPU notes).

On a GPU a factory call without `device=` makes a CPU tensor, and NCCL rejects a CPU tensor in a
collective: the first step would fail. The scan reads the syntax tree (not text), so a call split
over several lines or written `torch . zeros` is still found; a `# host` comment on any line of
the call, or on the line just above it, marks a buffer that belongs on the host (the L2L store, data loading, offline tools).
"""

import ast
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
    from tests.harness import compose_config

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
