"""Triton flash-attention forward for one ring step: ``TritonForward`` (the ForwardKernel contract).

Each ring step accumulates the attention of this rank's queries over one key/value block into a state that
lives in memory between steps, so no low-precision output is ever produced mid-ring.

Note [Ring forward state]
~~~~~~~~~~~~~~~~~~~~~~~~~
Per query row the state holds three fp32 quantities, all in the base-2 domain of the scaled scores
``s = (q . k) * scale * log2(e)`` (with a softcap: ``softcap * tanh((q . k) * scale / softcap) * log2(e)``)::

    m    running max of s over every key seen so far                         (B, H, Sq)
    l    running sum of 2^(s - m)                                            (B, H, Sq)
    acc  UNNORMALISED output: sum_j 2^(s_j - m) v_j                          (B, Sq, H, D)

A step (one Triton launch) loads (m, l, acc) for its rows, folds in the new key blocks with the usual
online-softmax rescaling (``alpha = 2^(m_old - m_new)``), and stores them back, in fp32::

    ring step:    0          1          2                     W-1
    k/v block:  [K0 V0]    [K1 V1]    [K2 V2]    ...        [K.. V..]
                   |          |          |                     |
    state:  init -+-> (m,l,acc) -> (m,l,acc) -> ... -> (m,l,acc) --finalize--> out = acc / l   (dtype)
                                                                               lse = (m + log2 l) * ln 2

A step may be marked ``final``: the kernel then normalises in registers and writes ``out`` (input dtype)
and ``lse`` directly, skipping the fp32 store/load round trip (with a single step this is ordinary flash
attention). Rows that never saw a key keep l == 0 and finalise to out = 0, lse = -inf (no NaN); a NaN score
makes its row's l NaN, and the row finalises to NaN out and lse.

Visibility: each step gets a ``BlockMask`` (Note [Visibility]: "full", top-left "causal", or "interval"
arrays), an optional key padding mask and a softcap, selected in the kernel by the constexprs MODE,
HAS_KEY_MASK and SOFTCAP. A query tile visits only the key tiles its rows can see, and skips every mask on
the interior tiles that all its rows see whole (Note [Kernel tiles] in distcomm_attention.kernels.triton_mask,
shared with the backward)::

             key tiles ->                         causal                     interval (window, documents)
    q tile   [ intr ][ intr ][ edge ]  .  .       [ intr ][ edge ]  .  .      .  [ edge ][ intr ][ edge ]  .
    m        [ intr ][ intr ][ intr ][ edge ] .   interior: no mask;          tiles outside the rows'
                                                  edge: rule + key bounds     intervals are never visited

Sequence lengths need not be multiples of the block sizes (tails are masked), the query and key lengths
may differ, any strides are accepted (the last dimension need not be contiguous), and GQA/MQA map query
head h to key/value head ``h // (H // Hkv)`` without expanding K/V.

Supported: CUDA fp16/bf16/fp32 (fp32 uses IEEE fp32 dot products, no TF32); head dims that are
multiples of 8 from 16 to 256 (non-powers of two are padded to the next power of two in registers).
On CPU the kernel runs only under the Triton interpreter (``TRITON_INTERPRET=1`` set before this module
is imported); there bf16 dot operands are upcast to fp32, because the interpreter's bf16 ``tl.dot`` is
wrong.

Note [Split-2 forward]
~~~~~~~~~~~~~~~~~~~~~~
``TritonConfig.split == 2`` (the default for head_dim 128 in fp16/bf16 on GPU) runs
``_ring_fwd_split_kernel``: the same step, state and visibility as ``_ring_fwd_kernel``, but a program's
BLOCK_M = 128 query rows are two 64-row halves, each with its own (m, l, acc), that share every K/V tile
and interleave their work by hand (FlashAttention-3's intra-warpgroup overlap; one warpgroup, 4 warps,
64-key tiles)::

    per key tile:  K | S0 = Q0 K^T | S1 = Q1 K^T | softmax(S0) | V | O0 += P0 V | softmax(S1) | O1 += P1 V
                                    '--- S1 in flight ---'          '-- O0 in flight --'

With one 128-row tile per program, the tensor cores sit idle during each softmax; with two halves one
half's matmul is in flight while the other half does its exponentials. Interior tiles without softcap also
fold the scale into the exponent (``exp2(qk * qk_scale - m)``, one FMA per score). q halves and K/V tiles
are TMA loads through host descriptors of the 2-D views (rows, heads * D), straight into shared memory;
that, and starting the key loop from the empty state and merging a stored state in only after the loop
(``_rows_end``: the two partial softmaxes rescaled to their common max), is what keeps the two halves'
accumulators in registers with (almost) no spills: sm_90a, bf16, 4 warps, 244-255 registers, spill
stores/loads 0/0 (full), 8/16 B (causal), 12/40 B (causal step with state), against 24-276 B with pointer
q loads or the state loaded before the loop. So on a GPU the split kernel runs only for "full" and
"causal" blocks where TMA applies (sm_90+, head_dim a power of two, unit stride along D, packed heads,
16-byte aligned rows, Sk % BLOCK_N == 0 so that no key tile crosses into rows of the next batch); other
calls, and "interval" blocks (88/112 B of spills with a state: three loops and per-row bounds), launch
``_ring_fwd_kernel`` with the plain config. Under the interpreter the split kernel runs in every mode
with masked pointer loads (or the descriptors, where tests force them), so its math is tested on CPU.
The key range, edge/interior split and masks are those of the whole BLOCK_M tile (an interior tile for
all 128 rows is interior for each half), so the key mask and softcap carry over unchanged.

Every launch is a ``torch.library`` custom op (``distcomm_attention::triton_fwd_step`` mutating the
state, ``distcomm_attention::triton_fwd_last`` returning ``(out, lse)``) with a fake implementation, so
a ring loop built on them can be traced by ``torch.compile``.
"""

import functools
import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch import Tensor

from distcomm_attention.kernels.triton_mask import (
    _key_range,
    _load_bounds,
    _load_key_mask,
    _split,
    _tanh,
    _visible_qk,
    interval_args,
    key_mask_arg,
    mode_code,
)
from distcomm_attention.planning.visibility import BlockMask

__all__ = ["TritonConfig", "TritonForward", "TritonForwardState", "default_config"]

_LOG2E = 1.4426950408889634  # log2(e): scores are scaled into the base-2 domain for exp2
_LN2 = 0.6931471805599453  # ln(2): back from base-2 to natural-log lse

_SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_MIN_HEAD_DIM, _MAX_HEAD_DIM = 16, 256


# --------------------------------------------------------------------------------------------------------
# Kernels
# --------------------------------------------------------------------------------------------------------


