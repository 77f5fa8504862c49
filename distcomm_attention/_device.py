"""Index tensors the strategies and the linear layers hand to the GPU, copied there once per device from pinned
memory.

A host-to-device copy from pageable memory can make the host wait for every kernel queued on the stream
before it (the driver stages such a copy once the stream has drained; ``non_blocking`` does not prevent it,
and ``torch.cuda.set_sync_debug_mode`` does not report it). The plans' index tensors are cached host tensors,
the same object for the same shards, so their device copies are cached as well, by identity.
"""

from __future__ import annotations

import collections

import torch

__all__ = ["on_device"]

_COPIES: collections.OrderedDict = collections.OrderedDict()  # (id, device) -> (host index, its device copy)
_MAX_COPIES = 256


def on_device(index: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``index`` (a host tensor the plans cache; never written) on ``device``: on CUDA copied once from pinned
    memory without blocking the host, then the same device tensor on every call."""
    if device.type != "cuda":
        return index.to(device)
    key = (id(index), str(device))
    hit = _COPIES.get(key)
    if hit is None or hit[0] is not index:  # the cache holds ``index`` itself, so its id is not reused meanwhile
        hit = _COPIES[key] = (index, index.pin_memory().to(device, non_blocking=True))
        while len(_COPIES) > _MAX_COPIES:
            _COPIES.popitem(last=False)
    _COPIES.move_to_end(key)
    return hit[1]
