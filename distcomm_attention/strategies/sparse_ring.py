"""The ring with direct sparse sends: at each needed step only the key rows the receiver's block reads move.

Note [Sparse ring]
    In the ring loop (Note [Ring attention loop]) rank r computes at step t one block against the keys of
    src = (r - t) mod W, rows [lo, hi) of src's shard (the block's kv slice: every key its queries can see
    lies in it). The plain ring relays whole shards around the ring, so every hop moves n rows whatever the
    block reads. With packed documents, windows or balanced layouts most blocks read a few rows or none, and
    the sparse ring sends them directly instead:

        step t (every rank posts the same steps):  rank r sends the runs of its shard that rank r + t's block
                                                   reads (the rows its queries see, runs closer than
                                                   MERGE_GAP joined while the joins add at most a tenth
                                                   of the rows), straight to r + t (shift t), and
                                                   receives the runs its own block reads from r - t; nothing
                                                   when empty
        block call:                                the plan's block split at the rows no query sees and re-based
                                                   to the received runs (planning/exchange.py, ``sparse_ring``)
        backward:                                  the same sends (or the forward's buffers, kept when every
                                                   rank's buffers total at most RING_KEEP_ROWS shards), and each
                                                   step's dK, dV of the received rows straight back to src
                                                   (shift -t, at most two in flight), added into src's own
                                                   fp32 accumulators

    Every send's size is known to both ends from the exchange plan alone (Note [Exchange plan]: the rows of
    src some query of the receiver sees, which is what its block reads), so nothing but the rows moves, and each
    step's transfer is posted before the step before it computes, as in the plain ring. The strategy picks
    it when the busiest rank receives less than SPARSE_BELOW of what the relay moves it. In the forward each
    rank holds one source's rows at a time, as the ring does, not the union of all of them as the sparse
    all-gather does (Note [Sparse gather]); kept buffers add up to RING_KEEP_ROWS shards for the backward,
    and at most two steps' dK, dV are in flight. What the loop derives from the schedule (each step's shift,
    row counts and rows as a slice or a device index; each step's packed calls or block list) is made once
    per schedule and device and kept on it (``SparseRing.cached``, ``RingPlan.cached``): a call issues its
    sends, views and kernels and builds no index tensor or table.

    What goes home: each step's dK, dV are one partial per row, sent once and summed by the source in fp32 (no
    chain of hops adds to them), so they travel as the all-gather's do (Note [Sparse gather], "What goes home",
    ``ring.return_dtype``): in the inputs' dtype where the backward kernel returns its dK/dV in it
    (flash-attn-4), the step's fp32 sum rounded once (a row one call wrote: the kernel's own values), else in
    fp32. The ranks verify that they agree on it (``prepare``'s field "sparse dK/dV home in").
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch.autograd.function import once_differentiable

from distcomm import _groups
from distcomm.ring import RingComm
from distcomm_attention import transport
from distcomm_attention._device import to_device
from distcomm_attention.planning.exchange import SparseRing, sparse_ring
from distcomm_attention.planning.visibility import ring_plan
from distcomm_attention.strategies.ring import (_as_bytes, _dq_result, _no_autocast, backward_start, forward_step,
                                                return_dtype, ring_attention, step_grads)

__all__ = ["sparse_ring_attention", "ring_planner", "run_ring"]


class _Move(NamedTuple):
    """What step i of a sparse ring moves, from the schedule alone (made once per schedule and device)."""

    shift: int  # the step t
    send: slice | torch.Tensor  # this rank's rows rank + t reads: a slice (one run, or none) or an index
    sent: int  # how many
    received: int  # rows of src = rank - t this rank's blocks read


def _selection(runs, device: torch.device) -> slice | torch.Tensor:
    """The rows of ``runs`` as a slice (one run, or none) or an index on ``device``, made once: pinned and copied
    without blocking the host on CUDA."""
    if len(runs) <= 1:
        return slice(*runs[0]) if runs else slice(0, 0)
    return to_device(torch.cat([torch.arange(a, b) for a, b in runs]), device)


def _moves(sp: SparseRing, device: torch.device) -> tuple[_Move, ...]:
    """Every step's ``_Move`` on ``device`` (cached on the schedule, whose runs never change)."""
    return sp.cached(("moves", device), lambda: tuple(
        _Move(t, _selection(send, device), _count(send), _count(recv))
        for t, send, recv in zip(sp.plan.steps, sp.send, sp.recv)))


