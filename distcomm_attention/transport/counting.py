"""A transport that counts the bytes this rank sends (Note [Transport]): tests assert a strategy's traffic."""

from __future__ import annotations

from collections import Counter
from typing import Sequence

import torch

from distcomm_attention.transport.base import nbytes as _nbytes

__all__ = ["CountingTransport"]


class CountingTransport:
    """Wraps ``inner`` and adds to ``sent[op]`` the bytes this rank puts on the wire for each operation (what
    stays on this rank is not counted: its own rows of an all-to-all, an all-gather or a reduce-scatter), and
    to ``calls[op]`` one per posted operation. ``peers[(op, peer)]``: bytes per destination, for the
    point-to-point and all-to-all operations."""

    def __init__(self, inner):
        self.inner, self.size, self.rank = inner, inner.size, inner.rank
        self.sent: Counter = Counter()
        self.calls: Counter = Counter()
        self.peers: Counter = Counter()

    @property
    def total(self) -> int:
        return sum(self.sent.values())

    def send_recv(self, tensors: Sequence[torch.Tensor], shift: int, recv_shapes=None):
        self.calls["send_recv"] += 1
        if shift % self.size:
            nbytes = sum(map(_nbytes, tensors))
            self.sent["send_recv"] += nbytes
            self.peers[("send_recv", (self.rank + shift) % self.size)] += nbytes
        return self.inner.send_recv(tensors, shift, recv_shapes)

    def all_to_all_v(self, send: torch.Tensor, send_splits: Sequence[int], recv_splits: Sequence[int]):
        self.calls["all_to_all_v"] += 1
        row = _nbytes(send[:1]) if send.shape[0] else 0
        for peer, rows in enumerate(send_splits):
            if peer != self.rank and rows:
                self.sent["all_to_all_v"] += rows * row
                self.peers[("all_to_all_v", peer)] += rows * row
        return self.inner.all_to_all_v(send, send_splits, recv_splits)

    @property
    def exchange(self):
        """The inner transport's ``exchange``, counted (an AttributeError where it has none, as for it)."""
        inner = self.inner.exchange

        def exchange(sends, recvs):
            self.calls["exchange"] += 1
            for peer, t in sends:
                self.sent["exchange"] += _nbytes(t)
                self.peers[("exchange", peer)] += _nbytes(t)
            return inner(sends, recvs)

        return exchange

    def all_gather(self, x: torch.Tensor):
        self.calls["all_gather"] += 1
        self.sent["all_gather"] += _nbytes(x) * (self.size - 1)
        return self.inner.all_gather(x)

    def reduce_scatter(self, x: torch.Tensor):
        self.calls["reduce_scatter"] += 1
        self.sent["reduce_scatter"] += _nbytes(x) * (self.size - 1) // self.size
        return self.inner.reduce_scatter(x)
