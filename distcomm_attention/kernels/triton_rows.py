"""Two memory-bound Triton kernels over rows: a row gather (the reorders and all-to-all packs of Ulysses and
the all-gather), and the NaN-row check of a block output (Note [Merging block outputs]).

    gather_rows(x, index)   out[i] = x[index[i]] for rows of x (N, C) contiguous: one read and one write of
                            each row; on one H100 1.6-1.9x PyTorch's index_select for rows of 256 bytes, on
                            par from 1 KB (``take_rows`` picks), and 1.3-1.5x the permuted copies that pack
                            Ulysses' all-to-alls (docs/bench/row_copies.md)
    nan_rows_(out, lse)     lse[b, h, s] = NaN where out[b, s, h, :] holds a NaN: one read of out, no temporary
                            (PyTorch: isnan, then an any over the head dimension: a bool tensor of out's size);
                            ``empty_only``: only where lse[b, h, s] is -inf, reading lse and the rows of out it
                            names (none in a call whose every row saw a key)

    sum_rows(out, segments, terms)
                            out's rows as sums of rows of other tensors, each row's terms added in fp32 in a
                            given order and rounded once (to nearest even; a NaN as one bit pattern): one
                            read of each term, one write (a ``RowSum``'s terms kept aside until its result,
                            instead of a copy or add per run of rows)

They run on CUDA tensors; the callers keep a PyTorch path for every other device.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from torch import Tensor

from distcomm_attention._device import on_device, on_device_kept, to_device

__all__ = ["gather_rows", "take_rows", "nan_rows_", "sum_available", "sum_rows", "summable", "SUM_TERMS"]


@triton.jit
def _gather_kernel(x, index, out, M, C, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    rows = (tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
    cols = (tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)).to(tl.int64)
    in_r = rows < M
    src = tl.load(index + rows, mask=in_r, other=0).to(tl.int64)
    tile = in_r[:, None] & (cols[None, :] < C)
    vals = tl.load(x + src[:, None] * C + cols[None, :], mask=tile)
    tl.store(out + rows[:, None] * C + cols[None, :], vals, mask=tile)


def _gather_config(c: int, element_size: int) -> tuple[int, int, int]:
    """(rows, columns, warps) of one program for rows of ``c`` elements (the best of a sweep on one H100,
    docs/bench/row_copies.md)."""
    block_c = min(triton.next_power_of_2(c), 256)
    block_r = 8
    return block_r, block_c, 2 if block_r * block_c * element_size <= 4096 else 4


FAST_INDEX_ROW_BYTES = 1024  # rows at least this long: PyTorch's index_select is as fast (docs/bench/row_copies.md)


def take_rows(x: Tensor, index: Tensor, out: Tensor | None = None) -> Tensor:
    """``gather_rows`` for short rows, ``index_select`` for rows of at least FAST_INDEX_ROW_BYTES (CUDA)."""
    if x.shape[1] * x.element_size() >= FAST_INDEX_ROW_BYTES:
        return torch.index_select(x, 0, index, out=out) if out is not None else x.index_select(0, index)
    return gather_rows(x, index, out)


def gather_rows(x: Tensor, index: Tensor, out: Tensor | None = None, config: tuple[int, int, int] | None = None) -> Tensor:
    """out[i] = x[index[i]]: x (N, C) contiguous, index (M,) int64 on x's device -> (M, C) (into ``out`` when
    given: contiguous, x's dtype). ``config``: (rows, columns, warps) of a program, for tuning."""
    if x.dim() != 2 or not x.is_contiguous():
        raise ValueError(f"gather_rows: x must be a contiguous 2-D tensor, got shape {tuple(x.shape)} "
                         f"strides {tuple(x.stride())}")
    if index.dim() != 1 or not index.is_contiguous() or index.dtype != torch.int64 or index.device != x.device:
        raise ValueError(f"gather_rows: index must be a contiguous 1-D int64 tensor on {x.device}, got shape "
                         f"{tuple(index.shape)}, {index.dtype} on {index.device}")
    m, c = index.shape[0], x.shape[1]
    if out is None:
        out = torch.empty(m, c, dtype=x.dtype, device=x.device)
    elif out.shape != (m, c) or not out.is_contiguous() or out.dtype != x.dtype or out.device != x.device:
        raise ValueError(f"gather_rows: out must be a contiguous ({m}, {c}) {x.dtype} tensor on {x.device}, got "
                         f"shape {tuple(out.shape)} strides {tuple(out.stride())}, {out.dtype} on {out.device}")
    if m == 0 or c == 0:
        return out
    block_r, block_c, warps = config or _gather_config(c, x.element_size())
    grid = (triton.cdiv(m, block_r), triton.cdiv(c, block_c))
    _gather_kernel[grid](x, index, out, m, c, BLOCK_R=block_r, BLOCK_C=block_c, num_warps=warps)
    return out


