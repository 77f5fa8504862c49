"""All-gather KV: every rank gathers the whole key/value sequence once and attends its own queries to it.

Note [All-gather KV]
    W ranks, rank r holding n queries and n keys/values (any layout):

        forward:   K, V, key mask  <- all_gather(k, v, key mask)        (W n kv rows; with GQA kv is small)
                   out, lse        =  block calls of ``gathered_plan``   (one step, fp32 state, Note
                                                                          [Gathered plans])
        backward:  K, V            <- all_gather(k, v) again             (or the forward's, kept when the
                                                                          buffer is at most GATHER_KEEP_ROWS
                                                                          shards: ``exchange.gather_keeps``)
                   dQ, dK, dV      =  block calls; dK, dV summed in fp32 over the whole buffer
                   dk, dv          <- reduce_scatter(dK, dV) in fp32, then rounded to the input dtype once

    The partial dK/dV sums cross the wire in fp32, the ring's rule: a bf16 reduce-scatter rounds at every hop (with
    flash-attn-4 the sparse exchange's rows go home in the inputs' dtype instead: each is one partial, summed once
    by its owner, Note [Sparse gather]). Measured on exact partial gradients of causal attention
    (docs/bench/strategies.md, "Reduction precision"): a bf16 reduction's max error is 1.5-2.5x that of
    fp32-then-round at W = 2-8 and 8.2x at W = 16, for twice the reduce-scatter bytes. Compared with the ring: the
    same FLOPs, no chain of W dependent hops, fewer and larger kernel calls (a contiguous rank makes 2, a zigzag
    rank 4), and S x Hkv x D of key/value memory per rank during the call instead of n x Hkv x D.

    The backward runs "others first", so that the reduction overlaps with the rest of it. The plan is split
    (``split_local``, cached on the plan as "own keys first", the split the sparse forward runs in that
    order): step 0 the blocks reading this rank's own keys only, step 1 the rest (a block reading own and
    other keys, across a boundary with a window or a document, is in step 1):

        compute:  | step 1: dQ, dK, dV of the whole buffer |  step 0: dQ, dk_own, dv_own  |          | add |
        wire:                                              | reduction of step 1's dK, dV (fp32) ...  |
                                                          post                                      wait

        dense:    reduce_scatter of step 1's dK, dV (every rank's rows summed over ranks; this rank's rows
                  hold only what step 1's boundary blocks wrote to them); step 0's dk_own, dv_own are this
                  rank's keys, added to the received rows (buffer row i is local row "own rows before i")
        sparse:   ``post_scatter_add``: the other ranks' rows leave at the post; with own rows by runs, step
                  0's dk_own, dv_own, step 1's terms on own rows and what comes back are summed per row over
                  the shard (``_own_sums``, a ``RowSum`` each); else step 0 adds into the buffer's own rows,
                  which the wait reads and adds with what came back (Note [Sparse gather])

    dQ accumulates over both steps in one fp32 accumulator, dK, dV in fp32, and each is rounded to the input dtype
    once, as before. With packing kernels (flash-attn-4) the calls write into their sums where they can (Note
    [Packed steps]: slots): the forward's outputs into the rank's state and the backward's dq into its dQ sum, over
    both steps; with the sparse exchange and own rows by runs, step 0 reads the shard's own rows
    (``own_keys_in_shard``, its blocks split at the runs; in the forward too, whose buffer then gets only the own
    rows step 1 reads: ``_forward_plan``), so that its dK/dV are rows of the shard's sums and are written there, and
    step 1's terms on own rows go to those sums as the kernel returned them, the buffer (in the dtype they travel
    in) holding only the rows that go home. Every rank posts the reduction at the same place (after its step 1,
    whatever its blocks), so the collectives match. What overlaps is step 0's work: for causal attention the
    diagonal blocks (of a contiguous rank r's pairs 1 in 2r + 1, of a zigzag rank's about 1 in 2W), with windows or
    documents the blocks inside the rank's own keys, on a rank with none nothing. The price: with packing kernels
    (Note [Packed steps]) the two steps are packed apart, possibly into more calls than one step's, and K, V are
    freed after step 0, no longer before the reduction's send buffers are made.
"""

from __future__ import annotations

import itertools

import torch
from torch.autograd.function import once_differentiable

from distcomm import _groups
from distcomm.ring import RingComm
from distcomm_attention import transport
from distcomm_attention.kernels.contract import (RowSum, Slots, _runs, _same_view, _zero_untouched, call_spans,
                                                 copy_all, slot_order)
