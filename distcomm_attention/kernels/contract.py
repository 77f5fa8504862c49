"""Block backends: a kernel that attends one query block to one key block becomes the ring's kernels.

A block backend (cuDNN, flash-attn-4) offers two calls on plain full or causal blocks:

    forward(q, k, v, *, causal, scale, softcap)                 -> out (B, Sq, H, D) in q's dtype,
                                                                    lse (B, H, Sq) float32, natural log
    backward(dout, q, k, v, out, lse, *, causal, scale, softcap) -> dq, dk, dv in q's dtype

``BlockForward`` turns the first into the ring's ForwardKernel and ``BlockBackward`` the second into its
BackwardKernel (contracts in distcomm_attention.kernels.dispatch). ``call_features`` names what a call asks for
beyond plain full/causal attention, for the backends' capability checks.

A backend with FlashAttention's sliding window and variable-length batches (``takes_windows``) also runs
"interval" blocks: their band pieces (Note [Band pieces] in distcomm_attention.planning.visibility) become
``WindowCall``s, each one kernel call with ``window=(left, right)`` and, for several pieces at once, ``varlen``
boundaries over packed rows (Note [Window calls]).

Note [Window calls]
    Consecutive pieces whose rows and keys are adjacent and whose windows agree run as one varlen call:
    the rows (B*nq, H, D) and keys (B*nk, Hkv, D) of the call are packed, batch-major, and
    ``cu_seqlens_q/k`` mark each (batch element, piece). A piece with an unbounded side takes any bound that
    clips nothing (left >= nk - 1, right >= nq - 1), so a document of a diagonal block (right 0, left
    unbounded) packs with its neighbours. Packed documents of one rank are thus one kernel call per block,
    and a window is one call per chunk pair.

Note [Packed steps]
    A backend whose varlen calls take each segment's offset and length apart (FA4: ``cu_seqlens`` gives the
    offsets, ``seqused`` the lengths; ``packs = True``) runs every piece of a ring step (or of a gathered
    plan) in as few calls as these rules allow, grouped first-fit in row order:

        rows     disjoint and increasing within a call (an output row is written by one segment)
        keys     increasing starts; disjoint too in the backward (a key's dK/dV is written by one segment)
        window   one (left, right) fits every piece (Note [Window calls])

    Rows and keys that no segment of a call covers are not written by the kernel: only the runs of rows (and
    keys) a call's segments cover are merged (accumulated), the rest of its outputs is never read. A ring step with packed documents is thus one forward
    call, and the backward needs a second call only where a document split over ranks has two pieces
    reading the same keys (a rank's head and tail share); one step of all-gather KV likewise. The pieces are
    the same as the per-block calls', so the visible pairs and the arithmetic per pair are unchanged.

    Slots. A call hands the kernel a span of rows (and of keys), and the kernel may write anywhere in that
    span; where a caller knows every call of a sum in advance, a call can write its output, dq or dK/dV
    straight into the sum's buffer instead of a buffer of its own that is then copied in (``MergeState.slot``,
    ``RowSum.slot``, ``BlockBackward.packed_step``'s ``dkv_into``). ``choose_slots`` picks the calls, largest
    runs first, so that no call's span holds a row an earlier slot already wrote (checked again at each
    slot); every other call's result waits until the sum is read and is merged or added then, so that no
    later slot overwrites it. The sums are those without slots: a row's first term is still kept as the
    kernel wrote it and every later one summed in fp32, in another order at most. A kernel that writes only
    its segments' rows (``writes_segments_only``: flash-attn-4, whose varlen calls leave the rows between
    segments as they were, tests/test_gpu_backends.py) is checked by its runs instead of its span, so calls
    whose spans overlap but whose runs do not both write in place (the all-gather's calls on own keys and
    across the rank's boundaries each span most of its rows). The forward's slot takes the lse too, for one
    batch element: the state's (H, n) rows of the span, a strided view the kernel writes its runs into.

Note [Merging block outputs]
    A block backend normalises each block on its own: it returns out_b = softmax(S_b) V_b and
    lse_b = log sum exp(S_b) per row. Two blocks of the same rows combine exactly by

        lse = log(exp(lse_a) + exp(lse_b))
        out = exp(lse_a - lse) out_a + exp(lse_b - lse) out_b

    (both weights <= 1, so nothing overflows). A row no block has reached has lse = -inf and weight 0,
    and finalizes to out 0, lse -inf like the other kernels. NaN in means NaN out: a NaN lse stays NaN
    through the merge, a NaN output row stays NaN (0 * NaN is NaN), and ``finalize`` sets the lse of a row
    whose output is NaN to NaN, since a kernel may report such a row with lse -inf (flash-attn-4 treats a
    NaN row sum like an empty row) and the backward would then take it for a row that saw no key. The state
    adopts the first block that covers every row as it is, without a copy: a ring of one (one block) is
    exactly one kernel call, its out and lse returned untouched. A partial block's rows that no block reached
    before are copied into the state as the kernel returned them (a merge with an empty row gives exactly
    them); a later block's rows get their running sum in fp32 (``acc``, allocated once, never filled); rows
    no later block touches stay as their first block wrote them, with no conversion either way. ``finalize``
    rounds only the merged rows, into the first blocks' buffer (every row merged: ``acc`` rounded whole), and
    fills only the rows no block reached (out 0, lse -inf): each block's output is rounded once, by its
    kernel, and each sum once. On CUDA the merge of a run of rows is one Triton kernel
    (distcomm_attention.kernels.triton_merge: one read of each input, one write) instead of five PyTorch
    passes with fp32 temporaries.

    The backward needs no merging: given the merged (global) out and lse of a row, the block kernels'
    own backward (P = exp(S - lse), D = rowsum(dout * out)) yields exactly this block's share of dq and
    its dk, dv.
"""

from __future__ import annotations

import functools
import itertools
from typing import NamedTuple

import torch
from torch import Tensor

from distcomm_attention._device import on_device, on_device_kept
from distcomm_attention.planning.calls import Fit, PackedCall, packed_calls
from distcomm_attention.planning.visibility import BlockMask, Piece, Visibility, pieces_of

__all__ = ["BlockForward", "BlockBackward", "MergeState", "RowSum", "merge_block", "call_features", "copy_all",
           "WindowCall", "window_calls", "Varlen", "PackedCall", "packed_calls"]


def call_features(vis: Visibility, softcap: float) -> dict[str, str]:
    """What a call asks for beyond plain full or causal attention, by feature name, as it reads in messages.

    Keys: "attention_mask", "window_size", "cu_seqlens", "softcap" (only those the call uses).
    """
    features = {}
    if vis.key_mask:
        features["attention_mask"] = "attention_mask"
    if vis.window != (-1, -1) and not (vis.causal and vis.left is None):
        features["window_size"] = f"window_size={vis.window}"
    if vis.cu_seqlens is not None:
        features["cu_seqlens"] = "cu_seqlens (packed documents)"
    if softcap:
        features["softcap"] = f"softcap={softcap}"
    return features


