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


# ----- device synchronisations, counted on CPU (issue 37, item 11)

class DeviceSyncCounter:
    """Counts, per training step, what would make the host wait for a GPU.

    On one CPU "device" and host are one memory, so the counter tracks where each tensor would
    live on a GPU (its provenance): the compute side's tensors at the step's start
    (`compute_resident_tensors`, minus the `step` counters torch's own optimizers keep on the
    host), the batch, factory calls given a torch.device (tests/test_device_discipline.py: host
    buffers name none, or spell out "cpu"), and every operator output with an input on the device. Then a
    TorchDispatchMode, outside host_side() (the L2L host store's work), counts, on device tensors:
      scalar_read: `.item()`, `float()`, `bool()` (aten._local_scalar_dense), `.tolist()` (wrapped:
        it does not dispatch) -- the host waits for every queued kernel;
      data_dependent_shape: nonzero, masked_select, ... -- the host must read a count;
      host_to_device: a tensor built from Python values on the device (torch.tensor(v, device=d):
        a pageable copy, which CUDA completes before returning);
      cross_device_copy: a copy between a host and a device tensor (but a non_blocking upload: the
        code pins its source on a GPU), and L2L's DeviceCopier.to_host (a blocking device -> host
        copy per tensor).
    `install(set_attribute, sink)` adds it to every Trainer train.py builds (forked ranks inherit
    it); `sink(rank, step, counts)` receives every rank's counts of each step.
    """

    KINDS = ("scalar_read", "data_dependent_shape", "host_to_device", "cross_device_copy")
    FACTORIES = ("tensor", "zeros", "ones", "empty", "full", "arange", "rand", "randn", "randint", "eye",
                 "linspace", "as_tensor", "empty_like", "zeros_like", "ones_like", "full_like")

    def install(self, set_attribute, sink) -> None:
        import threading

        import lightning.pytorch as pl
        import torch
        from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
        from torch.utils._pytree import tree_flatten
        from torch.utils.weak import WeakIdKeyDictionary

        from tests.ranks import add_callbacks
        import strategies.l2l as l2l
        from parallel.memory import on_host_side

        aten = torch.ops.aten
        data_dependent = {aten.nonzero, aten.masked_select, aten.unique_consecutive, aten._unique2,
                          aten.repeat_interleave}
        # storage -> "device" | "host": where a GPU run would keep it (unknown: made in C++, e.g.
        # DDP's buckets, or before the count began; copies to or from those are not counted)
        where = WeakIdKeyDictionary()
        naming = threading.local()  # inside a factory call: .device says whether it names a device

        def storages(tensor):
            if not isinstance(tensor, torch.Tensor):  # a DTensor's flattened parts hold its mesh too
                return []
            if is_traceable_wrapper_subclass(tensor):
                return [s for name in tensor.__tensor_flatten__()[0] for s in storages(getattr(tensor, name))]
            return [tensor.untyped_storage()] if tensor.device.type != "meta" else []

        def place(tensor):
            found = {where.get(s) for s in storages(tensor)} if isinstance(tensor, torch.Tensor) else set()
            return "device" if "device" in found else "host" if "host" in found else None

        def is_device(tensor) -> bool:
            return place(tensor) == "device"

        def mark(tensor, device: bool = True) -> None:
            for storage in storages(tensor) if isinstance(tensor, torch.Tensor) else []:
                where[storage] = "device" if device else "host"

        class Mode(TorchDispatchMode):
            counts = None

            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                kwargs = kwargs or {}
                output = func(*args, **kwargs)
                if self.counts is None or on_host_side():
                    return output
                inputs = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
                device_input = any(is_device(t) for t in inputs)
                packet = func.overloadpacket
                if packet is aten.copy_:
                    staged = place(args[0]) == "device" and (args[2:] or [kwargs.get("non_blocking")])[0]
                    if {place(args[0]), place(args[1])} == {"device", "host"} and not staged:
                        self.counts["cross_device_copy"] += 1  # a non-blocking upload (from pinned
                    return output                                # memory on a GPU) makes no one wait
                if packet is aten._to_copy and kwargs.get("device") is not None \
                        and torch.device(kwargs["device"]).type == "cpu":  # .to("cpu"): to the host
                    self.counts["cross_device_copy"] += int(device_input)
                    for tensor in tree_flatten(output)[0]:
                        mark(tensor, device=False)
                    return output
                if func is aten._local_scalar_dense.default and device_input:
                    self.counts["scalar_read"] += 1
                elif packet in data_dependent and device_input:
                    self.counts["data_dependent_shape"] += 1
                elif packet is aten.lift_fresh and getattr(naming, "device", None) is True:
                    self.counts["host_to_device"] += 1
                factory_call = getattr(naming, "device", None)
                host_input = any(place(t) == "host" for t in inputs)
                device = device_input or factory_call is True
                if device or host_input or factory_call is False:
                    for tensor in tree_flatten(output)[0]:
                        mark(tensor, device=device)
                return output

        mode = Mode()

        def names_a_device(device) -> bool:
            # a device object (root_device, a tensor's .device) is the compute device; host buffers
            # name none or spell out "cpu"
            return isinstance(device, torch.device) or (device is not None and str(device) != "cpu")

        def factory(name, original):
            like = name.endswith("_like")  # without device=, where its model tensor is

            def made(*arguments, **keywords):
                outer = getattr(naming, "device", None)
                naming.device = (names_a_device(keywords["device"]) if "device" in keywords
                                 else None if like else False)
                try:
                    return original(*arguments, **keywords)
                finally:
                    naming.device = outer
            return made

        original_tolist = torch.Tensor.tolist

        def tolist(tensor):
            if mode.counts is not None and not on_host_side() and is_device(tensor):
                mode.counts["scalar_read"] += 1
            return original_tolist(tensor)

        to_host, to_device = l2l.DeviceCopier.to_host, l2l.DeviceCopier.to_device

        def counted_to_host(copier, tensor, *arguments, **keywords):
            if mode.counts is not None and is_device(tensor):
                mode.counts["cross_device_copy"] += 1  # device.to("cpu", copy=True): blocking
            copied = to_host(copier, tensor, *arguments, **keywords)
            mark(copied, device=False)
            return copied

        to_host_async = l2l.DeviceCopier.to_host_async

        def marked_to_host_async(copier, tensors, *arguments, **keywords):
            copies, transfer = to_host_async(copier, tensors, *arguments, **keywords)
            for copy in copies:  # issued on a side stream, awaited by the host store's worker: no count
                mark(copy, device=False)
            return copies, transfer

        def marked_to_device(copier, tensor, *arguments, **keywords):
            copied = to_device(copier, tensor, *arguments, **keywords)
            mark(copied)  # on a GPU, on the device (a side stream's non-blocking copy: no count)
            return copied

        def seed(trainer, batch) -> None:
            for tensor in trainer.strategy.compute_resident_tensors():
                if place(tensor) is None:  # a counter its optimizer built on the host stays there
                    mark(tensor)
            for optimizer in trainer.optimizers:  # torch keeps its optimizers' `step` on the host
                if not type(optimizer).__module__.startswith("torch.optim") \
                        or optimizer.defaults.get("capturable") or optimizer.defaults.get("fused"):
                    continue  # ours (LAMB) or on the device: wherever its own code put it
                for state in optimizer.state.values():
                    if isinstance(state.get("step"), torch.Tensor):
                        mark(state["step"], device=False)
            for tensor in tree_flatten(batch)[0]:
                mark(tensor)

        class Start(pl.Callback):
            def on_train_batch_start(self, trainer, module, batch, batch_index):
                seed(trainer, batch)
                mode.counts = dict.fromkeys(DeviceSyncCounter.KINDS, 0)
                mode.__enter__()

        class End(pl.Callback):
            def on_train_batch_end(self, trainer, module, outputs, batch, batch_index):
                mode.__exit__(None, None, None)
                sink(trainer.global_rank, trainer.global_step, mode.counts)
                mode.counts = None

        for name in self.FACTORIES:
            set_attribute(torch, name, factory(name, getattr(torch, name)))
        set_attribute(torch.Tensor, "tolist", tolist)
        set_attribute(l2l.DeviceCopier, "to_host", counted_to_host)
        set_attribute(l2l.DeviceCopier, "to_device", marked_to_device)
        set_attribute(l2l.DeviceCopier, "to_host_async", marked_to_host_async)
        # first in, last out: the evidence's memory meter enters and leaves inside this window
        add_callbacks(set_attribute, End(), first=[Start()])


