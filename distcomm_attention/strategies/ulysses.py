"""Ulysses: all-to-all from sequence sharding to head sharding, attention over the whole sequence, and back.

Note [Ulysses]
    W ranks, rank r holding n tokens of every head (any layout). All-to-alls through the transport (Note
    [Transport]; the backward is the adjoint all-to-all) move the sequence dimension for the head dimension:

        q (B, n, H, D)  --a2a-->  (B, W n, H / W, D)   rank r gets heads [r H/W, (r+1) H/W) of every token,
                                                        rank w's tokens at rows [w n, (w+1) n)
        attention over the whole sequence for those heads: ONE kernel call per block of the local plan
        out (B, W n, H / W, D)  --a2a-->  (B, n, H, D)

    The rows arrive in source order; for the zigzag, striped and balanced layouts they are put into natural
    order (one index_select per tensor, ``inner.natural``) so that packed documents and windows keep their
    global positions and the local plan is the plain one (a packed batch is a single varlen call). The
    reordered q, k, v and out are what the backward keeps, so each tensor is reordered once per direction:
    q, k, v and the output back in the forward, dout in and dq, dk, dv back in the backward. The key padding
    mask is all-gathered.

    GQA, with G = H / Hkv query heads per kv head and h = H / W query heads per rank:
        Hkv % W == 0         kv heads split like the query heads: Hkv / W per rank, traffic at kv size
        G % h == 0           every rank's query heads share one kv head: that head is sent to the rank
                             (kv heads replicated, as DeepSpeed's ALST does): one kv head per rank
        otherwise            kv heads expanded to one per query head
    H % W != 0 is an error naming both numbers. With a 2-D mesh the "inner" attention is itself a ring or
    all-gather over the other mesh dimension (the hybrid, strategies/hybrid.py).

Note [Ulysses pipeline]
    The all-to-alls are posted through the transport (Note [Transport]) per group of a rank's heads, so
    that one group's transfer is in flight while another group's kernels run:

        forward:   post k, v, q_0 | wait k, v, q_0 | post q_1 | attend q_0 | post out_0 back | wait q_1 | ...
        backward:  post dout_0 | wait | post dout_1 | backward of group 0 | post dq_0 back | ... | dk, dv back

    A group holds whole kv heads (query heads h read kv head h // (H / Hkv)); the forward may split the
    query heads that share one kv head over several groups (heads are independent), the backward only
    where every kv head falls in one group, so that its gradient is one kernel's, rounded once (up to
    ``MAX_GROUPS`` groups; ``head_groups``). Each group is its own kernel call: the pipeline trades a little
    kernel efficiency (fewer heads per call) for hidden communication, and its send buffers are a group's.
    The hybrids' inner attention communicates over the other mesh dimension itself and runs on all heads
    at once.

    Measured (docs/bench/emulated.md, one H100, emulated NVLink-class links, W = 8, heads 32/8: 4 query heads
    and 1 kv head per rank, so the forward runs 4 groups of one head and the backward one group): slower
    than one group on every row, 0.97 vs 1.00 of flash-attn-4 at 16k tokens per GPU and 0.86 vs 0.90 at 8k
    (a one-head kernel call is less efficient than a four-head one), 0.37 vs 0.52 on packed documents (the
    block path's per-call cost, paid per group). The strategy therefore runs one group (``pipelined=False``)
    until the block path's per-call cost is gone; the pipeline stays tested (tests/test_ulysses_pipeline.py).
"""

from __future__ import annotations

import functools

import torch

from torch.autograd.function import once_differentiable

from distcomm import _groups
from distcomm_attention import transport
from distcomm_attention.strategies.ring import _no_autocast

__all__ = ["check_heads", "kv_head_index", "gather_key_mask", "head_groups", "ulysses"]


def check_heads(heads: int, kv_heads: int, degree: int) -> None:
    """Raise ValueError unless the query heads split evenly over the Ulysses degree."""
    if heads % degree:
        allowed = [d for d in range(1, heads + 1) if heads % d == 0]
        raise ValueError(
            f"strategy 'ulysses' splits the query heads over the Ulysses degree: heads={heads} is not divisible "
            f"by the degree {degree} (degrees that divide heads={heads}: {allowed}); use strategy='ring' or "
            f"'allgather', or the hybrid with a Ulysses dimension that divides the heads"
        )