from distcomm_attention.planning.exchange import Exchange, gather_keeps, split_block
from distcomm_attention.planning.plans import (gathered_in_natural_order, natural_inverse, natural_order, own_rows,
                                                split_local)
from distcomm_attention.planning.visibility import RingPlan
from distcomm_attention._device import on_device
from distcomm_attention.strategies.sparse_gather import SparseGather
from distcomm_attention.strategies.ring import (_dq_result, _no_autocast, _sum_terms, backward_start, block_grads,
                                                packed, return_dtype, ring_forward, step_grads)

__all__ = ["AllGatherKV", "allgather_attention", "gather_kv", "local_backward"]


def _reordered(x: torch.Tensor, index: torch.Tensor | None) -> torch.Tensor:
    """``x[:, index]`` (``index`` a cached host tensor, or None: ``x`` itself). The reduction's way back from
    the buffer's order gathers by the inverse index too: an index put there (``out[:, order] = x``) held a
    wait for the GPU on every call with a new plan (tests/test_gpu_host_sync.py)."""
    return x if index is None else x.index_select(1, on_device(index, x.device))


def _rows(x: torch.Tensor) -> torch.Tensor:
    """(B, n, ...) -> (n, B, ...): the sequence along dim 0, where the transport moves rows."""
    return x.transpose(0, 1).contiguous()


def gather_kv(k, v, key_mask, group, order):
    """(K, V, key mask) of the whole sequence, in the plan's buffer order (no autograd): one all-gather each,
    posted together through the transport (Note [Transport])."""
    t = transport.for_group(group)
    tensors = [k, v] + ([key_mask.view(torch.uint8)] if key_mask is not None else [])
    with torch.no_grad():
        pending = [t.all_gather(_rows(x)) for x in tensors]
        gathered = [_reordered(p.wait()[0].transpose(0, 1), order) for p in pending]
    k_all, v_all = gathered[0], gathered[1]
    return k_all, v_all, gathered[2].view(torch.bool) if key_mask is not None else None


class _Received:
    """Reduce-scatters in flight; ``wait()`` gives their results (B, n, ...) in the order posted."""

    def __init__(self, pending):
        self._pending = pending

    def wait(self) -> tuple[torch.Tensor, ...]:
        return tuple(p.wait()[0].transpose(0, 1) for p in self._pending)


def reduce_scatter_kv(dk_all, dv_all, group, inverse) -> _Received:
    """Post the sums over ranks of the buffers' dK, dV (in their dtype), together, taken back into the
    source-order concatenation by ``inverse`` (``plans.natural_inverse``, or None); ``wait()`` gives this
    rank's rows (what is sent may be a view of the buffers: they are not to change before the wait)."""
    t = transport.for_group(group)
    return _Received([t.reduce_scatter(_rows(_reordered(x, inverse))) for x in (dk_all, dv_all)])


def _kept_once(own):
    """Step 1's parts on own rows, (shard rows a, z, dK, dV), copied once into one tensor each (n rows at most),
    so that the kernels' buffers, up to the whole gathered span, can go now."""
    if not own:
        return own
    kept = [torch.cat([part[i] for part in own], 1) for i in (2, 3)]
    at = list(itertools.accumulate((z - a for a, z, _, _ in own), initial=0))
    return [(a, z, *(x[:, at[i]:at[i + 1]] for x in kept)) for i, (a, z, _, _) in enumerate(own)]


def _depth(spans) -> int:
    """The most of the [start, stop) ``spans`` (any iterable) that share a row."""
    spans = [(a, b) for a, b in spans if b > a]
    edges = sorted([(a, 1) for a, _ in spans] + [(b, -1) for _, b in spans])
    depth = most = 0
    for _, step in edges:  # a stop sorts before a start at the same row: [a, b) and [b, c) share none
        depth += step
        most = max(most, depth)
    return most


def local_backward(dout, q, k, v, out, lse, key_mask, plan: RingPlan, softcap: float, scale: float, bwd):
    """Gradients of a one-step plan: dq in q's dtype; dk, dv (shaped like k, v) in the accumulation dtype."""
    dout, acc_dtype, delta, dq = backward_start(dout, q, out, bwd)
    dk, dv = step_grads(dout, q, k, v, out, lse, delta, key_mask, dq, plan, 0, softcap, scale, bwd, acc_dtype)
    return _dq_result(dq, q.dtype), dk, dv




