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

Note [Ulysses halves]
    When no query sees a later key (causal attention, with or without a window and documents), Ulysses'
    all-to-alls are posted in two pieces around a cut h = S / 2 of the natural order, and the kernels run in
    two calls, so that half of each direction's transfer hides behind a kernel:

        queries [0, h) read keys [0, h) only; positions increase within a shard, so the rows before h are a
        prefix of every rank's shard (p_s rows of rank s: all-to-all-v splits, known to every rank)

        forward:   post q, k, v prefixes | post q, k, v rests | wait prefixes | attend [0, h) to [0, h) |
                   post out[0, h) back | wait rests | attend [h, S) to [0, S) | post out[h, S) back | place
        backward:  post dout rests, dout prefixes | wait rests | backward of [h, S): dq, and dK, dV of every key
                   in fp32 | post dq, dK, dV of [h, S) back (complete: no query before h reads those keys) |
                   wait prefixes | backward of [0, h) | dK, dV of [0, h) summed in fp32, rounded once |
                   post back | place

    Exposed: the first piece in and the last piece out of each direction, about half of the one-piece
    schedule's transfers; hidden: the second piece in behind the first call (a quarter of the work for dense
    causal attention, more with documents) and the first piece out behind the second call. The two calls'
    work is the one call's (the plans split the same visible pairs, ``plans.half_plans``); dK, dV of keys
    before h are two calls' partial sums, added in fp32 (Note [Merging block outputs]'s rule). Used when the
    split exists, the heads are not pipelined and the inner computation is local (plain Ulysses); the
    hybrids' inner attention communicates itself and runs in one piece. Off by default (``HALVES``; measured
    in docs/bench/emulated.md, run 6); the ranks verify that they agree on the switch, which decides how many
    all-to-alls each posts, and ``auto``'s cost model predicts the schedule the switch selects.
"""

from __future__ import annotations

import functools

import torch

from torch.autograd.function import once_differentiable

from distcomm import _groups
from distcomm_attention import transport
from distcomm_attention._device import on_device
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


@functools.lru_cache(maxsize=64)
def _kv_head_ids(heads: int, kv_heads: int, degree: int) -> torch.Tensor | None:
    """``kv_head_index`` as a host tensor (cached: its device copy is made once, ``on_device``)."""
    index = kv_head_index(heads, kv_heads, degree)
    return None if index is None else torch.tensor(index)


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
HALVES = False  # plain Ulysses in two halves where they apply (Note [Ulysses halves]: measured, off by default)


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


@functools.lru_cache(maxsize=8)
def _pack_index(start: int, rows: int, degree: int, group: int, groups: int, device: torch.device) -> torch.Tensor:
    """Row (r, j) of an all-to-all's send buffer <- row ((j degree + r) groups + group) of x viewed as rows of one
    group's heads, for j in [start, start + rows) (a (batch element, token) each), made on the device once per
    shape."""
    r = torch.arange(degree, device=device).unsqueeze(1)
    j = torch.arange(start, start + rows, device=device).unsqueeze(0)
    return ((j * degree + r) * groups + group).reshape(-1)


@functools.lru_cache(maxsize=8)
def _place_index(rows: int, degree: int, device: torch.device) -> torch.Tensor:
    """Row (j, r) of a (B, n, H, D) tensor <- row (r, j) of what the all-to-all back brought (one head group)."""
    j = torch.arange(rows, device=device).unsqueeze(1)
    r = torch.arange(degree, device=device).unsqueeze(0)
    return (r * rows + j).reshape(-1)


def _gathers(x: torch.Tensor, row_elems: int | None = None) -> bool:
    """Whether rows of ``x`` move as one row gather with a computed index (``triton_rows.take_rows``, CUDA): the
    reorders always, the all-to-alls' packs and places (``row_elems`` elements a row) from rows of 1 KB, where
    it is 1.3-1.8x PyTorch's permuted copies (below, those are as fast; docs/bench/row_copies.md)."""
    if not (x.is_cuda and x.is_contiguous()):
        return False
    from distcomm_attention.kernels import triton_rows

    return row_elems is None or row_elems * x.element_size() >= triton_rows.FAST_INDEX_ROW_BYTES


