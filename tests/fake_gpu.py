"""A CPU machine dressed as a GPU node, to prove the parent process never initialises CUDA.

`pretend_gpus(set_attribute, count)` makes torch look like a CUDA build whose NVML sees `count`
devices, and turns every call that would initialise CUDA in this process into a recorded error:
torch.cuda.is_available() (cudaGetDeviceCount: it initialises the driver), cudaGetDeviceCount
itself, and cuInit through torch.cuda._lazy_init (every device query, stream, tensor on cuda).

Run as a script it is train.py in such a process, with the local launcher replaced by a probe that
prints what it was asked to start (`LAUNCH {...}` as JSON) and stops: everything train.py does in
the parent before the ranks start runs for real.
"""

import json
import os
import runpy
import sys
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
INITIALISING = [("torch.cuda", "is_available"), ("torch._C", "_cuda_getDeviceCount"),
                ("torch._C", "_cuda_init"), ("torch.cuda", "_lazy_init")]


def pretend_gpus(set_attribute, count: int) -> list:
    """Patch torch through `set_attribute(object, name, value)`; return the list that records
    every CUDA-initialising call (each entry: the function's name and the caller's stack)."""
    import torch

    calls = []

    def trap(name):
        def initialising(*arguments, **keywords):
            calls.append(f"{name}\n{''.join(traceback.format_stack(limit=8))}")
            raise RuntimeError(f"{name} would initialise CUDA in the parent process")
        return initialising

    set_attribute(torch.backends.cuda, "is_built", lambda: True)
    set_attribute(torch.cuda, "_device_count_nvml", lambda: count)
    for module_name, name in INITIALISING:
        module = sys.modules[module_name]
        if hasattr(module, name):  # a CPU build has no torch._C._cuda_*: adding them would make
            set_attribute(module, name, trap(f"{module_name}.{name}"))  # torch think it has CUDA
    return calls


def setattr_anyway(target, name, value):
    setattr(target, name, value)


def run_train_py_until_launch() -> None:
    import torch

    sys.path.insert(0, str(ROOT))
    calls = pretend_gpus(setattr_anyway, int(os.environ.get("FAKE_GPU_COUNT", "2")))
    import layerwise.run.fit

    def probe(function, world_size, *arguments, method="fork", ranks_per_node=None, **keywords):
        print("LAUNCH " + json.dumps({"method": method, "world_size": world_size,
                                      "ranks_per_node": ranks_per_node,
                                      "cuda_initialized": torch.cuda.is_initialized(),
                                      "initialising_calls": calls}), flush=True)
        raise SystemExit(0)

    layerwise.run.fit.run_ranks = probe
    sys.argv[0] = str(ROOT / "train.py")
    runpy.run_path(str(ROOT / "train.py"), run_name="__main__")


if __name__ == "__main__":
    run_train_py_until_launch()