# ----- copies in flight on a side stream (issue 37, item 7; issue 54, defect 1)

class InFlightCopies:
    """L2L's host -> device copies as a CUDA side stream makes them, keyed as CUDA keys them.

    A copy writes a buffer (a storage) and records an event; the bytes have landed for the compute
    stream only once it has waited on that event. So `DeviceCopier.issue` (the code's one copy) hands
    the code an emulated event and puts the result's storage in flight; the storage lands only when
    the code passes *that* event to `DeviceCopier.compute_waits` (what its own lookup in `wait_for`
    found), or when `DeviceCopier.ready()` waits for the whole stream. A lookup that finds no event
    therefore leaves the bytes in flight, as on a GPU: the emulation learns nothing from the tensors
    `wait_for` was given, only from the events the code found for them. A TorchDispatchMode on the
    thread driving the device flags any operator that reads a storage still in flight (views and
    shape-only operators read no data): on a GPU it would read whatever the buffer held.

    Stricter than CUDA on one point, on purpose: a real side stream is in order, so a wait on a later
    copy's event also covers the earlier ones (issue 54: the dropout mask's wait hid an unfound
    stashed input). Here each copy needs its own wait, the code's contract (`wait_for(t)` waits for
    t's copies only), since a neighbour's wait covers nothing once that copy moves or is not made.

    `fail=True`: the first such read raises (the run stops there). `fail=False`: each is recorded in
    `reads` ("operator shape of copy n") and the run goes on, to count them; `issued` and `awaited` count the
    copies and the waits that found one. `install(set_attribute)` covers every training step
    train.py runs; `patch(set_attribute)` returns the mode, for a test that drives a Relay itself.
    """

    def __init__(self, fail: bool = True):
        self.fail, self.reads, self.issued, self.awaited = fail, [], 0, 0

    def patch(self, set_attribute):
        import torch
        from torch.utils._python_dispatch import TorchDispatchMode
        from torch.utils._pytree import tree_flatten
        from torch.utils.weak import WeakIdKeyDictionary

        import strategies.l2l as l2l

        copies = self
        in_flight = WeakIdKeyDictionary()  # storage -> its copy's event, until the compute stream waits on it
        aten = torch.ops.aten
        # these read a tensor's shape, not its data (a view is checked where its data is read)
        shape_only = {aten.empty_like, aten.zeros_like, aten.ones_like, aten.full_like, aten.detach}

        class SideStreamEvent:
            """The event copy `number` records on the side stream; `waited` once the compute stream waited on it."""
            waited = False

            def __init__(self, number):
                self.number = number

        def unlanded(tensor):
            event = in_flight.get(tensor.untyped_storage())
            return event if event is not None and not event.waited else None

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                if not (func.is_view or func.overloadpacket in shape_only):
                    for tensor in tree_flatten((args, kwargs or {}))[0]:
                        event = unlanded(tensor) if isinstance(tensor, torch.Tensor) else None
                        if event is not None:
                            copies.reads.append(f"{func} {tuple(tensor.shape)} of copy {event.number}")
                            if copies.fail:
                                raise RuntimeError(f"{func} read a {tuple(tensor.shape)} tensor whose copy to the "
                                                   f"device the compute stream never waited for")
                return func(*args, **(kwargs or {}))

        issue, ready = l2l.DeviceCopier.issue, l2l.DeviceCopier.ready

        def issued(copier, host, dtype):
            tensor, event = issue(copier, host, dtype)  # the CPU copy: complete, no event of its own
            assert event is None, "the emulation stands in for the side stream of a CPU device only"
            copies.issued += 1
            event = SideStreamEvent(copies.issued)
            in_flight[tensor.untyped_storage()] = event
            return tensor, event

        def waited(copier, event):
            event.waited = True  # only this copy's bytes: see the class docstring
            copies.awaited += 1

        def all_ready(copier):
            in_flight.clear()  # the compute stream waited for the whole side stream
            return ready(copier)

        set_attribute(l2l.DeviceCopier, "issue", issued)
        set_attribute(l2l.DeviceCopier, "compute_waits", waited)
        set_attribute(l2l.DeviceCopier, "ready", all_ready)
        return Mode()

    def install(self, set_attribute) -> None:
        import lightning.pytorch as pl

        from tests.ranks import add_callbacks

        mode = self.patch(set_attribute)

        class Start(pl.Callback):
            def on_train_batch_start(self, trainer, module, batch, batch_index):
                mode.__enter__()

        class End(pl.Callback):
            def on_train_batch_end(self, trainer, module, outputs, batch, batch_index):
                mode.__exit__(None, None, None)

        # first in, last out: the evidence's memory meter enters and leaves inside this window
        add_callbacks(set_attribute, End(), first=[Start()])
