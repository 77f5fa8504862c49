"""The one interface the strategies speak: a transport over one group of ranks.

Note [Transport]
    A strategy says *what* moves (pieces of k, v, dK, dV; all-to-alls of heads; gathers); a transport moves
    it. Every operation is posted at once and returns a :class:`Handle`; ``wait()`` hands back the received
    tensors, and is where the caller's stream starts depending on the transfer. Implementations, side by side:

        TorchTransport     torch.distributed (gloo, NCCL, the in-process threaded group)    transport/torch_dist.py
        CountingTransport  wraps another and counts the bytes each rank sends, per op       transport/counting.py
        EmulatedLink       one simulated rank on one GPU: each transfer occupies a side     transport/emulated.py
                           stream for bytes / bandwidth + latency, then the caller waits

    Operations (``n`` ranks, this one ``rank``; tensors move along dim 0 unless said otherwise):

        send_recv(tensors, shift, recv_shapes)   ring hop: to rank + shift, from rank - shift
        all_to_all_v(send, send_splits, recv_splits)
                                                 rows send[sum(send_splits[:j]) : ...] go to rank j; the
                                                 result holds rank i's rows at sum(recv_splits[:i]) ...
        exchange(sends, recvs)                   one group of point-to-point transfers: each (peer, tensor)
                                                 of ``sends`` to that peer, each (peer, tensor) of ``recvs``
                                                 filled in place from it; between two ranks the pieces pair
                                                 up in the order each lists them (a recv may be a slice of a
                                                 larger buffer: it arrives where it is used)
        all_gather(x)                            (n * rows, ...) in rank order
        reduce_scatter(x)                        x (n * rows, ...) summed over ranks, this rank's rows

    ``all_to_all_v`` with empty splits is how sparse exchanges move exactly what a plan says: a pair with
    nothing to send sends nothing, and an exchange in which no rank sends anything is skipped by every rank
    (the plan, being the same on every rank, tells them so).
"""

from __future__ import annotations

import contextlib
from typing import Callable, Protocol, Sequence

import torch

__all__ = ["Handle", "Done", "Transport", "for_group", "using", "nbytes"]


def nbytes(t: torch.Tensor) -> int:
    """The bytes a tensor's elements take (what it puts on a wire)."""
    return t.numel() * t.element_size()


class Handle(Protocol):
    def wait(self) -> tuple[torch.Tensor, ...]: ...


class Done:
    """A handle whose tensors are already there (a transfer of nothing, or a group of one)."""

    def __init__(self, *tensors: torch.Tensor):
        self._tensors = tensors

    def wait(self) -> tuple[torch.Tensor, ...]:
        return self._tensors


class Transport(Protocol):
    """See Note [Transport]."""

    size: int
    rank: int

    def send_recv(self, tensors: Sequence[torch.Tensor], shift: int,
                  recv_shapes: Sequence[tuple[int, ...]] | None = None) -> Handle: ...

    def all_to_all_v(self, send: torch.Tensor, send_splits: Sequence[int], recv_splits: Sequence[int]) -> Handle: ...

    def exchange(self, sends: Sequence[tuple[int, torch.Tensor]],
                 recvs: Sequence[tuple[int, torch.Tensor]]) -> Handle: ...

    def all_gather(self, x: torch.Tensor) -> Handle: ...

    def reduce_scatter(self, x: torch.Tensor) -> Handle: ...


_factories: list[Callable] = []


def for_group(group) -> Transport:
    """The transport the strategies use over ``group``: torch.distributed, unless :func:`using` installed
    another for the current block."""
    if _factories:
        return _factories[-1](group)
    from distcomm_attention.transport.torch_dist import TorchTransport

    return TorchTransport(group)


@contextlib.contextmanager
def using(factory: Callable):
    """Within the block, strategies get their transport from ``factory(group)`` (tests count bytes,
    benchmarks emulate links). Nested blocks stack; the previous factory returns on exit."""
    _factories.append(factory)
    try:
        yield
    finally:
        _factories.pop()