def _rows(x: torch.Tensor, rows: slice | torch.Tensor) -> torch.Tensor:
    """The rows of ``x`` (dim 1) a ``_Move`` selects, concatenated: a view for a slice."""
    return x[:, rows] if isinstance(rows, slice) else x.index_select(1, rows)


def _add_rows(acc: torch.Tensor, move: _Move, x: torch.Tensor) -> None:
    """acc[:, the move's rows] += x (x: those rows concatenated, in acc's dtype or one that widens into it)."""
    if isinstance(move.send, slice):
        if move.sent:
            acc[:, move.send].add_(x)
    else:
        acc.index_add_(1, move.send, x.to(acc.dtype))


def _count(runs) -> int:
    return sum(b - a for a, b in runs)


def _post_rows(t, k, v, km, move: _Move):
    """Post a step's rows: ours that rank + t reads out, the ones our blocks read in."""
    rows = move.send
    send = (_rows(k, rows), _rows(v, rows), *_as_bytes(None if km is None else _rows(km, rows)))
    shapes = [(x.shape[0], move.received, *x.shape[2:]) for x in send]
    return t.send_recv(send, move.shift, shapes)


def _received(handle, has_mask: bool):
    got = handle.wait()
    return got[0], got[1], (got[2].view(torch.bool) if has_mask else None)


def sparse_ring_forward(q, k, v, km, t, sp: SparseRing, softcap: float, scale: float, fwd):
    """The forward loop -> (out, lse, the received rows of every step when ``sp.keep``)."""
    plan = sp.plan
    moves = _moves(sp, k.device)
    state = fwd.init_state(q)
    kept = []
    handle = None
    for i in range(len(plan.steps)):
        more = i + 1 < len(plan.steps)
        nxt = _post_rows(t, k, v, km, moves[i + 1]) if more else None
        kb, vb, mb = (k, v, km) if i == 0 else _received(handle, km is not None)
        if i > 0 and sp.keep:
            kept.append((kb, vb, mb))
        forward_step(state, q, kb, vb, mb, plan, i, softcap, scale, fwd, last=not more)
        handle = nxt
    out, lse = fwd.finalize(state, q.dtype)
    return out, lse, kept


def sparse_ring_backward(dout, q, k, v, out, lse, km, t, sp: SparseRing, kept, softcap, scale, bwd):
    """The backward loop -> dq, dk, dv in the inputs' dtypes (Note [Sparse ring])."""
    plan = sp.plan
    moves = _moves(sp, k.device)
    dout, acc_dtype, delta, dq = backward_start(dout, q, out, bwd)
    wire = return_dtype(k.dtype, acc_dtype, bwd)  # what each step's dK, dV go home in
    steps = plan.steps
    # the forward's rows, unless a backward already took them (a second backward through the same graph,
    # retain_graph: every rank's were taken alike, so every rank sends the rows again)
    keep = sp.keep and kept is not None
    handle = None if keep else _post_rows(t, k, v, km, moves[1])
    dk_own, dv_own = step_grads(dout, q, k, v, out, lse, delta, km, dq, plan, 0, softcap, scale, bwd, acc_dtype)
    back = []  # (move, handle) of the dK, dV on their way to their sources, at most two in flight

    def land(move, h):
        dk_r, dv_r = h.wait()
        _add_rows(dk_own, move, dk_r)
        _add_rows(dv_own, move, dv_r)

    for i in range(1, len(steps)):
        if keep:
            kb, vb, mb = kept[i - 1]
        else:
            kb, vb, mb = _received(handle, km is not None)
            handle = _post_rows(t, k, v, km, moves[i + 1]) if i + 1 < len(steps) else None
        dk, dv = step_grads(dout, q, kb, vb, out, lse, delta, mb, dq, plan, i, softcap, scale, bwd, acc_dtype)
        shape = (k.shape[0], moves[i].sent, *k.shape[2:])
        back.append((moves[i], t.send_recv((dk.to(wire), dv.to(wire)), -steps[i], [shape, shape])))
        if len(back) > 2:
            land(*back.pop(0))
    for move, h in back:
        land(move, h)
    return _dq_result(dq, q.dtype), dk_own.to(k.dtype), dv_own.to(v.dtype)


