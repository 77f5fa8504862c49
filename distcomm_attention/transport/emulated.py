"""Emulated links: one simulated rank on one GPU, with each transfer taking the time a real link would
(Note [Transport], Note [Emulated links]).

Note [Emulated links]
    Simulated ranks (one rank's whole loop on one GPU, its peers' data stood in by its own) measure compute;
    an emulated link puts communication back in the loop without assuming what overlaps:

        compute stream:  ... post op ----------------- kernels ---------------- wait ...
                                  \\ (event: the data is ready)                  ^ (event: transfer done)
        link stream:               sleep(bytes / bandwidth + latency), copy -----/

    Every operation waits on the compute stream's progress, occupies a side stream (one per kind of link:
    ring hops and collectives run on separate streams, as NCCL's point-to-point and collective kernels may
    overlap) for ``bytes / bandwidth + latency`` (a calibrated ``torch.cuda._sleep``) plus a real copy of
    the data, and records an event; ``wait()`` makes the compute stream wait on that event, where the real
    code would wait on NCCL. The rank's own schedule then decides what is hidden. Bytes per operation are
    those a ring or pairwise algorithm puts on this rank's link: a hop its tensors; an all-to-all(-v) the
    larger of what leaves and what arrives; an all-gather (n - 1) x its input; a reduce-scatter (n - 1) / n x
    its input. NCCL also takes a few SMs for its copies; the emulation does not.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Sequence

import torch

from distcomm_attention.transport.base import nbytes as _nbytes

__all__ = ["Links", "NVLINK", "INTER_NODE", "EmulatedLink"]


@dataclass(frozen=True)
class Links:
    """Per-GPU link bandwidths (GB/s) and a fixed latency per operation (microseconds)."""

    p2p_gbps: float
    a2a_gbps: float
    allgather_gbps: float
    reduce_scatter_gbps: float
    latency_us: float = 10.0


# Measured on 2 H200s joined by NVLink at 1 GB (../docs/bench: p2p 359, all-gather 277, reduce-scatter 272;
# all-to-all ~250) and a 50 GB/s per-GPU inter-node fabric.
NVLINK = Links(360.0, 250.0, 277.0, 272.0)
INTER_NODE = Links(50.0, 50.0, 50.0, 50.0, latency_us=20.0)


@functools.lru_cache(maxsize=8)
def _cycles_per_us(device_index: int) -> float:
    """GPU clock cycles of ``torch.cuda._sleep`` per microsecond on this device, measured once."""
    with torch.cuda.device(device_index):
        torch.cuda._sleep(1_000_000)  # warm up the clocks
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        cycles = 20_000_000
        start.record()
        torch.cuda._sleep(cycles)
        end.record()
        end.synchronize()
        return cycles / (start.elapsed_time(end) * 1e3)


class _Pending:
    def __init__(self, event: torch.cuda.Event, tensors: tuple[torch.Tensor, ...]):
        self._event, self._tensors = event, tensors

    def wait(self) -> tuple[torch.Tensor, ...]:
        torch.cuda.current_stream().wait_event(self._event)
        return self._tensors


def _rows(x: torch.Tensor, rows: int) -> torch.Tensor:
    """``rows`` rows built from ``x``'s (repeated or cut): what a simulated peer would have sent."""
    if rows == 0 or x.shape[0] == 0:
        return x.new_zeros((rows,) + tuple(x.shape[1:]))
    reps = -(-rows // x.shape[0])
    return x.repeat((reps,) + (1,) * (x.dim() - 1))[:rows]


class EmulatedLink:
    """Simulated rank ``rank`` of ``size`` on one GPU with links ``links`` (see Note [Emulated links])."""

    def __init__(self, size: int, rank: int, links: Links = NVLINK, device: torch.device | None = None):
        self.size, self.rank, self.links = size, rank, links
        self.device = torch.device("cuda", torch.cuda.current_device()) if device is None else device
        self._streams = {kind: torch.cuda.Stream(self.device) for kind in ("p2p", "collective")}
        self.seconds = 0.0  # link time of every posted operation (for reports)

    def _post(self, kind: str, nbytes: float, gbps: float, fill, inputs):
        seconds = self.links.latency_us * 1e-6 + nbytes / (gbps * 1e9)
        self.seconds += seconds
        stream = self._streams[kind]
        stream.wait_stream(torch.cuda.current_stream())
        for t in inputs:  # read on the link's stream later: not to be reused before then
            t.record_stream(stream)
        with torch.cuda.stream(stream):
            torch.cuda._sleep(max(int(seconds * 1e6 * _cycles_per_us(self.device.index or 0)), 1))
            tensors = fill()
            event = torch.cuda.Event()
            event.record(stream)
        for t in tensors:
            t.record_stream(torch.cuda.current_stream())
        return _Pending(event, tensors)

    def send_recv(self, tensors: Sequence[torch.Tensor], shift: int, recv_shapes=None):
        shapes = [tuple(t.shape) for t in tensors] if recv_shapes is None else [tuple(s) for s in recv_shapes]
        nbytes = max(sum(map(_nbytes, tensors)),
                     sum(t.element_size() * torch.Size(s).numel() for t, s in zip(tensors, shapes)))
        return self._post("p2p", nbytes, self.links.p2p_gbps,
                          lambda: tuple(_rows(t.reshape(-1), torch.Size(s).numel()).view(s) for t, s in zip(tensors, shapes)),
                          tensors)

    def all_to_all_v(self, send: torch.Tensor, send_splits: Sequence[int], recv_splits: Sequence[int]):
        row = _nbytes(send[:1]) if send.shape[0] else 0
        out = sum(n for p, n in enumerate(send_splits) if p != self.rank)
        into = sum(n for p, n in enumerate(recv_splits) if p != self.rank)
        return self._post("collective", max(out, into) * row, self.links.a2a_gbps,
                          lambda: (_rows(send, sum(recv_splits)),), (send,))

    def all_gather(self, x: torch.Tensor):
        return self._post("collective", (self.size - 1) * _nbytes(x), self.links.allgather_gbps,
                          lambda: (_rows(x, self.size * x.shape[0]),), (x,))

    def reduce_scatter(self, x: torch.Tensor):
        return self._post("collective", (self.size - 1) * _nbytes(x) / self.size, self.links.reduce_scatter_gbps,
                          lambda: (x[: x.shape[0] // self.size].clone(),), (x,))
