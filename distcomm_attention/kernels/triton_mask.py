"""Per-tile visibility and score helpers shared by the Triton forward and backward kernels.

The kernels execute a ``BlockMask`` (distcomm_attention.planning.visibility, Note [Visibility]); everything they
need to know about it is here, as ``@triton.jit`` helpers selected by one ``MODE`` constexpr, plus the
host-side translation of a ``BlockMask`` and a key padding mask into kernel arguments.

Note [Kernel tiles]
~~~~~~~~~~~~~~~~~~~
A kernel program owns a tile of rows (forward, dQ: query rows; dK/dV: key rows) and loops over tiles of
the other axis. For the program's tile the visibility rule gives four numbers (``_key_range`` for a
query tile, ``_query_range`` for a key tile)::

    lo       first index of the other axis that ANY row of the tile sees
    hi       one past the last one any row sees
    mid_lo   [mid_lo, mid_hi): indices that EVERY row of the tile sees (may be empty)
    mid_hi

``_split`` aligns them to the loop's tile size into three ranges::

      start           u0                u1              hi
        |--- edge ----|---- interior ----|---- edge ----|
        masked tiles    no mask at all     masked tiles
        (rule + bounds)                    (rule + bounds)

Interior tiles skip every mask (the fast path of a causal kernel's off-diagonal tiles); edge tiles apply
the rule element-wise (``_visible_qk`` / ``_visible_kq``) and the sequence bounds. Tiles outside
[start, hi) are never visited. Per mode, for a query tile of rows [i0, i1] (i1 its last valid row) and a
key tile of keys [j0, j1]:

    mode       query tile: lo, mid_lo, mid_hi, hi              key tile: lo, mid_lo, mid_hi, hi
    full       0, 0, Sk, Sk                                    0, 0, Sq, Sq
    causal     0, 0, i0 + 1, i1 + 1        (clipped to Sk)     j0, j1, Sq, Sq      (clipped to Sq)
    interval   row_lo[i0], row_lo[i1], row_hi[i0], row_hi[i1]  col_lo[j0], col_lo[j1], col_hi[j0], col_hi[j1]

The interval arrays are nondecreasing, which is what makes the first/last row (key) of a tile bound the
whole tile. The key padding mask is element-wise on top: the forward and dQ kernels apply it in every
tile (interior tiles too); the dK/dV kernel needs it only once, when it stores (a hidden key's gradient
row is zero, and a key's row of dK/dV depends on no other key's scores).

Softcap (Gemma 2): ``s = softcap * tanh(scale * q.k / softcap)``; ``_tanh`` is written with one exp2 so
that it runs identically under the Triton interpreter (which has no tanh) and on GPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

__all__ = ["MODE_FULL", "MODE_CAUSAL", "MODE_INTERVAL", "mode_code", "interval_args", "key_mask_arg"]

MODE_FULL, MODE_CAUSAL, MODE_INTERVAL = 0, 1, 2
_MODE_CODES = {"full": MODE_FULL, "causal": MODE_CAUSAL, "interval": MODE_INTERVAL}


# --------------------------------------------------------------------------------------------------------
# Host side
# --------------------------------------------------------------------------------------------------------


def mode_code(mask) -> int:
    """The kernels' MODE constexpr for a ``BlockMask``; ValueError for anything else."""
    mode = getattr(mask, "mode", None)
    if mode not in _MODE_CODES:
        raise ValueError(f"`mask` must be a BlockMask with mode 'full', 'causal' or 'interval'; got {mask!r}")
    return _MODE_CODES[mode]


def interval_args(mask, seqlen_q: int, seqlen_k: int, device: torch.device, *, cols: bool = True):
    """The interval arrays of ``mask`` checked and made kernel-ready (contiguous int32 on ``device``).

    Returns (row_lo, row_hi, col_lo, col_hi) for an "interval" mask (col_* None when ``cols`` is False),
    or four Nones for "full"/"causal".
    """
    if mask.mode != "interval":
        return None, None, None, None
    wanted = (("row_lo", seqlen_q), ("row_hi", seqlen_q)) + ((("col_lo", seqlen_k), ("col_hi", seqlen_k)) if cols else ())
    arrays = []
    for name, length in wanted:
        a = getattr(mask, name)
        if not isinstance(a, Tensor) or a.dim() != 1 or a.shape[0] != length:
            shape = tuple(a.shape) if isinstance(a, Tensor) else type(a).__name__
            raise ValueError(f"`mask.{name}` must be a 1-D tensor of length {length}; got {shape}")
        if a.dtype != torch.int32 or a.device != device or not a.is_contiguous():
            a = a.to(device=device, dtype=torch.int32).contiguous()
        arrays.append(a)
    return tuple(arrays) + ((None, None) if not cols else ())


def key_mask_arg(key_mask: Tensor | None, batch: int, seqlen_k: int, device: torch.device) -> Tensor | None:
    """The key padding mask (B, Sk) bool checked and on ``device`` (any strides; launchers pass a uint8 view)."""
    if key_mask is None:
        return None
    if not isinstance(key_mask, Tensor) or key_mask.dtype != torch.bool:
        raise TypeError(f"`key_mask` must be a bool tensor (True = attend); got {getattr(key_mask, 'dtype', key_mask)}")
    if tuple(key_mask.shape) != (batch, seqlen_k):
        raise ValueError(f"`key_mask` must have shape {(batch, seqlen_k)} (batch, keys); got {tuple(key_mask.shape)}")
    return key_mask if key_mask.device == device else key_mask.to(device)