class WindowCall(NamedTuple):
    """One kernel call over rows [q0, q1) and keys [k0, k1) of a block (see Note [Window calls]).

    ``window`` (left, right), None = unbounded; ``cu_q``/``cu_k``: the pieces' boundaries relative to q0/k0
    (None for a single piece: a plain call).
    """

    q0: int
    q1: int
    k0: int
    k1: int
    window: tuple[int | None, int | None]
    cu_q: tuple[int, ...] | None = None
    cu_k: tuple[int, ...] | None = None


class Varlen(NamedTuple):
    """Variable-length arguments of a packed call: int32 boundaries on the device and the longest piece; with
    ``used_q``/``used_k`` (Note [Packed steps]) ``cu_q``/``cu_k`` are the segments' offsets and these their
    lengths."""

    cu_q: Tensor
    cu_k: Tensor
    max_q: int
    max_k: int
    used_q: Tensor | None = None
    used_k: Tensor | None = None


def _runs(spans) -> tuple[tuple[int, int], ...]:
    """Sorted disjoint [a, b) spans with adjacent ones merged."""
    runs: list[list[int]] = []
    for a, b in sorted(spans):
        if runs and a <= runs[-1][1]:
            runs[-1][1] = max(runs[-1][1], b)
        else:
            runs.append([a, b])
    return tuple((a, b) for a, b in runs)


def _meet(rows, runs) -> bool:
    """Whether two lists of [a, b) row ranges share a row."""
    return any(a < z and x < b for a, b in rows for x, z in runs)


def choose_slots(calls, segments: bool = False) -> tuple[int, ...]:
    """Which calls write their terms straight into the sum's buffer (``RowSum.slot``, ``packed_step``'s
    ``dkv_into``), from ``calls``: (span, runs) of every call adding to it, in the order they run, where a
    call's kernel is handed its span (None: it cannot be given a slot), writes its whole span (only its runs
    with ``segments``: a kernel that writes its segments' rows only, ``writes_segments_only``) and its terms
    are its runs. Largest runs first, a call is taken when no taken call that runs before it has a run in the
    rows it writes and it has no run in the rows a taken call that runs after it writes: a slot never
    overwrites an earlier one's term, and the terms of the calls not taken are added after every slot is
    written. The taken calls' indices, sorted."""
    written = [runs if segments else () if span is None else (span,) for span, runs in calls]
    taken: list[int] = []
    order = sorted(range(len(calls)), key=lambda i: -sum(b - a for a, b in calls[i][1]))
    for i in order:
        span, runs = calls[i]
        if span is None or span[1] <= span[0] or not runs:
            continue
        if all(not _meet(written[i], calls[j][1]) if j < i else not _meet(written[j], runs) for j in taken):
            taken.append(i)
    return tuple(sorted(taken))


def slot_order(calls, segments: bool = False) -> tuple[tuple[tuple[int, int], bool], ...] | None:
    """``choose_slots``' answer for ``calls`` ((span, runs) in the order they run; span None: the call asks for
    no slot) as the (span, granted) of each call that asks, in that order (``Slots``); None where no call
    is granted (the sum then runs without slots)."""
    taken = set(choose_slots(calls, segments))
    if not taken:
        return None
    return tuple((span, i in taken) for i, (span, _) in enumerate(calls) if span is not None)


class Slots:
    """A sum's slots for one call (``slot_order``): each request takes the next (span, granted) entry, so that the
    call ``choose_slots`` picked gets the slot even where several calls share a span; a request whose span is
    not the expected one ends the grants (the sum stays exact, it only writes nothing more in place)."""

    __slots__ = ("order", "asked")

    def __init__(self, order: tuple[tuple[tuple[int, int], bool], ...]):
        self.order, self.asked = order, 0

    def grant(self, r0: int, r1: int) -> bool:
        i, self.asked = self.asked, self.asked + 1
        if i >= len(self.order) or self.order[i][0] != (r0, r1):
            self.asked = len(self.order)  # out of step: no more grants
            return False
        return self.order[i][1]


def _granted(slots: Slots | None, touched, r0: int, r1: int, written=None) -> bool:
    """Whether a call asking for rows [r0, r1) of a sum gets a slot: ``slots`` grants the request (which counts
    it) and no term written in place before (``touched``) holds a row the kernel writes (``written``: its
    segments' rows, for a kernel that writes only those; else the whole span)."""
    return (slots is not None and slots.grant(r0, r1) and r1 > r0
            and not _meet(((r0, r1),) if written is None else written, touched))


def _owns(term: Tensor) -> bool:
    """Whether ``term`` is the whole of its memory (a kernel's own output), so that adopting it as a sum's buffer
    keeps nothing else alive and returns a contiguous tensor."""
    return term.is_contiguous() and term.untyped_storage().nbytes() == term.numel() * term.element_size()


def _same_view(a: Tensor, b: Tensor) -> bool:
    """Whether ``a`` and ``b`` are the same elements of the same memory (shape, strides, first element, dtype)."""
    return (a.shape == b.shape and a.dtype == b.dtype and a.data_ptr() == b.data_ptr()
            and all(x == y for x, y, n in zip(a.stride(), b.stride(), a.shape) if n > 1))


def _rows_at(term: Tensor, buffer: Tensor, r0: int) -> bool:
    """Whether ``term`` (B, m, ...) is ``buffer[:, r0:r0 + m]`` itself, the same memory (a kernel wrote it there)."""
    return (term.dtype == buffer.dtype and term.stride()[1:] == buffer.stride()[1:]
            and (term.shape[0] == 1 or term.stride(0) == buffer.stride(0))
            and term.data_ptr() == buffer.data_ptr() + r0 * buffer.stride(1) * buffer.element_size())


