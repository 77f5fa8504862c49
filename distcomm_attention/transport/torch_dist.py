"""The transport over torch.distributed (Note [Transport]): gloo, NCCL, or the in-process threaded group."""

from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist

from distcomm import _groups, _reduce_raw  # _reduce_raw: the non-deprecated all-gather and reduce-scatter names
from distcomm.ring import RingComm
from distcomm_attention.transport.base import Done

__all__ = ["TorchTransport"]


class _Work:
    """Works in flight and the tensors they fill; ``finish`` turns the filled buffers into the result."""

    def __init__(self, works, result, finish=None, keep=()):
        self._works, self._result, self._finish = works, result, finish
        self._keep = keep  # tensors the works read, alive until the wait

    def wait(self) -> tuple[torch.Tensor, ...]:
        for work in self._works:
            work.wait()
        self._works, self._keep = [], ()
        if self._finish is not None:
            self._result, self._finish = self._finish(self._result), None
        return self._result


class TorchTransport:
    """Every operation of Note [Transport] on one process group (``None``: the default group, or a group of
    one without a process group)."""

    def __init__(self, group=None):
        group = _groups.resolve_group(group)
        self._group = _groups.hold(group)  # graphs that keep this transport do not keep the group alive
        self.size = _groups.group_size(group)
        self.rank = _groups.group_rank(group)
        self._ring = RingComm(group) if self.size > 1 else None

    @property
    def group(self):
        return _groups.unhold(self._group)

    def send_recv(self, tensors: Sequence[torch.Tensor], shift: int, recv_shapes=None):
        if self._ring is None or shift % self.size == 0:
            return Done(*tensors)
        return self._ring.send_recv(*tensors, shift=shift, recv_like=recv_shapes)

    def all_to_all_v(self, send: torch.Tensor, send_splits: Sequence[int], recv_splits: Sequence[int]):
        send_splits, recv_splits = list(map(int, send_splits)), list(map(int, recv_splits))
        recv = send.new_empty((sum(recv_splits),) + tuple(send.shape[1:]))
        if self.size == 1:
            recv.copy_(send)
            return Done(recv)
        send = send.contiguous()
        if self._uses_p2p(send):
            return self._all_to_all_p2p(send, send_splits, recv, recv_splits)
        work = dist.all_to_all_single(recv, send, recv_splits, send_splits, group=self.group, async_op=True)
        return _Work([work], (recv,))

    def _uses_p2p(self, send: torch.Tensor) -> bool:
        """Host tensors move as pairs of point-to-point transfers (gloo's all_to_all_single rejects an empty
        tensor, and whether a rank's is empty differs between ranks: every rank must take the same path)."""
        return not send.is_cuda

    def _all_to_all_p2p(self, send, send_splits, recv, recv_splits):
        send_parts, recv_parts = send.split(send_splits), recv.split(recv_splits)
        recv_parts[self.rank].copy_(send_parts[self.rank])
        peers = [peer for peer in range(self.size) if peer != self.rank]
        return _Work([self.exchange([(p, send_parts[p]) for p in peers], [(p, recv_parts[p]) for p in peers])],
                     (recv,))

    def exchange(self, sends, recvs):
        """Note [Transport]'s ``exchange``: per peer in rank order, the lower rank's sends first and the higher
        rank's receives first (an order no backend can deadlock on); on NCCL one group (``batch_isend_irecv``)."""
        ops = []
        for peer in sorted({p for p, _ in sends} | {p for p, _ in recvs}):
            if peer == self.rank or not 0 <= peer < self.size:
                raise ValueError(f"exchange: peer {peer} is not another rank of this group of {self.size} "
                                 f"(this rank: {self.rank})")
            pair = [[(dist.isend, t.contiguous(), peer) for p, t in sends if p == peer and t.numel()],
                    [(dist.irecv, t, peer) for p, t in recvs if p == peer and t.numel()]]
            if self.rank > peer:
                pair.reverse()
            ops.extend(pair[0] + pair[1])
        result = tuple(t for _, t in recvs)
        if any(not t.is_contiguous() for _, t, _ in ops):
            raise ValueError("exchange: every tensor received into must be contiguous")
        if ops and ops[0][1].is_cuda and _groups.batches_p2p(self.group):
            works = dist.batch_isend_irecv([dist.P2POp(fn, t, group=self.group, group_peer=peer)
                                            for fn, t, peer in ops])
        else:
            works = [dist.isend(t, group=self.group, group_dst=peer) if fn is dist.isend
                     else dist.irecv(t, group=self.group, group_src=peer) for fn, t, peer in ops]
        return _Work(works, result, keep=[t for fn, t, _ in ops if fn is dist.isend])

    def all_gather(self, x: torch.Tensor):
        x = x.contiguous()
        out = x.new_empty((self.size * x.shape[0],) + tuple(x.shape[1:]))
        if self.size == 1 or x.numel() == 0:  # (shapes agree across ranks: every rank takes this path)
            out.copy_(x)
            return Done(out)
        work = _reduce_raw._all_gather_into(out, x, group=self.group, async_op=True)
        return _Work([work], (out,))

    def reduce_scatter(self, x: torch.Tensor):
        x = x.contiguous()
        out = x.new_empty((x.shape[0] // self.size,) + tuple(x.shape[1:]))
        if self.size == 1 or x.numel() == 0:
            out.copy_(x)
            return Done(out)
        work = _reduce_raw._reduce_scatter_into(out, x, group=self.group, async_op=True)
        return _Work([work], (out,))
