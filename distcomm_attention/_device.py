"""Index tensors the strategies and the linear layers hand to the GPU, copied there from pinned memory.

A host-to-device copy from pageable memory can make the host wait for every kernel queued on the stream
before it (the driver stages such a copy once the stream has drained; ``non_blocking`` does not prevent it,
and ``torch.cuda.set_sync_debug_mode`` does not report it). So every index goes through pinned memory
(``to_device``), and the plans' index tensors, cached host tensors reused on every call over the same shards,
keep their device copy for as long as they live (``on_device``).
"""

from __future__ import annotations

import threading
import weakref

import torch

__all__ = ["on_device", "to_device"]

# (id of a host index, device) -> (weak reference to the index, its device copy, the copy's event, its stream)
_COPIES: dict = {}
_LOCK = threading.Lock()


def to_device(index: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``index`` on ``device``; from the host to CUDA copied through pinned memory without blocking the host."""
    if device.type != "cuda" or index.device.type != "cpu":
        return index.to(device)
    return index.pin_memory().to(device, non_blocking=True)


def _key_device(device: torch.device) -> torch.device:
    return device if device.index is not None else torch.device(device.type, torch.cuda.current_device())


def on_device(index: torch.Tensor, device: torch.device, *, copy=to_device) -> torch.Tensor:
    """``index`` (a host tensor that a plan caches and nobody writes) on ``device``, copied once for as long as
    ``index`` lives: its device copy is dropped when it is (a plan for other documents makes new indices,
    and the old ones go with the plans' caches). Used from another stream than the one that made the copy,
    that stream waits for the copy first. ``copy``: how a copy is made (``to_device``; tests pass their own)."""
    if (device.type != "cuda" or index.device.type != "cpu") and copy is to_device:
        return index.to(device)
    device = _key_device(device) if device.type == "cuda" else device
    key = (id(index), str(device))
    with _LOCK:
        hit = _COPIES.get(key)
        if hit is not None and hit[0]() is not index:  # a dead index's id, reused
            hit = None
        if hit is None:
            made = copy(index, device)
            event = stream = None
            if device.type == "cuda":
                stream = torch.cuda.current_stream(device)
                event = torch.cuda.Event()
                event.record(stream)
            hit = _COPIES[key] = (weakref.ref(index), made, event, stream)
            weakref.finalize(index, _forget, key, made)
    _, made, event, stream = hit
    if stream is not None:
        current = torch.cuda.current_stream(device)
        if current != stream:  # read on another stream: after the copy, and kept until that stream is done
            current.wait_event(event)
            made.record_stream(current)
    return made


def _forget(key, made) -> None:
    with _LOCK:
        hit = _COPIES.get(key)
        if hit is not None and hit[1] is made:
            del _COPIES[key]


def cached_copies() -> int:
    """How many device copies are held (for tests)."""
    with _LOCK:
        return len(_COPIES)
