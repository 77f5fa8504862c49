"""Candidate Hopper flash-attention forward kernels in Triton, timed against ours and cuDNN on one GPU.

    PYTHONPATH=. timeout 420 python scripts/tune_triton_fwd.py --out $OUT   # GPU: the experiment (< 6 min)
    PYTHONPATH=. python scripts/tune_triton_fwd.py --dry                     # CPU: AOT-compile every candidate

An experiment, not library code: the candidates live only in this file and do plain full/causal
attention (bf16/fp16, q/k/v contiguous (B, S, H, D), S a multiple of BLOCK_M, head_dim 64/128/256) with
out in the input dtype and lse fp32 natural log (B, H, S), like ``TritonForward``'s final step.

Note [Forward candidates]
~~~~~~~~~~~~~~~~~~~~~~~~~
One kernel, ``_cand_fwd``, with constexpr switches; every candidate is one setting of them::

    LOADS        0 host TMA descriptors (TensorDescriptor on the 2-D view (B*S, H*D))
                 1 device TMA descriptors (tl.make_tensor_descriptor on the same view, once per program)
                 2 plain pointer loads (cp.async), the loads ours uses
    ORDER        0 query tiles fastest, 1 heads fastest (program t -> tile t // (B*H), head t % (B*H));
                 causal: heaviest query tiles first either way
    PERSISTENT   grid = #SMs programs looping over tiles (static round robin) instead of one per tile
    LAZY         FA4's lazy rescale: keep a stale row max until some row's max grew by > 8 (log2 domain),
                 so most tiles skip acc * alpha (and its wait on the previous P @ V)
    WARP_SPEC    tl.range(..., warp_specialize=True) on the key loop (or the persistent tile loop); in
                 Triton 3.6 on sm_90a it takes effect only for 64x64 tiles at 4 warps with one key loop
                 (then 12 warps: a load partition and two 232-register compute partitions)
    MASK_ALL     causal as one key loop [0, start_m + BLOCK_M) masking every tile (what warp
                 specialization needs) instead of the unmasked + diagonal loops
    SPLIT        2: the program's BLOCK_M rows are two halves with their own acc/m/l, interleaved in the
                 key loop (QK of half 1 is issued before the softmax of half 0: FA3's intra-warpgroup
                 overlap written out by hand)

The key loop is the same in all: scores in the log2 domain with the softmax scale folded into one FMA
(``p = exp2(qk * qk_scale - m)``, ``qk_scale = scale * log2(e)``); causal tiles split into an unmasked
off-diagonal loop [0, start_m) and a masked diagonal loop [start_m, start_m + BLOCK_M)::

    keys ->  [ unmasked, no compare/select ........ ][ diagonal: masked ]  .  .  .
             0                                    start_m          start_m + BLOCK_M

Method: every candidate is AOT-compiled first, in parallel subprocesses (one per candidate, so a
compiler crash costs only that candidate) through the same specialization as Triton's JIT, which fills
Triton's on-disk cache; the timed process then loads the binaries instead of compiling. Each candidate is
checked against an fp32 torch reference (S = 1024; and, at each benchmark shape, 128 query rows spread
over the sequence, plus ||out - out_cudnn|| / ||out_cudnn||) before it is timed; a failure is recorded and
the candidate skipped. Timing: one CUDA event pair per call, back-to-back calls after warm-up, median.
FLOPs 4 * B * H * S * S * D, halved for causal.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
import triton
import triton.language as tl

_HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(_HERE))

_LOG2E = 1.4426950408889634  # log2(e)
_LN2 = 0.6931471805599453  # ln(2)


# --------------------------------------------------------------------------------------------------------
# Kernels (see Note [Forward candidates])
# --------------------------------------------------------------------------------------------------------


@triton.jit
def _load_tile(src, row, col, stride_row, BLOCK: tl.constexpr, HEAD_DIM: tl.constexpr, LOADS: tl.constexpr):
    """A (BLOCK, HEAD_DIM) tile at (row, col) of the 2-D view (B*S, H*D): a descriptor load or pointers."""
    if LOADS == 2:
        rows = (row + tl.arange(0, BLOCK)).to(tl.int64)
        return tl.load(src + rows[:, None] * stride_row + col + tl.arange(0, HEAD_DIM)[None, :])
    else:
        return src.load([row, col])


@triton.jit
def _softmax_step(qk, m_i, l_i, acc, offs_m, start_n, qk_scale,
                  BLOCK_N: tl.constexpr, MASKED: tl.constexpr, LAZY: tl.constexpr):
    """Online-softmax update for one score tile -> (p, m_i, l_i, acc) with acc already rescaled."""
    if MASKED:
        offs_n = start_n + tl.arange(0, BLOCK_N)
        # Every row sees at least one key of the first diagonal tile: m stays finite, no inf - inf.
        qk = tl.where(offs_m[:, None] >= offs_n[None, :], qk * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
    else:
        m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
    if LAZY:
        # Rescale only when some row's max grew by more than 8 (p <= 2^8 otherwise: safe in fp32/bf16).
        if tl.max(m_new - m_i, 0) > 8.0:
            alpha = tl.math.exp2(m_i - m_new)
            acc = acc * alpha[:, None]
            l_i = l_i * alpha
            m_i = m_new
        if MASKED:
            p = tl.math.exp2(qk - m_i[:, None])
        else:
            p = tl.math.exp2(qk * qk_scale - m_i[:, None])
        l_i = l_i + tl.sum(p, 1)
    else:
        if MASKED:
            p = tl.math.exp2(qk - m_new[:, None])
        else:
            p = tl.math.exp2(qk * qk_scale - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        m_i = m_new
    return p, m_i, l_i, acc


@triton.jit
def _key_loop(acc, l_i, m_i, q, k_src, v_src, kv_row, kv_col, stride_kv, lo, hi, offs_m, qk_scale,
              HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr, LAZY: tl.constexpr,
              LOADS: tl.constexpr, WARP_SPEC: tl.constexpr):
    """Key tiles [lo, hi) for one query tile."""
    for start_n in tl.range(lo, hi, BLOCK_N, warp_specialize=WARP_SPEC):
        start_n = tl.multiple_of(start_n, BLOCK_N)
        k = _load_tile(k_src, kv_row + start_n, kv_col, stride_kv, BLOCK_N, HEAD_DIM, LOADS)
        qk = tl.dot(q, k.T)
        p, m_i, l_i, acc = _softmax_step(qk, m_i, l_i, acc, offs_m, start_n, qk_scale, BLOCK_N, MASKED, LAZY)
        v = _load_tile(v_src, kv_row + start_n, kv_col, stride_kv, BLOCK_N, HEAD_DIM, LOADS)
        acc = tl.dot(p.to(v.dtype), v, acc)
    return acc, l_i, m_i


@triton.jit
def _key_loop_split(acc0, l0, m0, acc1, l1, m1, q0, q1, k_src, v_src, kv_row, kv_col, stride_kv, lo, hi,
                    offs_m0, offs_m1, qk_scale,
                    HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr, LAZY: tl.constexpr,
                    LOADS: tl.constexpr, WARP_SPEC: tl.constexpr):
    """Key tiles [lo, hi) for two half query tiles, their matmuls interleaved with each other's softmax."""
    for start_n in tl.range(lo, hi, BLOCK_N, warp_specialize=WARP_SPEC):
        start_n = tl.multiple_of(start_n, BLOCK_N)
        k = _load_tile(k_src, kv_row + start_n, kv_col, stride_kv, BLOCK_N, HEAD_DIM, LOADS)
        qk0 = tl.dot(q0, k.T)
        qk1 = tl.dot(q1, k.T)  # in flight while half 0 does its softmax
        p0, m0, l0, acc0 = _softmax_step(qk0, m0, l0, acc0, offs_m0, start_n, qk_scale, BLOCK_N, MASKED, LAZY)
        v = _load_tile(v_src, kv_row + start_n, kv_col, stride_kv, BLOCK_N, HEAD_DIM, LOADS)
        acc0 = tl.dot(p0.to(v.dtype), v, acc0)  # in flight while half 1 does its softmax
        p1, m1, l1, acc1 = _softmax_step(qk1, m1, l1, acc1, offs_m1, start_n, qk_scale, BLOCK_N, MASKED, LAZY)
        acc1 = tl.dot(p1.to(v.dtype), v, acc1)
    return acc0, l0, m0, acc1, l1, m1


