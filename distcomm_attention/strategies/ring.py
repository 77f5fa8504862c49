"""The ring loop of ring flash attention (forward and backward), generic over the block kernels, and the
ring all-gather / reduce-scatter used to gather a sharded sequence.

Note [Ring attention loop]
    W ranks in a ring; at ring step t rank r holds the keys/values (and key padding mask) of rank
    src = (r - t) mod W. The plan (distcomm_attention.planning.visibility, Note [Ring plan]) lists the needed steps
    t_0 = 0 < t_1 < ... < t_m (every step for plain attention; fewer with a window or documents) and this
    rank's block calls for each.

    forward, step t_i:  post send_recv(k, v[, mask], shift=t_{i+1} - t_i)   (the block of step t_{i+1})
                        fwd.step(...) for each Block of the step     (fp32 state, never rounded)
                        wait
                        after the last step: out, lse = fwd.finalize(state)

    backward, step t_i: post send_recv(k, v[, mask], shift=t_{i+1} - t_i) and
                        send_recv(dk_acc, dv_acc, shift=t_i - t_{i-1})   (the accumulators of the block
                        computed at the previous step, to the next rank that computes with it)
                        dk_t, dv_t = contributions of this rank's queries to block src; dQ summed locally
                        wait; dk_acc = received dk_acc + dk_t   (received: the contributions of the ranks
                        that computed with src before; added in place when it is already fp32)
                        after the last step: one more hop (shift W - t_m) takes each accumulator to its
                        owner, with the contributions of all ranks; being complete, it travels in the input
                        dtype.

        plain ring, rank r:  t=0: block r   t=1: block r-1 (+acc from r-1)   ...   t=W-1: block r+1
                             then send acc(r+1) -> r+1, receive acc(r) <- r-1: the total dK, dV of r's block

dQ accumulates locally in fp32 (fp64 for fp64 input): kernels that return each call's dq (those that pack)
    add into a ``RowSum`` (distcomm_attention.kernels.contract), where a row one call reaches keeps that dq
    and only rows a second call reaches are summed in fp32; the others add into a zero-filled buffer. The
    dK/dV accumulators travel in the accumulation dtype at every hop but the last (the same dtype on every
    rank, so that each receive matches its send).
    Communication is posted before the compute it overlaps with and waited after it; every rank posts the
    same sequence, so there is no barrier and no deadlock (see distcomm.ring). Only q, k, v, out and lse
    are saved for the backward (q, k, v as given, not copies). The whole loop runs with autocast disabled:
    the kernels pick their own precisions. A ring of one runs the same code with no communication.
"""

from __future__ import annotations

import contextlib

import torch
from torch.autograd.function import once_differentiable

from distcomm.ring import RingComm
from distcomm_attention.kernels.contract import MergeState, RowSum, _runs, _split_runs, _zero_untouched, copy_all
from distcomm_attention.planning.calls import step_calls
from distcomm_attention.planning.visibility import RingPlan

__all__ = ["ring_attention", "ring_forward", "ring_backward", "ring_all_gather", "ring_reduce_scatter", "packed",
           "forward_step", "block_grads", "step_grads", "backward_start"]


def _whole(rows: slice, n: int) -> bool:
    """Whether the slice covers all n rows (the planner writes full ranges as slice(0, n))."""
    start, stop, _ = rows.indices(n)
    return start == 0 and stop == n


def _part(x: torch.Tensor, rows: slice, dim: int = 1) -> torch.Tensor:
    """``x``'s rows along ``dim`` (1 or 2) as a view, or ``x`` itself when they are all of them (no operation)."""
    if rows.start == 0 and rows.stop == x.shape[dim] and rows.step is None:
        return x
    return x[:, rows] if dim == 1 else x[:, :, rows]


def _add_into(acc: torch.Tensor, rows: slice, x: torch.Tensor) -> None:
    """acc[:, rows] += x as one in-place add on a view (``+=`` on an indexed view also writes the view back
    through indexing): the same sums with fewer operations issued; on ``acc`` itself when rows cover it."""
    _part(acc, rows).add_(x)