@triton.jit
def _attend_block(
    acc, l_i, m_i, q, start_n,
    # pointers (already offset to this batch and kv head / batch row of the key mask)
    k_base, v_base, km_base,
    # strides
    stride_kn, stride_kd, stride_vn, stride_vd, stride_kmn,
    # sizes and runtime values
    offs_m, offs_d, row_lo, row_hi, seqlen_k, qk_scale, softcap,
    # meta
    HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, MODE: tl.constexpr, EDGE: tl.constexpr,
    HAS_KEY_MASK: tl.constexpr, SOFTCAP: tl.constexpr, EVEN_D: tl.constexpr,
    UPCAST: tl.constexpr, IEEE: tl.constexpr,
):
    """Online-softmax update of (acc, l_i, m_i) with the key tile starting at ``start_n``.

    An EDGE tile applies the visibility rule and the key-length bound (see Note [Kernel tiles]); an
    interior tile is fully visible and in range and skips both. The key padding mask, when there is one,
    applies to every tile.
    """
    MASKED: tl.constexpr = EDGE or HAS_KEY_MASK
    offs_n = start_n + tl.arange(0, BLOCK_N)
    d_ok = offs_d < HEAD_DIM
    rows_n = offs_n[:, None].to(tl.int64)
    k_ptrs = k_base + rows_n * stride_kn + offs_d[None, :] * stride_kd
    v_ptrs = v_base + rows_n * stride_vn + offs_d[None, :] * stride_vd
    if EDGE:
        n_ok = offs_n < seqlen_k
        if EVEN_D:
            k = tl.load(k_ptrs, mask=n_ok[:, None], other=0.0)
        else:
            k = tl.load(k_ptrs, mask=n_ok[:, None] & d_ok[None, :], other=0.0)
    else:
        if EVEN_D:
            k = tl.load(k_ptrs)
        else:
            k = tl.load(k_ptrs, mask=d_ok[None, :], other=0.0)
    if UPCAST:
        k = k.to(tl.float32)
    if IEEE:
        qk = tl.dot(q, tl.trans(k), input_precision="ieee")
    else:
        qk = tl.dot(q, tl.trans(k))
    if SOFTCAP:
        qk = _tanh(qk * qk_scale) * softcap  # qk_scale = scale / cap, softcap = cap * log2(e)
    else:
        qk = qk * qk_scale
    if MASKED:
        if EDGE:
            visible = _visible_qk(offs_m, offs_n, row_lo, row_hi, seqlen_k, MODE)
            if HAS_KEY_MASK:
                visible = visible & _load_key_mask(km_base, offs_n, stride_kmn, seqlen_k)[None, :]
        else:
            visible = _load_key_mask(km_base, offs_n, stride_kmn, seqlen_k)[None, :]
        qk = tl.where(visible, qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        # A row with no visible key so far keeps m = -inf; subtract 0 instead to avoid inf - inf.
        m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        m_sub = m_new
    alpha = tl.math.exp2(m_i - m_sub)
    p = tl.math.exp2(qk - m_sub[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None]
    if EDGE:
        if EVEN_D:
            v = tl.load(v_ptrs, mask=n_ok[:, None], other=0.0)
        else:
            v = tl.load(v_ptrs, mask=n_ok[:, None] & d_ok[None, :], other=0.0)
    else:
        if EVEN_D:
            v = tl.load(v_ptrs)
        else:
            v = tl.load(v_ptrs, mask=d_ok[None, :], other=0.0)
    if UPCAST:
        v = v.to(tl.float32)
    if IEEE:
        acc = tl.dot(p.to(v.dtype), v, acc, input_precision="ieee")
    else:
        acc = tl.dot(p.to(v.dtype), v, acc)
    return acc, l_i, m_new


@triton.jit
def _attend_range(
    acc, l_i, m_i, q, lo, hi,
    k_base, v_base, km_base,
    stride_kn, stride_kd, stride_vn, stride_vd, stride_kmn,
    offs_m, offs_d, row_lo, row_hi, seqlen_k, qk_scale, softcap,
    HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, MODE: tl.constexpr, EDGE: tl.constexpr,
    HAS_KEY_MASK: tl.constexpr, SOFTCAP: tl.constexpr, EVEN_D: tl.constexpr,
    UPCAST: tl.constexpr, IEEE: tl.constexpr, INTERPRET: tl.constexpr,
):
    """Key tiles [lo, hi) in steps of BLOCK_N."""
    if INTERPRET:
        # The interpreter cannot use runtime scalars as range() bounds (they are 1-element arrays).
        start_n = lo
        while start_n < hi:
            acc, l_i, m_i = _attend_block(
                acc, l_i, m_i, q, start_n, k_base, v_base, km_base,
                stride_kn, stride_kd, stride_vn, stride_vd, stride_kmn,
                offs_m, offs_d, row_lo, row_hi, seqlen_k, qk_scale, softcap,
                HEAD_DIM, BLOCK_N, MODE, EDGE, HAS_KEY_MASK, SOFTCAP, EVEN_D, UPCAST, IEEE,
            )
            start_n += BLOCK_N
    else:
        for start_n in range(lo, hi, BLOCK_N):
            acc, l_i, m_i = _attend_block(
                acc, l_i, m_i, q, start_n, k_base, v_base, km_base,
                stride_kn, stride_kd, stride_vn, stride_vd, stride_kmn,
                offs_m, offs_d, row_lo, row_hi, seqlen_k, qk_scale, softcap,
                HEAD_DIM, BLOCK_N, MODE, EDGE, HAS_KEY_MASK, SOFTCAP, EVEN_D, UPCAST, IEEE,
            )
    return acc, l_i, m_i


@triton.jit
def _ring_fwd_kernel(
    # pointers
    Q, K, V, Acc, M, L, Out, Lse, RowLo, RowHi, KeyMask,
    # strides: q, k, v, out are (B, S, H, D); acc is (B, Sq, H, D); m, l, lse are (B, H, Sq); key mask (B, Sk)
    stride_qb, stride_qm, stride_qh, stride_qd,
    stride_kb, stride_kn, stride_kh, stride_kd,
    stride_vb, stride_vn, stride_vh, stride_vd,
    stride_ab, stride_am, stride_ah, stride_ad,
    stride_mb, stride_mh, stride_mm,
    stride_ob, stride_om, stride_oh, stride_od,
    stride_lb, stride_lh, stride_lm,
    stride_kmb, stride_kmn,
    # sizes and runtime values
    num_heads, kv_group, seqlen_q, seqlen_k, qk_scale, softcap,
    # meta
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    MODE: tl.constexpr, HAS_KEY_MASK: tl.constexpr, SOFTCAP: tl.constexpr,
    LOAD_STATE: tl.constexpr, FINAL: tl.constexpr,
    UPCAST: tl.constexpr, IEEE: tl.constexpr, INTERPRET: tl.constexpr,
):
    tl.static_assert(BLOCK_M % BLOCK_N == 0, "BLOCK_M must be a multiple of BLOCK_N")
    tl.static_assert(BLOCK_D >= HEAD_DIM, "BLOCK_D must cover HEAD_DIM")
    tl.static_assert(MODE >= 0 and MODE <= 2, "MODE: 0 full, 1 causal, 2 interval")
    EVEN_D: tl.constexpr = BLOCK_D == HEAD_DIM

    pid_m = tl.program_id(0)
    if MODE != 0:
        # Query tiles near the end of a causal (or causal-like) block do the most work: schedule them first.
        pid_m = tl.num_programs(0) - 1 - pid_m
    pid_bh = tl.program_id(1)
    off_b = (pid_bh // num_heads).to(tl.int64)
    off_h = (pid_bh % num_heads).to(tl.int64)
    off_hk = off_h // kv_group

    start_m = pid_m * BLOCK_M
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    rows_m = offs_m.to(tl.int64)
    m_ok = offs_m < seqlen_q
    d_ok = offs_d < HEAD_DIM
    md_ok = m_ok[:, None] & d_ok[None, :]

    q_ptrs = Q + off_b * stride_qb + off_h * stride_qh + rows_m[:, None] * stride_qm + offs_d[None, :] * stride_qd
    q = tl.load(q_ptrs, mask=md_ok, other=0.0)
    if UPCAST:
        q = q.to(tl.float32)

    ml_off = off_b * stride_mb + off_h * stride_mh + rows_m * stride_mm
    acc_ptrs = Acc + off_b * stride_ab + off_h * stride_ah + rows_m[:, None] * stride_am + offs_d[None, :] * stride_ad
    if LOAD_STATE:
        m_i = tl.load(M + ml_off, mask=m_ok, other=float("-inf"))
        l_i = tl.load(L + ml_off, mask=m_ok, other=0.0)
        acc = tl.load(acc_ptrs, mask=md_ok, other=0.0)
    else:
        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

    # Key tiles [start, u0) and [u1, hi) are edge tiles, [u0, u1) interior; see Note [Kernel tiles].
    lo, mid_lo, mid_hi, hi = _key_range(RowLo, RowHi, start_m, seqlen_q, seqlen_k, MODE, BLOCK_M)
    start, u0, u1 = _split(lo, mid_lo, mid_hi, hi, BLOCK_N)
    row_lo, row_hi = _load_bounds(RowLo, RowHi, offs_m, seqlen_q, MODE)

    k_base = K + off_b * stride_kb + off_hk * stride_kh
    v_base = V + off_b * stride_vb + off_hk * stride_vh
    km_base = KeyMask + off_b * stride_kmb
    if MODE == 2:  # full and causal tiles have no leading edge (start == u0 == 0)
        acc, l_i, m_i = _attend_range(
            acc, l_i, m_i, q, start, u0, k_base, v_base, km_base,
            stride_kn, stride_kd, stride_vn, stride_vd, stride_kmn,
            offs_m, offs_d, row_lo, row_hi, seqlen_k, qk_scale, softcap,
            HEAD_DIM, BLOCK_N, MODE, True, HAS_KEY_MASK, SOFTCAP, EVEN_D, UPCAST, IEEE, INTERPRET,
        )
    acc, l_i, m_i = _attend_range(
        acc, l_i, m_i, q, u0, u1, k_base, v_base, km_base,
        stride_kn, stride_kd, stride_vn, stride_vd, stride_kmn,
        offs_m, offs_d, row_lo, row_hi, seqlen_k, qk_scale, softcap,
        HEAD_DIM, BLOCK_N, MODE, False, HAS_KEY_MASK, SOFTCAP, EVEN_D, UPCAST, IEEE, INTERPRET,
    )
    acc, l_i, m_i = _attend_range(
        acc, l_i, m_i, q, u1, hi, k_base, v_base, km_base,
        stride_kn, stride_kd, stride_vn, stride_vd, stride_kmn,
        offs_m, offs_d, row_lo, row_hi, seqlen_k, qk_scale, softcap,
        HEAD_DIM, BLOCK_N, MODE, True, HAS_KEY_MASK, SOFTCAP, EVEN_D, UPCAST, IEEE, INTERPRET,
    )

    if FINAL:
        empty = l_i == 0.0  # no key seen; a NaN l (a NaN score) gives NaN out and lse, not this case
        l_safe = tl.where(empty, 1.0, l_i)
        out = acc * (1.0 / l_safe)[:, None]
        lse = tl.where(empty, float("-inf"), (m_i + tl.math.log2(l_safe)) * 0.6931471805599453)  # * ln(2)
        out_ptrs = Out + off_b * stride_ob + off_h * stride_oh
        out_ptrs += rows_m[:, None] * stride_om + offs_d[None, :] * stride_od
        tl.store(out_ptrs, out.to(Out.dtype.element_ty), mask=md_ok)
        tl.store(Lse + off_b * stride_lb + off_h * stride_lh + rows_m * stride_lm, lse, mask=m_ok)
    else:
        tl.store(M + ml_off, m_i, mask=m_ok)
        tl.store(L + ml_off, l_i, mask=m_ok)
        tl.store(acc_ptrs, acc, mask=md_ok)


# ---- the split-2 kernel (Note [Split-2 forward]) ----


@triton.jit
def _kv_tile(base, desc, start_n, kv_row, kv_col, stride_n, stride_d, offs_d, seqlen_k,
             HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, EDGE: tl.constexpr, EVEN_D: tl.constexpr,
             TMA: tl.constexpr, UPCAST: tl.constexpr):
    """The (BLOCK_N, BLOCK_D) key or value tile at key ``start_n``: a TMA descriptor load (the launcher
    guarantees the tile lies inside this batch's keys) or masked pointer loads (zeros past Sk / HEAD_DIM)."""
    if TMA:
        x = desc.load([kv_row + start_n, kv_col])
    else:
        offs_n = start_n + tl.arange(0, BLOCK_N)
        ptrs = base + offs_n[:, None].to(tl.int64) * stride_n + offs_d[None, :] * stride_d
        if EDGE:
            if EVEN_D:
                x = tl.load(ptrs, mask=(offs_n < seqlen_k)[:, None], other=0.0)
            else:
                x = tl.load(ptrs, mask=(offs_n < seqlen_k)[:, None] & (offs_d < HEAD_DIM)[None, :], other=0.0)
        else:
            if EVEN_D:
                x = tl.load(ptrs)
            else:
                x = tl.load(ptrs, mask=(offs_d < HEAD_DIM)[None, :], other=0.0)
    if UPCAST:
        x = x.to(tl.float32)
    return x


@triton.jit
def _softmax_update(qk, m_i, l_i, acc, offs_m, offs_n, row_lo, row_hi, key_ok, seqlen_k, qk_scale, softcap,
                    MODE: tl.constexpr, EDGE: tl.constexpr, HAS_KEY_MASK: tl.constexpr, SOFTCAP: tl.constexpr):
    """Online-softmax update of one half's (l_i, acc) with raw scores ``qk`` -> (p, m_new, l_i, acc rescaled).

    The same arithmetic as ``_attend_block``, except that an unmasked tile without softcap folds the scale
    into the exponent (``exp2(qk * qk_scale - m)``: one FMA per score; ``max(qk) * qk_scale`` is the max of
    the scaled scores since qk_scale > 0), a causal edge tile tests one bound per score
    (``n <= min(m, Sk - 1)``), and the guard for rows that have seen no key exists only where such rows can
    occur: with a key mask or interval rows. Full and causal blocks never have them, as every row sees key 0
    in the first tile it visits.
    """
    MASKED: tl.constexpr = EDGE or HAS_KEY_MASK
    GUARD: tl.constexpr = HAS_KEY_MASK or MODE == 2
    if SOFTCAP:
        s = _tanh(qk * qk_scale) * softcap  # qk_scale = scale / cap, softcap = cap * log2(e)
    else:
        s = qk
    if MASKED:
        if EDGE:
            if MODE == 1:
                visible = offs_n[None, :] <= tl.minimum(offs_m, seqlen_k - 1)[:, None]
            else:
                visible = _visible_qk(offs_m, offs_n, row_lo, row_hi, seqlen_k, MODE)
            if HAS_KEY_MASK:
                visible = visible & key_ok[None, :]
        else:
            visible = key_ok[None, :]
        if SOFTCAP:
            s = tl.where(visible, s, float("-inf"))
        else:
            s = tl.where(visible, s * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        if GUARD:
            # A row with no visible key so far keeps m = -inf; subtract 0 instead to avoid inf - inf.
            m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)
        else:
            m_sub = m_new
        p = tl.math.exp2(s - m_sub[:, None])
    elif SOFTCAP:
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_sub = m_new
        p = tl.math.exp2(s - m_sub[:, None])
    else:
        m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
        m_sub = m_new
        p = tl.math.exp2(s * qk_scale - m_sub[:, None])
    alpha = tl.math.exp2(m_i - m_sub)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None]
    return p, m_new, l_i, acc


@triton.jit
def _attend_block_split(
    acc0, l0, m0, acc1, l1, m1, q0, q1, start_n,
    k_base, v_base, km_base, k_desc, v_desc, kv_row, kv_col,
    stride_kn, stride_kd, stride_vn, stride_vd, stride_kmn,
    offs_m0, offs_m1, offs_d, row_lo0, row_hi0, row_lo1, row_hi1, seqlen_k, qk_scale, softcap,
    HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, MODE: tl.constexpr, EDGE: tl.constexpr,
    HAS_KEY_MASK: tl.constexpr, SOFTCAP: tl.constexpr, EVEN_D: tl.constexpr,
    UPCAST: tl.constexpr, IEEE: tl.constexpr, TMA: tl.constexpr,
):
    """One key tile for both halves: QK of half 1 is issued before the softmax of half 0, and P @ V of half 0
    before the softmax of half 1 (Note [Split-2 forward])."""
    offs_n = start_n + tl.arange(0, BLOCK_N)
    k = _kv_tile(k_base, k_desc, start_n, kv_row, kv_col, stride_kn, stride_kd, offs_d, seqlen_k,
                 HEAD_DIM, BLOCK_N, EDGE, EVEN_D, TMA, UPCAST)
    if IEEE:
        qk0 = tl.dot(q0, tl.trans(k), input_precision="ieee")
        qk1 = tl.dot(q1, tl.trans(k), input_precision="ieee")
    else:
        qk0 = tl.dot(q0, tl.trans(k))
        qk1 = tl.dot(q1, tl.trans(k))  # in flight during half 0's softmax
    if HAS_KEY_MASK:
        key_ok = _load_key_mask(km_base, offs_n, stride_kmn, seqlen_k)
    else:
        key_ok = offs_n < seqlen_k  # unused
    p0, m0, l0, acc0 = _softmax_update(qk0, m0, l0, acc0, offs_m0, offs_n, row_lo0, row_hi0, key_ok, seqlen_k,
                                       qk_scale, softcap, MODE, EDGE, HAS_KEY_MASK, SOFTCAP)
    v = _kv_tile(v_base, v_desc, start_n, kv_row, kv_col, stride_vn, stride_vd, offs_d, seqlen_k,
                 HEAD_DIM, BLOCK_N, EDGE, EVEN_D, TMA, UPCAST)
    if IEEE:
        acc0 = tl.dot(p0.to(v.dtype), v, acc0, input_precision="ieee")
    else:
        acc0 = tl.dot(p0.to(v.dtype), v, acc0)  # in flight during half 1's softmax
    p1, m1, l1, acc1 = _softmax_update(qk1, m1, l1, acc1, offs_m1, offs_n, row_lo1, row_hi1, key_ok, seqlen_k,
                                       qk_scale, softcap, MODE, EDGE, HAS_KEY_MASK, SOFTCAP)
    if IEEE:
        acc1 = tl.dot(p1.to(v.dtype), v, acc1, input_precision="ieee")
    else:
        acc1 = tl.dot(p1.to(v.dtype), v, acc1)
    return acc0, l0, m0, acc1, l1, m1


@triton.jit
def _attend_range_split(
    acc0, l0, m0, acc1, l1, m1, q0, q1, lo, hi,
    k_base, v_base, km_base, k_desc, v_desc, kv_row, kv_col,
    stride_kn, stride_kd, stride_vn, stride_vd, stride_kmn,
    offs_m0, offs_m1, offs_d, row_lo0, row_hi0, row_lo1, row_hi1, seqlen_k, qk_scale, softcap,
    HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, MODE: tl.constexpr, EDGE: tl.constexpr,
    HAS_KEY_MASK: tl.constexpr, SOFTCAP: tl.constexpr, EVEN_D: tl.constexpr,
    UPCAST: tl.constexpr, IEEE: tl.constexpr, TMA: tl.constexpr, INTERPRET: tl.constexpr,
):
    """Key tiles [lo, hi) in steps of BLOCK_N for both halves."""
    if INTERPRET:
        # The interpreter cannot use runtime scalars as range() bounds (they are 1-element arrays).
        start_n = lo
        while start_n < hi:
            acc0, l0, m0, acc1, l1, m1 = _attend_block_split(
                acc0, l0, m0, acc1, l1, m1, q0, q1, start_n,
                k_base, v_base, km_base, k_desc, v_desc, kv_row, kv_col,
                stride_kn, stride_kd, stride_vn, stride_vd, stride_kmn,
                offs_m0, offs_m1, offs_d, row_lo0, row_hi0, row_lo1, row_hi1, seqlen_k, qk_scale, softcap,
                HEAD_DIM, BLOCK_N, MODE, EDGE, HAS_KEY_MASK, SOFTCAP, EVEN_D, UPCAST, IEEE, TMA,
            )
            start_n += BLOCK_N
    else:
        for start_n in range(lo, hi, BLOCK_N):
            start_n = tl.multiple_of(start_n, BLOCK_N)
            acc0, l0, m0, acc1, l1, m1 = _attend_block_split(
                acc0, l0, m0, acc1, l1, m1, q0, q1, start_n,
                k_base, v_base, km_base, k_desc, v_desc, kv_row, kv_col,
                stride_kn, stride_kd, stride_vn, stride_vd, stride_kmn,
                offs_m0, offs_m1, offs_d, row_lo0, row_hi0, row_lo1, row_hi1, seqlen_k, qk_scale, softcap,
                HEAD_DIM, BLOCK_N, MODE, EDGE, HAS_KEY_MASK, SOFTCAP, EVEN_D, UPCAST, IEEE, TMA,
            )
    return acc0, l0, m0, acc1, l1, m1


@triton.jit
def _rows_begin(Q, q_desc, q_row, q_col, q_off, offs_m, offs_d, seqlen_q, stride_qm, stride_qd,
                HEAD_DIM: tl.constexpr, UPCAST: tl.constexpr, TMA_Q: tl.constexpr):
    """q of the query rows ``offs_m`` (zeros past Sq / HEAD_DIM).

    With TMA_Q, q comes straight into shared memory through the descriptor of the (rows, H*D) view at
    (q_row, q_col); rows past Sq read other rows of the view or zeros, and their results are never stored.
    """
    if TMA_Q:
        q = q_desc.load([q_row, q_col])
    else:
        md_ok = (offs_m < seqlen_q)[:, None] & (offs_d < HEAD_DIM)[None, :]
        q = tl.load(Q + q_off + offs_m.to(tl.int64)[:, None] * stride_qm + offs_d[None, :] * stride_qd,
                    mask=md_ok, other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
    return q


@triton.jit
def _rows_end(acc, l_i, m_i, Acc, M, L, Out, Lse, a_off, ml_off, o_off, lse_off, offs_m, offs_d, seqlen_q,
              stride_am, stride_ad, stride_mm, stride_om, stride_od, stride_lm,
              HEAD_DIM: tl.constexpr, LOAD_STATE: tl.constexpr, FINAL: tl.constexpr):
    """Merge this step's (acc, l_i, m_i) into the stored state (LOAD_STATE), then store the rows' state or
    (FINAL) their normalised out and lse (Note [Ring forward state])."""
    rows_m = offs_m.to(tl.int64)
    m_ok = offs_m < seqlen_q
    md_ok = m_ok[:, None] & (offs_d < HEAD_DIM)[None, :]
    acc_ptrs = Acc + a_off + rows_m[:, None] * stride_am + offs_d[None, :] * stride_ad
    if LOAD_STATE:
        # The two partial softmaxes, rescaled to their common max (-inf for rows that saw no key in either).
        m_old = tl.load(M + ml_off + rows_m * stride_mm, mask=m_ok, other=float("-inf"))
        l_old = tl.load(L + ml_off + rows_m * stride_mm, mask=m_ok, other=0.0)
        acc_old = tl.load(acc_ptrs, mask=md_ok, other=0.0)
        m_new = tl.maximum(m_old, m_i)
        m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)
        a_old = tl.math.exp2(m_old - m_sub)
        a_new = tl.math.exp2(m_i - m_sub)
        acc = acc_old * a_old[:, None] + acc * a_new[:, None]
        l_i = l_old * a_old + l_i * a_new
        m_i = m_new
    if FINAL:
        empty = l_i == 0.0  # no key seen; a NaN l (a NaN score) gives NaN out and lse, not this case
        l_safe = tl.where(empty, 1.0, l_i)
        out = acc * (1.0 / l_safe)[:, None]
        lse = tl.where(empty, float("-inf"), (m_i + tl.math.log2(l_safe)) * 0.6931471805599453)  # * ln(2)
        tl.store(Out + o_off + rows_m[:, None] * stride_om + offs_d[None, :] * stride_od,
                 out.to(Out.dtype.element_ty), mask=md_ok)
        tl.store(Lse + lse_off + rows_m * stride_lm, lse, mask=m_ok)
    else:
        tl.store(M + ml_off + rows_m * stride_mm, m_i, mask=m_ok)
        tl.store(L + ml_off + rows_m * stride_mm, l_i, mask=m_ok)
        tl.store(acc_ptrs, acc, mask=md_ok)


@triton.jit
def _ring_fwd_split_kernel(
    # pointers; QDesc (TMA_Q), KDesc/VDesc (TMA): descriptors of the 2-D views (B*S, heads*D), else unused
    Q, K, V, Acc, M, L, Out, Lse, RowLo, RowHi, KeyMask, QDesc, KDesc, VDesc,
    # strides: as _ring_fwd_kernel
    stride_qb, stride_qm, stride_qh, stride_qd,
    stride_kb, stride_kn, stride_kh, stride_kd,
    stride_vb, stride_vn, stride_vh, stride_vd,
    stride_ab, stride_am, stride_ah, stride_ad,
    stride_mb, stride_mh, stride_mm,
    stride_ob, stride_om, stride_oh, stride_od,
    stride_lb, stride_lh, stride_lm,
    stride_kmb, stride_kmn,
    # sizes and runtime values
    num_heads, kv_group, seqlen_q, seqlen_k, qk_scale, softcap,
    # rows of the descriptors' 2-D views between two batches (batch stride / row stride)
    q_batch_rows, kv_batch_rows,
    # meta
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    MODE: tl.constexpr, HAS_KEY_MASK: tl.constexpr, SOFTCAP: tl.constexpr,
    LOAD_STATE: tl.constexpr, FINAL: tl.constexpr,
    UPCAST: tl.constexpr, IEEE: tl.constexpr, TMA_Q: tl.constexpr, TMA: tl.constexpr, INTERPRET: tl.constexpr,
):
    """``_ring_fwd_kernel`` with the program's BLOCK_M rows as two interleaved halves (Note [Split-2 forward])."""
    tl.static_assert(BLOCK_M % 32 == 0, "BLOCK_M: two halves of at least 16 rows")
    tl.static_assert(BLOCK_D >= HEAD_DIM, "BLOCK_D must cover HEAD_DIM")
    tl.static_assert(MODE >= 0 and MODE <= 2, "MODE: 0 full, 1 causal, 2 interval")
    EVEN_D: tl.constexpr = BLOCK_D == HEAD_DIM
    HALF: tl.constexpr = BLOCK_M // 2

    pid_m = tl.program_id(0)
    if MODE != 0:
        pid_m = tl.num_programs(0) - 1 - pid_m  # heaviest query tiles first
    pid_bh = tl.program_id(1)
    off_b = (pid_bh // num_heads).to(tl.int64)
    off_h = (pid_bh % num_heads).to(tl.int64)
    off_hk = off_h // kv_group

    start_m = pid_m * BLOCK_M
    offs_m0 = start_m + tl.arange(0, HALF)
    offs_m1 = offs_m0 + HALF
    offs_d = tl.arange(0, BLOCK_D)
    q_off = off_b * stride_qb + off_h * stride_qh
    a_off = off_b * stride_ab + off_h * stride_ah
    ml_off = off_b * stride_mb + off_h * stride_mh
    q_row = (off_b * q_batch_rows + start_m).to(tl.int32)  # TMA coordinates of the tile's first row, this head
    q_col = (off_h * HEAD_DIM).to(tl.int32)
    q0 = _rows_begin(Q, QDesc, q_row, q_col, q_off, offs_m0, offs_d, seqlen_q, stride_qm, stride_qd,
                     HEAD_DIM, UPCAST, TMA_Q)
    q1 = _rows_begin(Q, QDesc, q_row + HALF, q_col, q_off, offs_m1, offs_d, seqlen_q, stride_qm, stride_qd,
                     HEAD_DIM, UPCAST, TMA_Q)
    # The key loop starts from the empty state; a stored state is merged in at the end (_rows_end), so that
    # it is not held in registers across the loop.
    m0 = tl.full([HALF], float("-inf"), dtype=tl.float32)
    l0 = tl.zeros([HALF], dtype=tl.float32)
    acc0 = tl.zeros([HALF, BLOCK_D], dtype=tl.float32)
    m1 = tl.full([HALF], float("-inf"), dtype=tl.float32)
    l1 = tl.zeros([HALF], dtype=tl.float32)
    acc1 = tl.zeros([HALF, BLOCK_D], dtype=tl.float32)

    # One key range for the whole BLOCK_M tile: a tile interior to all its rows is interior to each half.
    lo, mid_lo, mid_hi, hi = _key_range(RowLo, RowHi, start_m, seqlen_q, seqlen_k, MODE, BLOCK_M)
    start, u0, u1 = _split(lo, mid_lo, mid_hi, hi, BLOCK_N)
    row_lo0, row_hi0 = _load_bounds(RowLo, RowHi, offs_m0, seqlen_q, MODE)
    row_lo1, row_hi1 = _load_bounds(RowLo, RowHi, offs_m1, seqlen_q, MODE)

    k_base = K + off_b * stride_kb + off_hk * stride_kh
    v_base = V + off_b * stride_vb + off_hk * stride_vh
    km_base = KeyMask + off_b * stride_kmb
    kv_row = (off_b * kv_batch_rows).to(tl.int32)  # TMA coordinates of this batch's first key, this kv head
    kv_col = (off_hk * HEAD_DIM).to(tl.int32)
    if MODE == 2:
        acc0, l0, m0, acc1, l1, m1 = _attend_range_split(
            acc0, l0, m0, acc1, l1, m1, q0, q1, start, u0,
            k_base, v_base, km_base, KDesc, VDesc, kv_row, kv_col,
            stride_kn, stride_kd, stride_vn, stride_vd, stride_kmn,
            offs_m0, offs_m1, offs_d, row_lo0, row_hi0, row_lo1, row_hi1, seqlen_k, qk_scale, softcap,
            HEAD_DIM, BLOCK_N, MODE, True, HAS_KEY_MASK, SOFTCAP, EVEN_D, UPCAST, IEEE, TMA, INTERPRET,
        )
    acc0, l0, m0, acc1, l1, m1 = _attend_range_split(
        acc0, l0, m0, acc1, l1, m1, q0, q1, u0, u1,
        k_base, v_base, km_base, KDesc, VDesc, kv_row, kv_col,
        stride_kn, stride_kd, stride_vn, stride_vd, stride_kmn,
        offs_m0, offs_m1, offs_d, row_lo0, row_hi0, row_lo1, row_hi1, seqlen_k, qk_scale, softcap,
        HEAD_DIM, BLOCK_N, MODE, False, HAS_KEY_MASK, SOFTCAP, EVEN_D, UPCAST, IEEE, TMA, INTERPRET,
    )
    acc0, l0, m0, acc1, l1, m1 = _attend_range_split(
        acc0, l0, m0, acc1, l1, m1, q0, q1, u1, hi,
        k_base, v_base, km_base, KDesc, VDesc, kv_row, kv_col,
        stride_kn, stride_kd, stride_vn, stride_vd, stride_kmn,
        offs_m0, offs_m1, offs_d, row_lo0, row_hi0, row_lo1, row_hi1, seqlen_k, qk_scale, softcap,
        HEAD_DIM, BLOCK_N, MODE, True, HAS_KEY_MASK, SOFTCAP, EVEN_D, UPCAST, IEEE, TMA, INTERPRET,
    )

    o_off = off_b * stride_ob + off_h * stride_oh
    lse_off = off_b * stride_lb + off_h * stride_lh
    _rows_end(acc0, l0, m0, Acc, M, L, Out, Lse, a_off, ml_off, o_off, lse_off, offs_m0, offs_d, seqlen_q,
              stride_am, stride_ad, stride_mm, stride_om, stride_od, stride_lm, HEAD_DIM, LOAD_STATE,
              FINAL)
    _rows_end(acc1, l1, m1, Acc, M, L, Out, Lse, a_off, ml_off, o_off, lse_off, offs_m1, offs_d, seqlen_q,
              stride_am, stride_ad, stride_mm, stride_om, stride_od, stride_lm, HEAD_DIM, LOAD_STATE,
              FINAL)


def _interpreting() -> bool:
    """True when the kernels were decorated under TRITON_INTERPRET=1 (CPU execution)."""
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(_ring_fwd_kernel, InterpretedFunction)


# --------------------------------------------------------------------------------------------------------
# Configuration
# --------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TritonConfig:
    """Launch configuration of the forward kernel.

    Attributes:
        block_m: query rows per program (power of two >= 16, a multiple of ``block_n``).
        block_n: key rows per inner iteration (power of two >= 16).
        num_warps: warps per program.
        num_stages: software-pipelining depth of the key loop (ignored by the interpreter).
        split: 1 runs ``_ring_fwd_kernel``; 2 runs ``_ring_fwd_split_kernel``, whose program treats its
            ``block_m`` rows as two interleaved halves (Note [Split-2 forward]).
    """

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    split: int = 1

    def __post_init__(self):
        for name in ("block_m", "block_n"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 16 or value & (value - 1):
                raise ValueError(f"`{name}`={value!r} must be a power of two >= 16")
        if self.block_m % self.block_n:
            raise ValueError(f"`block_m`={self.block_m} must be a multiple of `block_n`={self.block_n}")
        if not isinstance(self.num_warps, int) or self.num_warps not in (1, 2, 4, 8, 16):
            raise ValueError(f"`num_warps`={self.num_warps!r} must be one of 1, 2, 4, 8, 16")
        if not isinstance(self.num_stages, int) or self.num_stages < 1:
            raise ValueError(f"`num_stages`={self.num_stages!r} must be a positive int")
        if self.split not in (1, 2) or isinstance(self.split, bool):
            raise ValueError(f"`split`={self.split!r} must be 1 or 2")
        if self.split == 2 and self.block_m < 32:
            raise ValueError(f"`block_m`={self.block_m} must be >= 32 with `split`=2 (two halves of >= 16 rows)")

    def astuple(self) -> tuple[int, int, int, int, int]:
        """(block_m, block_n, num_warps, num_stages, split): the custom ops' trailing arguments."""
        return self.block_m, self.block_n, self.num_warps, self.num_stages, self.split


# Hopper (H100/H200) defaults per padded head dim: (block_m, block_n, num_warps, num_stages).
# Measured on one H200, bf16, B=1, H=32, S=8192 (fused final step), TFLOP/s full / causal:
# d=64 402 / 355 (SDPA flash 304 / 272); d=128 486 / 461 (349 / 317); d=256 507 / 503 (322 / 307).
_GPU_DEFAULTS = {
    16: (128, 64, 4, 3),
    32: (128, 64, 4, 3),
    64: (128, 64, 4, 3),
    128: (128, 128, 8, 3),
    256: (128, 64, 8, 2),
}
# head_dim exactly 128 in fp16/bf16: the split-2 kernel (Note [Split-2 forward]). On one H100 (bf16, B=1,
# 32 heads; docs/bench/block_kernels.md, run 3) 461-577 TFLOP/s at 8k-32k, causal and full, against 443-510
# for the row above (runs 1-2). fp32 keeps the row above (two fp32 q halves and accumulators would not fit
# in 4 warps).
_GPU_SPLIT_128 = (128, 64, 4, 2, 2)
# The interpreter pays per program and per block iteration, not per element: use large blocks.
_INTERPRETER_DEFAULT = (64, 64, 4, 1)


def default_config(head_dim: int, dtype: torch.dtype | None = None, *,
                   interpret: bool | None = None) -> TritonConfig:
    """The default launch configuration for ``head_dim`` and ``dtype`` (Hopper-tuned, or
    interpreter-friendly). ``dtype`` None means fp16/bf16."""
    if interpret is None:
        interpret = _interpreting()
    if interpret:
        return TritonConfig(*_INTERPRETER_DEFAULT)
    if head_dim == 128 and dtype != torch.float32:
        return TritonConfig(*_GPU_SPLIT_128)
    return TritonConfig(*_GPU_DEFAULTS[max(16, triton.next_power_of_2(head_dim))])


# --------------------------------------------------------------------------------------------------------
# Launcher and custom ops
# --------------------------------------------------------------------------------------------------------


def _score_args(scale: float, softcap: float) -> tuple[float, float]:
    """(qk_scale, softcap) kernel arguments: scores reach the kernels' base-2 domain as
    ``qk * qk_scale`` without a softcap, or ``tanh(qk * qk_scale) * softcap`` with one."""
    if softcap > 0:
        return scale / softcap, softcap * _LOG2E
    return scale * _LOG2E, 0.0


def _launch(
    q: Tensor, k: Tensor, v: Tensor, acc: Tensor, m: Tensor, l: Tensor, out: Tensor, lse: Tensor,
    row_lo: Tensor | None, row_hi: Tensor | None, key_mask: Tensor | None,
    *, mode: int, scale: float, softcap: float, load_state: bool, final: bool, cfg: TritonConfig,
) -> None:
    """One kernel launch over the queries ``q`` (a view of the rows to update) and all of ``k``/``v``.

    ``row_lo``/``row_hi``: int32 (Sq,) for mode 2 (interval); ``key_mask``: uint8 (B, Sk) view or None.
    """
    batch, seqlen_q, heads, head_dim = q.shape
    seqlen_k, kv_heads = k.shape[1], k.shape[2]
    if batch == 0 or seqlen_q == 0 or heads == 0:
        return
    interpret = _interpreting()
    upcast = q.dtype == torch.bfloat16 and interpret
    qk_scale, cap = _score_args(scale, softcap)
    # Absent optional arrays are never read (their constexpr flag is off): pass any tensor.
    row_lo = q if row_lo is None else row_lo
    row_hi = q if row_hi is None else row_hi
    km, km_strides = (q, (0, 0)) if key_mask is None else (key_mask, key_mask.stride())
    block_d = max(16, triton.next_power_of_2(head_dim))
    descs = _split_descriptors(q, k, v, cfg) if cfg.split == 2 and mode != 2 else None
    if descs is None and cfg.split == 2 and not interpret:
        cfg = TritonConfig(*_GPU_DEFAULTS[block_d])  # the plain kernel (Note [Split-2 forward])
    grid = (triton.cdiv(seqlen_q, cfg.block_m), batch * heads)
    args = (
        *q.stride(), *k.stride(), *v.stride(), *acc.stride(),
        *m.stride(), *out.stride(), *lse.stride(), *km_strides,
        heads, heads // kv_heads, seqlen_q, seqlen_k, qk_scale, cap,
    )
    meta = dict(
        HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
        MODE=mode, HAS_KEY_MASK=key_mask is not None, SOFTCAP=softcap > 0,
        LOAD_STATE=load_state, FINAL=final,
        UPCAST=upcast, IEEE=q.dtype == torch.float32 or upcast, INTERPRET=interpret,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    if cfg.split == 1:
        _ring_fwd_kernel[grid](q, k, v, acc, m, l, out, lse, row_lo, row_hi, km, *args, **meta)
        return
    if descs is None:  # the interpreter: pointer loads
        descs = (None, 0, None, None, 0)
    q_desc, q_rows, k_desc, v_desc, kv_rows = descs
    _ring_fwd_split_kernel[grid](q, k, v, acc, m, l, out, lse, row_lo, row_hi, km,
                                 q_desc or q, k_desc or k, v_desc or v, *args, q_rows, kv_rows,
                                 TMA_Q=q_desc is not None, TMA=k_desc is not None, **meta)


def _split_descriptors(q: Tensor, k: Tensor, v: Tensor, cfg: TritonConfig):
    """TMA descriptors for a split-2 launch -> (q_desc, q_rows, k_desc, v_desc, kv_rows), or None when
    TMA does not apply (no TMA on the device, a padded head dim, strides, or Sk % block_n != 0): on a GPU
    the launch then runs the plain kernel, since the split kernel with pointer loads keeps its q halves
    and tiles in registers and spills (Note [Split-2 forward])."""
    head_dim, seqlen_k = q.shape[-1], k.shape[1]
    if (head_dim != max(16, triton.next_power_of_2(head_dim)) or seqlen_k % cfg.block_n
            or not _tma_capable(q.device)):
        return None
    (q_desc, q_rows), (k_desc, k_rows), (v_desc, v_rows) = (
        _view_descriptor(x, rows) for x, rows in ((q, cfg.block_m // 2), (k, cfg.block_n), (v, cfg.block_n)))
    if q_desc is None or k_desc is None or v_desc is None or k_rows != v_rows:
        return None
    return q_desc, q_rows, k_desc, v_desc, k_rows


def _tma_capable(device: torch.device) -> bool:
    """Whether ``device`` has TMA (CUDA compute capability >= 9.0)."""
    return device.type == "cuda" and _capability(device.index)[0] >= 9


@functools.lru_cache(maxsize=None)
def _capability(index: int | None) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def _view_descriptor(x: Tensor, block_rows: int):
    """-> (a host TMA descriptor of ``x`` (B, S, heads, D) as a 2-D view (rows, heads * D) with
    (block_rows, D) boxes, the view's rows per batch), or (None, 0) when the strides do not allow such a
    view (then the kernel uses pointer loads).

    The view needs unit stride along D, heads packed (stride D), 16-byte aligned rows and base, and a batch
    stride that is a whole number >= S of rows (a row slice of a packed tensor qualifies: batch b's row i
    is view row b * (batch stride / row stride) + i). A box may run past this batch's S rows into other
    rows of the view (TMA reads zeros past its last row). For q that is harmless (those rows are never stored);
    for k/v the launcher asks for descriptors only when Sk % block_n == 0, so that no key tile crosses (the
    kernel would hide such keys, but a non-finite value there would still reach P @ V as 0 * inf).
    """
    from triton.tools.tensor_descriptor import TensorDescriptor

    batch, seqlen, heads, head_dim = x.shape
    sb, sn, sh, sd = x.stride()
    size = x.element_size()
    if (sd != 1 or (heads > 1 and sh != head_dim) or sn < heads * head_dim or (sn * size) % 16
            or x.data_ptr() % 16 or (batch > 1 and (sb % sn or sb < seqlen * sn))):
        return None, 0
    batch_rows = sb // sn if batch > 1 else 0
    view = x.as_strided(((batch - 1) * batch_rows + seqlen, heads * head_dim), (sn, 1))
    return TensorDescriptor.from_tensor(view, [block_rows, head_dim]), batch_rows


def _fwd_step_impl(
    q: Tensor, k: Tensor, v: Tensor, acc: Tensor, m: Tensor, l: Tensor,
    row_lo: Tensor | None, row_hi: Tensor | None, key_mask: Tensor | None,
    q_start: int, q_stop: int, mode: int, scale: float, softcap: float, load_state: bool,
    block_m: int, block_n: int, num_warps: int, num_stages: int, split: int = 1,
) -> None:
    """Accumulate rows [q_start, q_stop) of the fp32 state (acc, m, l) in place (``key_mask``: bool)."""
    rows = slice(q_start, q_stop)
    _launch(
        q[:, rows], k, v, acc[:, rows], m[:, :, rows], l[:, :, rows], acc, m,
        row_lo, row_hi, None if key_mask is None else key_mask.view(torch.uint8),
        mode=mode, scale=scale, softcap=softcap, load_state=load_state, final=False,
        cfg=TritonConfig(block_m, block_n, num_warps, num_stages, split),
    )


# Eager calls on plain tensors go straight to the implementations (no dispatcher on the host's critical
# path); under torch.compile, a dispatch mode (FakeTensorMode, make_fx) or tensor subclasses, the same
# functions run as opaque custom ops with fake (meta) implementations.
def _plain_eager(*tensors: Tensor | None) -> bool:
    """Whether a direct kernel launch is safe: eager mode, plain tensors, no Python dispatch mode active."""
    if torch.compiler.is_compiling() or any(t is not None and type(t) is not Tensor for t in tensors):
        return False
    current_mode = getattr(getattr(torch.utils, "_python_dispatch", None), "_get_current_dispatch_mode", None)
    return current_mode is not None and current_mode() is None


_fwd_step_op = torch.library.custom_op("distcomm_attention::triton_fwd_step", _fwd_step_impl,
                                       mutates_args=("acc", "m", "l"))


@_fwd_step_op.register_fake
def _fwd_step_fake(q, k, v, acc, m, l, row_lo, row_hi, key_mask, q_start, q_stop, mode, scale, softcap,
                   load_state, block_m, block_n, num_warps, num_stages, split=1) -> None:
    return None


def _fwd_last_impl(
    q: Tensor, k: Tensor, v: Tensor, acc: Tensor, m: Tensor, l: Tensor,
    row_lo: Tensor | None, row_hi: Tensor | None, key_mask: Tensor | None,
    mode: int, scale: float, softcap: float, load_state: bool,
    block_m: int, block_n: int, num_warps: int, num_stages: int, split: int = 1,
) -> tuple[Tensor, Tensor]:
    """The last step for every row: returns out (B, Sq, H, D) in q's dtype and lse (B, H, Sq) fp32."""
    batch, seqlen_q, heads, _ = q.shape
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    lse = torch.empty((batch, heads, seqlen_q), dtype=torch.float32, device=q.device)
    if not load_state:
        acc, m, l = out, lse, lse  # never read: the kernel starts from a fresh state
    _launch(
        q, k, v, acc, m, l, out, lse,
        row_lo, row_hi, None if key_mask is None else key_mask.view(torch.uint8),
        mode=mode, scale=scale, softcap=softcap, load_state=load_state, final=True,
        cfg=TritonConfig(block_m, block_n, num_warps, num_stages, split),
    )
    return out, lse


_fwd_last_op = torch.library.custom_op("distcomm_attention::triton_fwd_last", _fwd_last_impl, mutates_args=())


@_fwd_last_op.register_fake
def _fwd_last_fake(q, k, v, acc, m, l, row_lo, row_hi, key_mask, mode, scale, softcap, load_state, block_m,
                   block_n, num_warps, num_stages, split=1):
    batch, seqlen_q, heads, _ = q.shape
    return q.new_empty(q.shape), q.new_empty((batch, heads, seqlen_q), dtype=torch.float32)


# --------------------------------------------------------------------------------------------------------
# ForwardKernel implementation
# --------------------------------------------------------------------------------------------------------


@dataclass
class TritonForwardState:
    """The per-forward accumulator of ``TritonForward`` (see Note [Ring forward state]).

    Buffers are allocated lazily: a forward whose first step is also its final step (one rank, or a
    fused last hop) never allocates the fp32 accumulator.
    """

    q_shape: tuple[int, int, int, int]
    dtype: torch.dtype
    device: torch.device
    acc: Tensor | None = None  # (B, Sq, H, D) fp32, unnormalised output
    m: Tensor | None = None  # (B, H, Sq) fp32, running max of scores * scale * log2(e)
    l: Tensor | None = None  # (B, H, Sq) fp32, running sum of exp2(s - m)
    fresh: bool = True  # no step has written the state yet
    out: Tensor | None = None  # set by a final step
    lse: Tensor | None = None


class TritonForward:
    """ForwardKernel backed by the Triton kernel above (see the module docstring for what it supports).

    Args:
        block_m, block_n, num_warps, num_stages, split: launch configuration (``TritonConfig``); each
            ``None`` takes the default for the head dim and dtype (Hopper-tuned on GPU, large blocks under
            the interpreter).
    """

    def __init__(self, *, block_m: int | None = None, block_n: int | None = None,
                 num_warps: int | None = None, num_stages: int | None = None, split: int | None = None):
        self._overrides = {"block_m": block_m, "block_n": block_n, "num_warps": num_warps,
                           "num_stages": num_stages, "split": split}
        if all(value is not None for value in (block_m, block_n, num_warps, num_stages)):
            TritonConfig(block_m, block_n, num_warps, num_stages, 1 if split is None else split)  # validate now

    # ---- capability queries (used by the API to validate before any communication) ----

    @staticmethod
    def supports_head_dim(head_dim: int) -> bool:
        """Head dims that are multiples of 8 from 16 to 256."""
        return isinstance(head_dim, int) and _MIN_HEAD_DIM <= head_dim <= _MAX_HEAD_DIM and head_dim % 8 == 0

    @staticmethod
    def supports_dtype(dtype: torch.dtype) -> bool:
        """fp16, bf16 and fp32 (fp32 with IEEE dot products)."""
        return dtype in _SUPPORTED_DTYPES

    @staticmethod
    def check_tensor(name: str, x: Tensor) -> None:
        """Raise a ValueError/TypeError naming ``name`` if the kernel cannot run on ``x`` (B, S, H, D)."""
        if x.dim() != 4:
            raise ValueError(f"`{name}` must be 4-D (batch, seq, heads, head_dim); got shape {tuple(x.shape)}")
        if x.dtype not in _SUPPORTED_DTYPES:
            raise TypeError(
                f"`{name}` has dtype {x.dtype}, which the Triton kernel does not support; "
                "allowed: torch.float16, torch.bfloat16, torch.float32"
            )
        if not TritonForward.supports_head_dim(x.shape[-1]):
            raise ValueError(
                f"`{name}` has head_dim {x.shape[-1]}, which the Triton kernel does not support; "
                f"allowed: multiples of 8 from {_MIN_HEAD_DIM} to {_MAX_HEAD_DIM}"
            )
        if x.device.type == "cpu" and not _interpreting():
            raise ValueError(
                f"`{name}` is on the CPU: the Triton kernel runs on CPU only under the Triton interpreter "
                "(set TRITON_INTERPRET=1 before distcomm_attention is imported); use a CUDA tensor"
            )
        if x.device.type not in ("cpu", "cuda"):
            raise ValueError(f"`{name}` is on device {x.device}; the Triton kernel needs a CUDA tensor")

    def config(self, head_dim: int, dtype: torch.dtype | None = None) -> TritonConfig:
        """The launch configuration used for ``head_dim`` and ``dtype`` (None: fp16/bf16)."""
        base = default_config(head_dim, dtype)
        picked = {name: getattr(base, name) if value is None else value for name, value in self._overrides.items()}
        if self._overrides["split"] is None and any(v is not None for v in self._overrides.values()):
            picked["split"] = 1  # a hand-picked tile without an explicit split is for the plain kernel
        return TritonConfig(**picked)

    # ---- ForwardKernel contract ----

    def init_state(self, q: Tensor) -> TritonForwardState:
        """A fresh accumulator for the queries ``q`` (B, Sq, H, D)."""
        self.check_tensor("q", q)
        return TritonForwardState(tuple(q.shape), q.dtype, q.device)

    def step(self, state: TritonForwardState, q: Tensor, k: Tensor, v: Tensor, *, mask: BlockMask,
             scale: float, softcap: float = 0.0, key_mask: Tensor | None = None, q_slice: slice = slice(None),
             final: bool = False) -> None:
        """Accumulate the attention of ``q[:, q_slice]`` over (``k``, ``v``) into ``state``, in place.

        Args:
            state: from ``init_state(q)``.
            q: (B, Sq, H, D), this rank's full local queries (any strides).
            k, v: (B, Sk, Hkv, D) with H % Hkv == 0, the block's keys (any strides).
            mask: the block's visibility (``BlockMask``, Note [Visibility]), relative to the first row of
                ``q_slice`` and the first key: "full"; "causal" (top-left: row i of the slice sees keys
                0..i); or "interval": row i sees keys [row_lo[i], row_hi[i]) (int32, one per row of the
                slice, nondecreasing; the col_* arrays are not needed by the forward).
            scale: softmax scale applied to q . k.
            softcap: > 0 caps the scaled scores, ``s = softcap * tanh(s / softcap)``; 0 = off.
            key_mask: bool (B, Sk), True = attend (any strides), applied on top of ``mask``.
            q_slice: the query rows (a contiguous slice of 0..Sq) this block contributes to.
            final: this is the last step for every row: normalise in the kernel and write out/lse
                directly (requires ``q_slice`` to cover all rows); ``finalize`` then only returns them.
        """
        if state.out is not None:
            raise RuntimeError("this TritonForward state was already completed by a final step")
        if tuple(q.shape) != state.q_shape or q.dtype != state.dtype or q.device != state.device:
            raise ValueError(
                f"`q` (shape {tuple(q.shape)}, {q.dtype}, {q.device}) does not match the state "
                f"(shape {state.q_shape}, {state.dtype}, {state.device})"
            )
        self._check_kv(q, k, v)
        batch, seqlen_q, heads, head_dim = q.shape
        start, stop = _slice_bounds(q_slice, seqlen_q)
        if final and (start, stop) != (0, seqlen_q):
            raise ValueError(f"`final`=True needs `q_slice` to cover all {seqlen_q} rows; got {q_slice}")
        mode = mode_code(mask)
        softcap = _check_softcap(softcap)
        row_lo, row_hi, _, _ = interval_args(mask, stop - start, k.shape[1], q.device, cols=False)
        key_mask = key_mask_arg(key_mask, batch, k.shape[1], q.device)
        meta = self.config(head_dim, q.dtype).astuple()
        if final:
            if k.shape[1] == 0:  # nothing to add: finalise what is there
                state.out, state.lse = self._finalize_state(state, state.dtype)
                return
            if state.fresh:
                empty = q.new_empty(0, dtype=torch.float32)
                acc = m = l = empty
            else:
                acc, m, l = state.acc, state.m, state.l
            last = _fwd_last_impl if _plain_eager(q, k, v, key_mask, row_lo) else _fwd_last_op
            state.out, state.lse = last(q, k, v, acc, m, l, row_lo, row_hi, key_mask, mode, float(scale),
                                        softcap, not state.fresh, *meta)
            state.fresh = False
            return
        if stop <= start or k.shape[1] == 0:
            return
        load_state = not state.fresh
        if state.acc is None:
            self._allocate(state, fill=(start, stop) != (0, seqlen_q))
        step = _fwd_step_impl if _plain_eager(q, k, v, key_mask, row_lo) else _fwd_step_op
        step(q, k, v, state.acc, state.m, state.l, row_lo, row_hi, key_mask, start, stop, mode, float(scale),
             softcap, load_state, *meta)
        state.fresh = False

    def finalize(self, state: TritonForwardState, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """-> out (B, Sq, H, D) in ``dtype``, lse (B, H, Sq) float32 (natural log).

        Rows that saw no key get out 0 and lse -inf.
        """
        if state.out is not None:
            return state.out.to(dtype), state.lse
        return self._finalize_state(state, dtype)

    # ---- helpers ----

    @staticmethod
    def _check_kv(q: Tensor, k: Tensor, v: Tensor) -> None:
        for name, x in (("k", k), ("v", v)):
            TritonForward.check_tensor(name, x)
            if x.dtype != q.dtype or x.device != q.device:
                raise ValueError(f"`{name}` ({x.dtype}, {x.device}) must match `q` ({q.dtype}, {q.device})")
        if k.shape != v.shape:
            raise ValueError(f"`k` {tuple(k.shape)} and `v` {tuple(v.shape)} must have the same shape")
        if k.shape[0] != q.shape[0] or k.shape[3] != q.shape[3]:
            raise ValueError(
                f"`k` {tuple(k.shape)} must match `q` {tuple(q.shape)} in batch and head_dim"
            )
        if k.shape[2] == 0 or q.shape[2] % k.shape[2]:
            raise ValueError(f"query heads {q.shape[2]} must be a multiple of kv heads {k.shape[2]}")

    @staticmethod
    def _allocate(state: TritonForwardState, *, fill: bool) -> None:
        batch, seqlen_q, heads, head_dim = state.q_shape
        f32 = dict(dtype=torch.float32, device=state.device)
        if fill:  # rows outside the first step's slice must start from the empty state
            state.acc = torch.zeros(state.q_shape, **f32)
            state.m = torch.full((batch, heads, seqlen_q), -math.inf, **f32)
            state.l = torch.zeros((batch, heads, seqlen_q), **f32)
        else:  # the first step covers every row and does not read the state
            state.acc = torch.empty(state.q_shape, **f32)
            state.m = torch.empty((batch, heads, seqlen_q), **f32)
            state.l = torch.empty((batch, heads, seqlen_q), **f32)

    @staticmethod
    def _finalize_state(state: TritonForwardState, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        batch, seqlen_q, heads, _ = state.q_shape
        if state.fresh:
            out = torch.zeros(state.q_shape, dtype=dtype, device=state.device)
            lse = torch.full((batch, heads, seqlen_q), -math.inf, dtype=torch.float32, device=state.device)
            return out, lse
        empty = state.l == 0  # a NaN l (a NaN score) gives NaN out and lse
        l_safe = torch.where(empty, torch.ones_like(state.l), state.l)
        lse = torch.where(empty, torch.full_like(state.l, -math.inf), (state.m + torch.log2(l_safe)) * _LN2)
        out = (state.acc * (1.0 / l_safe).transpose(1, 2).unsqueeze(-1)).to(dtype)
        return out, lse


def _check_softcap(softcap) -> float:
    if isinstance(softcap, bool) or not isinstance(softcap, (int, float)) or not softcap >= 0 \
            or softcap == math.inf:
        raise ValueError(f"`softcap` must be a finite float >= 0 (0 = off); got {softcap!r}")
    return float(softcap)


def _slice_bounds(q_slice: slice, length: int) -> tuple[int, int]:
    if not isinstance(q_slice, slice):
        raise TypeError(f"`q_slice` must be a slice; got {type(q_slice).__name__}")
    start, stop, stride = q_slice.indices(length)
    if stride != 1:
        raise ValueError(f"`q_slice`={q_slice} must have step 1")
    return start, max(start, stop)
