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
    those a ring or pairwise algorithm puts on this rank's link: a hop its tensors; an all-to-all(-v) or an
    exchange the larger of what leaves and what arrives (both at the all-to-all's bandwidth); an all-gather
    (n - 1) x its input; a reduce-scatter (n - 1) / n x its input. NCCL also takes a few SMs for its copies;
    the emulation does not. Its copy runs after the sleep, so where a kernel posted after the operation holds
    every SM by then (a flash-attn-4 call), the copy waits until that kernel's blocks drain, where NCCL's
    kernel, launched at the post, would have held its SMs from the start: seen as 21 us before the sparse
    all-gather's second forward call on one H100 (docs/bench/emulated.md, run 21). The emulation errs on the
    slow side there.

    What a simulated peer sends is this rank's own data: a hop receives its own tensors (repeated or cut to
    the shapes asked for), an all-to-all(-v) and an all-gather their input's rows repeated or cut to the rows
    that arrive, an exchange's receives the elements of its sends in order (repeated or cut, written into the
    tensors given), a reduce-scatter the input's first rows. ``InstantLink`` makes that same data at once on the
    caller's stream (no side stream, no link time): the reference an emulated run must match bit for bit
    (tests/test_gpu_emulated.py), and the simulated rank on a machine without a GPU.

    A post's host work is kept small, since host-bound schedules (the sparse ring's many small sends) would
    otherwise be slowed by the emulation itself (``scripts/bench_emulated.py --host-cost`` measures it): one
    query of the caller's stream; one record and one wait of a "data ready" event, one per link and recorded
    again by every post (a stream that waits on an event waits for the record made before the wait, whatever
    is recorded later); ``record_stream`` once per tensor sent and once per tensor received (the caching
    allocator must not give either to another stream before the link's copy or the caller's use); the side
    stream made current and the caller's restored by two ``set_stream`` calls, not a stream context; the
    sleep, the copies and a new "done" event (several transfers may be in flight, and each ``wait()`` waits
    for its own). The sleep's clock rate is measured once per device and kept on the link.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Sequence

import torch

from distcomm_attention.transport.base import Done
from distcomm_attention.transport.base import nbytes as _nbytes

__all__ = ["Links", "NVLINK", "INTER_NODE", "EmulatedLink", "InstantLink"]


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

# The operations, indexing EmulatedLink's per-operation bandwidths and streams.
_P2P, _A2A, _GATHER, _SCATTER = range(4)


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
        self._event.wait(torch.cuda.current_stream())
        return self._tensors