@triton.jit
def _finish(acc, l_i, m_i, o_dst, Lse, row, col, stride_o, offs_m, lse_off,
            HEAD_DIM: tl.constexpr, ROWS: tl.constexpr, LOADS: tl.constexpr):
    """out = acc / l (input dtype), lse = (m + log2 l) * ln 2."""
    out = acc * (1.0 / l_i)[:, None]
    tl.store(Lse + lse_off + offs_m, (m_i + tl.math.log2(l_i)) * 0.6931471805599453)  # * ln(2)
    if LOADS == 2:
        rows = (row + tl.arange(0, ROWS)).to(tl.int64)
        ptrs = o_dst + rows[:, None] * stride_o + col + tl.arange(0, HEAD_DIM)[None, :]
        tl.store(ptrs, out.to(o_dst.dtype.element_ty))
    else:
        o_dst.store([row, col], out.to(o_dst.dtype))


@triton.jit
def _attend_tile(tile, q_src, k_src, v_src, o_src, Lse, seqlen, num_heads, kv_group, num_m, bh_total, qk_scale,
                 stride_q, stride_kv, stride_o,
                 HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr,
                 ORDER: tl.constexpr, LAZY: tl.constexpr, LOADS: tl.constexpr, WARP_SPEC: tl.constexpr,
                 SPLIT: tl.constexpr, MASK_ALL: tl.constexpr):
    """The whole forward of query tile number ``tile`` (in the program order of ORDER)."""
    if ORDER == 1:
        pid_m = tile // bh_total
        pid_bh = tile % bh_total
    else:
        pid_m = tile % num_m
        pid_bh = tile // num_m
    if CAUSAL:
        pid_m = num_m - 1 - pid_m  # heaviest query tiles first
    off_b = pid_bh // num_heads
    off_h = pid_bh % num_heads
    start_m = pid_m * BLOCK_M
    q_row = off_b * seqlen + start_m
    q_col = off_h * HEAD_DIM
    kv_row = off_b * seqlen
    kv_col = (off_h // kv_group) * HEAD_DIM
    lse_off = pid_bh.to(tl.int64) * seqlen
    hi_full = start_m if CAUSAL else seqlen
    if SPLIT == 1:
        offs_m = start_m + tl.arange(0, BLOCK_M)
        q = _load_tile(q_src, q_row, q_col, stride_q, BLOCK_M, HEAD_DIM, LOADS)
        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
        if CAUSAL and MASK_ALL:  # one loop, every tile masked (Triton's sm_90 warp specialization needs one loop)
            acc, l_i, m_i = _key_loop(acc, l_i, m_i, q, k_src, v_src, kv_row, kv_col, stride_kv, 0,
                                      start_m + BLOCK_M, offs_m, qk_scale, HEAD_DIM, BLOCK_N, True, LAZY, LOADS,
                                      WARP_SPEC)
        else:
            acc, l_i, m_i = _key_loop(acc, l_i, m_i, q, k_src, v_src, kv_row, kv_col, stride_kv, 0, hi_full,
                                      offs_m, qk_scale, HEAD_DIM, BLOCK_N, False, LAZY, LOADS, WARP_SPEC)
        if CAUSAL and not MASK_ALL:
            acc, l_i, m_i = _key_loop(acc, l_i, m_i, q, k_src, v_src, kv_row, kv_col, stride_kv, start_m,
                                      start_m + BLOCK_M, offs_m, qk_scale, HEAD_DIM, BLOCK_N, True, LAZY, LOADS,
                                      WARP_SPEC)
        _finish(acc, l_i, m_i, o_src, Lse, q_row, q_col, stride_o, offs_m, lse_off, HEAD_DIM, BLOCK_M, LOADS)
    else:
        tl.static_assert(SPLIT == 2, "SPLIT: 1 or 2")
        HALF: tl.constexpr = BLOCK_M // 2
        offs_m0 = start_m + tl.arange(0, HALF)
        offs_m1 = offs_m0 + HALF
        q0 = _load_tile(q_src, q_row, q_col, stride_q, HALF, HEAD_DIM, LOADS)
        q1 = _load_tile(q_src, q_row + HALF, q_col, stride_q, HALF, HEAD_DIM, LOADS)
        m0 = tl.full([HALF], float("-inf"), dtype=tl.float32)
        l0 = tl.zeros([HALF], dtype=tl.float32)
        acc0 = tl.zeros([HALF, HEAD_DIM], dtype=tl.float32)
        m1 = tl.full([HALF], float("-inf"), dtype=tl.float32)
        l1 = tl.zeros([HALF], dtype=tl.float32)
        acc1 = tl.zeros([HALF, HEAD_DIM], dtype=tl.float32)
        acc0, l0, m0, acc1, l1, m1 = _key_loop_split(
            acc0, l0, m0, acc1, l1, m1, q0, q1, k_src, v_src, kv_row, kv_col, stride_kv, 0, hi_full,
            offs_m0, offs_m1, qk_scale, HEAD_DIM, BLOCK_N, False, LAZY, LOADS, WARP_SPEC)
        if CAUSAL:
            acc0, l0, m0, acc1, l1, m1 = _key_loop_split(
                acc0, l0, m0, acc1, l1, m1, q0, q1, k_src, v_src, kv_row, kv_col, stride_kv, start_m,
                start_m + BLOCK_M, offs_m0, offs_m1, qk_scale, HEAD_DIM, BLOCK_N, True, LAZY, LOADS, WARP_SPEC)
        _finish(acc0, l0, m0, o_src, Lse, q_row, q_col, stride_o, offs_m0, lse_off, HEAD_DIM, HALF, LOADS)
        _finish(acc1, l1, m1, o_src, Lse, q_row + HALF, q_col, stride_o, offs_m1, lse_off, HEAD_DIM, HALF, LOADS)


@triton.jit
def _cand_fwd(
    # q, k, v, out: host TensorDescriptors (LOADS 0) or the (B*S, H*D) / (B*S, Hkv*D) tensors (LOADS 1, 2)
    Q, K, V, Out, Lse,
    # sizes and runtime values
    batch, seqlen, num_heads, kv_group, qk_scale,
    # meta
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr,
    ORDER: tl.constexpr, PERSISTENT: tl.constexpr, LAZY: tl.constexpr, LOADS: tl.constexpr,
    WARP_SPEC: tl.constexpr, WS_OUTER: tl.constexpr, SPLIT: tl.constexpr, MASK_ALL: tl.constexpr,
):
    tl.static_assert(BLOCK_M % BLOCK_N == 0, "BLOCK_M must be a multiple of BLOCK_N")
    num_kv_heads = num_heads // kv_group
    stride_q = num_heads * HEAD_DIM
    stride_kv = num_kv_heads * HEAD_DIM
    ROWS: tl.constexpr = BLOCK_M // SPLIT
    if LOADS == 1:
        q_src = tl.make_tensor_descriptor(Q, shape=[batch * seqlen, stride_q], strides=[stride_q, 1],
                                          block_shape=[ROWS, HEAD_DIM])
        k_src = tl.make_tensor_descriptor(K, shape=[batch * seqlen, stride_kv], strides=[stride_kv, 1],
                                          block_shape=[BLOCK_N, HEAD_DIM])
        v_src = tl.make_tensor_descriptor(V, shape=[batch * seqlen, stride_kv], strides=[stride_kv, 1],
                                          block_shape=[BLOCK_N, HEAD_DIM])
        o_src = tl.make_tensor_descriptor(Out, shape=[batch * seqlen, stride_q], strides=[stride_q, 1],
                                          block_shape=[ROWS, HEAD_DIM])
    else:
        q_src = Q
        k_src = K
        v_src = V
        o_src = Out
    num_m = tl.cdiv(seqlen, BLOCK_M)
    bh_total = batch * num_heads
    if PERSISTENT:
        for tile in tl.range(tl.program_id(0), num_m * bh_total, tl.num_programs(0), warp_specialize=WS_OUTER):
            _attend_tile(tile, q_src, k_src, v_src, o_src, Lse, seqlen, num_heads, kv_group, num_m, bh_total,
                         qk_scale, stride_q, stride_kv, stride_q,
                         HEAD_DIM, BLOCK_M, BLOCK_N, CAUSAL, ORDER, LAZY, LOADS, WARP_SPEC, SPLIT, MASK_ALL)
    else:
        _attend_tile(tl.program_id(0), q_src, k_src, v_src, o_src, Lse, seqlen, num_heads, kv_group, num_m,
                     bh_total, qk_scale, stride_q, stride_kv, stride_q,
                     HEAD_DIM, BLOCK_M, BLOCK_N, CAUSAL, ORDER, LAZY, LOADS, WARP_SPEC, SPLIT, MASK_ALL)


# --------------------------------------------------------------------------------------------------------
# Candidates and their launch
# --------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Candidate:
    """One setting of ``_cand_fwd``'s switches plus its launch options (Note [Forward candidates])."""

    name: str
    block_m: int = 128
    block_n: int = 128
    num_warps: int = 8
    num_stages: int = 2
    loads: int = 0  # 0 host TMA descriptors, 1 device TMA descriptors, 2 pointers
    order: int = 0  # 0 tiles fastest, 1 heads fastest
    persistent: bool = False
    lazy: bool = False
    warp_spec: bool = False  # on the key loop
    ws_outer: bool = False  # on the persistent tile loop
    split: int = 1
    mask_all: bool = False  # causal: one loop with every tile masked instead of off-diagonal + diagonal
    maxnreg: int | None = None
    why: str = ""

    def config(self) -> str:
        loads = ("host-TMA", "dev-TMA", "ptr")[self.loads]
        bits = [f"{self.block_m}x{self.block_n}", f"w{self.num_warps}", f"s{self.num_stages}", loads,
                "heads-fastest" if self.order else "tiles-fastest"]
        bits += [b for b, on in (("persistent", self.persistent), ("lazy", self.lazy), ("ws", self.warp_spec),
                                 ("ws-outer", self.ws_outer), (f"split{self.split}", self.split > 1),
                                 ("mask-all", self.mask_all)) if on]
        if self.maxnreg:
            bits.append(f"maxnreg{self.maxnreg}")
        return " ".join(bits)


CANDIDATES = [
    Candidate("tma_s2", why="ours' tile with TMA loads, scale folded in one FMA, split causal loop; 2 stages"),
    Candidate("tma_s3", num_stages=3, why="as tma_s2, 3 K/V stages (225 KB smem with Q)"),
    Candidate("tma_n64_s3", block_n=64, num_stages=3, why="smaller score tile: half the registers for S/P"),
    Candidate("tma_n64_s4", block_n=64, num_stages=4, why="deeper pipeline for the 64-key tile"),
    Candidate("tma_m64_w4", block_m=64, block_n=64, num_warps=4, num_stages=3,
              why="one warpgroup per program: 2-3 programs per SM interleave instead of 2 warpgroups"),
    Candidate("tma_heads", order=1, why="tma_s2 with heads varying fastest (every head's heavy tiles first)"),
    Candidate("tma_persist", order=1, persistent=True,
              why="one program per SM looping over tiles: no tail of short causal programs, no relaunch"),
    Candidate("tma_lazy", lazy=True, why="tma_s2 with FA4's lazy rescale: fewer acc rescales and waits"),
    Candidate("tma_lazy_n64_s3", block_n=64, num_stages=3, lazy=True, why="lazy rescale on the 64-key tile"),
    Candidate("tma_persist_lazy", order=1, persistent=True, lazy=True, why="persistent + lazy rescale"),
    Candidate("tma_split2_n64", block_m=256, block_n=64, split=2,
              why="two 128-row halves interleaved by hand: QK of one overlaps the softmax of the other"),
    Candidate("tma_split2_m128", block_m=128, block_n=64, num_warps=4, split=2,
              why="one warpgroup, two 64-row halves interleaved (FA3's intra-warpgroup overlap)"),
    Candidate("tma_m64_ws", block_m=64, block_n=64, num_warps=4, num_stages=2, warp_spec=True, mask_all=True,
              why="Triton's sm_90 warp specialization (the one shape it applies to: 64x64, 4 warps, one key "
                  "loop): a TMA producer + two 232-register consumer warpgroups, 12 warps"),
    Candidate("tma_m64_ws_s3", block_m=64, block_n=64, num_warps=4, num_stages=3, warp_spec=True, mask_all=True,
              why="as tma_m64_ws with 3 K/V buffers"),
    Candidate("devdesc_s2", loads=1, why="tma_s2 with device-side descriptors (per-program descriptor setup)"),
    Candidate("ptr_s3", loads=2, num_stages=3,
              why="no TMA: ours' loads and config with the folded FMA and split loop; isolates TMA's effect"),
]

# Compiled by triton_sm90_report.py only, not timed. In Triton 3.6 on sm_90a, warp_specialize=True is a
# no-op at 8 warps (SASS identical to the same candidate without it), fails in the NVGPUWarpSpecialization
# pass for 128-row tiles at 4 warps and for the two-loop causal form, and is silently dropped when the loop
# holds an scf.if (LAZY); it applies to 64x64 tiles at 4 warps with one key loop (tma_m64_ws above).
WS_PROBES = [
    Candidate("tma_ws", warp_spec=True, why="tma_s2 + warp_specialize on the key loop"),
    Candidate("tma_persist_ws", order=1, persistent=True, ws_outer=True,
              why="tma_persist + warp_specialize on the tile loop (the tutorial's Blackwell form)"),
    Candidate("tma_m64_w4_ws", block_m=64, block_n=64, num_warps=4, num_stages=3, warp_spec=True,
              why="tma_m64_w4 + warp_specialize, causal as two loops"),
    Candidate("tma_ws_w4", block_n=64, num_warps=4, warp_spec=True, mask_all=True,
              why="128x64 tile, 4 warps, one key loop + warp_specialize"),
    Candidate("tma_m64_ws_lazy", block_m=64, block_n=64, num_warps=4, warp_spec=True, mask_all=True, lazy=True,
              why="tma_m64_ws + lazy rescale"),
]


def launch_args(cand: Candidate, q, k, v, out, lse, *, causal: bool, scale: float, num_sms: int = 132):
    """(grid, args, kwargs) of ``_cand_fwd`` for q (B, S, H, D), k/v (B, S, Hkv, D) contiguous."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    batch, seqlen, heads, head_dim = q.shape
    kv_heads = k.shape[2]
    for name, x in (("q", q), ("k", k), ("v", v), ("out", out)):
        if not x.is_contiguous():
            raise ValueError(f"`{name}` must be contiguous (B, S, H, D); got strides {x.stride()}")
    if seqlen % cand.block_m:
        raise ValueError(f"S={seqlen} must be a multiple of block_m={cand.block_m} for candidate {cand.name}")
    q2, o2 = q.view(batch * seqlen, heads * head_dim), out.view(batch * seqlen, heads * head_dim)
    k2, v2 = (x.view(batch * seqlen, kv_heads * head_dim) for x in (k, v))
    rows = cand.block_m // cand.split
    if cand.loads == 0:
        srcs = [TensorDescriptor.from_tensor(q2, [rows, head_dim]), TensorDescriptor.from_tensor(k2, [cand.block_n, head_dim]),
                TensorDescriptor.from_tensor(v2, [cand.block_n, head_dim]), TensorDescriptor.from_tensor(o2, [rows, head_dim])]
    else:
        srcs = [q2, k2, v2, o2]
    tiles = triton.cdiv(seqlen, cand.block_m) * batch * heads
    grid = (min(tiles, num_sms),) if cand.persistent else (tiles,)
    args = (*srcs, lse, batch, seqlen, heads, heads // kv_heads, scale * _LOG2E)
    kwargs = dict(HEAD_DIM=head_dim, BLOCK_M=cand.block_m, BLOCK_N=cand.block_n, CAUSAL=causal, ORDER=cand.order,
                  PERSISTENT=cand.persistent, LAZY=cand.lazy, LOADS=cand.loads, WARP_SPEC=cand.warp_spec,
                  WS_OUTER=cand.ws_outer, SPLIT=cand.split, MASK_ALL=cand.mask_all, num_warps=cand.num_warps, num_stages=cand.num_stages)
    if cand.maxnreg:
        kwargs["maxnreg"] = cand.maxnreg
    return grid, args, kwargs


_ALLOCATOR_SET = False


def cand_forward(cand: Candidate, q, k, v, *, causal: bool, scale: float, num_sms: int):
    """Run a candidate -> out (B, S, H, D) in q's dtype, lse (B, H, S) fp32 natural log."""
    global _ALLOCATOR_SET
    if cand.loads == 1 and not _ALLOCATOR_SET:  # device descriptors live in a global scratch buffer
        triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8, device="cuda"))
        _ALLOCATOR_SET = True
    batch, seqlen, heads, _ = q.shape
    out = torch.empty_like(q)
    lse = torch.empty((batch, heads, seqlen), dtype=torch.float32, device=q.device)
    grid, args, kwargs = launch_args(cand, q, k, v, out, lse, causal=causal, scale=scale, num_sms=num_sms)
    _cand_fwd[grid](*args, **kwargs)
    return out, lse