def _take(x: torch.Tensor, index: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``triton_rows.take_rows`` (imported on first use: Triton is needed on CUDA only)."""
    from distcomm_attention.kernels import triton_rows

    return triton_rows.take_rows(x, index, out)


def _post(t, x: torch.Tensor, degree: int, group: int, groups: int):
    """Post the all-to-all of head group ``group`` of sequence-sharded x (B, n, H, D)."""
    b, n, h, d = x.shape
    hs = h // (degree * groups)
    if _gathers(x, hs * d):
        send = _take(x.view(-1, hs * d), _pack_index(0, b * n, degree, group, groups, x.device))
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
        if groups == 1 and _gathers(recv, recv.shape[-2] * recv.shape[-1]):
            _take(recv.view(degree * b * n, -1), _place_index(b * n, degree, device), out=out.view(b * n * degree, -1))
            continue
        out[:, :, :, g] = recv.permute(1, 2, 0, 3, 4)
    return out.view(b, n, h, d)


class Halves:
    """Ulysses' rows split at ``cut`` of the natural order (Note [Ulysses halves]), the same on every rank: the
    rows of each rank's shard in each part and where they go. ``order``: the natural order of the source-order
    concatenation of the shards (``plans.natural_order``; None when it is already natural)."""

    def __init__(self, order: torch.Tensor | None, ranks: int, local_len: int, cut: int):
        seq_len = ranks * local_len
        nat = torch.arange(seq_len) if order is None else order  # natural row i <- source-order row nat[i]
        position = torch.argsort(nat)  # of each source-order row
        before = (position < cut).view(ranks, local_len)
        prefix = before.sum(1)
        if not bool((before == (torch.arange(local_len) < prefix.unsqueeze(1))).all()):
            raise ValueError("Ulysses halves need each shard's positions in increasing order")
        self.cut, self.prefix = cut, tuple(prefix.tolist())
        rank, row = nat // local_len, nat % local_len
        counts = (prefix, local_len - prefix)
        starts = tuple(torch.cumsum(c, 0) - c for c in counts)
        first, second = slice(0, cut), slice(cut, seq_len)
        # natural row i of each part <- row order[part][i] of what arrived (the shards' parts in source order)
        self.order = (starts[0][rank[first]] + row[first],
                      starts[1][rank[second]] + row[second] - prefix[rank[second]])
        self.inverse = tuple(torch.argsort(o) for o in self.order)  # what a part sends back, in source order

    def rows(self, rank: int, part: int) -> slice:
        """The rows of ``rank``'s shard in ``part`` (0: before the cut)."""
        p = self.prefix[rank]
        return slice(0, p) if part == 0 else slice(p, None)

    def splits(self, part: int, local_len: int) -> list[int]:
        """Every rank's row count in ``part``."""
        return [p if part == 0 else local_len - p for p in self.prefix]

    def index(self, name: str, part: int, device: torch.device) -> torch.Tensor:
        """``order`` or ``inverse`` of ``part`` on ``device`` (copied once)."""
        return on_device(getattr(self, name)[part], device)  # ``halves`` is cached: so are these


@functools.lru_cache(maxsize=32)
def halves(layout, ranks: int, local_len: int) -> Halves | None:
    """The split at S / 2 of a layout's shards (Note [Ulysses halves]), or None for a sequence of one row."""
    from distcomm_attention.planning.plans import natural_order

    seq_len = ranks * local_len
    if seq_len < 2:
        return None
    return Halves(natural_order(layout, ranks, local_len), ranks, local_len, seq_len // 2)


def _post_part(t, x: torch.Tensor, degree: int, split: Halves, part: int):
    """Post the all-to-all of one part of sequence-sharded x (B, n, H, D): to rank r its heads of this rank's
    rows in the part, token-major ((tokens, B, h, D) per rank)."""
    b, n, h, d = x.shape
    hs, rows = h // degree, split.rows(t.rank, part)
    start, stop, _ = rows.indices(n)
    m = stop - start
    if b == 1 and _gathers(x, hs * d):
        send = _take(x.view(-1, hs * d), _pack_index(start, m, degree, 0, 1, x.device))
    else:
        send = x[:, rows].reshape(b, m, degree, hs, d).permute(2, 1, 0, 3, 4).contiguous()
    return t.all_to_all_v(send.view(degree * m, b, hs, d), [m] * degree, split.splits(part, n))


def _natural_part(handle, split: Halves, part: int, out: torch.Tensor) -> torch.Tensor:
    """Wait for a part and put its rows (tokens, B, h, D), source order, into ``out`` (B, rows, h, D) in
    natural order."""
    (recv,) = handle.wait()
    index = split.index("order", part, recv.device)
    if out.shape[0] == 1 and out.is_contiguous() and _gathers(recv):
        _take(recv.view(recv.shape[0], -1), index, out=out.view(out.shape[1], -1))
    else:
        out.copy_(recv.index_select(0, index).transpose(0, 1))
    return out


def _post_part_back(t, y: torch.Tensor, degree: int, split: Halves, part: int, local_len: int):
    """Post the all-to-all of a part's natural-order rows y (B, rows, h, D) back to their shards."""
    b, m, hs, d = y.shape
    index = split.index("inverse", part, y.device)
    if b == 1 and _gathers(y):
        send = _take(y.view(m, -1), index).view(m, b, hs, d)
    else:
        send = y.transpose(0, 1).index_select(0, index)
    mine = split.splits(part, local_len)[t.rank]
    return t.all_to_all_v(send, split.splits(part, local_len), [mine] * degree)


def _place_part(handle, out: torch.Tensor, degree: int, rows: slice) -> None:
    """Wait for a part on its way back and place it: out (B, n, H, D) rows ``rows``, every rank's heads."""
    (recv,) = handle.wait()
    b, n, h, d = out.shape
    start, stop, _ = rows.indices(n)
    m = stop - start
    if m == 0:
        return
    if b == 1 and _gathers(recv, (h // degree) * d) and out.is_contiguous():
        _take(recv.view(degree * m, -1), _place_index(m, degree, recv.device),
              out=out.view(n * degree, -1)[start * degree:stop * degree])
    else:
        out[:, rows] = recv.view(degree, m, b, h // degree, d).permute(2, 1, 0, 3, 4).reshape(b, m, h, d)


def _forward_halves(t, q, k, v, km, degree: int, inner, split: Halves):
    """The forward in two parts (Note [Ulysses halves]) -> (out (B, n, H, D), what the backward keeps)."""
    b, n, heads, d = q.shape
    h, hk, cut = heads // degree, k.shape[2] // degree, split.cut
    seq_len = degree * n
    pending = [[_post_part(t, x, degree, split, part) for x in (q, k, v)] for part in (0, 1)]
    kh = torch.empty(b, seq_len, hk, d, dtype=k.dtype, device=k.device)
    vh = torch.empty(b, seq_len, hk, d, dtype=v.dtype, device=v.device)
    qs, outs, lses, back = [], [], [], []
    for part, rows in ((0, slice(0, cut)), (1, slice(cut, seq_len))):
        qp = q.new_empty(b, rows.stop - rows.start, h, d)
        for handle, out in zip(pending[part], (qp, kh[:, rows], vh[:, rows])):
            _natural_part(handle, split, part, out)
        keys = slice(0, cut) if part == 0 else slice(0, seq_len)
        out, lse = inner.forward_part(part, qp, kh[:, keys], vh[:, keys], None if km is None else km[:, keys])
        back.append(_post_part_back(t, out, degree, split, part, n))
        qs.append(qp), outs.append(out), lses.append(lse)
    result = q.new_empty(b, n, heads, d, dtype=outs[0].dtype)
    for part, handle in enumerate(back):
        _place_part(handle, result, degree, split.rows(t.rank, part))
    return result, (*qs, kh, vh, *outs, *lses)


def _backward_halves(t, dout, saved, km, degree: int, inner, split: Halves):
    """The backward in two parts (Note [Ulysses halves]) -> dq (B, n, H, D), dk, dv (B, n, Hkv', D) in the
    inputs' dtypes (Hkv': the kv heads as sent)."""
    q0, q1, kh, vh, out0, out1, lse0, lse1 = saved
    b, n, heads, d = dout.shape
    cut, seq_len = split.cut, degree * n
    pending = {part: _post_part(t, dout, degree, split, part) for part in (1, 0)}
    d1 = _natural_part(pending[1], split, 1, dout.new_empty(b, seq_len - cut, *q1.shape[2:]))
    dq1, dk, dv = inner.backward_part(1, d1, q1, kh, vh, out1, lse1, km)  # dk, dv of every key, fp32
    back = {1: [_post_part_back(t, x, degree, split, 1, n)
                for x in (dq1, dk[:, cut:].to(kh.dtype), dv[:, cut:].to(vh.dtype))]}
    d0 = _natural_part(pending[0], split, 0, dout.new_empty(b, cut, *q0.shape[2:]))
    dq0, dk0, dv0 = inner.backward_part(0, d0, q0, kh[:, :cut], vh[:, :cut], out0, lse0,
                                        None if km is None else km[:, :cut])
    dk0 += dk[:, :cut]
    dv0 += dv[:, :cut]
    back[0] = [_post_part_back(t, x, degree, split, 0, n) for x in (dq0, dk0.to(kh.dtype), dv0.to(vh.dtype))]
    hk = kh.shape[2] * degree
    grads = (dout.new_empty(b, n, heads, d), kh.new_empty(b, n, hk, d), vh.new_empty(b, n, hk, d))
    for part in (1, 0):
        for handle, g in zip(back[part], grads):
            _place_part(handle, g, degree, split.rows(t.rank, part))
    return grads


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
        ids = _kv_head_ids(q.shape[2], kv_heads, degree)
        ids = None if ids is None else on_device(ids, k.device)
        if ids is not None:
            k, v = k.index_select(2, ids), v.index_select(2, ids)
        t = transport.for_group(group)
        split = None if pipelined else getattr(inner, "halves", None)
        ctx.group, ctx.degree, ctx.inner = _groups.hold(group), degree, inner
        ctx.kv_heads, ctx.pipelined, ctx.split = kv_heads, pipelined, split
        if split is not None:  # Note [Ulysses halves]
            (km,) = inner.natural(gather_key_mask(key_mask, group, degree))
            out, saved = _forward_halves(t, q.contiguous(), k.contiguous(), v.contiguous(), km, degree, inner, split)
            ctx.save_for_backward(*saved, km, ids)
            return out
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
        if groups == 1:  # (a concatenation of one would copy each of them whole)
            qh, out, lse = qs[0], outs[0], lses[0]
        else:
            qh, out, lse = torch.cat(qs, 2), torch.cat(outs, 2), torch.cat(lses, 1)
        ctx.save_for_backward(qh, kh, vh, out, lse, km, ids)
        b, n, heads, d = q.shape
        return _place(back, b, n, heads, d, degree, out.dtype, out.device)

    @staticmethod
    @once_differentiable
    def backward(ctx, dout):
        degree, inner = ctx.degree, ctx.inner
        t = transport.for_group(_groups.unhold(ctx.group))
        dout = dout.contiguous()
        if ctx.split is not None:
            *saved, km, ids = ctx.saved_tensors
            dq, dk, dv = _backward_halves(t, dout, saved, km, degree, inner, ctx.split)
            return (dq, *_kv_sum(dk, dv, ids, ctx.kv_heads), None, None, None, None, None)
        qh, kh, vh, out, lse, km, ids = ctx.saved_tensors
        h, hk = qh.shape[2], kh.shape[2]
        groups = head_groups(h, hk, backward=True) if ctx.pipelined else 1
        size = h // groups
        # one group's dk, dv are the kernels' own; several are written into one buffer each
        dk, dv = (None, None) if groups == 1 else (torch.empty_like(kh), torch.empty_like(vh))
        pending = _post(t, dout, degree, 0, groups)
        back = []
        for g in range(groups):
            (dg,) = inner.natural(_heads(pending))
            if g + 1 < groups:
                pending = _post(t, dout, degree, g + 1, groups)
            if groups == 1:
                dq_g, dk, dv = inner.backward(dg, qh, kh, vh, out, lse.contiguous(), km)
                dk, dv = dk.to(kh.dtype), dv.to(vh.dtype)
            else:
                rows, kv = slice(g * size, (g + 1) * size), _kv_of(g, size, h // hk)
                dq_g, dk[:, :, kv], dv[:, :, kv] = inner.backward(
                    dg, qh[:, :, rows], kh[:, :, kv], vh[:, :, kv], out[:, :, rows], lse[:, rows].contiguous(), km)
            back.append(_post_back(t, inner.source(dq_g)[0], degree))
        b, n, heads, d = dout.shape
        kv_back = [_post_back(t, x, degree) for x in inner.source(dk, dv)]
        dq = _place(back, b, n, heads, d, degree, dout.dtype, dout.device)
        dk, dv = (_place([p], b, n, hk * degree, d, degree, x.dtype, x.device) for p, x in zip(kv_back, (dk, dv)))
        return (dq, *_kv_sum(dk, dv, ids, ctx.kv_heads), None, None, None, None, None)


def _kv_sum(dk: torch.Tensor, dv: torch.Tensor, ids: torch.Tensor | None, kv_heads: int):
    """dk, dv of the kv heads as sent -> of the caller's kv heads: the copies of each head summed (in fp32)."""
    if ids is None:
        return dk, dv
    b, n, _, d = dk.shape
    acc = torch.float64 if dk.dtype == torch.float64 else torch.float32
    sums = (torch.zeros(b, n, kv_heads, d, dtype=acc, device=x.device).index_add_(2, ids, x.to(acc)) for x in (dk, dv))
    return tuple(x.to(dk.dtype) for x in sums)


def ulysses(q, k, v, key_mask, group, degree: int, inner, *, pipelined: bool = False) -> torch.Tensor:
    """Head-shard q, k, v over ``group``, run ``inner`` on the gathered rows (source order), shard back;
    ``pipelined``: by head groups (Note [Ulysses pipeline]: measured slower than one group on one H100 with
    emulated links, so off by default; an inner that communicates itself, the hybrids', never pipelines)."""
    if degree == 1:
        pipelined = False
    with _no_autocast(q.device):
        return _UlyssesAttn.apply(q, k, v, key_mask, group, degree, inner, pipelined)