def kv_head_index(heads: int, kv_heads: int, degree: int) -> list[int] | None:
    """The kv heads to send, in rank-major order, or None to send k, v as they are (see Note [Ulysses])."""
    if kv_heads % degree == 0:
        return None
    group, per_rank = heads // kv_heads, heads // degree
    if group % per_rank == 0:
        return [(r * per_rank) // group for r in range(degree)]
    return [h // group for h in range(heads)]


def gather_key_mask(key_mask: torch.Tensor | None, group, degree: int) -> torch.Tensor | None:
    """Every rank's key padding mask rows, concatenated in source order (no autograd)."""
    if key_mask is None or degree == 1:
        return key_mask
    rows = key_mask.view(torch.uint8).transpose(0, 1).contiguous()  # (n, B): the transport moves rows
    (gathered,) = transport.for_group(group).all_gather(rows).wait()
    return gathered.transpose(0, 1).contiguous().view(torch.bool)


MAX_GROUPS = 4  # head groups a rank's heads are pipelined in (Note [Ulysses pipeline])


def head_groups(heads: int, kv_heads: int, *, backward: bool) -> int:
    """How many groups a rank's ``heads`` query heads (and ``kv_heads`` kv heads) are pipelined in: the
    largest G <= MAX_GROUPS dividing ``heads`` whose groups each read whole kv heads of their own (backward:
    every kv head in one group only, so its gradient is one kernel's, rounded once), or 1."""
    ratio = heads // kv_heads
    for groups in range(min(MAX_GROUPS, heads), 1, -1):
        size = heads // groups
        if heads % groups == 0 and (size % ratio == 0 or (not backward and ratio % size == 0)):
            return groups
    return 1


def _kv_of(group: int, size: int, ratio: int) -> slice:
    """The kv heads query heads [group * size, (group + 1) * size) read."""
    return slice(group * size // ratio, ((group + 1) * size - 1) // ratio + 1)


@functools.lru_cache(maxsize=32)
def _pack_index(rows: int, degree: int, group: int, groups: int, device: torch.device) -> torch.Tensor:
    """Row (r, j) of an all-to-all's send buffer <- row ((j degree + r) groups + group) of x viewed as rows of one
    group's heads (j: a (batch element, token) of ``rows``), made on the device once per shape."""
    r = torch.arange(degree, device=device).unsqueeze(1)
    j = torch.arange(rows, device=device).unsqueeze(0)
    return ((j * degree + r) * groups + group).reshape(-1)


@functools.lru_cache(maxsize=32)
def _place_index(rows: int, degree: int, device: torch.device) -> torch.Tensor:
    """Row (j, r) of a (B, n, H, D) tensor <- row (r, j) of what the all-to-all back brought (one head group)."""
    j = torch.arange(rows, device=device).unsqueeze(1)
    r = torch.arange(degree, device=device).unsqueeze(0)
    return (r * rows + j).reshape(-1)


def _gathers(x: torch.Tensor) -> bool:
    """Whether the packs and places of ``x`` run as one row gather with a computed index (on CUDA:
    ``triton_rows.take_rows``, 1.3-1.5x PyTorch's permuted copies on one H100, docs/bench/row_copies.md)."""
    return x.is_cuda and x.is_contiguous()


def _post(t, x: torch.Tensor, degree: int, group: int, groups: int):
    """Post the all-to-all of head group ``group`` of sequence-sharded x (B, n, H, D)."""
    b, n, h, d = x.shape
    hs = h // (degree * groups)
    if _gathers(x):
        from distcomm_attention.kernels import triton_rows

        send = triton_rows.take_rows(x.view(-1, hs * d), _pack_index(b * n, degree, group, groups, x.device))
        return t.all_to_all_v(send.view(degree, b, n, hs, d), [1] * degree, [1] * degree)
    send = x.reshape(b, n, degree, groups, hs, d)[:, :, :, group]
    return t.all_to_all_v(send.permute(2, 0, 1, 3, 4).contiguous(), [1] * degree, [1] * degree)


def _heads(handle) -> torch.Tensor:
    """Wait for a posted group: (B, W n, h, D), rows in source order."""
    (recv,) = handle.wait()
    w, b, n, h, d = recv.shape
    return recv.permute(1, 0, 2, 3, 4).reshape(b, w * n, h, d)


def _post_back(t, y: torch.Tensor, degree: int):
    """Post the all-to-all of head-sharded y (B, W n, h, D) back to sequence sharding."""
    b, s, h, d = y.shape
    return t.all_to_all_v(y.reshape(b, degree, s // degree, h, d).permute(1, 0, 2, 3, 4).contiguous(),
                          [1] * degree, [1] * degree)


def _place(handles, b: int, n: int, h: int, d: int, degree: int, dtype, device) -> torch.Tensor:
    """(B, n, H, D) from the posted groups' all-to-alls back (group g: heads g of every rank's share)."""
    groups = len(handles)
    out = torch.empty(b, n, degree, groups, h // (degree * groups), d, dtype=dtype, device=device)
    for g, handle in enumerate(handles):
        (recv,) = handle.wait()
        if groups == 1 and _gathers(recv):
            from distcomm_attention.kernels import triton_rows

            triton_rows.take_rows(recv.view(degree * b * n, -1), _place_index(b * n, degree, device),
                                  out=out.view(b * n * degree, -1))
            continue
        out[:, :, :, g] = recv.permute(1, 2, 0, 3, 4)
    return out.view(b, n, h, d)


class _UlyssesAttn(torch.autograd.Function):
    """out = attention over the whole sequence, head-sharded in between; see Note [Ulysses] and
    Note [Ulysses pipeline].

    Adjoint: all_to_all <-> all_to_all in the other direction; the kv heads' selection <-> a sum over the
    copies of each kv head (in fp32). ``inner`` computes the head-sharded attention: ``inner.forward(q, k,
    v, key_mask) -> (out, lse)`` and ``inner.backward(dout, q, k, v, out, lse, key_mask) -> (dq, dk, dv)`` on
    rows in its own order; ``inner.natural(*ts)`` / ``inner.source(*ts)`` reorder rows into it and back.
    """

    @staticmethod
    def forward(ctx, q, k, v, key_mask, group, degree: int, inner, pipelined: bool):
        kv_heads = k.shape[2]
        index = kv_head_index(q.shape[2], kv_heads, degree)
        ids = None if index is None else torch.tensor(index).to(k.device, non_blocking=True)
        if ids is not None:
            k, v = k.index_select(2, ids), v.index_select(2, ids)
        t = transport.for_group(group)
        h, hk = q.shape[2] // degree, k.shape[2] // degree
        groups = head_groups(h, hk, backward=False) if pipelined else 1
        size = h // groups
        pending_q = _post(t, q, degree, 0, groups)
        pending_kv = [_post(t, x, degree, 0, 1) for x in (k, v)]
        (km,) = inner.natural(gather_key_mask(key_mask, group, degree))
        kh, vh = inner.natural(*(_heads(p) for p in pending_kv))
        qs, outs, lses, back = [], [], [], []
        for g in range(groups):  # the next group's all-to-all in flight while this group's kernels run
            (qg,) = inner.natural(_heads(pending_q))
            if g + 1 < groups:
                pending_q = _post(t, q, degree, g + 1, groups)
            kv = _kv_of(g, size, h // hk)
            out, lse = inner.forward(qg, kh[:, :, kv], vh[:, :, kv], km)
            back.append(_post_back(t, inner.source(out)[0], degree))
            qs.append(qg), outs.append(out), lses.append(lse)
        qh, out, lse = torch.cat(qs, 2), torch.cat(outs, 2), torch.cat(lses, 1)
        ctx.save_for_backward(qh, kh, vh, out, lse, km, ids)
        ctx.group, ctx.degree, ctx.inner = _groups.hold(group), degree, inner
        ctx.kv_heads, ctx.pipelined = kv_heads, pipelined
        b, n, heads, d = q.shape
        return _place(back, b, n, heads, d, degree, out.dtype, out.device)

    @staticmethod
    @once_differentiable
    def backward(ctx, dout):
        qh, kh, vh, out, lse, km, ids = ctx.saved_tensors
        degree, inner = ctx.degree, ctx.inner
        t = transport.for_group(_groups.unhold(ctx.group))
        dout = dout.contiguous()
        h, hk = qh.shape[2], kh.shape[2]
        groups = head_groups(h, hk, backward=True) if ctx.pipelined else 1
        size = h // groups
        dk = torch.empty_like(kh)
        dv = torch.empty_like(vh)
        pending = _post(t, dout, degree, 0, groups)
        back = []
        for g in range(groups):
            (dg,) = inner.natural(_heads(pending))
            if g + 1 < groups:
                pending = _post(t, dout, degree, g + 1, groups)
            rows, kv = slice(g * size, (g + 1) * size), _kv_of(g, size, h // hk)
            dq_g, dk[:, :, kv], dv[:, :, kv] = inner.backward(
                dg, qh[:, :, rows], kh[:, :, kv], vh[:, :, kv], out[:, :, rows], lse[:, rows].contiguous(), km)
            back.append(_post_back(t, inner.source(dq_g)[0], degree))
        b, n, heads, d = dout.shape
        kv_back = [_post_back(t, x, degree) for x in inner.source(dk, dv)]
        dq = _place(back, b, n, heads, d, degree, dout.dtype, dout.device)
        dk, dv = (_place([p], b, n, hk * degree, d, degree, x.dtype, x.device) for p, x in zip(kv_back, (dk, dv)))
        if ids is not None:  # the copies of each kv head sum to its gradient
            acc = torch.float64 if dk.dtype == torch.float64 else torch.float32
            dk = torch.zeros(b, n, ctx.kv_heads, d, dtype=acc, device=dk.device).index_add_(2, ids, dk.to(acc))
            dv = torch.zeros(b, n, ctx.kv_heads, d, dtype=acc, device=dv.device).index_add_(2, ids, dv.to(acc))
            dk, dv = dk.to(dout.dtype), dv.to(dout.dtype)
        return dq, dk, dv, None, None, None, None, None


def ulysses(q, k, v, key_mask, group, degree: int, inner, *, pipelined: bool = False) -> torch.Tensor:
    """Head-shard q, k, v over ``group``, run ``inner`` on the gathered rows (source order), shard back;
    ``pipelined``: by head groups (Note [Ulysses pipeline]: measured slower than one group on one H100 with
    emulated links, so off by default; an inner that communicates itself, the hybrids', never pipelines)."""
    if degree == 1:
        pipelined = False
    with _no_autocast(q.device):
        return _UlyssesAttn.apply(q, k, v, key_mask, group, degree, inner, pipelined)