# --------------------------------------------------------------------------------------------------------
# AOT compile (CPU; also the GPU run's parallel warm-up of Triton's cache)
# --------------------------------------------------------------------------------------------------------


AOT_SHAPE = (1, 1024, 32, 128)  # (B, S, H, D): same specialization as the benchmark shapes (S % 16 == 0)


def aot_candidate(cand: Candidate, *, arch: int = 90, report: bool = True) -> dict:
    """AOT-compile both masks of ``cand`` for sm_{arch}; -> {mask: resource report or {"error": ...}}."""
    import triton_sm90_report as R

    b, s, h, d = AOT_SHAPE
    q, k, v, out = (torch.empty(b, s, h, d, dtype=torch.bfloat16) for _ in range(4))
    lse = torch.empty(b, h, s, dtype=torch.float32)
    result = {}
    for causal in (True, False):
        mask = "causal" if causal else "full"
        try:
            _, args, kwargs = launch_args(cand, q, k, v, out, lse, causal=causal, scale=d**-0.5)
            compiled, seconds = R.aot_compile(_cand_fwd, args, kwargs, arch=arch)
            result[mask] = R.resources(compiled) if report else {}
            result[mask]["compile_s"] = round(seconds, 1)
        except Exception as exc:  # a candidate that does not compile is reported, not fatal
            result[mask] = {"error": _error_text(exc)}
    return result


