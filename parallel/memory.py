"""Compute-side peak memory, measured from the tensors themselves.

On a machine without an accelerator, "device" and host are the same DRAM, so allocator statistics
cannot tell what a strategy holds on the compute side. This meter counts storages instead:
1. `resident(tensors)` registers what lives on the compute side before the step (weights, grads,
   optimizer state of the strategy's compute copy);
2. inside the `with` block a TorchDispatchMode registers every storage an operator creates;
3. a weak reference on each storage subtracts its bytes when it is freed;
4. `peak_bytes` is the largest live total seen. Tensors a strategy keeps in its host store are
   never registered (they are created outside the meter's block or marked with `host()`).
"""

import collections
import contextlib
import threading
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_flatten
from torch.utils.weak import WeakIdKeyDictionary


# The operators that do a transformer's FLOPs: the dtype they run in is the step's real precision.
_MATRIX_PRODUCTS = {torch.ops.aten.mm, torch.ops.aten.addmm, torch.ops.aten.bmm, torch.ops.aten.baddbmm}


class ComputeMemoryMeter(TorchDispatchMode):
    """Peak bytes of live compute-side storages during a block (see the module docstring).

    It also counts the dtypes matrix products ran in (`matrix_product_dtypes`): what precision the
    step really computed in, read from the compute rather than from the configuration.
    """

    def __init__(self):
        super().__init__()
        self._storages = WeakIdKeyDictionary()
        self._host = WeakIdKeyDictionary()
        self.live_bytes = 0
        self.peak_bytes = 0
        self.matrix_product_dtypes = collections.Counter()

    def resident(self, tensors) -> None:
        for tensor in tensors:
            self._track(tensor)

    def host(self, tensor: torch.Tensor) -> None:
        """Mark a tensor as host-store memory: never counted, even if an op produced it."""
        storage = tensor.untyped_storage()
        self._host[storage] = True
        self._forget(storage)

    def _forget(self, storage) -> None:
        entry = self._storages.pop(storage, None)
        if entry is not None:
            self.live_bytes -= entry[0]
            entry[0] = 0  # the weak reference's callback will then subtract nothing

    def _track(self, tensor) -> None:
        if not isinstance(tensor, torch.Tensor) or tensor.device.type == "meta":
            return
        if is_traceable_wrapper_subclass(tensor):  # a DTensor's own storage is a placeholder of
            for name in tensor.__tensor_flatten__()[0]:  # the full size: its local shard is the memory
                self._track(getattr(tensor, name))
            return
        storage = tensor.untyped_storage()
        if storage in self._storages or storage in self._host:
            return
        entry = [storage.nbytes()]
        entry.append(weakref.ref(storage, self._make_release(entry)))
        self._storages[storage] = entry
        self.live_bytes += entry[0]
        self.peak_bytes = max(self.peak_bytes, self.live_bytes)

    def _make_release(self, entry: list):
        def release(_reference):
            self.live_bytes -= entry[0]
        return release

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        output = func(*args, **(kwargs or {}))
        if getattr(_suspended, "depth", 0):
            return output  # inside host_side(): host-store work
        if func.overloadpacket in _MATRIX_PRODUCTS:
            self.matrix_product_dtypes[str(output.dtype).removeprefix("torch.")] += 1
        for tensor in tree_flatten(output)[0]:
            self._track(tensor)
        return output


@contextlib.contextmanager
def host_side():
    """Suspend every active meter of this thread: work on the host store (L2L's gradient copies,
    stash offload, mask drawing) is not compute-side memory. Meters are per thread already, so the
    host store's background worker is never counted."""
    _suspended.depth = getattr(_suspended, "depth", 0) + 1
    try:
        yield
    finally:
        _suspended.depth -= 1


_suspended = threading.local()


def on_host_side() -> bool:
    """Whether this thread is inside host_side(): host-store work, not the compute device's."""
    return getattr(_suspended, "depth", 0) > 0
