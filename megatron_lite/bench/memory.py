"""Peak live tensor memory of a region of code, on any device, counted at the dispatcher.

CPU has no allocator statistics, so ``track_peak_memory`` counts it from the operator stream: a
``TorchDispatchMode`` sees every aten op (including those the autograd engine runs during
``.backward()`` on the calling thread, which is where CPU backward runs), and for every output
tensor whose storage is new it adds the storage's bytes to a live counter and registers a
``weakref.finalize`` on the storage that subtracts them when the storage is freed. Storages are
keyed by ``data_ptr`` so views (which share a storage) are counted once, and an output that aliases
an input (views, in-place ops, ``out=``) is never counted: only memory allocated inside the region
is, so inputs and parameters that already exist form the baseline of zero.

Not seen: scratch buffers a fused kernel allocates and frees internally (e.g. the per-thread blocks
of the CPU flash-attention kernel) and work done on other threads. The dispatch mode adds Python
overhead to every op; never time code while tracking it.
"""

from __future__ import annotations

import contextlib
import itertools
import weakref
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


def _storage_of(tensor: torch.Tensor) -> torch.UntypedStorage | None:
    """The tensor's untyped storage, or None for tensors without real memory (sparse, meta, empty)."""
    if tensor.is_sparse or tensor.device.type == "meta":
        return None
    try:
        storage = tensor.untyped_storage()
    except (RuntimeError, NotImplementedError):  # e.g. tensor subclasses without a storage
        return None
    if storage.nbytes() == 0 or storage.data_ptr() == 0:
        return None
    return storage


class PeakMemoryTracker(TorchDispatchMode):
    """Dispatch mode counting live bytes of storages allocated while it is active."""

    def __init__(self) -> None:
        super().__init__()
        self.live_bytes = 0
        self.peak_bytes = 0
        self.num_allocations = 0
        # data_ptr -> token of the live storage there; the token guards against a stale release
        # removing a newer storage that reuses the address.
        self._live: dict[int, int] = {}
        self._tokens = itertools.count()

    def _release(self, data_ptr: int, token: int, nbytes: int) -> None:
        if self._live.get(data_ptr) == token:
            del self._live[data_ptr]
            self.live_bytes -= nbytes

    def _track(self, tensor: torch.Tensor, input_ptrs: set[int]) -> None:
        storage = _storage_of(tensor)
        if storage is None:
            return
        data_ptr = storage.data_ptr()
        if data_ptr in input_ptrs or data_ptr in self._live:
            return  # a view / in-place result of an input, or a storage already counted
        nbytes = storage.nbytes()
        token = next(self._tokens)
        self._live[data_ptr] = token
        # Storage Python objects are preserved while the C++ storage lives (views and tensors
        # saved for backward keep it alive), so the finalizer fires exactly when the memory goes.
        weakref.finalize(storage, self._release, data_ptr, token, nbytes)
        self.live_bytes += nbytes
        self.num_allocations += 1
        self.peak_bytes = max(self.peak_bytes, self.live_bytes)

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        input_ptrs = set()
        for leaf in tree_leaves((args, kwargs)):
            if isinstance(leaf, torch.Tensor):
                storage = _storage_of(leaf)
                if storage is not None:
                    input_ptrs.add(storage.data_ptr())
        for leaf in tree_leaves(out):
            if isinstance(leaf, torch.Tensor):
                self._track(leaf, input_ptrs)
        return out


@contextlib.contextmanager
def track_peak_memory() -> Iterator[PeakMemoryTracker]:
    """``with track_peak_memory() as tracker: ...`` then ``tracker.peak_bytes`` (above the entry baseline)."""
    tracker = PeakMemoryTracker()
    with tracker:
        yield tracker