@triton.jit
def _nan_block(out, at, rows, R, D, EMPTY: tl.constexpr, BLOCK_D: tl.constexpr):
    # lse at ``at`` (a row's) set to NaN where its output row (``out``: a row's) holds a NaN, for ``rows``
    cols = tl.arange(0, BLOCK_D)
    in_r = rows < R
    if EMPTY:  # only the rows reported empty are read
        empty = in_r & (tl.load(at, mask=in_r, other=0.0) == float("-inf"))
    else:
        empty = in_r
    tile = empty[:, None] & (cols[None, :] < D)
    vals = tl.load(out + cols[None, :], mask=tile, other=0.0).to(tl.float32)
    bad = tl.max((vals != vals).to(tl.int32), axis=1) > 0
    tl.store(at, float("nan"), mask=empty & bad)


@triton.jit
def _nan_kernel(out, lse, R, H, D, s_ob, s_or, s_oh, s_lb, s_lh, s_lr,
                BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr, EMPTY_ONLY: tl.constexpr, STEPS: tl.constexpr):
    # One program: STEPS blocks of BLOCK_R rows of one (batch element, head).
    h, b = tl.program_id(1).to(tl.int64), tl.program_id(2).to(tl.int64)
    first = tl.program_id(0).to(tl.int64) * (STEPS * BLOCK_R)
    out += b * s_ob + h * s_oh
    lse += b * s_lb + h * s_lh
    if EMPTY_ONLY:  # the span's lse in one read; its outputs only where some row is reported empty
        span = first + tl.arange(0, STEPS * BLOCK_R)
        reported = tl.load(lse + span * s_lr, mask=span < R, other=0.0)
        if tl.max((reported == float("-inf")).to(tl.int32), axis=0) > 0:
            for step in range(STEPS):
                rows = first + step * BLOCK_R + tl.arange(0, BLOCK_R)
                _nan_block(out + rows[:, None] * s_or, lse + rows * s_lr, rows, R, D, True, BLOCK_D)
    else:
        for step in range(STEPS):
            rows = first + step * BLOCK_R + tl.arange(0, BLOCK_R)
            _nan_block(out + rows[:, None] * s_or, lse + rows * s_lr, rows, R, D, False, BLOCK_D)


def nan_rows_(out: Tensor, lse: Tensor, empty_only: bool = False) -> Tensor:
    """lse (B, H, S) set to NaN in place where out (B, S, H, D) (head dimension contiguous) holds a NaN; with
    ``empty_only`` only on the rows whose lse is -inf (reported as having seen no key; Note [Merging block
    outputs]), whose outputs alone are read: a program then reads the lse of 16 blocks of rows at once and
    their outputs only where one is -inf (a program per block of 32 rows, or one walking 16 blocks and reading
    each block's lse in turn, took 21-24 us on an H100 for the 2 MB of lse of 16k rows of 32 heads)."""
    b, s, h, d = out.shape
    if out.stride(-1) != 1:
        raise ValueError(f"nan_rows_: the head dimension of out must be contiguous (strides {tuple(out.stride())})")
    if out.numel() == 0:
        return lse
    block_d = triton.next_power_of_2(d)
    block_r = max(1, 8192 // (block_d * out.element_size()))
    steps = 16 if empty_only else 1
    grid = (triton.cdiv(s, block_r * steps), h, b)
    _nan_kernel[grid](out, lse, s, h, d, *out.stride()[:3], *lse.stride(), BLOCK_R=block_r, BLOCK_D=block_d,
                      EMPTY_ONLY=empty_only, STEPS=steps, num_warps=4)
    return lse


SUM_TERMS = 8  # the most terms one row of ``sum_rows`` adds
_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
_SEGMENT_FIELDS = 4 + 2 * SUM_TERMS  # first program, first row, rows, terms, (term, row offset) x SUM_TERMS


@triton.jit
def _sum_kernel(out, table, terms, segments, C, s_ob, s_or,
                K: tl.constexpr, W: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
                OUT_BF16: tl.constexpr):
    # One program: BLOCK_R rows of one segment (rows with the same terms), BLOCK_C columns, one batch element.
    p, b = tl.program_id(0).to(tl.int64), tl.program_id(2).to(tl.int64)
    seg = p * 0
    for i in range(segments):  # the last segment whose first program is at most p
        seg = tl.where(tl.load(table + i * W) <= p, i, seg)
    at = table + seg * W
    first, row0, nrows, nterms = tl.load(at), tl.load(at + 1), tl.load(at + 2), tl.load(at + 3)
    rows = (p - first) * BLOCK_R + tl.arange(0, BLOCK_R).to(tl.int64)
    cols = (tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)).to(tl.int64)
    tile = (rows < nrows)[:, None] & (cols < C)[None, :]
    rows = row0 + rows
    acc = tl.zeros((BLOCK_R, BLOCK_C), dtype=tl.float32)
    for j in tl.static_range(K):
        if j < nterms:
            t, off = tl.load(at + 4 + 2 * j), tl.load(at + 5 + 2 * j)
            ptr, s_b, s_r, code = tl.load(terms + 4 * t), tl.load(terms + 4 * t + 1), tl.load(terms + 4 * t + 2), \
                tl.load(terms + 4 * t + 3)
            idx = b * s_b + (rows + off)[:, None] * s_r + cols[None, :]
            if code == 0:
                x = tl.load(ptr.to(tl.pointer_type(tl.float32)) + idx, mask=tile, other=0.0)
            elif code == 1:
                x = tl.load(ptr.to(tl.pointer_type(tl.bfloat16)) + idx, mask=tile, other=0.0).to(tl.float32)
            else:
                x = tl.load(ptr.to(tl.pointer_type(tl.float16)) + idx, mask=tile, other=0.0).to(tl.float32)
            if j == 0:
                acc = x  # the first term as it is (a sum from 0 would turn -0 into +0)
            else:
                acc = acc + x
    at_out = out + b * s_ob + rows[:, None] * s_or + cols[None, :]
    if OUT_BF16:  # rounded to nearest even by integer steps (``out`` as int16: the interpreter's own conversion
        # truncates); a NaN written as 0x7FC0, whatever its payload
        bits = acc.to(tl.uint32, bitcast=True)
        bits = bits + (((bits >> 16) & 1) + 0x7FFF)
        tl.store(at_out, tl.where(acc != acc, 0x7FC0, (bits >> 16).to(tl.int16)), mask=tile)
    else:
        tl.store(at_out, acc.to(out.dtype.element_ty), mask=tile)