class _Arriving:
    """The ring loop's view of a sparse gather in flight: its one "hop" is the arrival of the other ranks'
    keys (the plan's step 0 reads own rows, step 1 the rest; Note [Sparse gather])."""

    size, rank = 2, 0

    def __init__(self, arrival):
        self._arrival = arrival

    def send_recv(self, *tensors, shift: int = 1, **_):
        return self._arrival


class AllGatherKV:
    """The all-gather computation over ``group`` for one call's plan (shared by the strategy and the hybrid):
    ``forward(q, k, v, key_mask) -> (out, lse)``, ``backward(dout, q, k, v, out, lse, key_mask) -> (dq, dk,
    dv)``, every tensor this rank's (see Note [All-gather KV])."""

    def __init__(self, group, layout: str, local_len: int, plan: RingPlan, softcap: float, scale: float, fwd, bwd,
                 exchange: Exchange | None = None):
        self._group = _groups.hold(group)  # kept by the autograd graph: not keeping the group alive
        self.plan, self.softcap, self.scale, self.fwd, self.bwd = plan, softcap, scale, fwd, bwd
        world = _groups.group_size(group) if exchange is None else exchange.ring_size
        natural = gathered_in_natural_order(layout)
        self.order = natural_order(layout, world, local_len) if natural else None
        # the reduction's way back (the dense gather only: the sparse exchange places its rows itself)
        self.inverse = natural_inverse(layout, world, local_len) if natural and exchange is None else None
        self._world, self._local_len, self._layout = world, local_len, layout
        self._rank = _groups.group_rank(group) if exchange is None else None  # (the exchange knows its own)
        self.one = RingComm(group, 1) if world > 1 else RingComm(None)
        # only the keys the plan reads (Note [Sparse gather]); ``plan`` then indexes the compacted buffer
        self.sparse = None if exchange is None else SparseGather(transport.for_group(group), exchange, layout)
        if self.sparse is not None:  # decided from the plan, alike on every rank (the second exchange is collective)
            self.sparse.keep = gather_keeps(exchange, world, local_len)
        self.keep_gathered = exchange is None and gather_keeps(None, world, local_len)
        self._kept = None  # a buffer small enough to keep for the backward (no second exchange)

    def _gather(self, k, v, key_mask):
        if self._kept is not None:
            kept, self._kept = self._kept, None
            return kept
        if self.sparse is not None:
            with torch.no_grad():
                return self.sparse.gather(k, v, key_mask)
        return gather_kv(k, v, key_mask, self.group, self.order)

    def _own(self) -> torch.Tensor:
        """(buffer rows,) bool: which rows of the key buffer are this rank's keys."""
        if self.sparse is not None:
            return self.sparse.is_own()
        return own_rows(self._layout, self._world, self._rank, self._local_len)

    def own_keys_first(self) -> RingPlan:
        """The plan as two steps, the blocks reading this rank's own keys only, then the rest (Note [All-gather
        KV]; cached on the plan)."""
        return self.plan.cached("own keys first", lambda: split_local(self.plan, self._own()))

    def _own_rows_before(self) -> torch.Tensor:
        """(buffer rows + 1,) int64 on the host: [i] of this rank's keys precede buffer row i. With the dense
        buffer, an own key's buffer row i is local row [i]."""
        return self.plan.cached("own rows before", lambda: torch.cat(
            [torch.zeros(1, dtype=torch.int64), self._own().to(torch.int64).cumsum(0)]))

    def _spans(self, plan: RingPlan, i: int, km, q, keys, backward: bool = True):
        """``call_spans`` of step i's packed calls, or None where the step runs a call per block."""
        kernel = self.bwd if backward else self.fwd
        calls = packed(plan, i, kernel, km, q.device, backward)
        if calls is None:
            return None
        b, n, nk = q.shape[0], q.shape[1], keys.shape[1]
        return plan.cached(("call spans", i, backward, b, n, nk), lambda: call_spans(calls, b, n, nk))

    @staticmethod
    def _row_slots(plan: RingPlan, spans, kernel) -> Slots | None:
        """The slots of the rank's state or dQ sum (``MergeState.slot``, ``RowSum.slot``): which packed calls
        (``spans``: each step's ``call_spans`` in the order they run, or None) of ``kernel`` write their output or
        dq straight into it (``slot_order``; a kernel writing only its segments' rows, ``writes_segments_only``,
        may be granted spans that overlap where their runs do not); None where no call does."""
        segments = getattr(kernel, "writes_segments_only", False)

        def make():
            return slot_order([(row_span, rows) for step in spans if step is not None
                               for row_span, rows, _, _ in step], segments)

        order = plan.cached(("row slots", tuple(spans), segments), make)
        return None if order is None else Slots(order)

    def own_keys_in_shard(self) -> RingPlan | None:
        """Step 0 of ``own_keys_first`` (the blocks on own keys) reading the shard's rows instead of the buffer's
        (one step), so that its calls' dK/dV are rows of the shard's sums, written there by the kernel
        (``RowSum.slot``). Own rows by runs (Note [Sparse gather]) only; a block is split where it crosses from
        one run of own rows to the next, and None is returned, to be safe, for a block without intervals that
        would need it (the runs are apart in the buffer, so a block on own keys only does not cross one)."""
        def make():
            runs = tuple((at, at + length) for _, at, length in self.sparse.own_runs)
            shard_row = {at: a for a, at, _ in self.sparse.own_runs}
            blocks = []
            for block in self.own_keys_first().blocks[0]:
                if block.mode != "interval" and sum(a < block.kv.stop and b > block.kv.start for a, b in runs) > 1:
                    return None
                blocks.extend(split_block(block, runs, shard_row))
            return RingPlan((0,), (tuple(blocks),), self.plan.documents)

        return self.plan.cached("own keys in shard rows", make)

    def _by_runs(self) -> bool:
        """Whether the sparse exchange's own rows and what comes back for them go by runs (Note [Sparse gather]):
        then the blocks on own keys read the shard's rows (``own_keys_in_shard``), forward and backward alike."""
        return self.sparse is not None and self.sparse.own_all and self.sparse.returns_by_runs

    def _forward_plan(self) -> tuple[RingPlan, tuple | None]:
        """(plan, own rows to place) of the sparse forward. Where the backward runs its blocks on own keys over
        the shard's rows (own rows by runs, ``own_keys_in_shard``), the forward does too: its step 0 those
        blocks, step 1 ``own_keys_first``'s rest on the buffer, and the buffer gets only the own rows step 1's
        blocks read ((shard row, buffer row, length) runs; the backward's step 1 reads no other: the same
        blocks; cached on the in-shard plan). Else ``own_keys_first`` on the buffer, every own row placed (None)."""
        sparse = self.sparse
        in_shard = self.own_keys_in_shard() if self._by_runs() else None
        if in_shard is None:
            return self.own_keys_first(), None

        def make():
            plan = self.own_keys_first()
            read = _runs((b.kv.start, b.kv.stop) for b in plan.blocks[1])
            place = []
            for a, at, length in sparse.own_runs:
                for lo, hi in read:
                    lo, hi = max(lo, at), min(hi, at + length)
                    if lo < hi:
                        place.append((a + lo - at, lo, hi - lo))
            return RingPlan((0, 1), (in_shard.blocks[0], plan.blocks[1]), plan.documents), tuple(place)

        return in_shard.cached("sparse forward", make)

    @staticmethod
    def _own_slots(plan: RingPlan, spans, kernel) -> tuple | None:
        """Which of ``own_keys_in_shard``'s packed calls of ``kernel`` write their dK/dV straight into the own keys'
        sums, as a ``slot_order`` over their shard-row key spans (one ``Slots`` of it for each of dK and dV), or
        None."""
        segments = getattr(kernel, "writes_segments_only", False)
        return plan.cached(("own slots", spans, segments),
                           lambda: slot_order([(key_span, keys) for _, _, key_span, keys in spans], segments))

    @staticmethod
    def _buffers(k_all, v_all, dtype):
        """Uninitialised (B, m, Hkv, D) buffers shaped like the gathered keys and values, in ``dtype``."""
        if k_all.shape == v_all.shape:
            return torch.empty((2, *k_all.shape), dtype=dtype, device=k_all.device).unbind(0)
        return tuple(torch.empty(x.shape, dtype=dtype, device=x.device) for x in (k_all, v_all))

    def _home_slots(self, plan: RingPlan, spans, k_all, v_all, wire):
        """(dK, dV buffers in ``wire``, the ``dkv_into`` that hands step 1's calls their rows) where step 1's
        packed calls (``spans``) can all write their dK/dV straight into the buffers that go home: ``wire`` is the
        inputs' dtype (the kernel's, ``return_dtype``; a term in another would be copied), no two calls' key runs
        share a row (each row one term, sent as the kernel wrote it) and ``slot_order`` grants every call (a
        kernel writing its whole span: spans apart); else None (the terms are summed into them,
        ``_others_sums``)."""
        if spans is None or wire != k_all.dtype:
            return None
        segments = getattr(self.bwd, "writes_segments_only", False)

        def make():
            runs = [run for _, _, _, keys in spans for run in keys]
            if any(key_span is None for _, _, key_span, _ in spans) or \
                    sum(b - a for a, b in runs) != sum(b - a for a, b in _runs(runs)):  # a row two calls write
                return None
            order = slot_order([(key_span, keys) for _, _, key_span, keys in spans], segments)
            return order if order is not None and all(granted for _, granted in order) else None

        order = plan.cached(("home slots", spans, segments), make)
        if order is None:
            return None
        dk_all, dv_all = self._buffers(k_all, v_all, wire)
        slots = Slots(order)

        def into(lo, hi, written):
            return (dk_all[:, lo:hi], dv_all[:, lo:hi]) if slots.grant(lo, hi) else None

        return dk_all, dv_all, into

    def _others_sums(self, grads, k_all, v_all, acc_dtype, wire, home=None):
        """Step 1's terms (kv rows of the buffer, dK, dV) summed on the other ranks' rows into buffers in the
        ``wire`` dtype (what goes home; the buffers' own rows are not sent), each row rounded once (through
        fp32 buffers where three or more terms reach a row or the terms are in another dtype), and their parts
        on own rows, (shard rows, dK, dV) in the kernel's dtype, for the own keys' sums (``_own_sums``): copied
        once, into one tensor each, not into the buffer. With ``home`` (``_home_slots``: one term a row) the
        kernels wrote their terms into those buffers: nothing is summed, a term a kernel wrote into a buffer of
        its own is copied in, the other ranks' rows no term reached are zeroed, and the parts on own rows are
        read where the kernel wrote them (copied once as above where a kernel wrote them elsewhere)."""
        sparse, n = self.sparse, k_all.shape[1]
        others, own = [], []
        for kv, dk_b, dv_b in grads:
            k0, k1, _ = kv.indices(n)
            pos = k0
            for a, z, off in sparse.own_ranges(k0, k1):
                if k0 + off > pos:
                    others.append((slice(pos, k0 + off), dk_b[:, pos - k0:off], dv_b[:, pos - k0:off]))
                own.append((a, z, dk_b[:, off:off + z - a], dv_b[:, off:off + z - a]))
                pos = k0 + off + z - a
            if k1 > pos:
                others.append((slice(pos, k1), dk_b[:, pos - k0:], dv_b[:, pos - k0:]))
        own_rows = tuple((at, at + length) for _, at, length in sparse.own_runs)
        depth = _depth((rows.start, rows.stop) for rows, _, _ in others)
        if home is not None:  # one term a row: in place, or copied where a kernel wrote a buffer of its own
            dk_all, dv_all, _ = home
            pairs = [(buffer[:, rows], term) for rows, *terms in others for buffer, term in zip((dk_all, dv_all), terms)
                     if not _same_view(term, buffer[:, rows])]
            copy_all([dst for dst, _ in pairs], [src for _, src in pairs])
            reached = _runs([(rows.start, rows.stop) for rows, _, _ in others] + list(own_rows))
            for buffer in (dk_all, dv_all):
                _zero_untouched(buffer, reached)
            mine = [x.untyped_storage().data_ptr() for x in (dk_all, dv_all)]
            if all([dk_b.untyped_storage().data_ptr(), dv_b.untyped_storage().data_ptr()] == mine
                   for _, _, dk_b, dv_b in own):  # written where they are read
                return dk_all, dv_all, own
            return dk_all, dv_all, _kept_once(own)
        # terms in ``wire`` that reach a row at most twice: one addition there (computed in fp32, rounded once);
        # else sums in fp32, rounded once at the end
        deep = depth > 2 or any(g.dtype != wire for _, dk_b, dv_b in others for g in (dk_b, dv_b))
        dtype = acc_dtype if deep else wire
        dk_all, dv_all = self._buffers(k_all, v_all, dtype)
        _sum_terms((dk_all, dv_all), others, unread=own_rows)
        if deep:  # rounded once, whole (own rows unset: converted, never read)
            dk_all, dv_all = dk_all.to(wire), dv_all.to(wire)
        return dk_all, dv_all, _kept_once(own)

    def _own_sums(self, acc, own_grads, in_shard: bool, step1, pending, k, v):
        """dk, dv of this rank's keys in the inputs' dtypes (Note [Sparse gather]: own rows by runs): every term
        added into ``acc``, a ``RowSum`` over the shard's rows each, so that a row one call reached keeps the
        kernel's result and only rows two terms reached are summed in fp32: the own-key calls' gradients first
        (their rows the shard's with ``in_shard``, written there where the kernel had a slot; else the
        buffer's), then step 1's terms on own rows (``step1``: (shard rows, dK, dV), ``_others_sums``), then
        what the other ranks sent back."""
        sparse = self.sparse
        for kv, *grads in own_grads:
            ranges = [(kv.start, kv.stop, 0)] if in_shard else sparse.own_ranges(kv.start, kv.stop)
            for a, z, off in ranges:
                for sums, g in zip(acc, grads):
                    sums.add(a, z, g[:, off:off + z - a])
        for a, z, *grads in step1:
            for sums, g in zip(acc, grads):
                sums.add(a, z, g)
        for returning, sums in zip(pending, acc):
            returning.add_returned(sums)
        return acc[0].result(k.dtype), acc[1].result(v.dtype)

    @property
    def group(self):
        return _groups.unhold(self._group)

    @staticmethod
    def natural(*ts):
        """As Ulysses' inner (the hybrid's all-gather dimension) rows stay in source order."""
        return ts

    source = natural

    def forward(self, q, k, v, key_mask):
        """The blocks' outputs go straight into the rank's state where a packed call has a slot (``_row_slots``)."""
        if self.sparse is None:
            k_all, v_all, km_all = self._gather(k, v, key_mask)
            if self.keep_gathered:
                self._kept = (k_all, v_all, km_all)
            slots = self._row_slots(self.plan, (self._spans(self.plan, 0, km_all, q, k_all, backward=False),),
                                    self.fwd)
            return ring_forward(q, k_all, v_all, km_all, self.one, self.plan, self.softcap, self.scale, self.fwd,
                                slots)
        # the blocks on own keys run while the other ranks' keys arrive (Note [Sparse gather])
        plan, place = self._forward_plan()
        with torch.no_grad():
            arrival = self.sparse.post(k, v, key_mask, own=place)
        k_buf, v_buf, km_buf = arrival.local()
        km_buf = None if km_buf is None else km_buf.view(torch.bool)
        if place is None:  # step 0 on the buffer's own rows
            first = (k_buf, v_buf, km_buf)
        else:  # step 0 on the shard's rows
            first = (k, v, key_mask)
        spans = (self._spans(plan, 0, first[2], q, first[0], backward=False),
                 self._spans(plan, 1, km_buf, q, k_buf, backward=False))
        out, lse = ring_forward(q, *first, _Arriving(arrival), plan, self.softcap, self.scale, self.fwd,
                                self._row_slots(plan, spans, self.fwd))
        if self.sparse.keep:
            k_all, v_all, km_all = arrival.wait()
            self._kept = (k_all, v_all, None if km_all is None else km_all.view(torch.bool))
        return out, lse

    def backward(self, dout, q, k, v, out, lse, key_mask):
        """Others first (Note [All-gather KV]): the reduction of the dK/dV that travel runs while the blocks on
        this rank's own keys do. Packed calls write their gradients straight into the sums where they can
        (Note [Packed steps]: slots)."""
        k_all, v_all, km_all = self._gather(k, v, key_mask)
        plan = self.own_keys_first()
        dout, acc_dtype, delta, dq = backward_start(dout, q, out, self.bwd)
        by_runs = self._by_runs()
        in_shard = self.own_keys_in_shard() if by_runs else None
        # step 0 (own keys): over the shard's rows where it can, else the buffer's
        own = (k.contiguous(), v.contiguous(), key_mask, in_shard) if in_shard is not None else \
            (k_all, v_all, km_all, plan)
        spans = (self._spans(plan, 1, km_all, q, k_all), self._spans(own[3], 0, own[2], q, own[0]))
        if isinstance(dq, RowSum):
            dq.slots = self._row_slots(plan, spans, self.bwd)
        step = (dout, q, k_all, v_all, out, lse, delta, km_all, dq, plan)
        kernel = (self.softcap, self.scale, self.bwd, acc_dtype)
        own1 = None  # step 1's terms on own rows, (shard rows, dK, dV), where they skip the buffer
        wire = return_dtype(k.dtype, acc_dtype, self.bwd)
        if by_runs:  # step 1's dK/dV straight into the buffers that go home where its calls allow it
            home = self._home_slots(plan, spans[0], k_all, v_all, wire)
            grads = block_grads(*step, 1, *kernel, dkv_into=None if home is None else home[2])
            dk_all, dv_all, own1 = self._others_sums(grads, k_all, v_all, acc_dtype, wire, home)
        else:
            dk_all, dv_all = step_grads(*step, 1, *kernel)
        if in_shard is not None:  # the gathered keys are read no more
            del step, k_all, v_all, km_all
        with torch.no_grad():
            if self.sparse is not None:
                pending = self.sparse.post_scatter_add((dk_all, dv_all), k.shape[1], wire)
            else:
                received = reduce_scatter_kv(dk_all, dv_all, self.group, self.inverse)
                del dk_all, dv_all
            into = None
            if by_runs:
                acc = (RowSum(k.shape, acc_dtype, k.device), RowSum(v.shape, acc_dtype, v.device))
                order = None if in_shard is None or spans[1] is None else self._own_slots(in_shard, spans[1], self.bwd)
                # every term not written in place is kept for the result, which sums them at once (``RowSum``)
                acc[0].slots, acc[1].slots = Slots(order or ()), Slots(order or ())
                if order is not None:  # the kernels write into the sums' rows

                    def into(lo, hi, written):
                        dk_b, dv_b = (a.slot(lo, hi, x.dtype, written) for a, x in zip(acc, (k, v)))
                        return None if dk_b is None or dv_b is None else (dk_b, dv_b)
            own_grads = block_grads(dout, q, own[0], own[1], out, lse, delta, own[2], dq, own[3], 0, *kernel,
                                    dkv_into=into)
            if in_shard is None:
                del step, k_all, v_all
            del own
            if by_runs:
                dk, dv = self._own_sums(acc, own_grads, in_shard is not None, own1, pending, k, v)
            elif self.sparse is not None:  # into the buffer's own rows, which the wait reads
                for kv, dk_b, dv_b in own_grads:
                    dk_all[:, kv] += dk_b
                    dv_all[:, kv] += dv_b
                dk, dv = (p.wait() for p in pending)
            else:  # this rank's keys: added to the summed rows
                dk, dv = received.wait()
                before = self._own_rows_before()
                for kv, dk_b, dv_b in own_grads:
                    start, stop, _ = kv.indices(before.shape[0] - 1)
                    rows = slice(int(before[start]), int(before[stop]))  # (host tensor)
                    dk[:, rows] += dk_b
                    dv[:, rows] += dv_b
        return _dq_result(dq, q.dtype), dk.to(k.dtype), dv.to(v.dtype)