# --------------------------------------------------------------------------------------------------------
# Kernel helpers (see Note [Kernel tiles])
# --------------------------------------------------------------------------------------------------------


@triton.jit
def _split(lo, mid_lo, mid_hi, hi, BLOCK: tl.constexpr):
    """Align [lo, hi) and its interior [mid_lo, mid_hi) to BLOCK tiles -> (start, u0, u1).

    Tiles starting in [start, u0) and [u1, hi) are edge tiles, those in [u0, u1) lie inside the interior.
    """
    start = (lo // BLOCK) * BLOCK
    u0 = tl.minimum(tl.maximum(((mid_lo + BLOCK - 1) // BLOCK) * BLOCK, start), hi)
    u1 = tl.minimum(tl.maximum((mid_hi // BLOCK) * BLOCK, u0), hi)
    return start, u0, u1


@triton.jit
def _key_range(RowLo, RowHi, start_m, seqlen_q, seqlen_k, MODE: tl.constexpr, BLOCK_M: tl.constexpr):
    """(lo, mid_lo, mid_hi, hi) over the keys for the query tile starting at row ``start_m``."""
    last_m = tl.minimum(start_m + BLOCK_M, seqlen_q) - 1
    if MODE == 2:
        lo = tl.load(RowLo + start_m)
        mid_lo = tl.load(RowLo + last_m)
        mid_hi = tl.load(RowHi + start_m)
        hi = tl.load(RowHi + last_m)
    elif MODE == 1:
        lo = 0
        mid_lo = 0
        mid_hi = tl.minimum(start_m + 1, seqlen_k)
        hi = tl.minimum(last_m + 1, seqlen_k)
    else:
        lo = 0
        mid_lo = 0
        mid_hi = seqlen_k
        hi = seqlen_k
    return lo, mid_lo, mid_hi, hi


@triton.jit
def _query_range(ColLo, ColHi, start_n, seqlen_q, seqlen_k, MODE: tl.constexpr, BLOCK_N: tl.constexpr):
    """(lo, mid_lo, mid_hi, hi) over the query rows for the key tile starting at key ``start_n``."""
    last_n = tl.minimum(start_n + BLOCK_N, seqlen_k) - 1
    if MODE == 2:
        lo = tl.load(ColLo + start_n)
        mid_lo = tl.load(ColLo + last_n)
        mid_hi = tl.load(ColHi + start_n)
        hi = tl.load(ColHi + last_n)
    elif MODE == 1:
        lo = tl.minimum(start_n, seqlen_q)
        mid_lo = tl.minimum(last_n, seqlen_q)
        mid_hi = seqlen_q
        hi = seqlen_q
    else:
        lo = 0
        mid_lo = 0
        mid_hi = seqlen_q
        hi = seqlen_q
    return lo, mid_lo, mid_hi, hi


@triton.jit
def _load_bounds(Lo, Hi, offs, n, MODE: tl.constexpr):
    """Per-index interval bounds of an "interval" tile (out-of-range indices get the empty interval [0, 0))."""
    if MODE == 2:
        ok = offs < n
        lo = tl.load(Lo + offs, mask=ok, other=0)
        hi = tl.load(Hi + offs, mask=ok, other=0)
    else:
        lo = offs * 0
        hi = offs * 0
    return lo, hi


@triton.jit
def _visible_qk(offs_m, offs_n, row_lo, row_hi, seqlen_k, MODE: tl.constexpr):
    """Visibility of an edge tile, queries along rows (forward, dQ), broadcastable to [BLOCK_M, BLOCK_N];
    includes the bound n < Sk."""
    if MODE == 2:
        vis = (offs_n[None, :] >= row_lo[:, None]) & (offs_n[None, :] < row_hi[:, None])
    elif MODE == 1:
        vis = (offs_n[None, :] <= offs_m[:, None]) & (offs_n < seqlen_k)[None, :]
    else:
        vis = (offs_n < seqlen_k)[None, :]
    return vis


@triton.jit
def _visible_kq(offs_n, offs_m, col_lo, col_hi, seqlen_q, MODE: tl.constexpr):
    """Visibility of an edge tile, keys along rows (dK/dV), broadcastable to [BLOCK_N, BLOCK_M]; includes the
    bound m < Sq."""
    if MODE == 2:
        vis = (offs_m[None, :] >= col_lo[:, None]) & (offs_m[None, :] < col_hi[:, None])
    elif MODE == 1:
        vis = (offs_m[None, :] >= offs_n[:, None]) & (offs_m < seqlen_q)[None, :]
    else:
        vis = (offs_m < seqlen_q)[None, :]
    return vis


@triton.jit
def _load_key_mask(km_base, offs_n, stride_kmn, seqlen_k):
    """Key padding mask of a key tile as a bool vector (keys past Sk are hidden)."""
    return tl.load(km_base + offs_n * stride_kmn, mask=offs_n < seqlen_k, other=0) != 0


@triton.jit
def _tanh(x):
    """tanh via one exp2: (1 - e^-2|x|) / (1 + e^-2|x|), with the sign of x (no overflow for any x)."""
    t = tl.math.exp2(-2.8853900817779268 * tl.abs(x))  # 2 * log2(e)
    y = (1.0 - t) / (1.0 + t)
    return tl.where(x < 0.0, -y, y)