def _rows(x: torch.Tensor, rows: int) -> torch.Tensor:
    """``rows`` rows built from ``x``'s (repeated or cut): what a simulated peer would have sent."""
    if rows == 0 or x.shape[0] == 0:
        return x.new_zeros((rows,) + tuple(x.shape[1:]))
    reps = -(-rows // x.shape[0])
    whole = x.repeat((reps,) + (1,) * (x.dim() - 1))
    return whole if reps * x.shape[0] == rows else whole[:rows]


def _copies(tensors: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """A hop's arrivals shaped like what it sends: contiguous copies."""
    return tuple(t.clone(memory_format=torch.contiguous_format) for t in tensors)


def _hop(tensors: Sequence[torch.Tensor], shapes: Sequence[torch.Size]) -> tuple[torch.Tensor, ...]:
    """A hop's arrivals of the given shapes: each sent tensor's elements, in order, repeated or cut."""
    out = []
    for t, shape in zip(tensors, shapes):
        numel = shape.numel()
        if numel == t.numel():
            out.append(t.clone(memory_format=torch.contiguous_format).view(shape))
        else:
            out.append(_rows(t.reshape(-1), numel).view(shape))
    return tuple(out)


def _filled(x: torch.Tensor, rows: int) -> tuple[torch.Tensor]:
    return (_rows(x, rows),)


def _into(sends: Sequence[torch.Tensor], recvs: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """Fills ``recvs`` in order with the elements of ``sends`` (flattened, in order, repeated or cut), each
    element read and written once, as the transfers would, by one fused copy (zeros when nothing is sent)."""
    flats = [t.reshape(-1) for t in sends if t.numel()]
    if not flats:
        for t in recvs:
            t.zero_()
        return tuple(recvs)
    into, source = [], []
    i = at = 0  # the send read next, and where in it
    for t in recvs:
        dst, filled = t.view(-1), 0
        while filled < dst.numel():
            src = flats[i]
            n = min(src.numel() - at, dst.numel() - filled)
            into.append(dst[filled:filled + n])
            source.append(src[at:at + n])
            filled, at = filled + n, at + n
            if at == src.numel():
                i, at = (i + 1) % len(flats), 0
    if into:
        torch._foreach_copy_(into, source)
    return tuple(recvs)


def _first(x: torch.Tensor, rows: int) -> tuple[torch.Tensor]:
    return (x[:rows].clone(),)


class _StandIn:
    """The four operations of Note [Transport] for simulated rank ``rank`` of ``size``: the bytes each puts on
    this rank's link and the data its simulated peers send (Note [Emulated links]); ``_post`` delivers it."""

    size: int
    rank: int

    def _post(self, op: int, nbytes: float, make, args: tuple, inputs: Sequence[torch.Tensor]):
        raise NotImplementedError

    def send_recv(self, tensors: Sequence[torch.Tensor], shift: int, recv_shapes=None):
        sent = 0
        for t in tensors:
            sent += t.numel() * t.element_size()
        if recv_shapes is None:
            return self._post(_P2P, sent, _copies, (tensors,), tensors)
        shapes = [torch.Size(s) for s in recv_shapes]
        into = 0
        for t, shape in zip(tensors, shapes):
            into += t.element_size() * shape.numel()
        return self._post(_P2P, max(sent, into), _hop, (tensors, shapes), tensors)

    def all_to_all_v(self, send: torch.Tensor, send_splits: Sequence[int], recv_splits: Sequence[int]):
        row = send.element_size() * (send.numel() // send.shape[0]) if send.shape[0] else 0  # bytes of a row
        out = sum(send_splits) - send_splits[self.rank]
        into = sum(recv_splits) - recv_splits[self.rank]
        return self._post(_A2A, max(out, into) * row, _filled, (send, sum(recv_splits)), (send,))

    def exchange(self, sends, recvs):
        out = sum(_nbytes(t) for _, t in sends)
        into = sum(_nbytes(t) for _, t in recvs)
        sent, filled = [t for _, t in sends], [t for _, t in recvs]
        return self._post(_A2A, max(out, into), _into, (sent, filled), sent + filled)

    def all_gather(self, x: torch.Tensor):
        return self._post(_GATHER, (self.size - 1) * _nbytes(x), _filled, (x, self.size * x.shape[0]), (x,))

    def reduce_scatter(self, x: torch.Tensor):
        return self._post(_SCATTER, (self.size - 1) * _nbytes(x) / self.size, _first,
                          (x, x.shape[0] // self.size), (x,))


class InstantLink(_StandIn):
    """Simulated rank ``rank`` of ``size`` whose transfers arrive at once: the data of an ``EmulatedLink``,
    made on the caller's stream when posted (any device; see Note [Emulated links])."""

    def __init__(self, size: int, rank: int):
        self.size, self.rank = size, rank

    def _post(self, op, nbytes, make, args, inputs):
        return Done(*make(*args))


class EmulatedLink(_StandIn):
    """Simulated rank ``rank`` of ``size`` on one GPU with links ``links`` (see Note [Emulated links]).

    ``seconds``: the link time of every operation posted so far."""

    def __init__(self, size: int, rank: int, links: Links = NVLINK, device: torch.device | None = None):
        self.size, self.rank, self.links = size, rank, links
        self.device = torch.device("cuda", torch.cuda.current_device()) if device is None else device
        p2p, collective = torch.cuda.Stream(self.device), torch.cuda.Stream(self.device)
        self._streams = (p2p, collective, collective, collective)  # by operation
        self._bytes_per_s = tuple(gbps * 1e9 for gbps in (links.p2p_gbps, links.a2a_gbps, links.allgather_gbps,
                                                          links.reduce_scatter_gbps))
        self._latency_s = links.latency_us * 1e-6
        self._cycles_per_us = _cycles_per_us(self.device.index or 0)
        self._ready = torch.cuda.Event()
        self.seconds = 0.0

    def _post(self, op, nbytes, make, args, inputs):
        seconds = self._latency_s + nbytes / self._bytes_per_s[op]
        self.seconds += seconds
        stream, caller = self._streams[op], torch.cuda.current_stream()
        self._ready.record(caller)
        stream.wait_event(self._ready)
        for t in inputs:  # read on the link's stream later: not to be reused before then
            t.record_stream(stream)
        torch.cuda.set_stream(stream)
        try:
            torch.cuda._sleep(max(int(seconds * 1e6 * self._cycles_per_us), 1))
            tensors = make(*args)
            done = torch.cuda.Event()
            done.record(stream)
        finally:
            torch.cuda.set_stream(caller)
        for t in tensors:
            t.record_stream(caller)
        return _Pending(done, tensors)