def _compile_task(name: str, out_path: Path) -> None:
    """Subprocess entry: AOT-compile one candidate (or "ours") and write the report JSON."""
    import triton_sm90_report as R

    if name == "ours":
        res = {f"{k_}": v_ for k_, v_ in R.report_ours(arch=90).items()}
    else:
        res = aot_candidate(next(c for c in CANDIDATES if c.name == name))
    out_path.write_text(json.dumps(res, default=str))


def compile_all(names: list[str], *, workers: int, timeout: float, log) -> dict:
    """AOT-compile the named candidates in parallel subprocesses (a crash or hang costs one candidate)."""
    tmp = Path(os.environ.get("TMPDIR", "/tmp")) / f"tune_triton_fwd_{os.getpid()}"
    tmp.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")  # compile only: never touch the GPU

    def one(name: str) -> tuple[str, dict]:
        path = tmp / f"{name}.json"
        t0 = time.monotonic()
        try:
            proc = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--_compile-task", name,
                                   "--_task-out", str(path)], capture_output=True, text=True, timeout=timeout,
                                  env=env)
            if proc.returncode != 0 or not path.exists():
                tail = " | ".join((proc.stderr or proc.stdout).strip().splitlines()[-3:])
                return name, {"error": f"compile subprocess exited {proc.returncode}: {tail[-600:]}"}
            res = json.loads(path.read_text())
        except subprocess.TimeoutExpired:
            return name, {"error": f"compile timed out after {timeout:.0f} s"}
        log(f"  compiled {name} in {time.monotonic() - t0:.0f} s: " + _compile_summary(res))
        return name, res

    with ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
        return dict(pool.map(one, names))