def sum_available(device: torch.device) -> bool:
    """Whether a ``RowSum`` on ``device`` finishes with ``sum_rows``: on CUDA (the tests run it on the CPU
    under the Triton interpreter)."""
    return device.type == "cuda"


def summable(t: Tensor) -> bool:
    """Whether ``t`` (B, m, ...) can be a term or the output of ``sum_rows``: a dtype it reads (fp32, bf16, fp16)
    and rows whose trailing dimensions are contiguous."""
    if t.dtype not in _CODES or t.dim() < 2:
        return False
    step = 1
    for size, stride in zip(reversed(t.shape[2:]), reversed(t.stride()[2:])):
        if size != 1 and stride != step:
            return False
        step *= size
    return True


def sum_rows(out: Tensor, segments, terms) -> Tensor:
    """Rows of ``out`` (B, n, ...) as sums: ``segments`` is a list of (first row, stop, [(term, offset), ...]),
    sorted and disjoint, each row r of a segment the sum in fp32 of ``terms[term][:, r + offset]`` in the order
    given (at most ``SUM_TERMS``; no term: 0), rounded once to out's dtype; rows in no segment are not written.
    ``terms``: tensors (B, m, ...) with out's trailing shape (``summable``). On the device of ``out``; the
    segments' table goes there once per segments (``on_device``), the terms' addresses by one copy from pinned
    memory per call, neither waiting for the GPU (not while a CUDA graph is captured: the addresses are this
    call's tensors')."""
    b, n = out.shape[0], out.shape[1]
    c = out[0, 0].numel() if n else 0
    if not segments or b == 0 or c == 0:
        return out
    block_c = min(triton.next_power_of_2(c), 256)
    block_r = max(1, 4096 // block_c)
    k = max(1, max(len(s[2]) for s in segments))
    if k > SUM_TERMS:
        raise ValueError(f"sum_rows: a row adds at most {SUM_TERMS} terms, got {k}")
    table, first = _segment_table(tuple((r0, r1, tuple(parts)) for r0, r1, parts in segments), block_r)
    # the segments' table depends on the plan alone: made and copied once (``on_device``); the terms' addresses
    # change with every call and go there by one copy from pinned memory
    spec = []
    for t in terms:
        spec += [t.data_ptr(), t.stride(0), t.stride(1), _CODES[t.dtype]]
    terms_dev = to_device(torch.tensor(spec, dtype=torch.int64), out.device)
    grid = (first, triton.cdiv(c, block_c), b)
    bf16 = out.dtype == torch.bfloat16
    table_dev = on_device_kept(table, out.device, lambda: on_device(table, out.device))  # (one lookup per stream)
    _sum_kernel[grid](out.view(torch.int16) if bf16 else out, table_dev, terms_dev, len(segments),
                      c, out.stride(0), out.stride(1), K=k, W=_SEGMENT_FIELDS, BLOCK_R=block_r, BLOCK_C=block_c,
                      OUT_BF16=bf16, num_warps=4)
    return out


@functools.lru_cache(maxsize=256)
def _segment_table(segments, block_r: int) -> tuple[Tensor, int]:
    """``sum_rows``' table of ``segments`` ((first row, stop, ((term, offset), ...)), ...) on the host: per segment
    its first program, first row, rows, terms and (term, offset) pairs, ``_SEGMENT_FIELDS`` ints; and the programs
    along the rows in all."""
    table, first = [], 0
    for r0, r1, parts in segments:
        row = [first, r0, r1 - r0, len(parts)]
        for t, off in parts:
            row += [t, off]
        table += row + [0] * (_SEGMENT_FIELDS - len(row))
        first += triton.cdiv(r1 - r0, block_r)
    return torch.tensor(table, dtype=torch.int64), first
