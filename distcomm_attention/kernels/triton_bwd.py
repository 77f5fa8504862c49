"""Triton flash-attention backward of one ring block: ``TritonBackward`` (the BackwardKernel contract).

Given the GLOBAL output rows and logsumexp of this rank's queries (merged over every block of the ring),
the gradient of one (query rows, key block) pair is independent of every other block: the probabilities
of the block are ``P = exp(S - lse)`` with the global lse, and ``D = rowsum(dO * O)`` uses the global out.

Note [Ring backward kernels]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Two kernels, FlashAttention-2 style, both deterministic (no atomics: every output tile has one owner)::

    _bwd_dkdv_kernel   one program per (key tile, batch, KV head), keys along rows:
                       for each (query head of the kv head's group of G = H / Hkv,  (GQA, no K/V copies;
                                 query tile the key tile is visible to):            one flat loop)
                           S^T = K Q^T          P^T = exp2(S^T - lse)     (recomputed, base 2)
                           dV += P^T dO         dP^T = V dO^T
                           dS^T = P^T (dP^T - D)                          (x (1 - tanh^2): softcap)
                           dK += dS^T Q
                       dK *= scale; hidden keys (key padding mask) -> 0; store in ``dkv_dtype``

    _bwd_dq_kernel     one program per (query tile, batch, head), queries along rows:
                       for each key tile visible to the query tile
                           S = Q K^T   P = exp2(S - lse)   dP = dO V^T   dS = P (dP - D)   dQ += dS K
                       dQ *= scale; dQ (+)= into the fp32 buffer (``dq_acc`` of the ring, or a new one)

                 keys ->                          dK/dV program of key tile j visits the query tiles
    queries  [###]                                whose rows see a key of j (a column of the picture);
        |    [####][#]                            dQ program of query tile i visits the key tiles its
        v    [####][####]                         rows see (a row of the picture). Interior tiles (all
             [####][####][###]                    visible) skip every mask; edge tiles apply the rule.

Program order: the hardware starts programs in linear grid order. By default tiles vary fastest (the
programs running together share one head's Q/dO or K/V in L2). For causal-like blocks whose dK/dV grid is
under 4 waves (e.g. 8 kv heads at 4k-8k) the heads vary fastest instead, so that every head's heaviest tiles (first key
tiles, last query tiles) start first and the last wave is not a few long programs: on an H100, 32/8 heads,
causal 4k blocks went from 243 to 322 TFLOP/s, while at long sequences the tiles-fastest order's L2
locality wins (32k full, 32/32: 342 vs 319).

P and dS are recomputed in both kernels (FA2's trade: 2 extra matmuls instead of materialising P). The
scores are moved to base 2 once (``qk_scale = scale * log2(e)``, ``lse2 = lse * log2(e)``) so the inner
loop has one FMA and one exp2 per score. Rows whose global lse is -inf (no visible key anywhere) use
lse2 = +inf: their P is exactly 0 and so are their gradients (no inf - inf). With a key padding mask the
dK/dV kernel computes the tile unmasked and zeroes the hidden keys' rows when storing, which is exact:
row j of dK and dV depends only on key j's column of P and dS; a key tile of padding only visits nothing.
The flat (head, tile) loop matters on Hopper: a loop over heads around the tile loop kept more values live
and spilled registers inside the tile loop at head_dim 128.

Supported: CUDA fp16/bf16/fp32 (fp32 with IEEE dot products), head dims that are multiples of 8 from 16
to 256, any lengths and strides, GQA/MQA. Under the Triton interpreter (CPU) bf16 dot operands are upcast
to fp32. Each launch pair is the ``torch.library`` custom op ``distcomm_attention::triton_bwd_block`` (dq
buffer mutated, (dk, dv) returned) with a fake implementation, for ``torch.compile``; eager calls on plain
tensors skip the dispatcher.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch import Tensor

from distcomm_attention.kernels.triton_fwd import TritonForward, _check_softcap, _plain_eager, _score_args
from distcomm_attention.kernels.triton_mask import (
    _key_range,
    _load_bounds,
    _load_key_mask,
    _query_range,
    _split,
    _tanh,
    _visible_kq,
    _visible_qk,
    interval_args,
    key_mask_arg,
    mode_code,
)
from distcomm_attention.planning.visibility import BlockMask

__all__ = ["TritonBackward", "BackwardConfig", "default_backward_config"]

_LOG2E = 1.4426950408889634  # log2(e)


# --------------------------------------------------------------------------------------------------------
# Kernels
# --------------------------------------------------------------------------------------------------------


@triton.jit
def _dkdv_tile(
    dk, dv, k, v, start_m,
    # pointers (offset to this batch and query head)
    q_base, do_base, lse_base, delta_base,
    # strides
    stride_qm, stride_qd, stride_dom, stride_dod, stride_lm, stride_dem,
    # sizes and runtime values
    offs_n, offs_d, col_lo, col_hi, seqlen_q, qk_scale, softcap,
    # meta
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, MODE: tl.constexpr, EDGE: tl.constexpr,
    SOFTCAP: tl.constexpr, EVEN_D: tl.constexpr, UPCAST: tl.constexpr, IEEE: tl.constexpr,
):
    """dK/dV of the program's key tile += the contribution of the query tile starting at ``start_m``."""
    offs_m = start_m + tl.arange(0, BLOCK_M)
    rows_m = offs_m.to(tl.int64)
    d_ok = offs_d < HEAD_DIM
    qT_ptrs = q_base + rows_m[None, :] * stride_qm + offs_d[:, None] * stride_qd  # (BLOCK_D, BLOCK_M)
    do_ptrs = do_base + rows_m[:, None] * stride_dom + offs_d[None, :] * stride_dod  # (BLOCK_M, BLOCK_D)
    if EDGE:
        m_ok = offs_m < seqlen_q
        if EVEN_D:
            qT = tl.load(qT_ptrs, mask=m_ok[None, :], other=0.0)
            do = tl.load(do_ptrs, mask=m_ok[:, None], other=0.0)
        else:
            qT = tl.load(qT_ptrs, mask=m_ok[None, :] & d_ok[:, None], other=0.0)
            do = tl.load(do_ptrs, mask=m_ok[:, None] & d_ok[None, :], other=0.0)
        lse = tl.load(lse_base + rows_m * stride_lm, mask=m_ok, other=float("inf"))
        delta = tl.load(delta_base + rows_m * stride_dem, mask=m_ok, other=0.0)
    else:
        if EVEN_D:
            qT = tl.load(qT_ptrs)
            do = tl.load(do_ptrs)
        else:
            qT = tl.load(qT_ptrs, mask=d_ok[:, None], other=0.0)
            do = tl.load(do_ptrs, mask=d_ok[None, :], other=0.0)
        lse = tl.load(lse_base + rows_m * stride_lm)
        delta = tl.load(delta_base + rows_m * stride_dem)
    if UPCAST:
        qT = qT.to(tl.float32)
        do = do.to(tl.float32)
    # Rows with no visible key anywhere (lse = -inf) get P = 0.
    lse2 = tl.where(lse == float("-inf"), float("inf"), lse * 1.4426950408889634)  # * log2(e)
    if IEEE:
        sT = tl.dot(k, qT, input_precision="ieee")
    else:
        sT = tl.dot(k, qT)
    if SOFTCAP:
        tanh = _tanh(sT * qk_scale)
        pT = tl.math.exp2(tanh * softcap - lse2[None, :])
    else:
        pT = tl.math.exp2(sT * qk_scale - lse2[None, :])
    if EDGE:
        pT = tl.where(_visible_kq(offs_n, offs_m, col_lo, col_hi, seqlen_q, MODE), pT, 0.0)
    if IEEE:
        dv = tl.dot(pT.to(do.dtype), do, dv, input_precision="ieee")
        dpT = tl.dot(v, tl.trans(do), input_precision="ieee")
    else:
        dv = tl.dot(pT.to(do.dtype), do, dv)
        dpT = tl.dot(v, tl.trans(do))
    dsT = pT * (dpT - delta[None, :])
    if SOFTCAP:
        dsT = dsT * (1.0 - tanh * tanh)  # d(cap * tanh(x / cap)) / dx
    if IEEE:
        dk = tl.dot(dsT.to(qT.dtype), tl.trans(qT), dk, input_precision="ieee")
    else:
        dk = tl.dot(dsT.to(qT.dtype), tl.trans(qT), dk)
    return dk, dv