def _start_acc(grads: list, like: torch.Tensor, dtype: torch.dtype, which: int) -> torch.Tensor:
    """The accumulator of step 0: the sum of ``grads[i][which]`` over their kv rows, shaped like ``like``.

    Always in ``dtype``: every rank posts the same receive for it, whatever its own blocks were. A single
    block covering every row is one term: it is only converted (a no-op for kernels asked for the accumulation
    dtype), with no zero fill and no extra add.
    """
    if len(grads) == 1 and _whole(grads[0][0], like.shape[1]):
        return grads[0][which].to(dtype)
    acc = torch.empty(like.shape, dtype=dtype, device=like.device)
    _sum_terms((acc,), [(g[0], g[which]) for g in grads])
    return acc


def _accumulate(received: torch.Tensor, grads: list, dtype: torch.dtype, which: int,
                out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """received + this step's block gradients, summed in ``dtype`` (in place when received already has it).

    With ``out_dtype`` (the last step: the sum is complete) the result is rounded to it once; a single block
    covering every row does it in one kernel: ``torch.add`` computes in the promoted dtype (fp32 opmath for
    two half-precision operands) and rounds on store, the same bits as summing in ``dtype`` and casting.
    """
    if out_dtype is not None and len(grads) == 1 and _whole(grads[0][0], received.shape[1]):
        out = torch.empty(received.shape, dtype=out_dtype, device=received.device)
        return torch.add(received, grads[0][which], out=out)
    acc = received if received.dtype == dtype else received.to(dtype)
    for g in grads:
        _add_into(acc, g[0], g[which])
    return acc if out_dtype is None else acc.to(out_dtype)


def _no_autocast(device: torch.device):
    """A context disabling autocast on ``device``: the kernels choose their own precisions (fp32 state, fp32
    math in the exact path), and autocast would round the exact path's matmuls to bf16/fp16."""
    if torch.amp.is_autocast_available(device.type):
        return torch.autocast(device.type, enabled=False)
    return contextlib.nullcontext()


def _as_bytes(key_mask: torch.Tensor | None) -> tuple[torch.Tensor, ...]:
    """The key mask as uint8 for the wire (every backend moves bytes), or nothing without one."""
    return () if key_mask is None else (key_mask.contiguous().view(torch.uint8),)


def packed(plan: RingPlan, i: int, kernel, key_mask, device: torch.device, backward: bool):
    """Step i's packed calls when ``kernel`` packs and the step has pieces to pack (an "interval" block: packed
    documents or a window), else None: the per-block calls (Note [Packed steps] in kernels/contract.py)."""
    if key_mask is not None or not getattr(kernel, "packs", False):
        return None
    return step_calls(plan, i, device, backward)


def _dq_sum(q: torch.Tensor, acc_dtype: torch.dtype, bwd) -> torch.Tensor | RowSum:
    """The accumulator of a rank's dQ: a RowSum for kernels that pack (block backends that return each call's dq:
    rows one call reaches are never converted), else a zero-filled buffer the kernels add into."""
    if getattr(bwd, "packs", False):
        return RowSum(q.shape, acc_dtype, q.device)
    return torch.zeros(q.shape, dtype=acc_dtype, device=q.device)


def _rows_of(dq, rows: slice):
    """What a per-block backward call gets as ``dq_acc``: the rows of a buffer, or None for a RowSum (the call
    returns its dq, added by ``_add_dq``)."""
    return None if isinstance(dq, RowSum) else _part(dq, rows)


def _add_dq(dq, rows: slice, dq_b: torch.Tensor) -> None:
    """Add a per-block call's dq into a RowSum (a buffer was already added to by the call)."""
    if isinstance(dq, RowSum):
        start, stop, _ = rows.indices(dq.shape[1])
        dq.add(start, stop, dq_b)


def return_dtype(dtype: torch.dtype, acc_dtype: torch.dtype, bwd) -> torch.dtype:
    """The dtype the sparse exchanges' dK/dV rows travel home in (the all-gather's, Note [Sparse gather], "What
    goes home", and the sparse ring's, Note [Sparse ring]), for inputs of ``dtype`` and backward kernel ``bwd``:
    that dtype where the kernel returns its dK/dV in it (``dkv_in_input_dtype``), else the accumulation dtype.
    The ranks verify that they agree on it (``prepare``), so every rank sends and receives in one dtype."""
    return dtype if getattr(bwd, "dkv_in_input_dtype", False) else acc_dtype


def backward_start(dout, q, out, bwd):
    """(dout contiguous, the accumulation dtype, D = rowsum(dout * out) as (B, H, n) or None for kernels that
    compute it themselves, the dQ accumulator): what every backward loop starts from."""
    dout = dout.contiguous()
    acc_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    delta = None
    if getattr(bwd, "uses_delta", True):
        delta = (dout.to(acc_dtype) * out.to(acc_dtype)).sum(-1).transpose(1, 2).contiguous()
    return dout, acc_dtype, delta, _dq_sum(q, acc_dtype, bwd)


def _dq_result(dq, dtype: torch.dtype) -> torch.Tensor:
    return dq.result(dtype) if isinstance(dq, RowSum) else dq.to(dtype)


def _shifts(steps: tuple[int, ...], size: int) -> list[int]:
    """Ring distance from each needed step to the next one; the last entry takes a block home."""
    return [b - a for a, b in zip(steps, steps[1:])] + [size - steps[-1]]


def _step_work(plan: RingPlan, i: int, kernel, key_mask, device: torch.device, n: int, backward: bool):
    """Step i as the loop runs it for ``n`` query rows on ``device``: (its packed calls, None), or (None, (block,
    its mask, whether it is the step's last block and covers every row) of each block); made once per plan."""
    packs = key_mask is None and getattr(kernel, "packs", False)

    def make():
        calls = step_calls(plan, i, device, backward) if packs else None
        if calls is not None:
            return calls, None
        blocks = plan.blocks[i]
        return None, tuple((block, plan.mask(i, j, device), j + 1 == len(blocks) and _whole(block.q, n))
                           for j, block in enumerate(blocks))

    return plan.cached(("work", i, backward, packs, device, n), make)


def forward_step(state, q, k, v, km, plan: RingPlan, i: int, softcap: float, scale: float, fwd,
                 last: bool = False) -> None:
    """Step i's kernel calls on keys ``k``, ``v`` (and key mask ``km``) into the fp32 ``state``: one packed call
    set, or one call per block. ``last``: the loop's last step, whose last call may normalise in place when
    it covers every row (always so at W = 1)."""
    calls, blocks = _step_work(plan, i, fwd, km, q.device, q.shape[1], backward=False)
    if calls is not None:
        fwd.packed_step(state, q, k, v, calls, scale=scale, softcap=softcap)
        return
    for block, mask, covers in blocks:
        kv = block.kv
        fwd.step(
            state, q, _part(k, kv), _part(v, kv), mask=mask, scale=scale, softcap=softcap,
            key_mask=None if km is None else _part(km, kv), q_slice=block.q, final=last and covers,
        )


def block_grads(dout, q, k, v, out, lse, delta, km, dq, plan: RingPlan, i: int, softcap: float, scale: float, bwd,
                acc_dtype: torch.dtype, dkv_into=None) -> list:
    """Step i's backward calls: this rank's dQ added into ``dq``; returns (kv rows, dK, dV) of each call, in
    ``acc_dtype`` (packed calls: as the kernel returned them, into ``dkv_into``'s buffers where it gives
    them, ``BlockBackward.packed_step``)."""
    calls, blocks = _step_work(plan, i, bwd, km, q.device, q.shape[1], backward=True)
    if calls is not None:  # Note [Packed steps]
        return bwd.packed_step(dout, q, k, v, out, lse, calls, scale=scale, softcap=softcap, dq_acc=dq,
                               dkv_into=dkv_into)
    grads = []
    for block, mask, _ in blocks:
        rows, kv = block.q, block.kv
        dq_b, dk_b, dv_b = bwd.step(
            _part(dout, rows), _part(q, rows), _part(k, kv), _part(v, kv), _part(out, rows), _part(lse, rows, 2),
            None if delta is None else _part(delta, rows, 2), mask=mask, scale=scale,
            softcap=softcap, key_mask=None if km is None else _part(km, kv), dq_acc=_rows_of(dq, rows),
            dkv_dtype=acc_dtype,
        )
        _add_dq(dq, rows, dq_b)
        grads.append((kv, dk_b, dv_b))
    return grads


def step_grads(dout, q, k, v, out, lse, delta, km, dq, plan: RingPlan, i: int, softcap: float, scale: float, bwd,
               acc_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``block_grads`` summed into dK, dV shaped like ``k``, ``v`` (in ``acc_dtype``; one buffer holds both when
    their shapes agree), by ``_sum_terms``."""
    if k.shape == v.shape:
        dk, dv = torch.empty((2, *k.shape), dtype=acc_dtype, device=k.device).unbind(0)
    else:
        dk = torch.empty(k.shape, dtype=acc_dtype, device=k.device)
        dv = torch.empty(v.shape, dtype=acc_dtype, device=v.device)
    grads = block_grads(dout, q, k, v, out, lse, delta, km, dq, plan, i, softcap, scale, bwd, acc_dtype)
    _sum_terms((dk, dv), grads)
    return dk, dv


_MAX_TERMS = 8  # more terms than this are added into zeros (``_sum_terms``)


def _sum_terms(accs: tuple[torch.Tensor, ...], grads, unread=()) -> None:
    """Sum (kv rows, term for accs[0], term for accs[1], ...) into the uninitialised buffers ``accs`` (rows along
    dim 1): a row's first term is copied in (converted exactly), later ones added, and only rows no term
    reaches are zero-filled: the sums of adding every term into zeros, without filling rows a term
    overwrites or reading zeros to add to (signed zeros aside). With more than ``_MAX_TERMS`` terms (a striped
    rank's hundreds of disjoint calls) every buffer is zero-filled once and each term added: one launch a term
    rather than a copy or add per piece and a fill per gap. Rows of ``unread`` (sorted disjoint runs) that no term
    reaches are left unset: the caller reads none of them."""
    grads = list(grads)
    n, written = accs[0].shape[1], ()
    if len(grads) > _MAX_TERMS:
        for acc in accs:
            _zero_untouched(acc, _runs(unread))
        for kv, *terms in grads:
            for acc, term in zip(accs, terms):
                _add_into(acc, kv, term)
        return
    into, firsts, adds = [], [], []  # each row's first term copied (all at once), then the later ones added
    for kv, *terms in grads:
        start, stop, _ = kv.indices(n)
        if start >= stop:
            continue
        for a, z, seen in _split_runs(start, stop, written):
            for acc, term in zip(accs, terms):
                part = term[:, a - start:z - start]
                if seen:
                    adds.append((acc[:, a:z], part))
                else:
                    into.append(acc[:, a:z]), firsts.append(part)
        written = _runs(written + ((start, stop),))
    copy_all(into, firsts)
    for rows, part in adds:
        rows.add_(part)
    for acc in accs:
        _zero_untouched(acc, _runs(written + tuple(unread)))


def ring_forward(q, k, v, key_mask, comm: RingComm, plan: RingPlan, softcap: float, scale: float, fwd, slots=None):
    """The forward ring loop (see Note [Ring attention loop]) -> out (B, n, H, D), lse (B, H, n). ``slots``: the
    row spans of packed calls that write their outputs straight into the state (``MergeState.slot``)."""
    k, v = k.contiguous(), v.contiguous()
    km = key_mask
    shifts = _shifts(plan.steps, comm.size)
    state = fwd.init_state(q)
    if slots is not None and isinstance(state, MergeState):
        state.slots = slots
    for i in range(len(plan.steps)):
        more = i + 1 < len(plan.steps)
        handle = comm.send_recv(k, v, *_as_bytes(km), shift=shifts[i]) if more else None
        forward_step(state, q, k, v, km, plan, i, softcap, scale, fwd, last=not more)
        if handle is not None:
            received = handle.wait()
            k, v = received[0], received[1]
            km = None if km is None else received[2].view(torch.bool)
    return fwd.finalize(state, q.dtype)


def ring_backward(dout, q, k, v, out, lse, km, comm: RingComm, plan: RingPlan, softcap: float, scale: float, bwd):
    """The backward ring loop (see Note [Ring attention loop]) -> dq, dk, dv in the inputs' dtypes."""
    dout = dout.contiguous()
    size = comm.size
    acc_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    n = q.shape[1]
    if size == 1 and len(plan.blocks[0]) == 1 and _whole(plan.blocks[0][0].q, n) and _whole(plan.blocks[0][0].kv, n):
        # A ring of one whole block: the kernel's gradients are the result (no accumulators), and kernels
        # that compute rowsum(dout * out) themselves get no delta.
        delta = None
        if getattr(bwd, "uses_delta", True):
            delta = (dout.to(acc_dtype) * out.to(acc_dtype)).sum(-1).transpose(1, 2).contiguous()
        dq, dk, dv = bwd.step(dout, q, k.contiguous(), v.contiguous(), out, lse, delta,
                              mask=plan.mask(0, 0, q.device), scale=scale, softcap=softcap, key_mask=km)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)
    # D = rowsum(dout * out) of the global output rows, once for every block: (B, H, n); block backends
    # compute it in their own kernels and skip it here. dq: this rank's dQ.
    dout, acc_dtype, delta, dq = backward_start(dout, q, out, bwd)
    k, v = k.contiguous(), v.contiguous()
    shifts = _shifts(plan.steps, size)
    dk_acc = dv_acc = None  # accumulators of the block computed at the previous step
    for i in range(len(plan.steps)):
        last = i + 1 == len(plan.steps)
        handles = []
        if not last:
            handles.append(comm.send_recv(k, v, *_as_bytes(km), shift=shifts[i]))
        if i > 0:  # the previous block's partial sums go to the next rank that computes with it
            handles.append(comm.send_recv(dk_acc, dv_acc, shift=shifts[i - 1]))
        # (kv rows, dk, dv) of this step's blocks, added to the accumulators after the wait
        grads = block_grads(dout, q, k, v, out, lse, delta, km, dq, plan, i, softcap, scale, bwd, acc_dtype)
        received = [t for h in handles for t in h.wait()]
        if not last:
            k, v = received[0], received[1]
            km = None if km is None else received[2].view(torch.bool)
            received = received[3 if km is not None else 2:]
        if i == 0:
            dk_acc, dv_acc = _start_acc(grads, k, acc_dtype, 1), _start_acc(grads, v, acc_dtype, 2)
        else:  # the received buffers are ours: accumulate in place
            # After the last step the sums are complete: they are rounded to the input dtype before the
            # final hop (the same bits as rounding after it, half the bytes).
            dk_acc = _accumulate(received[0], grads, acc_dtype, 1, k.dtype if last else None)
            dv_acc = _accumulate(received[1], grads, acc_dtype, 2, v.dtype if last else None)
    dk_acc, dv_acc = comm.send_recv(dk_acc.to(k.dtype), dv_acc.to(v.dtype), shift=shifts[-1]).wait()
    return _dq_result(dq, q.dtype), dk_acc, dv_acc


class _RingFlashAttn(torch.autograd.Function):
    """out = softmax(mask(q k^T * scale)) v over the ring's global sequence; see Note [Ring attention loop].

    Adjoint: the same ring, carrying dK/dV accumulators back to their owners (summing convention: rank r's
    dK/dV include the contributions of every rank's queries).
    """

    @staticmethod
    def forward(ctx, q, k, v, key_mask, comm: RingComm, plan: RingPlan, softcap: float, scale: float, fwd, bwd):
        out, lse = ring_forward(q, k, v, key_mask, comm, plan, softcap, scale, fwd)
        ctx.save_for_backward(q, k, v, out, lse, key_mask)  # k, v as given: no duplicated storage
        ctx.comm, ctx.plan, ctx.softcap, ctx.scale, ctx.bwd = comm, plan, softcap, scale, bwd
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, dout):
        q, k, v, out, lse, km = ctx.saved_tensors
        with _no_autocast(dout.device):
            dq, dk, dv = ring_backward(dout, q, k, v, out, lse, km, ctx.comm, ctx.plan, ctx.softcap, ctx.scale,
                                       ctx.bwd)
        return dq, dk, dv, None, None, None, None, None, None, None


def ring_attention(q, k, v, comm: RingComm, *, plan: RingPlan, key_mask: torch.Tensor | None, softcap: float,
                   scale: float, fwd, bwd) -> torch.Tensor:
    """Run the ring loop (inputs already validated). q: (B, n, H, D); k, v: (B, n, Hkv, D) -> (B, n, H, D)."""
    with _no_autocast(q.device):
        return _RingFlashAttn.apply(q, k, v, key_mask, comm, plan, softcap, scale, fwd, bwd)


def _ring_all_gather_impl(x: torch.Tensor, comm: RingComm, dim: int) -> torch.Tensor:
    pieces = [x] * comm.size
    cur = x.contiguous()
    for t in range(1, comm.size):
        (cur,) = comm.send_recv(cur).wait()
        pieces[(comm.rank - t) % comm.size] = cur
    return torch.cat(pieces, dim) if comm.size > 1 else x


def _ring_reduce_scatter_impl(x: torch.Tensor, comm: RingComm, dim: int) -> torch.Tensor:
    """Chunk j of x (along ``dim``) is summed over the ring and lands on ring position j."""
    if comm.size == 1:
        return x
    wide = x.dtype in (torch.float16, torch.bfloat16)  # partial sums travel in fp32
    chunks = [c.float() if wide else c for c in x.chunk(comm.size, dim)]
    # The sum for owner j starts at j + 1 and gains one term per hop, reaching j after W - 1 hops.
    acc = chunks[(comm.rank - 1) % comm.size].contiguous()
    for t in range(1, comm.size):
        (acc,) = comm.send_recv(acc).wait()
        acc = acc + chunks[(comm.rank - 1 - t) % comm.size]
    return acc.to(x.dtype)


class _RingAllGather(torch.autograd.Function):
    """y = cat over the ring's positions of x (along dim). Adjoint: ring reduce-scatter (sum)."""

    @staticmethod
    def forward(ctx, x, comm, dim):
        ctx.comm, ctx.dim = comm, dim
        return _ring_all_gather_impl(x, comm, dim)

    @staticmethod
    def backward(ctx, grad):
        return _RingReduceScatter.apply(grad.contiguous(), ctx.comm, ctx.dim), None, None


class _RingReduceScatter(torch.autograd.Function):
    """y_j = sum over the ring of chunk j of x (along dim). Adjoint: ring all-gather."""

    @staticmethod
    def forward(ctx, x, comm, dim):
        ctx.comm, ctx.dim = comm, dim
        return _ring_reduce_scatter_impl(x, comm, dim)

    @staticmethod
    def backward(ctx, grad):
        return _RingAllGather.apply(grad.contiguous(), ctx.comm, ctx.dim), None, None


def ring_all_gather(x: torch.Tensor, comm: RingComm, dim: int) -> torch.Tensor:
    """Differentiable all-gather restricted to the ring: the ring positions' tensors concatenated along dim."""
    return _RingAllGather.apply(x, comm, dim)


def ring_reduce_scatter(x: torch.Tensor, comm: RingComm, dim: int) -> torch.Tensor:
    """Differentiable reduce-scatter (sum) restricted to the ring: chunk j of the sum lands on position j."""
    return _RingReduceScatter.apply(x, comm, dim)