def _compile_summary(res: dict) -> str:
    parts = []
    for key, r in res.items():
        if not isinstance(r, dict):
            continue
        if "error" in r:
            parts.append(f"{key}: ERROR {r['error'][:160]}")
        else:
            parts.append(f"{key}: {r.get('registers')} regs, spill {r.get('spill_stores')}/{r.get('spill_loads')} B, "
                         f"smem {r.get('shared')} B, wgmma={r.get('wgmma')} tma={r.get('tma')} ws={r.get('warp_specialized')}")
    return "; ".join(parts)


def _compile_ok(res: dict | None) -> str | None:
    """None if every entry compiled, else the first error."""
    if res is None:
        return "not compiled"
    if "error" in res:
        return res["error"]
    for r in res.values():
        if isinstance(r, dict) and "error" in r:
            return r["error"]
    return None


# --------------------------------------------------------------------------------------------------------
# GPU: references, checks, timing
# --------------------------------------------------------------------------------------------------------


def _error_text(exc: BaseException) -> str:
    msg = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {msg[:500]}"


def make_qkv(b, s, h, hkv, d, dtype, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    return tuple(torch.randn(b, s, n, d, generator=gen, device="cuda", dtype=dtype) for n in (h, hkv, hkv))


def reference_rows(q, k, v, rows: torch.Tensor, *, causal: bool, scale: float):
    """fp32 torch attention for query rows ``rows`` of q (B, S, H, D) -> out (B, R, H, D), lse (B, H, R)."""
    group = q.shape[2] // k.shape[2]
    qf = q[:, rows].float().transpose(1, 2)  # (B, H, R, D)
    kf = k.float().repeat_interleave(group, dim=2).transpose(1, 2)
    vf = v.float().repeat_interleave(group, dim=2).transpose(1, 2)
    s = (qf @ kf.transpose(-1, -2)) * scale
    if causal:
        keys = torch.arange(k.shape[1], device=q.device)
        s = s.masked_fill(keys[None, None, None, :] > rows.to(q.device)[None, None, :, None], float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    out = torch.softmax(s, dim=-1) @ vf
    return out.transpose(1, 2), lse


def check(out, lse, q, k, v, rows, *, causal, scale, out_cmp=None) -> dict:
    """Errors of (out, lse) vs the fp32 reference on ``rows`` (and vs ``out_cmp`` on every row)."""
    ref_out, ref_lse = reference_rows(q, k, v, rows, causal=causal, scale=scale)
    got_out = out[:, rows].float()
    res = {"out_rel_err": float((got_out - ref_out).norm() / ref_out.norm()),
           "lse_max_err": float((lse[:, :, rows] - ref_lse).abs().max())}
    if out_cmp is not None:
        res["out_rel_err_vs_cudnn"] = float((out.float() - out_cmp.float()).norm() / out_cmp.float().norm())
    res["ok"] = (res["out_rel_err"] < 1e-2 and res["lse_max_err"] < 1e-2
                 and res.get("out_rel_err_vs_cudnn", 0.0) < 1e-2 and math.isfinite(res["out_rel_err"]))
    return res


def sample_rows(s: int, n: int = 128) -> torch.Tensor:
    """n query rows spread over [0, s), always including the first and last rows and a tile boundary."""
    rows = torch.linspace(0, s - 1, n - 2).round().long()
    return torch.unique(torch.cat([rows, torch.tensor([127, 128, s - 1])]))


def time_fn(fn, *, target_s: float = 0.12, min_iters: int = 5, max_iters: int = 50) -> dict:
    """Median and mean seconds per call: one CUDA event pair per call, back-to-back after warm-up."""
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    one = max(time.perf_counter() - t0, 1e-5)
    iters = int(min(max_iters, max(min_iters, target_s / one)))
    for _ in range(2):
        fn()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(iters)]
    for start, end in events:
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    times = sorted(s.elapsed_time(e) / 1e3 for s, e in events)
    return {"median_s": times[len(times) // 2], "mean_s": sum(times) / len(times), "iters": iters}


def ours_calls(q, k, v, *, causal: bool, scale: float):
    """Our TritonForward as a ring of one (the fused final step) -> (fn, (out, lse))."""
    from distcomm_attention.kernels.triton_fwd import TritonForward
    from distcomm_attention.planning.visibility import CAUSAL, FULL

    fwd = TritonForward()
    block = CAUSAL if causal else FULL

    def run():
        st = fwd.init_state(q)
        fwd.step(st, q, k, v, mask=block, scale=scale, final=True)
        return fwd.finalize(st, q.dtype)

    return run, fwd.config(q.shape[-1])


def cudnn_calls(q, k, v, *, causal: bool, scale: float):
    """``aten._scaled_dot_product_cudnn_attention`` in (B, H, S, D) layout (as bench_block_kernels.py) ->
    fn returning out (B, S, H, D) and lse (B, H, S)."""
    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
    op = torch.ops.aten._scaled_dot_product_cudnn_attention

    def run():
        res = op(qt, kt, vt, None, True, 0.0, causal, False, scale=scale)
        return res[0].transpose(1, 2), res[1]

    return run


# --------------------------------------------------------------------------------------------------------
# Driver
# --------------------------------------------------------------------------------------------------------


class Log:
    """print(flush) + a copy for the log file."""

    def __init__(self):
        self.lines: list[str] = []

    def __call__(self, text: str = "") -> None:
        print(text, flush=True)
        self.lines.append(text)


def fwd_flops(b, h, s, d, causal) -> float:
    return 4.0 * b * h * s * s * d * (0.5 if causal else 1.0)


def run_gpu(args, log: Log, result: dict, started: float) -> None:
    import _bench_util as U

    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    b, h, hkv, d = 1, args.heads, args.kv_heads, args.head_dim
    scale = d**-0.5
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    result["env"] = U.env_info("none (one GPU)", 1)
    result["env"]["sms"] = num_sms
    cands = [c for c in CANDIDATES if not args.only or c.name in args.only]

    # 1. Compile everything in parallel on the CPU (fills Triton's cache for the JIT below).
    t0 = time.monotonic()
    log(f"[{time.monotonic() - started:5.0f} s] AOT-compiling {len(cands)} candidates + ours ({args.workers} workers)")
    compiled = compile_all(["ours"] + [c.name for c in cands], workers=args.workers, timeout=args.compile_timeout,
                           log=log)
    result["compile"] = compiled
    result["compile_wall_s"] = time.monotonic() - t0
    bad = {c.name: _compile_ok(compiled.get(c.name)) for c in cands}
    for name, err in bad.items():
        if err:
            log(f"  {name}: does not compile, skipped: {err[:300]}")
    cands = [c for c in cands if not bad[c.name]]

    # 2. Small-shape correctness against an fp32 reference (every row).
    log(f"[{time.monotonic() - started:5.0f} s] correctness at S=1024 (every row vs fp32 torch)")
    q, k, v = make_qkv(b, 1024, h, hkv, d, dtype, seed=1)
    rows = torch.arange(1024)
    status = {}
    for c in cands:
        for causal in (True, False):
            mask = "causal" if causal else "full"
            try:
                t1 = time.monotonic()
                out, lse = cand_forward(c, q, k, v, causal=causal, scale=scale, num_sms=num_sms)
                torch.cuda.synchronize()
                res = check(out, lse, q, k, v, rows, causal=causal, scale=scale)
                res["first_call_s"] = round(time.monotonic() - t1, 2)
            except Exception as exc:
                res = {"ok": False, "error": _error_text(exc)}
            result["small_check"].setdefault(c.name, {})[mask] = res
            if not res["ok"]:
                status[c.name] = f"wrong or failed at S=1024 {mask}: {res}"
        log(f"  {c.name:18s} " + ("OK" if c.name not in status else status[c.name][:300]) + "  "
            + " ".join(f"{m}: out {r.get('out_rel_err', float('nan')):.1e} lse {r.get('lse_max_err', float('nan')):.1e}"
                       f" ({r.get('first_call_s', '-')} s)" for m, r in result["small_check"][c.name].items()))
    cands = [c for c in cands if c.name not in status]
    del q, k, v
    torch.cuda.empty_cache()

    # 3. Benchmark shapes: cuDNN and ours first, then each candidate (checked, then timed).
    for s in args.seqs:
        for causal in (True, False):
            mask = "causal" if causal else "full"
            if time.monotonic() - started > args.budget:
                log(f"  budget of {args.budget:.0f} s spent: skipping S={s} {mask}")
                result["skipped"].append({"s": s, "mask": mask})
                continue
            flops = fwd_flops(b, h, s, d, causal)
            q, k, v = make_qkv(b, s, h, hkv, d, dtype)
            rows = sample_rows(s)
            log(f"[{time.monotonic() - started:5.0f} s] S={s} {mask} ({flops / 1e12:.2f} TFLOP per call)")
            base = {}
            out_cudnn = None
            try:
                fn = cudnn_calls(q, k, v, causal=causal, scale=scale)
                out_cudnn, lse_cudnn = fn()
                chk = check(out_cudnn, lse_cudnn.reshape(b, h, s), q, k, v, rows, causal=causal, scale=scale)
                base["cudnn"] = {**time_fn(fn), "check": chk}
            except Exception as exc:
                base["cudnn"] = {"error": _error_text(exc)}
            try:
                fn, cfg = ours_calls(q, k, v, causal=causal, scale=scale)
                out, lse = fn()
                chk = check(out, lse, q, k, v, rows, causal=causal, scale=scale, out_cmp=out_cudnn)
                base["ours"] = {**time_fn(fn), "check": chk, "config": str(cfg)}
            except Exception as exc:
                base["ours"] = {"error": _error_text(exc)}
            for name in ("cudnn", "ours"):
                add_row(result, log, name, base[name].get("config", "aten op" if name == "cudnn" else ""), s, mask,
                        flops, base[name], base)
            for c in cands:
                if time.monotonic() - started > args.budget:
                    log(f"  budget spent: {c.name} not timed at S={s} {mask}")
                    result["skipped"].append({"s": s, "mask": mask, "candidate": c.name})
                    continue
                try:
                    def fn(c=c):
                        return cand_forward(c, q, k, v, causal=causal, scale=scale, num_sms=num_sms)
                    out, lse = fn()
                    chk = check(out, lse, q, k, v, rows, causal=causal, scale=scale, out_cmp=out_cudnn)
                    entry = {"check": chk}
                    if chk["ok"]:
                        entry.update(time_fn(fn))
                    else:
                        entry["error"] = f"wrong at the benchmark shape: {chk}"
                except Exception as exc:
                    entry = {"error": _error_text(exc)}
                add_row(result, log, c.name, c.config(), s, mask, flops, entry, base)
            del q, k, v, out_cudnn
            torch.cuda.empty_cache()


def add_row(result, log, name, config, s, mask, flops, entry, base) -> None:
    row = {"candidate": name, "config": config, "s": s, "mask": mask, **entry}
    if "median_s" in entry:
        row["tflops"] = flops / entry["median_s"] / 1e12
        for ref in ("cudnn", "ours"):
            t = base.get(ref, {}).get("median_s")
            row[f"vs_{ref}"] = t / entry["median_s"] if t else None
    result["rows"].append(row)
    log("  " + fmt_row(row))


def fmt_row(row) -> str:
    if "tflops" not in row:
        return f"{row['candidate']:18s} {row['config']:52s} {row['s']:>6d} {row['mask']:6s}  ERROR {str(row.get('error'))[:200]}"
    ratio = lambda x: "-" if x is None else f"{x:.2f}"  # noqa: E731
    return (f"{row['candidate']:18s} {row['config']:52s} {row['s']:>6d} {row['mask']:6s} {row['tflops']:7.0f} "
            f"{ratio(row.get('vs_cudnn')):>9s} {ratio(row.get('vs_ours')):>8s}")


def final_table(result) -> str:
    head = f"{'candidate':18s} {'config':52s} {'S':>6s} {'mask':6s} {'TFLOP/s':>7s} {'vs cuDNN':>9s} {'vs ours':>8s}"
    rows = sorted(result["rows"], key=lambda r: (r["s"], r["mask"], -r.get("tflops", -1)))
    return "\n".join([head, "-" * len(head)] + [fmt_row(r) for r in rows])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=None, help="folder for tune_triton_fwd.json and .log")
    p.add_argument("--seqs", default="8k,16k,32k", help="sequence lengths (32k is skipped if the budget is spent)")
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=32)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--dtype", choices=["bf16", "fp16"], default="bf16")
    p.add_argument("--only", default="", help="comma-separated candidate names (default: all)")
    p.add_argument("--budget", type=float, default=300.0,
                   help="seconds after which no new shape/candidate is started (the run stays < 6 min)")
    p.add_argument("--workers", type=int, default=max(1, min(15, (os.cpu_count() or 2) - 1)))
    p.add_argument("--compile-timeout", type=float, default=150.0, help="seconds per candidate's AOT compile")
    p.add_argument("--dry", action="store_true", help="no GPU: AOT-compile every candidate for sm_90a and report")
    p.add_argument("--_compile-task", dest="compile_task", default=None, help=argparse.SUPPRESS)
    p.add_argument("--_task-out", dest="task_out", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.compile_task:
        _compile_task(args.compile_task, Path(args.task_out))
        return 0
    import _bench_util as U

    args.seqs = U.parse_list(args.seqs, U.parse_count)
    args.only = U.parse_list(args.only)
    started = time.monotonic()
    log = Log()
    result = {"command": U.command_line(), "args": {k: str(v) for k, v in vars(args).items()},
              "candidates": [asdict(c) | {"config": c.config()} for c in CANDIDATES],
              "small_check": {}, "rows": [], "skipped": []}
    if args.dry:
        cands = [c for c in CANDIDATES if not args.only or c.name in args.only]
        log(f"dry run: AOT-compiling {len(cands)} candidates + ours for sm_90a on the CPU ({args.workers} workers)")
        result["compile"] = compile_all(["ours"] + [c.name for c in cands], workers=args.workers,
                                        timeout=args.compile_timeout, log=log)
        failed = [n for n, r in result["compile"].items() if _compile_ok(r)]
        log(f"done in {time.monotonic() - started:.0f} s; failed: {failed or 'none'}")
    else:
        if not torch.cuda.is_available():
            raise SystemExit("tune_triton_fwd.py needs a CUDA GPU (or --dry for the CPU compile check)")
        try:
            run_gpu(args, log, result, started)
        finally:
            log("\n" + final_table(result))
            log(f"\ntotal {time.monotonic() - started:.0f} s")
    result["seconds"] = time.monotonic() - started
    if args.out is not None:
        U.write_json(args.out / "tune_triton_fwd.json", result)
        (args.out / "tune_triton_fwd.log").write_text("\n".join(log.lines) + "\n")
        print(f"wrote {args.out / 'tune_triton_fwd.json'} and .log", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