class _AllGatherKVAttn(torch.autograd.Function):
    """out = attention of this rank's queries to the gathered sequence; see Note [All-gather KV].

    Adjoint: all_gather <-> reduce_scatter(sum) for dK/dV (in fp32), dQ local.
    """

    @staticmethod
    def forward(ctx, q, k, v, key_mask, computation: AllGatherKV):
        out, lse = computation.forward(q, k, v, key_mask)
        ctx.save_for_backward(q, k, v, out, lse, key_mask)
        ctx.computation = computation
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, dout):
        q, k, v, out, lse, key_mask = ctx.saved_tensors
        with _no_autocast(dout.device):
            dq, dk, dv = ctx.computation.backward(dout, q, k, v, out, lse, key_mask)
        return dq, dk, dv, None, None


def allgather_attention(q, k, v, group, *, layout: str, plan: RingPlan, key_mask, softcap: float, scale: float,
                        fwd, bwd, exchange: Exchange | None = None) -> torch.Tensor:
    """All-gather KV attention (inputs validated and verified; ``group`` resolved): q (B, n, H, D) -> (B, n, H, D).
    With ``exchange`` only the keys it names move and ``plan`` indexes the compacted buffer (Note [Sparse
    gather])."""
    computation = AllGatherKV(group, layout, q.shape[1], plan, softcap, scale, fwd, bwd, exchange)
    with _no_autocast(q.device):
        return _AllGatherKVAttn.apply(q, k, v, key_mask, computation)
