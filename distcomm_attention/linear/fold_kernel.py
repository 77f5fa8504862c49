"""The fold over the gathered maps (phase 2 of Note [Linear attention across ranks]) in one Triton launch each
way, for float32 tables on CUDA (``recurrence._Fold``; its loop of batched products stays the reference and
the path elsewhere).

    fold_states(table, steps, na, rows, dk, dv, delta) -> states   (T, R, K, V) float32
    fold_grads(table, steps, na, rows, dk, dv, delta, d_states) -> after   (T, R, K, V) float32

        table     (W, slots, numbers) float32, numbers contiguous: A (R, K, K) for the delta rule, (R,) for a
                  scalar decay, then B (R, K, V); the slot's map takes S to A S + B (R = rows x value heads)
        steps     device int64 (2T,): steps[t] the element offset of step t's map in ``table`` (-1: the state
                  passes step t unchanged), steps[T + t] whether it restarts (1: the state after it is its B
                  alone)
        states[t] the state entering step t (zero entering step 0)
        after[t]  the gradient of the state after step t, given d_states[t], the gradient of states[t]: B_t's
                  gradient, and A_t's contracted with states[t] (``recurrence._Fold.backward``)

Each program carries one [K, BV] tile of the state through every step, in float32, its products as three
TF32 products (``PRECISION``: about T x 2^-22 relative error over T steps). A loop of batched products
costs a host launch per step (tens of microseconds each on a GPU, where the products take a few): this is
one launch for all of them.
"""

from __future__ import annotations

import contextlib

import torch
import triton
import triton.language as tl

__all__ = ["fold_states", "fold_grads", "MAX_K"]

MAX_K = 128  # A's whole K x K tile per program
# float32 products as three TF32 products on the tensor cores (NVIDIA): about 22 bits each, so the relative error
# grows about T x 2^-22 over T steps of near-isometric maps (on an H100, K = V = 128, 32 heads: 5.5e-7 at 16
# steps, 1e-5 at 64, where exact float32 products give 1.2e-6), far below the chunk kernels' own (fla multiplies
# float32 inputs in TF32, 16-bit inputs in 16 bits); 0.10 ms for 16 steps, where "ieee" (no tensor cores) took
# 1.8-8.8 ms and the loop of float32 products 0.20 ms of GPU time and 0.35 ms of host time
PRECISION = "tf32x3"


@triton.jit
def _tile(R: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr):
    """The program's (row, column tile): (row, key offsets, the tile's mask and offsets in one step's states,
    one step's size in 64 bits)."""
    i_r, i_v = tl.program_id(0), tl.program_id(1)
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_kv = (o_k[:, None] < K) & (o_v[None, :] < V)
    return i_r, o_k, m_kv, i_r * K * V + o_k[:, None] * V + o_v[None, :], tl.full([], R * K * V, tl.int64)


@triton.jit
def _fold_kernel(table, steps, states, T, NA: tl.constexpr, R: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                 BK: tl.constexpr, BV: tl.constexpr, DELTA: tl.constexpr, PRECISION: tl.constexpr):
    i_r, o_k, m_kv, p_kv, step = _tile(R, K, V, BK, BV)
    b_h = tl.zeros([BK, BV], dtype=tl.float32)
    for t in range(0, T):
        tl.store(states + t * step + p_kv, b_h, mask=m_kv)
        off = tl.load(steps + t)
        restart = tl.load(steps + T + t)
        if off >= 0:
            b_b = tl.load(table + off + NA + p_kv, mask=m_kv, other=0.0)
            if restart != 0:
                b_h = b_b
            else:
                if DELTA:
                    b_a = tl.load(table + off + i_r * K * K + o_k[:, None] * K + o_k[None, :],
                                  mask=(o_k[:, None] < K) & (o_k[None, :] < K), other=0.0)
                    b_h = tl.dot(b_a, b_h, input_precision=PRECISION) + b_b
                else:
                    b_h = tl.load(table + off + i_r) * b_h + b_b


@triton.jit
def _fold_grad_kernel(table, steps, d_states, after, T, NA: tl.constexpr, R: tl.constexpr, K: tl.constexpr,
                      V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, DELTA: tl.constexpr,
                      PRECISION: tl.constexpr):
    i_r, o_k, m_kv, p_kv, step = _tile(R, K, V, BK, BV)
    b_g = tl.zeros([BK, BV], dtype=tl.float32)  # the gradient of the state after step t
    for i in range(0, T):
        t = T - 1 - i
        off = tl.load(steps + t)
        restart = tl.load(steps + T + t)
        at = t * step + p_kv
        if off >= 0:
            tl.store(after + at, b_g, mask=m_kv)
            if restart != 0:
                b_g = tl.zeros([BK, BV], dtype=tl.float32)
            else:
                if DELTA:  # A^T g
                    b_a = tl.load(table + off + i_r * K * K + o_k[None, :] * K + o_k[:, None],
                                  mask=(o_k[:, None] < K) & (o_k[None, :] < K), other=0.0)
                    b_g = tl.dot(b_a, b_g, input_precision=PRECISION)
                else:
                    b_g = tl.load(table + off + i_r) * b_g
        b_g += tl.load(d_states + at, mask=m_kv, other=0.0)


def _launch(kernel, table, steps, outs, na, rows, dk, dv, delta):
    if delta and dk > MAX_K:
        raise ValueError(f"fold kernel: key dim {dk} > {MAX_K} (A's tile per program)")
    if table.dtype != torch.float32 or table.stride(-1) != 1:
        raise ValueError("fold kernel: a float32 table with contiguous numbers")
    bk = max(16, triton.next_power_of_2(dk))
    bv = min(32, max(16, triton.next_power_of_2(dv)))
    t = steps.shape[0] // 2
    with torch.cuda.device(table.device) if table.is_cuda else contextlib.nullcontext():  # the table's GPU
        kernel[(rows, triton.cdiv(dv, bv))](table, steps, *outs, t, NA=na, R=rows, K=dk, V=dv, BK=bk, BV=bv,
                                            DELTA=delta, PRECISION=PRECISION, num_warps=8 if bk >= 128 else 4)


def fold_states(table: torch.Tensor, steps: torch.Tensor, na: int, rows: int, dk: int, dv: int,
                delta: bool) -> torch.Tensor:
    """The state entering every step (the module's docstring)."""
    states = torch.empty(steps.shape[0] // 2, rows, dk, dv, dtype=torch.float32, device=table.device)
    _launch(_fold_kernel, table, steps, (states,), na, rows, dk, dv, delta)
    return states


def fold_grads(table: torch.Tensor, steps: torch.Tensor, na: int, rows: int, dk: int, dv: int, delta: bool,
               d_states: torch.Tensor) -> torch.Tensor:
    """The gradient of the state after every folded step (the module's docstring; rows of steps that fold
    nothing are left unwritten)."""
    after = torch.empty_like(d_states)
    _launch(_fold_grad_kernel, table, steps, (d_states.contiguous(), after), na, rows, dk, dv, delta)
    return after
