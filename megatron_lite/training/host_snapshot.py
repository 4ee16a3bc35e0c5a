"""Host copies of a checkpoint's state dicts, taken while the step loop waits, written later in the background.

A state dict handed to DeepSpeed's checkpoint engine holds the live parameters and optimizer states, which the
next step changes in place; a background write needs them as they were at the save. ``host_copy`` copies every
tensor storage once (pinned host memory for a CUDA tensor, so its copy is a fast DMA) and rebuilds each tensor
as the same view of its copy, so that ``torch.save`` of the copy writes what it would have written of the
original (a view of a flat ZeRO buffer still saves that buffer's storage once). Non-tensor values are deep
copies (param groups' learning rates change every step).

A storage's copy goes into the buffer its copy had at the previous snapshot (``reusable``), when there is one:
no allocation, no page faults, no pinning, which cost more than the copy itself (on a CPU 200 MB copy into a
fresh buffer in ~3x the time of a copy into a used one). The caller reuses a buffer only once the write that
read it has ended.
"""

from __future__ import annotations

import copy
from typing import Any

import torch

StorageKey = tuple[str, int, int]  # (device, data pointer, bytes)


Buffers = dict[StorageKey, torch.Tensor]  # storage -> its host copy, a flat uint8 tensor


def host_copy(obj: Any, copies: Buffers | None = None, reusable: Buffers | None = None) -> Any:
    """``obj`` (nested dicts, lists, tuples of tensors and plain values) with every tensor on the host, in a
    storage of its own; tensors sharing a storage in ``obj`` share one copy. ``copies``: the storages copied so
    far in this snapshot (filled in); ``reusable``: the previous snapshot's buffers (taken from)."""
    copies = {} if copies is None else copies
    reusable = {} if reusable is None else reusable
    if isinstance(obj, torch.Tensor):
        return _copy_tensor(obj, copies, reusable)
    if isinstance(obj, dict):
        copied = {key: host_copy(value, copies, reusable) for key, value in obj.items()}
        return copied if type(obj) is dict else _same_type(obj, copied)
    if type(obj) is list:
        return [host_copy(value, copies, reusable) for value in obj]
    if type(obj) is tuple:
        return tuple(host_copy(value, copies, reusable) for value in obj)
    return copy.deepcopy(obj)  # plain values, torch.Size, named tuples


def snapshot_bytes(obj: Any) -> int:
    """The host memory ``host_copy(obj)`` takes: each distinct storage once."""
    seen: dict[StorageKey, int] = {}

    def walk(node: Any) -> None:
        if isinstance(node, torch.Tensor):
            storage = node.untyped_storage()
            seen[_key(storage)] = storage.nbytes()
        elif isinstance(node, dict):
            for value in node.values():
                walk(value)
        elif isinstance(node, (list, tuple)):
            for value in node:
                walk(value)

    walk(obj)
    return sum(seen.values())


def _key(storage: torch.UntypedStorage) -> StorageKey:
    return (str(storage.device), storage.data_ptr(), storage.nbytes())


def _copy_tensor(tensor: torch.Tensor, copies: Buffers, reusable: Buffers) -> torch.Tensor:
    source = tensor.detach()
    storage = source.untyped_storage()
    key = _key(storage)
    if key not in copies:
        buffer = reusable.pop(key, None)
        if buffer is None:
            buffer = torch.empty(storage.nbytes(), dtype=torch.uint8, pin_memory=storage.device.type == "cuda")
        buffer.copy_(torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage))  # blocking: done
        copies[key] = buffer  # before the next step changes the original
    copied = torch.empty(0, dtype=source.dtype).set_(copies[key].untyped_storage(), source.storage_offset(),
                                                     source.size(), source.stride())
    if isinstance(tensor, torch.nn.Parameter):
        return torch.nn.Parameter(copied, requires_grad=tensor.requires_grad)
    return copied.requires_grad_(tensor.requires_grad) if tensor.requires_grad else copied


def _same_type(original: dict[Any, Any], copied: dict[Any, Any]) -> dict[Any, Any]:
    """An OrderedDict (a module's state dict) or another dict subclass, with its attributes (``_metadata``)."""
    result = copy.copy(original)
    result.clear()
    result.update(copied)
    return result