class _Packed(NamedTuple):
    varlen: Varlen
    rows: tuple[tuple[int, int], ...]  # the row runs the call writes
    keys: tuple[tuple[int, int], ...]  # the key runs
    row_span: tuple[int, int]  # the rows handed to the kernel (the pieces' span for one batch element, else all)
    key_span: tuple[int, int]  # the keys handed to the kernel: a slice of the step's keys ...
    key_index: Tensor | None  # ... or, when the key runs are sparse in it, only the runs, gathered
    key_at: tuple[int, ...]  # where each key run starts among the keys handed to the kernel

    def call_keys(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """The keys and values handed to the kernel, from the step's (B, nk, Hkv, D)."""
        if self.key_index is not None:
            return k.index_select(1, self.key_index), v.index_select(1, self.key_index)
        lo, hi = self.key_span
        return k[:, lo:hi], v[:, lo:hi]


def copy_all(dsts, srcs) -> None:
    """``dst.copy_(src)`` for each pair, as one launch where they allow it (``torch._foreach_copy_``: contiguous
    pairs of one dtype, e.g. runs of rows of (1, n, ...) tensors), not a copy each: a copy of a few rows takes
    a few microseconds, as long as the gap after it (eight runs of rows, 33 us, one H100)."""
    if len(dsts) == 1:
        dsts[0].copy_(srcs[0])
    elif dsts:
        torch._foreach_copy_(list(dsts), list(srcs))


def _on(x: Tensor | None, device: torch.device) -> Tensor | None:
    """A cached host index on ``device`` (``_device.on_device``: copied once, without a host wait, and waited
    for by every stream that reads it)."""
    return None if x is None else on_device(x, device)


def _varlen_on(varlen: Varlen, device: torch.device) -> Varlen:
    """``varlen`` (host tensors, cached) with its boundaries on ``device``."""
    return varlen._replace(cu_q=_on(varlen.cu_q, device), cu_k=_on(varlen.cu_k, device),
                           used_q=_on(varlen.used_q, device), used_k=_on(varlen.used_k, device))


def _packed_varlen(call: PackedCall, batch: int, n: int, nk: int, device: torch.device) -> _Packed:
    """``_packed_host``'s arguments with its index tensors on ``device`` (looked up once per call and stream)."""
    packed = _packed_host(call, batch, n, nk)
    if device.type == "cpu":
        return packed
    return on_device_kept(packed.varlen.cu_q, device, lambda: packed._replace(
        varlen=_varlen_on(packed.varlen, device), key_index=_on(packed.key_index, device)))


@functools.lru_cache(maxsize=1024)
def _packed_host(call: PackedCall, batch: int, n: int, nk: int) -> _Packed:
    """The varlen arguments of a packed call over ``batch`` packed batch elements, and the runs of rows and keys
    its segments cover (cached; index tensors on the host: ``_packed_varlen`` puts them on the device, where
    the cache would otherwise copy each from pageable memory on every new plan and make the host wait).

    The kernel gets only the rows between the first and last piece's and the keys between the first and the
    last key run (for one batch element; with several, every row and key: a slice of each would be a copy);
    its row- and key-sized work outside the segments (zero fills, rowsum(dout * out), the dQ/dK/dV
    conversions) shrinks with them. Key runs spread over less than a third of their span (documents of one
    rank scattered over a gathered sequence) are gathered into one buffer instead: copying the visible keys
    is cheaper than the kernel's per-key work over the span.
    """
    ps = call.pieces
    rows, keys = _runs((p.q0, p.q1) for p in ps), _runs((p.k0, p.k1) for p in ps)
    covered = sum(b - a for a, b in keys)
    if batch == 1:
        (r_lo, r_hi), (lo, hi) = (rows[0][0], rows[-1][1]), (keys[0][0], keys[-1][1])
    else:
        (r_lo, r_hi), (lo, hi) = (0, n), (0, nk)
    index = None
    if 3 * covered < hi - lo:
        index = torch.cat([torch.arange(a, b) for a, b in keys])
        key_at = tuple(itertools.accumulate((b - a for a, b in keys[:-1]), initial=0))
        width = covered
    else:
        key_at = tuple(a - lo for a, _ in keys)
        width = hi - lo

    def key_pos(x: int) -> int:  # a piece's first key among the keys handed to the kernel
        j = max(i for i, (a, _) in enumerate(keys) if a <= x)
        return key_at[j] + x - keys[j][0]

    cu_q = [e * n + p.q0 - r_lo for e in range(batch) for p in ps] + [batch * (r_hi - r_lo)]
    cu_k = [e * width + key_pos(p.k0) for e in range(batch) for p in ps] + [batch * width]
    used_q = [p.q1 - p.q0 for _ in range(batch) for p in ps]
    used_k = [p.k1 - p.k0 for _ in range(batch) for p in ps]
    i32 = dict(dtype=torch.int32)
    varlen = Varlen(torch.tensor(cu_q, **i32), torch.tensor(cu_k, **i32), max(used_q), max(used_k),
                    torch.tensor(used_q, **i32), torch.tensor(used_k, **i32))
    return _Packed(varlen, rows, keys, (r_lo, r_hi), (lo, hi), index, key_at)


@functools.lru_cache(maxsize=256)
def call_spans(calls: tuple[PackedCall, ...], batch: int, n: int, nk: int):
    """(row span, row runs, key span or None, key runs) of each packed call over ``batch`` batch elements, n rows
    and nk keys: the rows and keys its kernel writes (its spans) and those its segments cover (its runs). The
    key span is None where the call's keys are gathered (``_Packed.key_index``): its dK/dV are not a slice."""
    out = []
    for call in calls:
        p = _packed_host(call, batch, n, nk)
        out.append((p.row_span, p.rows, None if p.key_index is not None else p.key_span, p.keys))
    return tuple(out)


@functools.lru_cache(maxsize=256)
def window_calls(pieces: tuple[Piece, ...]) -> tuple[WindowCall, ...]:
    """Group band pieces into kernel calls (Note [Window calls]); cached: a plan's block asks again on every
    call (the one-block backward of a ring of one, Ulysses' inner), and grouping hundreds of documents' pieces
    takes milliseconds of host time."""
    calls: list[tuple[list[Piece], Fit]] = []
    for p in pieces:
        group, fit = calls[-1] if calls else (None, None)
        if group is not None and p.q0 == group[-1].q1 and p.k0 == group[-1].k1 and (grown := fit.add(p)).ok:
            group.append(p)
            calls[-1] = (group, grown)
        else:
            calls.append(([p], Fit().add(p)))
    out = []
    for group, fit in calls:
        window = fit.window
        first, last = group[0], group[-1]
        if len(group) == 1:
            out.append(WindowCall(first.q0, first.q1, first.k0, first.k1, window))
        else:
            cu_q = tuple(p.q0 - first.q0 for p in group) + (last.q1 - first.q0,)
            cu_k = tuple(p.k0 - first.k0 for p in group) + (last.k1 - first.k0,)
            out.append(WindowCall(first.q0, last.q1, first.k0, last.k1, window, cu_q, cu_k))
    return tuple(out)


def _varlen(call: WindowCall, batch: int, device: torch.device) -> Varlen:
    """The call's boundaries for ``batch`` packed batch elements, on ``device``."""
    host = _varlen_host(call, batch)
    return on_device_kept(host.cu_q, device, lambda: _varlen_on(host, device))


@functools.lru_cache(maxsize=256)
def _varlen_host(call: WindowCall, batch: int) -> Varlen:
    """The call's boundaries for ``batch`` packed batch elements, on the host (cached)."""
    nq, nk = call.q1 - call.q0, call.k1 - call.k0
    cu_q = [b * nq + c for b in range(batch) for c in call.cu_q[:-1]] + [batch * nq]
    cu_k = [b * nk + c for b in range(batch) for c in call.cu_k[:-1]] + [batch * nk]
    longest = lambda cu: max(b - a for a, b in zip(cu, cu[1:]))  # noqa: E731
    return Varlen(torch.tensor(cu_q, dtype=torch.int32), torch.tensor(cu_k, dtype=torch.int32), longest(call.cu_q),
                  longest(call.cu_k))


def _pack(x: Tensor) -> Tensor:
    """(B, n, H, D) -> (B*n, H, D), batch-major (a view when x is contiguous)."""
    return x.reshape(x.shape[0] * x.shape[1], *x.shape[2:])


def _block_causal(name: str, mask: BlockMask, key_mask: Tensor | None) -> bool:
    """The block's causal flag; ValueError for a visibility a block backend cannot express (the backend
    selection never gives it one)."""
    if mask.mode not in ("full", "causal") or key_mask is not None:
        raise ValueError(
            f"{name}: only full or causal blocks without a key mask are supported (got mode {mask.mode!r}, key "
            f"mask {'given' if key_mask is not None else 'none'}); use backend='triton'"
        )
    return mask.mode == "causal"


def _covers(rows: slice, n: int) -> bool:
    """Whether ``rows`` (step 1) selects all n rows."""
    start, stop, _ = rows.indices(n)
    return start == 0 and stop == n


class MergeState:
    """Running (out, lse) of one rank's queries (see Note [Merging block outputs]).

    ``out`` is None (nothing seen yet) or (B, Sq, H, D) in the blocks' dtype: the first whole-coverage block's
    own output, adopted, or a buffer that holds, on the rows of ``touched`` (sorted disjoint runs), the output
    of the first block that reached them (other rows unset until ``finalize``); ``lse`` (B, H, Sq) fp32
    alongside (fp64 when the blocks' lse is fp64, as from exact float64 kernels). Rows merged at least once
    keep their running sum in ``acc`` (fp32, or fp64 with an fp64 lse; allocated on the first merge, never
    filled): ``in_acc`` lists them as sorted disjoint runs, and every other touched row's output is still the
    one in ``out``.

    With ``slots`` (row spans, ``choose_slots``) a packed call over one of those spans writes its output
    straight into ``out`` (``slot``; its lse is copied); every other block waits in ``deferred`` until
    ``finalize`` (``settle``), so that no call writing into a slot overwrites it, as for ``RowSum``.
    """

    __slots__ = ("shape", "device", "out", "lse", "acc", "in_acc", "touched", "slots", "deferred")

    def __init__(self, shape: torch.Size, device: torch.device):
        self.shape = shape
        self.device = device
        self.out: Tensor | None = None
        self.lse: Tensor | None = None
        self.acc: Tensor | None = None
        self.in_acc: list[tuple[int, int]] = []
        self.touched: list[tuple[int, int]] = []
        self.slots: Slots | None = None
        self.deferred: list[tuple[Tensor, Tensor, slice]] = []

    def slot(self, r0: int, r1: int, dtype: torch.dtype, lse_dtype: torch.dtype, written=None) -> Tensor | None:
        """Rows [r0, r1) of ``out`` (B, r1 - r0, H, D), contiguous, for a packed call to write its output into
        (then merged with ``merge_block`` as usual: recorded, not copied), or None (as ``RowSum.slot``)."""
        if not _granted(self.slots, self.touched, r0, r1, written):
            return None
        if self.out is not None and (self.out.dtype != dtype or self.lse.dtype != lse_dtype):
            return None
        if self.out is None:
            b, sq, h, d = self.shape
            self.out = torch.empty(self.shape, dtype=dtype, device=self.device)
            self.lse = torch.empty((b, h, sq), dtype=lse_dtype, device=self.device)
        view = self.out[:, r0:r1]
        return view if view.is_contiguous() else None

    def settle(self) -> None:
        """Close the slots: merge the blocks kept aside, in the order they came."""
        deferred, self.slots, self.deferred = self.deferred, None, []
        for out_b, lse_b, rows in deferred:
            merge_block(self, out_b, lse_b, rows)

    @property
    def merged(self) -> bool:
        """Whether any row has been merged (holds an fp32 sum)."""
        return self.acc is not None


class RowSum:
    """dQ of one rank's rows summed over block calls, each row rounded once (Note [Merging block outputs]'s rule
    for outputs, applied to gradients): a row one call reaches keeps that call's dq as the kernel returned it
    (the first call spanning every row is adopted without a copy, ``add_runs``); only rows a second call
    reaches get a sum in ``dtype`` (fp32; ``acc``, allocated once, never filled). The same values as summing
    every term into a zero-filled fp32 buffer and rounding, without filling rows a term reaches, the first
    addition or the rounding of rows no second call reached. ``add(r0, r1, term)`` adds term (B, r1 - r0, ...)
    to rows [r0, r1); ``result(dtype)``.
    Terms may differ in dtype (the all-gather's own rows: bf16 kernel outputs and fp32 partial sums): a first
    term whose dtype is not the kept rows' goes to the sums, never rounded into the kept rows. A term is
    adopted as the kept rows only when it is the whole of its memory (a kernel's own output), never a view of
    a larger buffer, which the result would keep alive and might return strided.

    With ``slots`` (``Slots``: which calls, in the order they ask, ``slot_order``) a kernel call may write its
    term straight into the kept rows (``slot``: no copy at all); every other term then waits until ``result``
    (nothing is adopted meanwhile), so that no call writing into a slot can overwrite it (a kernel may write
    its whole span, rows outside its segments included; one that writes only its segments' rows,
    ``writes_segments_only``, is checked by them). A slot is refused where an earlier slot's term already holds
    a row the kernel writes.
    """

    __slots__ = ("shape", "dtype", "device", "base", "acc", "touched", "in_acc", "deferred", "slots")

    def __init__(self, shape: torch.Size, dtype: torch.dtype, device: torch.device):
        self.shape, self.dtype, self.device = shape, dtype, device
        self.base: Tensor | None = None  # the first term of each touched row (others unset), in its dtype
        self.acc: Tensor | None = None
        self.touched: list[tuple[int, int]] = []
        self.in_acc: list[tuple[int, int]] = []
        self.deferred: list[tuple[Tensor, tuple[tuple[int, int], ...], int]] = []  # add_runs before a base
        self.slots: Slots | None = None  # the calls that may write into the kept rows (until ``result``)

    def slot(self, r0: int, r1: int, dtype: torch.dtype, written=None) -> Tensor | None:
        """Rows [r0, r1) of the kept rows (B, r1 - r0, ...), contiguous, for a kernel call to write its term of
        those rows into (then pass that term to ``add``/``add_runs`` as usual: it is recorded, not copied), or
        None: ``slots`` does not grant this request, the kept rows have another dtype, or a term written in
        place before holds one of the rows the kernel writes (``written``: its segments' rows, for a kernel
        that writes only those, ``writes_segments_only``; else the whole span)."""
        if not _granted(self.slots, self.touched, r0, r1, written):
            return None
        if self.base is not None and self.base.dtype != dtype:
            return None
        if self.base is None:
            self.base = torch.empty(self.shape, dtype=dtype, device=self.device)
        view = self.base[:, r0:r1]
        return view if view.is_contiguous() else None

    def _in_place(self, term: Tensor, r0: int) -> bool:
        """Whether ``term`` is the kept rows' own memory from row r0 on (a kernel wrote it into a slot)."""
        return self.base is not None and _rows_at(term, self.base, r0)

    def add(self, r0: int, r1: int, term: Tensor) -> None:
        n = self.shape[1]
        if r1 <= r0:
            return
        if self.slots is not None:  # slots still open: written in place, or kept for ``result``
            self.add_runs(term, ((r0, r1),), r0)
            return
        if self.deferred:
            self._replay()
        if self.base is None:
            if r0 == 0 and r1 == n and _owns(term):
                self.base, self.touched = term, [(0, n)]
                return
            self.base = torch.empty(self.shape, dtype=term.dtype, device=self.device)
        for a, z, summed in _split_runs(r0, r1, self.in_acc):
            t = term[:, a - r0:z - r0]
            if summed:
                self.acc[:, a:z].add_(t)
                continue
            for a2, z2, seen in _split_runs(a, z, self.touched):
                t2 = t[:, a2 - a:z2 - a]
                if not seen and t2.dtype == self.base.dtype:  # the first term of these rows: kept as given
                    self.base[:, a2:z2] = t2
                    continue
                if self.acc is None:
                    self.acc = torch.empty(self.shape, dtype=self.dtype, device=self.device)
                if seen:
                    self.acc[:, a2:z2] = self.base[:, a2:z2]
                    self.acc[:, a2:z2].add_(t2)
                else:  # a first term of another dtype (an fp32 partial sum beside bf16 kernel outputs): kept in
                    self.acc[:, a2:z2] = t2  # the sums, so that it is rounded once, at the result
                self.in_acc = list(_runs(self.in_acc + [(a2, z2)]))
        self.touched = list(_runs(self.touched + [(r0, r1)]))

    def add_runs(self, term: Tensor, runs, start: int = 0) -> None:
        """Add the rows ``runs`` (row ranges of the sum) of ``term`` (B, m, ...), whose row i is the sum's row
        ``start + i`` and whose other rows are unset. The first such term spanning every row (start 0, m = n)
        and owning its memory is adopted as the buffer itself, without a copy (its other rows are filled at the
        result or by later terms); terms that come before it wait for it, unless an ``add`` or the result
        comes first. With slots open: recorded if the kernel wrote it into a slot, else kept for ``result``."""
        runs = tuple((a, z) for a, z in runs if z > a)
        if not runs:
            return
        if self.slots is not None:
            if self._in_place(term, start):
                self.touched = list(_runs(self.touched + list(runs)))
            else:
                self.deferred.append((term, runs, start))
            return
        if self.base is None and start == 0 and term.shape[1] == self.shape[1] and _owns(term):
            self.base, self.touched = term, list(_runs(runs))
            self._replay()
        elif self.base is None:
            self.deferred.append((term, runs, start))
        else:
            for r0, r1 in runs:
                self.add(r0, r1, term[:, r0 - start:r1 - start])

    def _replay(self) -> None:
        deferred, self.deferred = self.deferred, []
        for term, runs, start in deferred:
            for r0, r1 in runs:
                self.add(r0, r1, term[:, r0 - start:r1 - start])

    def result(self, dtype: torch.dtype) -> Tensor:
        """The sum in ``dtype`` (rows no term reached: 0); the summed rows are rounded into the adopted buffer.
        Terms kept aside with nothing summed yet (the slots' case) are summed by one kernel on CUDA
        (``_summed``), in the order ``_replay`` would add them: the same values, without a copy or add per run."""
        self.slots = None  # the terms kept aside now go in, after every term written in place
        summed = self._summed(dtype)
        if summed is not None:
            return summed
        self._replay()
        if self.base is None:
            return torch.zeros(self.shape, dtype=dtype, device=self.device)
        _zero_untouched(self.base, self.touched)
        return _rounded(self.base, self.acc, self.in_acc, dtype)

    def _summed(self, dtype: torch.dtype) -> Tensor | None:
        """The result by ``triton_rows.sum_rows`` (None where it does not apply): each row the sum in fp32 of
        the rows written in place (``touched``) and then the kept terms reaching it, in order, rounded once to
        ``dtype`` (into the buffer itself where it has that dtype, whose rows no kept term reaches are then not
        read again); rows no term reaches 0. The values of ``_replay`` and ``_rounded`` (a NaN's bits aside).
        The result is then the sum's buffer, every row of it set, as after a result by the replay."""
        from distcomm_attention.kernels import triton_rows

        if (not self.deferred or self.acc is not None or self.in_acc or self.dtype != torch.float32
                or not triton_rows.sum_available(self.device)
                or self.device.type == "cuda" and torch.cuda.is_current_stream_capturing()):
            return None  # (a graph being captured would keep a table of this call's addresses)
        n, trailing = self.shape[1], (self.shape[0],) + tuple(self.shape[2:])
        sources = [] if self.base is None else [(a, z, self.base, 0) for a, z in self.touched]
        sources += [(r0, r1, term, start) for term, runs, start in self.deferred for r0, r1 in runs]
        terms: list[Tensor] = []
        index: dict[int, int] = {}
        for _, _, term, _ in sources:
            if id(term) not in index:
                if (term.shape[0],) + tuple(term.shape[2:]) != trailing or not triton_rows.summable(term):
                    return None
                index[id(term)] = len(terms)
                terms.append(term)
        out = self.base if self.base is not None and self.base.dtype == dtype and self.base.is_contiguous() else \
            torch.empty(self.shape, dtype=dtype, device=self.device)
        if not triton_rows.summable(out):
            return None
        cuts = sorted({0, n} | {x for r0, r1, _, _ in sources for x in (r0, r1)})
        at = {x: i for i, x in enumerate(cuts)}
        covering: list[list[tuple[int, int]]] = [[] for _ in cuts[1:]]  # each piece's terms, in the sources' order
        for r0, r1, term, start in sources:
            for i in range(at[r0], at[r1]):
                covering[i].append((index[id(term)], -start))
        segments: list[tuple[int, int, list]] = []
        for a, z, parts in zip(cuts, cuts[1:], covering):
            if len(parts) > triton_rows.SUM_TERMS:
                return None
            if out is self.base and parts == [(index.get(id(out)), 0)]:  # written in place, nothing to add
                continue
            if segments and segments[-1][1] == a and segments[-1][2] == parts:
                segments[-1] = (segments[-1][0], z, parts)
            else:
                segments.append((a, z, parts))
        triton_rows.sum_rows(out, segments, terms)
        self.deferred, self.base, self.touched = [], out, [(0, n)]
        return out


def _zero_untouched(out: Tensor, touched, lse: Tensor | None = None) -> None:
    """Zero the rows of ``out`` (and set those of ``lse`` to -inf) that no term reached: dim 1's complement of
    ``touched`` (sorted disjoint runs)."""
    for a, z, seen in _split_runs(0, out.shape[1], touched):
        if not seen:
            out[:, a:z].zero_()
            if lse is not None:
                lse[:, :, a:z].fill_(float("-inf"))


def _rounded(base: Tensor, acc: Tensor | None, in_acc: list[tuple[int, int]], dtype: torch.dtype) -> Tensor:
    """``base`` in ``dtype`` with the rows of ``in_acc`` taken from the sums in ``acc``, each rounded once
    (written into ``base`` itself when it has the dtype: no copy); every row summed: ``acc`` converted whole."""
    if acc is not None and in_acc == [(0, base.shape[1])]:
        return acc.to(dtype)
    out = base.to(dtype)
    for a, z in in_acc:
        out[:, a:z] = acc[:, a:z]
    return out


def _merge_rows(dst: Tensor, src: Tensor, lse: Tensor, out_b: Tensor, lse_b: Tensor) -> None:
    """dst = exp(lse - new) src + exp(lse_b - new) out_b and lse <- new = logaddexp(lse, lse_b), summed in dst's
    dtype (rows of the state; Note [Merging block outputs]): one fused kernel on CUDA fp32, else PyTorch."""
    if dst.dtype == torch.float32 and lse.dtype == torch.float32 and all(x.stride(-1) == 1 for x in (dst, src, out_b)):
        from distcomm_attention.kernels import triton_merge

        if triton_merge.fused_available(dst.device):
            triton_merge.merge_rows(dst, src, lse, out_b, lse_b)
            return
    new = torch.logaddexp(lse, lse_b.to(lse.dtype))
    shift = new.masked_fill(new == float("-inf"), 0.0)  # rows still empty keep weight 0 instead of NaN
    w_old = torch.exp(lse - shift).transpose(1, 2).unsqueeze(-1)
    w_new = torch.exp(lse_b - shift).transpose(1, 2).unsqueeze(-1)
    dst.copy_(src * w_old + out_b * w_new)
    lse.copy_(new)


def _nan_rows(out: Tensor, lse: Tensor, merged=((0, None),)) -> Tensor:
    """``lse`` with NaN on the rows whose output holds a NaN (Note [Merging block outputs]): a kernel may report
    a row with a NaN score as one that saw no key (lse -inf; flash-attn-4 does) while its output carries the NaN,
    and the backward must not take it for an empty row (P = 0, zero gradients). A row one block reached keeps
    that block's lse unless it is -inf (a NaN row with a finite lse, a NaN in a value, is NaN in the backward
    through rowsum(dout * out)), so only the lse and those rows' outputs are read; the rows of ``merged``
    (runs [a, z): rows whose lse is a merge, where a block's -inf no longer shows) are read whole."""
    if out.is_cuda and out.stride(-1) == 1:  # (distcomm_attention/kernels/triton_rows.py)
        from distcomm_attention.kernels import triton_rows

        triton_rows.nan_rows_(out, lse, empty_only=True)
        for a, z in merged:
            triton_rows.nan_rows_(out[:, a:z], lse[:, :, a:z])
        return lse
    bad = out.isnan().any(-1).transpose(1, 2)
    check = lse == float("-inf")
    for a, z in merged:
        check[:, :, a:z] = True
    return lse.masked_fill_(bad & check, float("nan"))  # in place: an adopted kernel lse is returned as it is


def _split_runs(a: int, b: int, runs: list[tuple[int, int]]) -> list[tuple[int, int, bool]]:
    """[a, b) cut at the boundaries of ``runs`` (sorted, disjoint): (start, stop, inside a run) pieces."""
    out, pos = [], a
    for r0, r1 in runs:
        if r1 <= pos or r0 >= b:
            continue
        if r0 > pos:
            out.append((pos, r0, False))
        out.append((max(pos, r0), min(b, r1), True))
        pos = min(b, r1)
    if pos < b:
        out.append((pos, b, False))
    return out


def merge_block(state: MergeState, out_b: Tensor, lse_b: Tensor, rows: slice = slice(None)) -> None:
    """Merge one block's normalised output ``out_b`` (B, n, H, D) and ``lse_b`` (B, H, n) fp32 into the state
    rows ``rows`` (n of them), in place; the sums run in fp32 (fp64 for an fp64 ``lse_b``)."""
    b, sq, h, d = state.shape
    dtype = torch.float64 if lse_b.dtype == torch.float64 else torch.float32
    r0, r1, _ = rows.indices(sq)
    if r1 <= r0:
        return
    if state.slots is not None:  # slots open: written in place (its lse too, or copied), or kept for ``settle``
        if state.out is not None and _rows_at(out_b, state.out, r0):
            if not _same_view(lse_b, state.lse[:, :, r0:r1]):  # (else the kernel wrote it there too)
                state.lse[:, :, r0:r1] = lse_b
            state.touched = list(_runs(state.touched + [(r0, r1)]))
        else:  # (a kernel that wrote its lse, not its output, into the state's rows: the lse kept apart)
            if state.lse is not None and lse_b.untyped_storage().data_ptr() == state.lse.untyped_storage().data_ptr():
                lse_b = lse_b.clone()
            state.deferred.append((out_b, lse_b, slice(r0, r1)))
        return
    if state.out is None:
        if r0 == 0 and r1 == sq:
            state.out, state.lse = out_b, lse_b  # adopted as returned: no copy, no merge
            state.touched = [(0, sq)]
            return
        state.out = torch.empty(b, sq, h, d, dtype=out_b.dtype, device=state.device)
        state.lse = torch.empty((b, h, sq), dtype=dtype, device=state.device)
    for a, z, seen in _split_runs(r0, r1, state.touched):
        if not seen:  # the first block on these rows: kept as the kernel returned them
            state.out[:, a:z] = out_b[:, a - r0:z - r0]
            state.lse[:, :, a:z] = lse_b[:, :, a - r0:z - r0]
            continue
        if state.acc is None:
            state.acc = torch.empty(b, sq, h, d, dtype=dtype, device=state.device)
            if state.lse.dtype != dtype:
                state.lse = state.lse.to(dtype)
        for a2, z2, inside in _split_runs(a, z, state.in_acc):
            src = state.acc if inside else state.out
            _merge_rows(state.acc[:, a2:z2], src[:, a2:z2], state.lse[:, :, a2:z2], out_b[:, a2 - r0:z2 - r0],
                        lse_b[:, :, a2 - r0:z2 - r0])
        state.in_acc = list(_runs(state.in_acc + [(a, z)]))
    state.touched = list(_runs(state.touched + [(r0, r1)]))


def _check_window_mask(name: str, takes_windows: bool, mask: BlockMask, key_mask: Tensor | None) -> bool:
    """Whether the block runs as window calls (an "interval" block of a backend that takes windows);
    ValueError for what the backend cannot run."""
    if mask.mode == "interval" and takes_windows and key_mask is None:
        return True
    _block_causal(name, mask, key_mask)
    return False


class BlockForward:
    """ForwardKernel over a block backend's forward (``block``, set by subclasses)."""

    takes_windows = False  # whether ``block`` takes window= and varlen= (Note [Window calls])
    packs = False  # whether ``block`` takes segment lengths and out=, lse= (Note [Packed steps])
    # whether a packed call writes only its segments' rows of out= (else anywhere in the rows it is handed)
    writes_segments_only = False

    def block(self, q: Tensor, k: Tensor, v: Tensor, *, causal: bool, scale: float, softcap: float,
              window: tuple[int | None, int | None] | None = None,
              varlen: Varlen | None = None) -> tuple[Tensor, Tensor]:
        """One block: out (B, Sq, H, D) in q's dtype, lse (B, H, Sq) float32. With ``varlen``, q (total_q, H, D)
        and k, v (total_k, Hkv, D) are packed and the result is out (total_q, H, D), lse (H, total_q). A packing
        backend (``packs``) also takes ``out=`` and ``lse=`` to write into: ``lse`` may be a view of columns of a
        larger (H, S) buffer (row stride S), the rank's state."""
        raise NotImplementedError

    def _window_call(self, q: Tensor, k: Tensor, v: Tensor, call: WindowCall, *, scale: float,
                     softcap: float) -> tuple[Tensor, Tensor]:
        """One window call on the call's rows q (B, nq, H, D) and keys k, v -> out (B, nq, H, D), lse (B, H, nq)."""
        if call.cu_q is None:
            return self.block(q, k, v, causal=False, scale=scale, softcap=softcap, window=call.window)
        b, nq, h, _ = q.shape
        varlen = _varlen(call, b, q.device)
        out, lse = self.block(_pack(q), _pack(k), _pack(v), causal=False, scale=scale, softcap=softcap,
                              window=call.window, varlen=varlen)
        return out.view(q.shape), lse.view(h, b, nq).transpose(0, 1).contiguous()

    def init_state(self, q: Tensor) -> MergeState:
        """An empty state for queries q (B, Sq, H, D); nothing is allocated until a block arrives."""
        return MergeState(q.shape, q.device)

    def step(self, state: MergeState, q: Tensor, k: Tensor, v: Tensor, *, mask: BlockMask, scale: float,
             softcap: float = 0.0, key_mask: Tensor | None = None, q_slice: slice = slice(None),
             final: bool = False) -> None:
        """Attend q[:, q_slice] to (k, v) under ``mask`` ("full" or "causal"; "interval" too with
        ``takes_windows``, as window calls) and merge the block into the state rows q_slice. A block covering every row of a fresh state is kept as the kernel returned it,
        whether or not ``final`` is set, so a ring of one is one kernel call."""
        windows = _check_window_mask(type(self).__name__, self.takes_windows, mask, key_mask)
        rows = q[:, q_slice]
        if rows.numel() == 0 or k.shape[1] == 0:
            return
        if not windows:
            out_b, lse_b = self.block(rows, k, v, causal=mask.mode == "causal", scale=scale, softcap=softcap)
            merge_block(state, out_b, lse_b, q_slice)
            return
        start = q_slice.indices(q.shape[1])[0]
        for call in window_calls(pieces_of(mask)):
            out_b, lse_b = self._window_call(rows[:, call.q0:call.q1], k[:, call.k0:call.k1],
                                             v[:, call.k0:call.k1], call, scale=scale, softcap=softcap)
            merge_block(state, out_b, lse_b, slice(start + call.q0, start + call.q1))

    def packed_step(self, state: MergeState, q: Tensor, k: Tensor, v: Tensor, calls: tuple[PackedCall, ...], *,
                    scale: float, softcap: float) -> None:
        """Attend q (B, n, H, D) to the step's keys k, v (B, nk, Hkv, D) as ``calls`` (Note [Packed steps]) and
        merge the rows each call wrote into the state (into its rows directly where the state grants the call
        a slot, ``MergeState.slot``)."""
        b, n, h, _ = q.shape
        for call in calls:
            packed = _packed_varlen(call, b, n, k.shape[1], q.device)
            r_lo, r_hi = packed.row_span
            rows = q[:, r_lo:r_hi]
            kk, vv = packed.call_keys(k, v)
            lse_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
            slot = state.slot(r_lo, r_hi, q.dtype, lse_dtype, packed.rows if self.writes_segments_only else None)
            into = {}
            if slot is not None:  # the output, and for one batch element the lse: rows [r_lo, r_hi) of the state's
                into["out"] = _pack(slot)
                if b == 1:
                    into["lse"] = state.lse[0, :, r_lo:r_hi]
            out, lse = self.block(_pack(rows), _pack(kk), _pack(vv), causal=False, scale=scale, softcap=softcap,
                                  window=call.window, varlen=packed.varlen, **into)
            out, lse = out.view(rows.shape), lse.view(h, b, r_hi - r_lo).transpose(0, 1)
            if state.out is None and state.slots is None and (r_lo, r_hi) == (0, n) and packed.rows:
                # adopted (its gaps unset); not while slots are open: a slot may be granted these rows
                state.out, state.lse, state.touched = out, lse, list(_runs(packed.rows))
                continue
            for r0, r1 in packed.rows:  # rows no segment covers hold whatever the kernel left there
                whole = r0 == r_lo and r1 == r_hi
                a, z = r0 - r_lo, r1 - r_lo
                merge_block(state, out if whole else out[:, a:z], lse if whole else lse[:, :, a:z], slice(r0, r1))

    def finalize(self, state: MergeState, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """-> out (B, Sq, H, D) in ``dtype``, lse (B, H, Sq) float32 (the blocks' lse dtype); rows that saw no
        key: out 0, lse -inf; rows whose output is NaN and whose lse is -inf or a merge: lse NaN."""
        state.settle()
        if state.out is None:
            b, sq, h, _ = state.shape
            return (torch.zeros(state.shape, dtype=dtype, device=state.device),
                    torch.full((b, h, sq), float("-inf"), dtype=torch.float32, device=state.device))
        _zero_untouched(state.out, state.touched, state.lse)
        out = _rounded(state.out, state.acc, state.in_acc, dtype)
        return out, _nan_rows(out, state.lse, state.in_acc)


class BlockBackward:
    """BackwardKernel over a block backend's backward (``block``, set by subclasses); see
    Note [Merging block outputs]. ``delta`` is not read (``uses_delta`` False): the kernels compute
    rowsum(dout * out) themselves."""

    uses_delta = False
    takes_windows = False  # whether ``block`` takes window= and varlen= (Note [Window calls])
    packs = False  # whether ``block`` takes segment lengths and dq=, dk=, dv= (Note [Packed steps])
    # whether a packed call writes only its segments' rows of dq=, dk=, dv= (else anywhere in those handed)
    writes_segments_only = False
    # whether every call returns its dK/dV in the inputs' dtype, each row rounded once from the kernel's own
    # accumulation (no fp32 partial handed back, no second rounding of a sum made outside the kernel): then a
    # row one call wrote goes home in that dtype unchanged (Note [Sparse gather], "What goes home")
    dkv_in_input_dtype = False

    def block(self, dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, *, causal: bool,
              scale: float, softcap: float, window: tuple[int | None, int | None] | None = None,
              varlen: Varlen | None = None) -> tuple[Tensor, Tensor, Tensor]:
        """One block from the merged out / lse: dq (B, Sq, H, D), dk, dv (B, Sk, Hkv, D) in q's dtype. With
        ``varlen`` every tensor is packed (total, heads, D) and lse is (H, total_q)."""
        raise NotImplementedError

    def _window_call(self, dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                     call: WindowCall, *, scale: float, softcap: float) -> tuple[Tensor, Tensor, Tensor]:
        """One window call's gradients; tensors are the call's rows and keys, lse (B, H, nq)."""
        if call.cu_q is None:
            return self.block(dout, q, k, v, out, lse, causal=False, scale=scale, softcap=softcap,
                              window=call.window)
        b, nq, h, _ = q.shape
        varlen = _varlen(call, b, q.device)
        lse = lse.transpose(0, 1).reshape(h, b * nq)
        dq, dk, dv = self.block(_pack(dout), _pack(q), _pack(k), _pack(v), _pack(out), lse, causal=False,
                                scale=scale, softcap=softcap, window=call.window, varlen=varlen)
        return dq.view(q.shape), dk.view(k.shape), dv.view(v.shape)

    def _window_step(self, dout, q, k, v, out, lse, mask, scale, softcap, dq_acc, dkv_dtype):
        """The backward of an "interval" block as window calls (Note [Window calls])."""
        calls = window_calls(pieces_of(mask))
        (sq, sk), whole = (q.shape[1], k.shape[1]), len(calls) == 1
        if whole and calls[0][:4] == (0, sq, 0, sk) and dq_acc is None:
            dq, dk, dv = self._window_call(dout, q, k, v, out, lse, calls[0], scale=scale, softcap=softcap)
            return dq, dk.to(dkv_dtype or dk.dtype), dv.to(dkv_dtype or dv.dtype)
        acc = torch.float64 if q.dtype == torch.float64 else torch.float32
        dq = dq_acc if dq_acc is not None else torch.zeros(q.shape, dtype=acc, device=q.device)
        dk = torch.zeros(k.shape, dtype=acc, device=k.device)
        dv = torch.zeros(v.shape, dtype=acc, device=v.device)
        for c in calls:
            rows, keys = slice(c.q0, c.q1), slice(c.k0, c.k1)
            dq_c, dk_c, dv_c = self._window_call(dout[:, rows], q[:, rows], k[:, keys], v[:, keys], out[:, rows],
                                                 lse[:, :, rows], c, scale=scale, softcap=softcap)
            dq[:, rows] += dq_c
            dk[:, keys] += dk_c
            dv[:, keys] += dv_c
        if dq_acc is None:
            dq = dq.to(q.dtype)
        return dq, dk.to(dkv_dtype or k.dtype), dv.to(dkv_dtype or v.dtype)

    def packed_step(self, dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                    calls: tuple[PackedCall, ...], *, scale: float, softcap: float,
                    dq_acc: Tensor | RowSum, dkv_into=None) -> list[tuple[slice, Tensor, Tensor]]:
        """The backward of a step as ``calls`` (Note [Packed steps]): dq added into ``dq_acc`` (B, n, H, D, or a
        ``RowSum``, whose slots the kernel may write into) on the rows each call wrote; returns (key rows, dk,
        dv) for each run of keys a call wrote, as the kernel returned them (the caller converts or sums them in
        its accumulation dtype). ``dkv_into(lo, hi, written)``: (dk, dv) buffers (B, hi - lo, Hkv, D) for a call
        handed keys [lo, hi) of the step's (not gathered ones) to write into, or None (the kernel makes its own);
        the returned terms are then views of them. ``written``: the key runs the kernel writes where it writes
        only its segments' (``writes_segments_only``), else None (its whole span)."""
        b, n, h, _ = q.shape
        nk = k.shape[1]
        grads = []
        for call in calls:
            packed = _packed_varlen(call, b, n, nk, q.device)
            r_lo, r_hi = packed.row_span
            rows = slice(r_lo, r_hi)
            qq, (kk, vv) = q[:, rows], packed.call_keys(k, v)
            lse_rows = lse[:, :, rows].transpose(0, 1).reshape(h, b * (r_hi - r_lo))
            into = {}
            rows_written, keys_written = (packed.rows, packed.keys) if self.writes_segments_only else (None, None)
            if isinstance(dq_acc, RowSum) and (slot := dq_acc.slot(r_lo, r_hi, q.dtype, rows_written)) is not None:
                into["dq"] = _pack(slot)
            if dkv_into is not None and packed.key_index is None and \
                    (dkv := dkv_into(*packed.key_span, keys_written)) is not None:
                into["dk"], into["dv"] = _pack(dkv[0]), _pack(dkv[1])
            dq, dk, dv = self.block(_pack(dout[:, rows]), _pack(qq), _pack(kk), _pack(vv), _pack(out[:, rows]),
                                    lse_rows, causal=False, scale=scale, softcap=softcap, window=call.window,
                                    varlen=packed.varlen, **into)
            dq, dk, dv = dq.view(qq.shape), dk.view(kk.shape), dv.view(vv.shape)
            if isinstance(dq_acc, RowSum):  # rows and keys no segment covers hold whatever the kernel left there
                dq_acc.add_runs(dq, packed.rows, r_lo)
            else:
                for r0, r1 in packed.rows:
                    dq_acc[:, r0:r1] += dq[:, r0 - r_lo:r1 - r_lo]
            for (k0, k1), at in zip(packed.keys, packed.key_at):
                keys = slice(at, at + k1 - k0)
                grads.append((slice(k0, k1), dk[:, keys], dv[:, keys]))
        return grads

    def step(self, dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
             delta: Tensor | None = None, *, mask: BlockMask, scale: float, softcap: float = 0.0,
             key_mask: Tensor | None = None, dq_acc: Tensor | None = None,
             dkv_dtype: torch.dtype | None = None) -> tuple[Tensor, Tensor, Tensor]:
        """dout, q, out: (B, Sq, H, D); lse: (B, H, Sq) of the merged (global) rows; k, v: (B, Sk, Hkv, D).
        Adds the block's dq into ``dq_acc`` and returns it (the kernel's dq without one); dk, dv in
        ``dkv_dtype`` (the kernel's dtype without one)."""
        windows = _check_window_mask(type(self).__name__, self.takes_windows, mask, key_mask)
        if windows and q.numel() and k.shape[1]:
            return self._window_step(dout, q, k, v, out, lse, mask, scale, softcap, dq_acc, dkv_dtype)
        if q.numel() == 0 or k.shape[1] == 0:
            dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        else:
            dq, dk, dv = self.block(dout, q, k, v, out, lse, causal=mask.mode == "causal", scale=scale,
                                    softcap=softcap)
        if dq_acc is not None:
            dq = dq_acc.add_(dq)
        if dkv_dtype is not None:
            dk, dv = dk.to(dkv_dtype), dv.to(dkv_dtype)
        return dq, dk, dv