class _OnRing:
    """The transport's ring hops on a ring that is part of its group (``RingComm(group, ring_size)``)."""

    def __init__(self, comm: RingComm):
        self.comm, self.size, self.rank = comm, comm.size, comm.rank

    def send_recv(self, tensors, shift: int, recv_shapes=None):
        return self.comm.send_recv(*tensors, shift=shift, recv_like=recv_shapes)


def _transport(comm: RingComm):
    """The strategies' transport over the ring (Note [Transport]) when the ring is its whole group."""
    if comm.size == _groups.group_size(comm.group):
        return transport.for_group(comm.group)
    return _OnRing(comm)


class _SparseRingAttn(torch.autograd.Function):
    """The ring's attention with direct sparse sends; adjoint: the same sends, dK/dV straight back."""

    @staticmethod
    def forward(ctx, q, k, v, key_mask, comm: RingComm, sp: SparseRing, softcap: float, scale: float, fwd, bwd):
        t = _transport(comm)
        out, lse, kept = sparse_ring_forward(q, k.contiguous(), v.contiguous(), key_mask, t, sp, softcap, scale, fwd)
        # k, v as given (no contiguous copies kept); the kept rows and masks as saved tensors too
        ctx.save_for_backward(q, k, v, out, lse, key_mask, *(x for step in kept for x in step[:2]),
                              *(step[2] for step in kept if step[2] is not None))
        ctx.comm, ctx.sp, ctx.softcap, ctx.scale, ctx.bwd = comm, sp, softcap, scale, bwd
        ctx.kept = len(kept)
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, dout):
        q, k, v, out, lse, km, *rest = ctx.saved_tensors
        k, v = k.contiguous(), v.contiguous()
        n = ctx.kept
        masks = rest[2 * n:] if km is not None else [None] * n
        kept = [(rest[2 * j], rest[2 * j + 1], masks[j]) for j in range(n)]
        with _no_autocast(dout.device):
            dq, dk, dv = sparse_ring_backward(dout, q, k, v, out, lse, km, _transport(ctx.comm), ctx.sp,
                                              kept, ctx.softcap, ctx.scale, ctx.bwd)
        return dq, dk, dv, None, None, None, None, None, None, None


def sparse_ring_attention(q, k, v, comm: RingComm, *, sparse: SparseRing, key_mask, softcap: float, scale: float,
                          fwd, bwd):
    """The ring strategy with direct sparse sends (Note [Sparse ring]); inputs already validated."""
    with _no_autocast(q.device):
        return _SparseRingAttn.apply(q, k, v, key_mask, comm, sparse, softcap, scale, fwd, bwd)


def ring_planner(comm: RingComm, q):
    """``prepare``'s planner for the ring: (this rank's ring plan, its sparse schedule or None)."""
    n = q.shape[1] if isinstance(q, torch.Tensor) and q.dim() == 4 else 0
    return lambda vis, layout: (ring_plan(layout, vis, comm.size, comm.rank, n),
                                sparse_ring(layout, vis, comm.size, comm.rank, n))


def run_ring(q, k, v, comm: RingComm, planned, *, key_mask, softcap: float, scale: float, fwd, bwd):
    """The ring strategy on ``prepare``'s result of ``ring_planner``: the sparse ring where it moves less."""
    plan, sparse = planned
    if sparse is None:
        return ring_attention(q, k, v, comm, plan=plan, key_mask=key_mask, softcap=softcap, scale=scale, fwd=fwd,
                              bwd=bwd)
    return sparse_ring_attention(q, k, v, comm, sparse=sparse, key_mask=key_mask, softcap=softcap, scale=scale,
                                 fwd=fwd, bwd=bwd)
