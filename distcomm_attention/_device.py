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

__all__ = ["on_device", "on_device_kept", "to_device"]

# (id of a host index, device) -> _Copy of it on that device
_COPIES: dict = {}
# Reentrant: a garbage collection inside ``on_device`` may run a dead index's finalizer (``_forget``) on the
# same thread while the lock is held.
_LOCK = threading.RLock()


class _Copy:
    __slots__ = ("index", "made", "event", "streams")

    def __init__(self, index, made, event, stream):
        self.index, self.made, self.event = weakref.ref(index), made, event
        self.streams = {stream}  # streams known to read the copy after it was made


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
    and the old ones go with the plans' caches). A stream other than the one that made the copy waits for
    it and is recorded as a reader, once per stream. During CUDA graph capture a copy is only looked up: the
    first call over these shards must run before capture. ``copy``: how a copy is made (``to_device``;
    tests pass their own)."""
    if (device.type != "cuda" or index.device.type != "cpu") and copy is to_device:
        return index.to(device)
    cuda = device.type == "cuda"
    device = _key_device(device) if cuda else device
    key = (id(index), str(device))
    with _LOCK:
        hit = _COPIES.get(key)
        if hit is not None and hit.index() is not index:  # a dead index's id, reused
            hit = None
        capturing = cuda and torch.cuda.is_current_stream_capturing()
        if hit is None:
            if capturing:
                raise RuntimeError(
                    "an index of this call's plan is not on the GPU yet, and copying it while a CUDA graph is "
                    "being captured would record a copy from a buffer freed after capture: run the call once "
                    "before capturing it")
            made = copy(index, device)
            if made is index or getattr(made, "_base", None) is index:
                raise ValueError("on_device: `copy` must return a new tensor, not `index` or a view of it")
            event = stream = None
            if cuda:
                stream = torch.cuda.current_stream(device)
                event = torch.cuda.Event()
                event.record(stream)
            hit = _COPIES[key] = _Copy(index, made, event, stream)
            weakref.finalize(index, _forget, key, made)
        elif cuda and not capturing:  # captured work runs after the copies made before capture
            current = torch.cuda.current_stream(device)
            if current not in hit.streams:  # read on another stream: after the copy, kept until it is done
                current.wait_event(hit.event)
                hit.made.record_stream(current)
                hit.streams.add(current)
        return hit.made


def _reader(device: torch.device) -> tuple[int, int] | None:
    """(device index, current stream's handle) of the CUDA stream about to read an index; None while a graph is
    captured."""
    if torch.cuda.is_current_stream_capturing():
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)  # (the handle, without making a Stream object)
    return index, raw(index) if raw is not None else torch.cuda.current_stream(index).cuda_stream


def on_device_kept(anchor: torch.Tensor, device: torch.device, make):
    """``make()``: host indices put on ``device`` by ``on_device`` (a tuple of them, say), made once per stream
    that reads them and kept on ``anchor``, one of those host indices, for as long as it lives; so that a call
    over the same plan looks its indices up once, not each through ``on_device``. While a CUDA graph is
    captured nothing is kept (``make()`` each time)."""
    key = _reader(device) if device.type == "cuda" else None
    if key is None:
        return make()
    kept = anchor.__dict__.setdefault("_on_device_kept", {})
    hit = kept.get(key)
    if hit is None:
        hit = kept[key] = make()
    return hit


def _forget(key, made) -> None:
    with _LOCK:
        hit = _COPIES.get(key)
        if hit is not None and hit.made is made:
            del _COPIES[key]


def _cached_copies() -> int:
    """How many device copies are held (for the tests)."""
    with _LOCK:
        return len(_COPIES)