@triton.jit
def _dkdv_range(
    dk, dv, k, v, lo, hi, off_b, off_h0, kv_group,
    # pointers
    Q, DO, Lse, Delta,
    # strides
    stride_qb, stride_qm, stride_qh, stride_qd, stride_dob, stride_dom, stride_doh, stride_dod,
    stride_lb, stride_lh, stride_lm, stride_deb, stride_deh, stride_dem,
    # sizes and runtime values
    offs_n, offs_d, col_lo, col_hi, seqlen_q, qk_scale, softcap,
    # meta
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, MODE: tl.constexpr, EDGE: tl.constexpr,
    SOFTCAP: tl.constexpr, EVEN_D: tl.constexpr, UPCAST: tl.constexpr, IEEE: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    """Query tiles [lo, hi) in steps of BLOCK_M for each query head off_h0 .. off_h0 + kv_group - 1, as one
    flat loop over (head, tile) (see Note [Ring backward kernels])."""
    n_tiles = (hi - lo + BLOCK_M - 1) // BLOCK_M
    if INTERPRET:
        # The interpreter cannot use runtime scalars as range() bounds (they are 1-element arrays).
        t = 0
        while t < n_tiles * kv_group:
            g = t // n_tiles
            off_h = off_h0 + g
            dk, dv = _dkdv_tile(
                dk, dv, k, v, lo + (t - g * n_tiles) * BLOCK_M,
                Q + off_b * stride_qb + off_h * stride_qh, DO + off_b * stride_dob + off_h * stride_doh,
                Lse + off_b * stride_lb + off_h * stride_lh, Delta + off_b * stride_deb + off_h * stride_deh,
                stride_qm, stride_qd, stride_dom, stride_dod, stride_lm, stride_dem,
                offs_n, offs_d, col_lo, col_hi, seqlen_q, qk_scale, softcap,
                HEAD_DIM, BLOCK_M, MODE, EDGE, SOFTCAP, EVEN_D, UPCAST, IEEE,
            )
            t += 1
    else:
        for t in range(0, n_tiles * kv_group):
            g = t // n_tiles
            off_h = off_h0 + g
            dk, dv = _dkdv_tile(
                dk, dv, k, v, lo + (t - g * n_tiles) * BLOCK_M,
                Q + off_b * stride_qb + off_h * stride_qh, DO + off_b * stride_dob + off_h * stride_doh,
                Lse + off_b * stride_lb + off_h * stride_lh, Delta + off_b * stride_deb + off_h * stride_deh,
                stride_qm, stride_qd, stride_dom, stride_dod, stride_lm, stride_dem,
                offs_n, offs_d, col_lo, col_hi, seqlen_q, qk_scale, softcap,
                HEAD_DIM, BLOCK_M, MODE, EDGE, SOFTCAP, EVEN_D, UPCAST, IEEE,
            )
    return dk, dv


@triton.jit
def _bwd_dkdv_kernel(
    # pointers
    Q, K, V, DO, Lse, Delta, DK, DV, ColLo, ColHi, KeyMask,
    # strides: q, do (B, Sq, H, D); k, v, dk, dv (B, Sk, Hkv, D); lse, delta (B, H, Sq); key mask (B, Sk)
    stride_qb, stride_qm, stride_qh, stride_qd,
    stride_kb, stride_kn, stride_kh, stride_kd,
    stride_vb, stride_vn, stride_vh, stride_vd,
    stride_dob, stride_dom, stride_doh, stride_dod,
    stride_lb, stride_lh, stride_lm,
    stride_deb, stride_deh, stride_dem,
    stride_dkb, stride_dkn, stride_dkh, stride_dkd,
    stride_dvb, stride_dvn, stride_dvh, stride_dvd,
    stride_kmb, stride_kmn,
    # sizes and runtime values
    kv_heads, kv_group, seqlen_q, seqlen_k, qk_scale, softcap, scale,
    # meta
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    MODE: tl.constexpr, HAS_KEY_MASK: tl.constexpr, SOFTCAP: tl.constexpr, HEADS_FASTEST: tl.constexpr,
    UPCAST: tl.constexpr, IEEE: tl.constexpr, INTERPRET: tl.constexpr,
):
    tl.static_assert(BLOCK_D >= HEAD_DIM, "BLOCK_D must cover HEAD_DIM")
    tl.static_assert(MODE >= 0 and MODE <= 2, "MODE: 0 full, 1 causal, 2 interval")
    EVEN_D: tl.constexpr = BLOCK_D == HEAD_DIM

    if HEADS_FASTEST:  # grid (B * Hkv, key tiles); see Note [Ring backward kernels]
        pid_bh = tl.program_id(0)
        pid_n = tl.program_id(1)
    else:  # grid (key tiles, B * Hkv)
        pid_n = tl.program_id(0)
        pid_bh = tl.program_id(1)
    off_b = (pid_bh // kv_heads).to(tl.int64)
    off_hk = (pid_bh % kv_heads).to(tl.int64)

    start_n = pid_n * BLOCK_N
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    rows_n = offs_n.to(tl.int64)
    n_ok = offs_n < seqlen_k
    nd_ok = n_ok[:, None] & (offs_d < HEAD_DIM)[None, :]
    k = tl.load(K + off_b * stride_kb + off_hk * stride_kh + rows_n[:, None] * stride_kn + offs_d[None, :] * stride_kd,
                mask=nd_ok, other=0.0)
    v = tl.load(V + off_b * stride_vb + off_hk * stride_vh + rows_n[:, None] * stride_vn + offs_d[None, :] * stride_vd,
                mask=nd_ok, other=0.0)
    if UPCAST:
        k = k.to(tl.float32)
        v = v.to(tl.float32)

    # Query tiles [start, u0) and [u1, hi) are edge tiles, [u0, u1) interior; see Note [Kernel tiles].
    lo, mid_lo, mid_hi, hi = _query_range(ColLo, ColHi, start_n, seqlen_q, seqlen_k, MODE, BLOCK_N)
    start, u0, u1 = _split(lo, mid_lo, mid_hi, hi, BLOCK_M)
    col_lo, col_hi = _load_bounds(ColLo, ColHi, offs_n, seqlen_k, MODE)
    if HAS_KEY_MASK:
        keep = _load_key_mask(KeyMask + off_b * stride_kmb, offs_n, stride_kmn, seqlen_k)
        any_key = tl.max(keep.to(tl.int32), 0) > 0  # a tile of padding only has nothing to compute
        u0 = tl.where(any_key, u0, start)
        u1 = tl.where(any_key, u1, start)
        hi = tl.where(any_key, hi, start)

    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    if MODE != 0:  # full tiles have no leading edge (start == u0 == 0)
        dk, dv = _dkdv_range(
            dk, dv, k, v, start, u0, off_b, off_hk * kv_group, kv_group, Q, DO, Lse, Delta,
            stride_qb, stride_qm, stride_qh, stride_qd, stride_dob, stride_dom, stride_doh, stride_dod,
            stride_lb, stride_lh, stride_lm, stride_deb, stride_deh, stride_dem,
            offs_n, offs_d, col_lo, col_hi, seqlen_q, qk_scale, softcap,
            HEAD_DIM, BLOCK_M, MODE, True, SOFTCAP, EVEN_D, UPCAST, IEEE, INTERPRET,
        )
    dk, dv = _dkdv_range(
        dk, dv, k, v, u0, u1, off_b, off_hk * kv_group, kv_group, Q, DO, Lse, Delta,
        stride_qb, stride_qm, stride_qh, stride_qd, stride_dob, stride_dom, stride_doh, stride_dod,
        stride_lb, stride_lh, stride_lm, stride_deb, stride_deh, stride_dem,
        offs_n, offs_d, col_lo, col_hi, seqlen_q, qk_scale, softcap,
        HEAD_DIM, BLOCK_M, MODE, False, SOFTCAP, EVEN_D, UPCAST, IEEE, INTERPRET,
    )
    dk, dv = _dkdv_range(
        dk, dv, k, v, u1, hi, off_b, off_hk * kv_group, kv_group, Q, DO, Lse, Delta,
        stride_qb, stride_qm, stride_qh, stride_qd, stride_dob, stride_dom, stride_doh, stride_dod,
        stride_lb, stride_lh, stride_lm, stride_deb, stride_deh, stride_dem,
        offs_n, offs_d, col_lo, col_hi, seqlen_q, qk_scale, softcap,
        HEAD_DIM, BLOCK_M, MODE, True, SOFTCAP, EVEN_D, UPCAST, IEEE, INTERPRET,
    )

    dk = dk * scale
    if HAS_KEY_MASK:  # exact: row j of dK/dV depends only on key j (see Note [Ring backward kernels])
        dk = tl.where(keep[:, None], dk, 0.0)
        dv = tl.where(keep[:, None], dv, 0.0)
    dk_ptrs = DK + off_b * stride_dkb + off_hk * stride_dkh + rows_n[:, None] * stride_dkn + offs_d[None, :] * stride_dkd
    dv_ptrs = DV + off_b * stride_dvb + off_hk * stride_dvh + rows_n[:, None] * stride_dvn + offs_d[None, :] * stride_dvd
    tl.store(dk_ptrs, dk.to(DK.dtype.element_ty), mask=nd_ok)
    tl.store(dv_ptrs, dv.to(DV.dtype.element_ty), mask=nd_ok)


@triton.jit
def _dq_tile(
    dq, q, do, lse2, delta, start_n,
    # pointers (offset to this batch and kv head / batch row of the key mask)
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
    """dQ of the program's query tile += the contribution of the key tile starting at ``start_n``."""
    offs_n = start_n + tl.arange(0, BLOCK_N)
    rows_n = offs_n.to(tl.int64)
    d_ok = offs_d < HEAD_DIM
    kT_ptrs = k_base + rows_n[None, :] * stride_kn + offs_d[:, None] * stride_kd  # (BLOCK_D, BLOCK_N)
    vT_ptrs = v_base + rows_n[None, :] * stride_vn + offs_d[:, None] * stride_vd
    if EDGE:
        n_ok = offs_n < seqlen_k
        if EVEN_D:
            kT = tl.load(kT_ptrs, mask=n_ok[None, :], other=0.0)
            vT = tl.load(vT_ptrs, mask=n_ok[None, :], other=0.0)
        else:
            kT = tl.load(kT_ptrs, mask=n_ok[None, :] & d_ok[:, None], other=0.0)
            vT = tl.load(vT_ptrs, mask=n_ok[None, :] & d_ok[:, None], other=0.0)
    else:
        if EVEN_D:
            kT = tl.load(kT_ptrs)
            vT = tl.load(vT_ptrs)
        else:
            kT = tl.load(kT_ptrs, mask=d_ok[:, None], other=0.0)
            vT = tl.load(vT_ptrs, mask=d_ok[:, None], other=0.0)
    if UPCAST:
        kT = kT.to(tl.float32)
        vT = vT.to(tl.float32)
    if IEEE:
        s = tl.dot(q, kT, input_precision="ieee")
    else:
        s = tl.dot(q, kT)
    if SOFTCAP:
        tanh = _tanh(s * qk_scale)
        p = tl.math.exp2(tanh * softcap - lse2[:, None])
    else:
        p = tl.math.exp2(s * qk_scale - lse2[:, None])
    if EDGE:
        visible = _visible_qk(offs_m, offs_n, row_lo, row_hi, seqlen_k, MODE)
        if HAS_KEY_MASK:
            visible = visible & _load_key_mask(km_base, offs_n, stride_kmn, seqlen_k)[None, :]
        p = tl.where(visible, p, 0.0)
    elif HAS_KEY_MASK:
        p = tl.where(_load_key_mask(km_base, offs_n, stride_kmn, seqlen_k)[None, :], p, 0.0)
    if IEEE:
        dp = tl.dot(do, vT, input_precision="ieee")
    else:
        dp = tl.dot(do, vT)
    ds = p * (dp - delta[:, None])
    if SOFTCAP:
        ds = ds * (1.0 - tanh * tanh)  # d(cap * tanh(x / cap)) / dx
    if IEEE:
        dq = tl.dot(ds.to(kT.dtype), tl.trans(kT), dq, input_precision="ieee")
    else:
        dq = tl.dot(ds.to(kT.dtype), tl.trans(kT), dq)
    return dq


@triton.jit
def _dq_range(
    dq, q, do, lse2, delta, lo, hi,
    k_base, v_base, km_base,
    stride_kn, stride_kd, stride_vn, stride_vd, stride_kmn,
    offs_m, offs_d, row_lo, row_hi, seqlen_k, qk_scale, softcap,
    HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, MODE: tl.constexpr, EDGE: tl.constexpr,
    HAS_KEY_MASK: tl.constexpr, SOFTCAP: tl.constexpr, EVEN_D: tl.constexpr,
    UPCAST: tl.constexpr, IEEE: tl.constexpr, INTERPRET: tl.constexpr,
):
    """Key tiles [lo, hi) in steps of BLOCK_N."""
    if INTERPRET:
        start_n = lo
        while start_n < hi:
            dq = _dq_tile(
                dq, q, do, lse2, delta, start_n, k_base, v_base, km_base,
                stride_kn, stride_kd, stride_vn, stride_vd, stride_kmn,
                offs_m, offs_d, row_lo, row_hi, seqlen_k, qk_scale, softcap,
                HEAD_DIM, BLOCK_N, MODE, EDGE, HAS_KEY_MASK, SOFTCAP, EVEN_D, UPCAST, IEEE,
            )
            start_n += BLOCK_N
    else:
        for start_n in range(lo, hi, BLOCK_N):
            dq = _dq_tile(
                dq, q, do, lse2, delta, start_n, k_base, v_base, km_base,
                stride_kn, stride_kd, stride_vn, stride_vd, stride_kmn,
                offs_m, offs_d, row_lo, row_hi, seqlen_k, qk_scale, softcap,
                HEAD_DIM, BLOCK_N, MODE, EDGE, HAS_KEY_MASK, SOFTCAP, EVEN_D, UPCAST, IEEE,
            )
    return dq


@triton.jit
def _bwd_dq_kernel(
    # pointers
    Q, K, V, DO, Lse, Delta, DQ, RowLo, RowHi, KeyMask,
    # strides: q, do, dq (B, Sq, H, D); k, v (B, Sk, Hkv, D); lse, delta (B, H, Sq); key mask (B, Sk)
    stride_qb, stride_qm, stride_qh, stride_qd,
    stride_kb, stride_kn, stride_kh, stride_kd,
    stride_vb, stride_vn, stride_vh, stride_vd,
    stride_dob, stride_dom, stride_doh, stride_dod,
    stride_lb, stride_lh, stride_lm,
    stride_deb, stride_deh, stride_dem,
    stride_dqb, stride_dqm, stride_dqh, stride_dqd,
    stride_kmb, stride_kmn,
    # sizes and runtime values
    num_heads, kv_group, seqlen_q, seqlen_k, qk_scale, softcap, scale,
    # meta
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    MODE: tl.constexpr, HAS_KEY_MASK: tl.constexpr, SOFTCAP: tl.constexpr, ACCUMULATE: tl.constexpr,
    HEADS_FASTEST: tl.constexpr, UPCAST: tl.constexpr, IEEE: tl.constexpr, INTERPRET: tl.constexpr,
):
    tl.static_assert(BLOCK_D >= HEAD_DIM, "BLOCK_D must cover HEAD_DIM")
    tl.static_assert(MODE >= 0 and MODE <= 2, "MODE: 0 full, 1 causal, 2 interval")
    EVEN_D: tl.constexpr = BLOCK_D == HEAD_DIM

    if HEADS_FASTEST:  # grid (B * H, query tiles); see Note [Ring backward kernels]
        pid_bh = tl.program_id(0)
        pid_m = tl.program_id(1)
        num_m = tl.num_programs(1)
    else:  # grid (query tiles, B * H)
        pid_m = tl.program_id(0)
        pid_bh = tl.program_id(1)
        num_m = tl.num_programs(0)
    if MODE != 0:
        # Query tiles near the end of a causal (or causal-like) block do the most work: schedule them first.
        pid_m = num_m - 1 - pid_m
    off_b = (pid_bh // num_heads).to(tl.int64)
    off_h = (pid_bh % num_heads).to(tl.int64)
    off_hk = off_h // kv_group

    start_m = pid_m * BLOCK_M
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    rows_m = offs_m.to(tl.int64)
    m_ok = offs_m < seqlen_q
    md_ok = m_ok[:, None] & (offs_d < HEAD_DIM)[None, :]
    q = tl.load(Q + off_b * stride_qb + off_h * stride_qh + rows_m[:, None] * stride_qm + offs_d[None, :] * stride_qd,
                mask=md_ok, other=0.0)
    do = tl.load(DO + off_b * stride_dob + off_h * stride_doh + rows_m[:, None] * stride_dom
                 + offs_d[None, :] * stride_dod, mask=md_ok, other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
        do = do.to(tl.float32)
    lse = tl.load(Lse + off_b * stride_lb + off_h * stride_lh + rows_m * stride_lm, mask=m_ok, other=float("inf"))
    lse2 = tl.where(lse == float("-inf"), float("inf"), lse * 1.4426950408889634)  # * log2(e); P = 0 if -inf
    delta = tl.load(Delta + off_b * stride_deb + off_h * stride_deh + rows_m * stride_dem, mask=m_ok, other=0.0)

    # Key tiles [start, u0) and [u1, hi) are edge tiles, [u0, u1) interior; see Note [Kernel tiles].
    lo, mid_lo, mid_hi, hi = _key_range(RowLo, RowHi, start_m, seqlen_q, seqlen_k, MODE, BLOCK_M)
    start, u0, u1 = _split(lo, mid_lo, mid_hi, hi, BLOCK_N)
    row_lo, row_hi = _load_bounds(RowLo, RowHi, offs_m, seqlen_q, MODE)

    k_base = K + off_b * stride_kb + off_hk * stride_kh
    v_base = V + off_b * stride_vb + off_hk * stride_vh
    km_base = KeyMask + off_b * stride_kmb
    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    if MODE == 2:  # full and causal tiles have no leading edge (start == u0 == 0)
        dq = _dq_range(
            dq, q, do, lse2, delta, start, u0, k_base, v_base, km_base,
            stride_kn, stride_kd, stride_vn, stride_vd, stride_kmn,
            offs_m, offs_d, row_lo, row_hi, seqlen_k, qk_scale, softcap,
            HEAD_DIM, BLOCK_N, MODE, True, HAS_KEY_MASK, SOFTCAP, EVEN_D, UPCAST, IEEE, INTERPRET,
        )
    dq = _dq_range(
        dq, q, do, lse2, delta, u0, u1, k_base, v_base, km_base,
        stride_kn, stride_kd, stride_vn, stride_vd, stride_kmn,
        offs_m, offs_d, row_lo, row_hi, seqlen_k, qk_scale, softcap,
        HEAD_DIM, BLOCK_N, MODE, False, HAS_KEY_MASK, SOFTCAP, EVEN_D, UPCAST, IEEE, INTERPRET,
    )
    dq = _dq_range(
        dq, q, do, lse2, delta, u1, hi, k_base, v_base, km_base,
        stride_kn, stride_kd, stride_vn, stride_vd, stride_kmn,
        offs_m, offs_d, row_lo, row_hi, seqlen_k, qk_scale, softcap,
        HEAD_DIM, BLOCK_N, MODE, True, HAS_KEY_MASK, SOFTCAP, EVEN_D, UPCAST, IEEE, INTERPRET,
    )

    dq = dq * scale
    dq_ptrs = DQ + off_b * stride_dqb + off_h * stride_dqh + rows_m[:, None] * stride_dqm + offs_d[None, :] * stride_dqd
    if ACCUMULATE:  # this program owns the tile: a plain read-add-write, deterministic
        dq += tl.load(dq_ptrs, mask=md_ok, other=0.0)
    tl.store(dq_ptrs, dq.to(DQ.dtype.element_ty), mask=md_ok)


def _interpreting() -> bool:
    """True when the kernels were decorated under TRITON_INTERPRET=1 (CPU execution)."""
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(_bwd_dq_kernel, InterpretedFunction)


# --------------------------------------------------------------------------------------------------------
# Configuration
# --------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class BackwardConfig:
    """Launch configuration of the two backward kernels.

    Attributes:
        block_m1, block_n1: query rows per inner iteration / key rows per program of the dK/dV kernel.
        num_warps1, num_stages1: its warps per program and software-pipelining depth.
        block_m2, block_n2: query rows per program / key rows per inner iteration of the dQ kernel.
        num_warps2, num_stages2: its warps and pipelining depth (stages are ignored by the interpreter).
    """

    block_m1: int
    block_n1: int
    num_warps1: int
    num_stages1: int
    block_m2: int
    block_n2: int
    num_warps2: int
    num_stages2: int

    def __post_init__(self):
        for name in ("block_m1", "block_n1", "block_m2", "block_n2"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 16 or value & (value - 1):
                raise ValueError(f"`{name}`={value!r} must be a power of two >= 16")
        for name in ("num_warps1", "num_warps2"):
            value = getattr(self, name)
            if not isinstance(value, int) or value not in (1, 2, 4, 8, 16):
                raise ValueError(f"`{name}`={value!r} must be one of 1, 2, 4, 8, 16")
        for name in ("num_stages1", "num_stages2"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"`{name}`={value!r} must be a positive int")

    def astuple(self) -> tuple[int, ...]:
        return (self.block_m1, self.block_n1, self.num_warps1, self.num_stages1,
                self.block_m2, self.block_n2, self.num_warps2, self.num_stages2)


# Hopper (H100/H200) defaults per padded head dim:
# (block_m1, block_n1, warps1, stages1, block_m2, block_n2, warps2, stages2). head_dim 128: the fastest of the
# candidates timed by `scripts/bench_block_kernels.py --tune` on an H100 (docs/bench/block_kernels.md); the
# others: candidates without register spills inside the tile loops (ptxas reports for sm_90a), not timed.
_GPU_DEFAULTS = {
    16: (64, 128, 8, 2, 128, 64, 8, 2),
    32: (64, 128, 8, 2, 128, 64, 8, 2),
    64: (64, 128, 8, 2, 128, 64, 8, 2),
    128: (64, 128, 8, 2, 128, 64, 8, 3),
    256: (32, 64, 8, 2, 128, 32, 8, 2),
}
# fp32 inputs use IEEE fp32 dot products (FMA, no tensor cores): small tiles keep registers and compile
# time in check (larger tiles spill heavily and take over a minute to compile at head_dim 128).
_GPU_FP32 = (32, 32, 4, 1, 32, 32, 4, 1)
# The interpreter pays per program and per tile iteration, not per element: use large tiles.
_INTERPRETER_DEFAULT = (64, 64, 4, 1, 64, 64, 4, 1)


def default_backward_config(head_dim: int, dtype: torch.dtype | None = None, *,
                            interpret: bool | None = None) -> BackwardConfig:
    """The default launch configuration for ``head_dim`` and input ``dtype`` (Hopper-tuned for fp16/bf16,
    small tiles for fp32, or interpreter-friendly)."""
    if interpret is None:
        interpret = _interpreting()
    if interpret:
        return BackwardConfig(*_INTERPRETER_DEFAULT)
    if dtype == torch.float32:
        return BackwardConfig(*_GPU_FP32)
    return BackwardConfig(*_GPU_DEFAULTS[max(16, triton.next_power_of_2(head_dim))])


# --------------------------------------------------------------------------------------------------------
# Launcher and custom op
# --------------------------------------------------------------------------------------------------------


_SM_COUNTS: dict = {}


def _heads_fastest(mode: int, dkdv_programs: int, device: torch.device) -> bool:
    """Whether both kernels take the heads-fastest grid order (see Note [Ring backward kernels]): for
    causal-like blocks whose dK/dV grid is under 4 waves of programs."""
    if mode == 0:
        return False
    if device.type != "cuda":  # the interpreter: as on a large GPU
        sms = 132
    else:
        if device not in _SM_COUNTS:
            _SM_COUNTS[device] = torch.cuda.get_device_properties(device).multi_processor_count
        sms = _SM_COUNTS[device]
    return dkdv_programs < 4 * sms


def _bwd_block_impl(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, lse: Tensor, delta: Tensor, dq: Tensor,
    row_lo: Tensor | None, row_hi: Tensor | None, col_lo: Tensor | None, col_hi: Tensor | None,
    key_mask: Tensor | None, mode: int, accumulate: bool, scale: float, softcap: float,
    dkv_dtype: torch.dtype, block_m1: int, block_n1: int, num_warps1: int, num_stages1: int,
    block_m2: int, block_n2: int, num_warps2: int, num_stages2: int,
) -> tuple[Tensor, Tensor]:
    """Both backward kernels of one block: writes (or adds, ``accumulate``) the block's dQ into ``dq`` and
    returns dK, dV (B, Sk, Hkv, D) in ``dkv_dtype``. ``key_mask``: bool (B, Sk) or None."""
    batch, seqlen_q, heads, head_dim = q.shape
    seqlen_k, kv_heads = k.shape[1], k.shape[2]
    dk = torch.empty(k.shape, dtype=dkv_dtype, device=k.device)
    dv = torch.empty(v.shape, dtype=dkv_dtype, device=v.device)
    if batch == 0 or heads == 0 or seqlen_k == 0:
        if seqlen_q and not accumulate:
            dq.zero_()
        return dk, dv
    if seqlen_q == 0:
        return dk.zero_(), dv.zero_()
    interpret = _interpreting()
    upcast = q.dtype == torch.bfloat16 and interpret
    ieee = q.dtype == torch.float32 or upcast
    qk_scale, cap = _score_args(scale, softcap)
    # Absent optional arrays are never read (their constexpr flag is off): pass any tensor.
    row_lo, row_hi, col_lo, col_hi = (q if a is None else a for a in (row_lo, row_hi, col_lo, col_hi))
    km, km_strides = (q, (0, 0)) if key_mask is None else (key_mask.view(torch.uint8), key_mask.stride())
    block_d = max(16, triton.next_power_of_2(head_dim))
    key_tiles, query_tiles = triton.cdiv(seqlen_k, block_n1), triton.cdiv(seqlen_q, block_m2)
    heads_fastest = _heads_fastest(mode, batch * kv_heads * key_tiles, q.device)
    common = dict(HEAD_DIM=head_dim, BLOCK_D=block_d, MODE=mode, HAS_KEY_MASK=key_mask is not None,
                  SOFTCAP=softcap > 0, HEADS_FASTEST=heads_fastest, UPCAST=upcast, IEEE=ieee, INTERPRET=interpret)
    grid = (batch * kv_heads, key_tiles) if heads_fastest else (key_tiles, batch * kv_heads)
    _bwd_dkdv_kernel[grid](
        q, k, v, dout, lse, delta, dk, dv, col_lo, col_hi, km,
        *q.stride(), *k.stride(), *v.stride(), *dout.stride(), *lse.stride(), *delta.stride(),
        *dk.stride(), *dv.stride(), *km_strides,
        kv_heads, heads // kv_heads, seqlen_q, seqlen_k, qk_scale, cap, scale,
        BLOCK_M=block_m1, BLOCK_N=block_n1, **common, num_warps=num_warps1, num_stages=num_stages1,
    )
    grid = (batch * heads, query_tiles) if heads_fastest else (query_tiles, batch * heads)
    _bwd_dq_kernel[grid](
        q, k, v, dout, lse, delta, dq, row_lo, row_hi, km,
        *q.stride(), *k.stride(), *v.stride(), *dout.stride(), *lse.stride(), *delta.stride(),
        *dq.stride(), *km_strides,
        heads, heads // kv_heads, seqlen_q, seqlen_k, qk_scale, cap, scale,
        BLOCK_M=block_m2, BLOCK_N=block_n2, ACCUMULATE=accumulate, **common,
        num_warps=num_warps2, num_stages=num_stages2,
    )
    return dk, dv


_bwd_block_op = torch.library.custom_op("distcomm_attention::triton_bwd_block", _bwd_block_impl,
                                        mutates_args=("dq",))


@_bwd_block_op.register_fake
def _bwd_block_fake(dout, q, k, v, lse, delta, dq, row_lo, row_hi, col_lo, col_hi, key_mask, mode, accumulate,
                    scale, softcap, dkv_dtype, block_m1, block_n1, num_warps1, num_stages1, block_m2, block_n2,
                    num_warps2, num_stages2):
    return k.new_empty(k.shape, dtype=dkv_dtype), v.new_empty(v.shape, dtype=dkv_dtype)


# --------------------------------------------------------------------------------------------------------
# BackwardKernel implementation
# --------------------------------------------------------------------------------------------------------


class TritonBackward:
    """BackwardKernel backed by the two Triton kernels above (Note [Ring backward kernels]).

    Args:
        config: launch configuration; ``None`` takes the default for the head dim (Hopper-tuned on GPU,
            large tiles under the interpreter).
    """

    def __init__(self, *, config: BackwardConfig | None = None):
        if config is not None and not isinstance(config, BackwardConfig):
            raise TypeError(f"`config` must be a BackwardConfig or None; got {type(config).__name__}")
        self._config = config

    supports_head_dim = staticmethod(TritonForward.supports_head_dim)
    supports_dtype = staticmethod(TritonForward.supports_dtype)

    def config(self, head_dim: int, dtype: torch.dtype | None = None) -> BackwardConfig:
        """The launch configuration used for ``head_dim`` and input ``dtype``."""
        return self._config if self._config is not None else default_backward_config(head_dim, dtype)

    def step(self, dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor | None, lse: Tensor,
             delta: Tensor | None = None, *, mask: BlockMask, scale: float, softcap: float = 0.0,
             key_mask: Tensor | None = None, dq_acc: Tensor | None = None,
             dkv_dtype: torch.dtype | None = torch.float32) -> tuple[Tensor, Tensor, Tensor]:
        """Gradients of one block from the global output statistics.

        Args:
            dout, q: (B, Sq, H, D), the block's query rows (any strides; dout is cast to q's dtype).
            k, v: (B, Sk, Hkv, D), H % Hkv == 0, the block's keys (any strides).
            out: (B, Sq, H, D), the GLOBAL output rows (merged over every block); only read to compute
                ``delta`` when that is not given (may be None otherwise).
            lse: (B, H, Sq) float32, natural log, the GLOBAL logsumexp of these rows; -inf for a row that
                sees no key anywhere (its gradients are zero).
            delta: (B, H, Sq) float32, ``rowsum(dout * out)``; computed here from ``out`` when None.
            mask, scale, softcap, key_mask: the block's visibility and scores, exactly as for
                ``TritonForward.step`` (an "interval" mask needs all four arrays: row_* of length Sq,
                col_* of length Sk).
            dq_acc: optional float32 (B, Sq, H, D) buffer (any strides, e.g. a view of a bigger one): the
                block's dQ is added into it in the kernel and it is returned.
            dkv_dtype: dtype of the returned dK, dV (float32 for ring accumulation, or the input dtype for
                a final result); None means float32.

        Returns:
            dq (B, Sq, H, D) float32 (``dq_acc`` when given), dk, dv (B, Sk, Hkv, D) in ``dkv_dtype``.
        """
        TritonForward.check_tensor("q", q)
        TritonForward._check_kv(q, k, v)
        batch, seqlen_q, heads, head_dim = q.shape
        seqlen_k = k.shape[1]
        if tuple(dout.shape) != tuple(q.shape):
            raise ValueError(f"`dout` {tuple(dout.shape)} must have q's shape {tuple(q.shape)}")
        if dout.dtype != q.dtype:
            dout = dout.to(q.dtype)
        if not isinstance(lse, Tensor) or tuple(lse.shape) != (batch, heads, seqlen_q):
            raise ValueError(f"`lse` must have shape {(batch, heads, seqlen_q)}; got {tuple(getattr(lse, 'shape', ()))}")
        lse = lse.to(torch.float32)
        if delta is None:
            if out is None or tuple(out.shape) != tuple(q.shape):
                raise ValueError("`delta` is None, so `out` of q's shape is needed to compute rowsum(dout * out)")
            delta = (dout.float() * out.float()).sum(-1).transpose(1, 2)
        elif tuple(delta.shape) != (batch, heads, seqlen_q):
            raise ValueError(f"`delta` must have shape {(batch, heads, seqlen_q)}; got {tuple(delta.shape)}")
        delta = delta.to(torch.float32)
        if dq_acc is not None and (tuple(dq_acc.shape) != tuple(q.shape) or dq_acc.dtype != torch.float32
                                   or dq_acc.device != q.device):
            raise ValueError(
                f"`dq_acc` must be a float32 tensor of q's shape {tuple(q.shape)} on {q.device}; got "
                f"{tuple(dq_acc.shape)} {dq_acc.dtype} on {dq_acc.device}"
            )
        dkv_dtype = torch.float32 if dkv_dtype is None else dkv_dtype
        if dkv_dtype not in (torch.float16, torch.bfloat16, torch.float32):
            raise TypeError(f"`dkv_dtype` must be torch.float32, torch.float16 or torch.bfloat16; got {dkv_dtype}")
        mode = mode_code(mask)
        softcap = _check_softcap(softcap)
        row_lo, row_hi, col_lo, col_hi = interval_args(mask, seqlen_q, seqlen_k, q.device)
        key_mask = key_mask_arg(key_mask, batch, seqlen_k, q.device)
        accumulate = dq_acc is not None
        dq = dq_acc if accumulate else torch.empty(q.shape, dtype=torch.float32, device=q.device)
        cfg = self.config(head_dim, q.dtype).astuple()
        run = _bwd_block_impl if _plain_eager(dout, q, k, v, lse, delta, dq, key_mask, row_lo) else _bwd_block_op
        dk, dv = run(dout, q, k, v, lse, delta, dq, row_lo, row_hi, col_lo, col_hi, key_mask, mode, accumulate,
                     float(scale), softcap, dkv_dtype, *cfg)
        return dq, dk, dv
