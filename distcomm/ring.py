"""The ring: rank r sends to its right neighbour and receives from its left.

Note [Ring layout]
    A group of G ranks is cut into G / ring_size independent rings of consecutive group ranks:

        group ranks   0 1 2 3 | 4 5 6 7        ring_size = 4
        ring          ring 0  | ring 1
        position r    0 1 2 3 | 0 1 2 3

    Inside a ring, ``send_recv(x, shift=s)`` sends x to position (r + s) mod W and receives from
    (r - s) mod W. Sends and receives are posted together (NCCL: one batched group; gloo: independent
    isend/irecv pairs, which never block each other), so every rank may post in the same order without
    deadlock. ``RingComm.send_recv`` returns at once; compute on the current block while the next one is
    in flight and call ``wait()`` only when it is needed.

Under ``torch.compile`` ``ring_pass`` hands its validated arguments to the compiled path (Note [Import
direction of the compiled path] in :mod:`distcomm._dispatch`).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from distcomm import _check, _groups
from distcomm._dispatch import compiled_path


__all__ = ["RingComm", "RingHandle", "ring_pass"]


class RingHandle:
    """An in-flight ring transfer; ``wait()`` returns the received tensors (a tuple)."""

    def __init__(self, works, received, keep_alive):
        self._works = works
        self._received = received
        self._keep_alive = keep_alive

    def wait(self) -> tuple[torch.Tensor, ...]:
        for work in self._works:
            work.wait()
        self._works = []
        self._keep_alive = None
        return self._received

    def is_completed(self) -> bool:
        return all(work.is_completed() for work in self._works)


def _ring_size(ring_size, group_size: int) -> int:
    """The validated ranks per ring (``None``: the whole group)."""
    if ring_size is None:
        return group_size
    if isinstance(ring_size, bool) or not isinstance(ring_size, int) or ring_size < 1:
        raise ValueError(f"`ring_size` must be a positive int or None, got {ring_size!r}")
    if group_size % ring_size:
        raise ValueError(
            f"`ring_size`={ring_size} must divide the group size {group_size} "
            f"(allowed: {[d for d in range(1, group_size + 1) if group_size % d == 0]})"
        )
    return ring_size


class RingComm:
    """Point-to-point ring over a process group, for compute/communication overlap.

    Args:
        group: process group, 1-D DeviceMesh or ``(mesh, dim_name)`` (``None``: the default group; no group at
            all: a ring of one).
        ring_size: ranks per ring. ``None`` means the whole group; a smaller value that divides the group
            size makes independent rings of consecutive group ranks (see Note [Ring layout]).

    Attributes:
        size: W, the number of ranks in this ring.
        rank: r, this rank's position in its ring.
        ranks: the global ranks of this ring, in ring order.

    Example::

        comm = RingComm()
        k_next, v_next = k, v
        for step in range(comm.size):
            if step + 1 < comm.size:
                handle = comm.send_recv(k_next, v_next)   # posted before computing on the current block
            compute(k_next, v_next)
            if step + 1 < comm.size:
                k_next, v_next = handle.wait()
    """

    def __init__(self, group=None, ring_size: int | None = None):
        group = _groups.resolve_group(group)
        self._group = _groups.hold(group)  # not kept alive by the autograd graphs that keep this ring
        group_size = _groups.group_size(group)
        group_rank = _groups.group_rank(group)
        ring_size = _ring_size(ring_size, group_size)
        self.size = ring_size
        self.rank = group_rank % ring_size
        first = group_rank - self.rank
        self._positions = list(range(first, first + ring_size))  # group ranks: what the transfers address
        self.ranks = [_groups.to_global_rank(group, r) for r in self._positions]
        self._batch: bool | None = None  # whether CUDA transfers go in one NCCL batch (looked up on first use)

    @property
    def group(self):
        """The ring's process group (None: no group, a world of one); held weakly (Note [Groups held weakly]
        in distcomm/_groups.py)."""
        return _groups.unhold(self._group)

    def peer(self, offset: int) -> int:
        """Global rank of the ring member ``offset`` positions to the right (negative: to the left)."""
        return self.ranks[(self.rank + offset) % self.size]

    def all_gather_ints(self, row: list[int], device: torch.device) -> list[list[int]]:
        """Every ring member's small int vector ``row`` (same length everywhere), in ring order.

        Only the members of this ring take part (W - 1 hops of ``send_recv``), unless the ring is the whole
        group, where one all-gather is cheaper. Used to learn shapes without involving other rings.
        """
        local = torch.tensor(row, dtype=torch.int64, device=device)
        if self.size == 1:
            return [row]
        if self.size == _groups.group_size(self.group):
            out = torch.empty(self.size * len(row), dtype=torch.int64, device=device)
            _check.all_gather_flat(out, local, group=self.group)
            return out.view(self.size, -1).tolist()
        rows = {self.rank: local}
        held = local
        for hop in range(1, self.size):
            (held,) = self.send_recv(held).wait()
            rows[(self.rank - hop) % self.size] = held
        return [rows[i].tolist() for i in range(self.size)]

    def send_recv(self, *tensors: torch.Tensor, shift: int = 1, recv_like=None, verify: bool = False) -> RingHandle:
        """Send ``tensors`` ``shift`` positions to the right and receive as many from the left.

        Args:
            tensors: tensors to send; made contiguous if they are not.
            shift: ring distance (negative sends to the left).
            recv_like: optional tensors or shapes giving the incoming tensors' shapes (default: the same
                shapes as ``tensors``). Incoming dtypes and devices are those of ``tensors``.
            verify: first check, among the ring's members, that every member passes the same number of
                tensors and ``shift`` and that what each one sends is what its receiver expects (shape and
                dtype), raising the same ValueError on every member otherwise (two small exchanges, a
                host sync). Every member must pass the same ``verify``. Off: the shapes are trusted, and a
                mismatch fails in the transport on one rank or leaves the receiver's buffer unwritten.

        Returns:
            A :class:`RingHandle`; its ``wait()`` returns the received tensors in order.
        """
        if not tensors:
            raise ValueError("send_recv needs at least one tensor")
        if recv_like is None:
            recv_like = [t.shape for t in tensors]
        if len(recv_like) != len(tensors):
            raise ValueError(f"`recv_like` has {len(recv_like)} entries, expected {len(tensors)} (one per tensor)")
        shapes = [tuple(r.shape) if isinstance(r, torch.Tensor) else tuple(r) for r in recv_like]
        if verify and self.size > 1:
            _verify_transfer(self, tensors, shapes, shift, "send_recv", "recv_like")
        if shift % self.size == 0:
            for t, s in zip(tensors, shapes):
                if tuple(t.shape) != s:
                    raise ValueError(f"a ring shift of 0 returns the input, but shape {s} was expected for {tuple(t.shape)}")
            return RingHandle([], tuple(tensors), None)
        send = [t.contiguous() for t in tensors]
        recv = [torch.empty(s, dtype=t.dtype, device=t.device) for t, s in zip(tensors, shapes)]
        dst = self._positions[(self.rank + shift) % self.size]
        src = self._positions[(self.rank - shift) % self.size]
        if send[0].is_cuda and self._batch is None:
            self._batch = _groups.batches_p2p(self.group)
        use_batch = send[0].is_cuda and self._batch
        ops = []
        # Even positions send first, odd positions receive first: a fixed global order that cannot deadlock
        # even for backends that serialise point-to-point operations.
        for t_send, t_recv in zip(send, recv):
            pair = []
            if t_send.numel():
                pair.append((dist.isend, t_send, dst))
            if t_recv.numel():
                pair.append((dist.irecv, t_recv, src))
            if self.rank % 2:
                pair.reverse()
            ops.extend(pair)
        if use_batch:
            p2p = [dist.P2POp(fn, t, group=self.group, group_peer=peer) for fn, t, peer in ops]
            works = dist.batch_isend_irecv(p2p) if p2p else []
        else:
            works = [
                dist.isend(t, group=self.group, group_dst=peer) if fn is dist.isend
                else dist.irecv(t, group=self.group, group_src=peer)
                for fn, t, peer in ops
            ]
        return RingHandle(works, tuple(recv), send)


def _verify_transfer(comm: RingComm, tensors, shapes, shift: int, op: str, arg: str) -> None:
    """Check that every ring member's transfer matches its receiver's expectation; the same verdict and
    error on every member (see :meth:`RingComm.send_recv`'s ``verify``)."""
    device = _groups.comm_device(tensors[0], comm.group)
    heads = comm.all_gather_ints([len(tensors), shift % comm.size], device)
    _check.require_agreement(op, "number of tensors", [h[0] for h in heads])
    _check.require_agreement(op, "shift", [h[1] for h in heads], show=lambda v: f"{v} (mod {comm.size})")
    row = []
    for t, s in zip(tensors, shapes):
        row += _check.meta_row(t.shape, t.dtype) + _check.meta_row(s, t.dtype)
    rows = comm.all_gather_ints(row, device)
    width = 2 * (2 + _check.MAX_DIMS)
    _check.refuse_wide((comm.ranks[p], rows[p][k * width + half]) for p in range(comm.size)
                       for k in range(len(tensors)) for half in (0, width // 2))
    shift %= comm.size
    for p in range(comm.size):
        q = (p + shift) % comm.size
        for k in range(len(tensors)):
            sent_row = rows[p][k * width : k * width + width // 2]
            wanted_row = rows[q][k * width + width // 2 : (k + 1) * width]
            if sent_row != wanted_row:
                sent, wanted = _check.decode_meta(sent_row), _check.decode_meta(wanted_row)
                raise ValueError(
                    f"{op}: rank {comm.ranks[p]} sends tensor {k} with shape {tuple(sent.shape)} and dtype "
                    f"{sent.dtype} to rank {comm.ranks[q]}, which expects shape {tuple(wanted.shape)} and dtype "
                    f"{wanted.dtype} (its `{arg}` and its own tensor's dtype); they must match on every rank"
                )


class _RingPass(torch.autograd.Function):
    """y_r = x_{r - shift}. Adjoint: the ring pass with -shift (the grad travels back)."""

    @staticmethod
    def forward(ctx, tensor, shift, comm, recv_shape):
        ctx.shift, ctx.comm, ctx.shape = shift, comm, tuple(tensor.shape)
        (out,) = comm.send_recv(tensor, shift=shift, recv_like=[recv_shape]).wait()
        return out

    @staticmethod
    def backward(ctx, grad):
        return _RingPass.apply(grad.contiguous(), -ctx.shift, ctx.comm, ctx.shape), None, None, None


def ring_pass(
    tensor: torch.Tensor,
    shift: int = 1,
    group=None,
    ring_size: int | None = None,
    *,
    recv_shape=None,
) -> torch.Tensor:
    """Differentiable ring pass: rank r receives the tensor of rank (r - shift) mod W.

    W and r are taken within the ring (group ranks; ``ring_size`` smaller than the group makes independent
    rings of consecutive ranks). Shapes may differ across ranks, zero-size included: unless
    ``recv_shape`` gives the incoming shape, one small exchange among the ring's members learns every
    member's shape and dtype (and raises the same error on every member if the dtypes, ``shift`` or whether
    the input requires grad differ); other rings are not involved. Pass ``recv_shape`` to skip it (it costs a
    host sync); in check mode the ring then verifies that every member's ``recv_shape`` is what its left
    neighbour sends. The backward sends the grad the other way.
    No barrier. Without a process group, or in a ring of one, returns ``tensor`` itself. Under ``torch.compile``
    pass ``recv_shape``: without it the call runs eagerly (a graph break; an error under ``fullgraph=True``).
    """
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"`tensor` must be a torch.Tensor, got {type(tensor).__name__}")
    if isinstance(shift, bool) or not isinstance(shift, int):
        raise TypeError(f"`shift` must be an int, got {shift!r}")
    if torch.compiler.is_compiling():
        group, group_size, _ = _groups.resolve(group)
        size = _ring_size(ring_size, group_size)
        if size == 1 or shift % size == 0:
            return tensor
        if recv_shape is None:
            return compiled_path().ring_pass_eagerly(tensor, shift, group, ring_size)
        return compiled_path().ring_pass(tensor, shift, size, recv_shape, group)
    comm = RingComm(group, ring_size)
    checking = _check.is_check_mode()
    if comm.size == 1 or (shift % comm.size == 0 and recv_shape is not None and not checking):
        return tensor  # without recv_shape every rank enters the exchange, which compares the shifts
    needs_grad = torch.is_grad_enabled() and tensor.requires_grad
    if recv_shape is None:
        recv_shape = _learn_recv_shape(comm, tensor, shift, needs_grad)
    else:
        recv_shape = tuple(recv_shape)
        if checking:
            _verify_transfer(comm, [tensor], [recv_shape], shift, "ring_pass", "recv_shape")
            rows = comm.all_gather_ints([int(needs_grad)], _groups.comm_device(tensor, comm.group))
            _check.require_agreement("ring_pass", "requires_grad", [r[0] for r in rows])
    if shift % comm.size == 0:
        return tensor
    return _RingPass.apply(tensor, shift, comm, recv_shape)


def _learn_recv_shape(comm: RingComm, tensor: torch.Tensor, shift: int, needs_grad: bool) -> tuple[int, ...]:
    """The shape of the tensor this rank receives, from one exchange among the ring's members, which also
    checks (the same error on every member) that dtypes, numbers of dims, ``shift`` and whether the input
    requires grad (the backward is a ring pass too) agree."""
    row = _check.meta_row(tensor.shape, tensor.dtype) + [shift % comm.size, int(needs_grad)]
    rows = comm.all_gather_ints(row, _groups.comm_device(tensor, comm.group))
    _check.refuse_wide((comm.ranks[i], r[0]) for i, r in enumerate(rows))
    ring_metas = [_check.decode_meta(r[:-2]) for r in rows]
    if any(m.dtype != ring_metas[0].dtype or len(m.shape) != len(ring_metas[0].shape) for m in ring_metas):
        _check.raise_mismatch("ring_pass", "dtypes or numbers of dims", ring_metas)
    _check.require_agreement("ring_pass", "shift", [r[-2] for r in rows], show=lambda v: f"{v} (mod {comm.size})")
    _check.require_agreement("ring_pass", "requires_grad", [r[-1] for r in rows])
    return ring_metas[(comm.rank - shift) % comm.size].shape
