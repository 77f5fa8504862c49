"""The scalar-decay correction of an open segment's outputs by the incoming state, fused (Triton, CUDA).

    o[b, t, h] = o0[b, t, h] + w[b, t, h] * (q[b, t, h // G] @ S[b, h])

        o0   (B, T, HV, V)  16-bit, the outputs from a zero state     q  (B, T, H, K), G = HV / H
        w    (B, T, HV)     float32, scale * exp(cumulative log decay)  S  (B, HV, K, V) float32, rounded to
                            o0's dtype for the product (as fla rounds its chunk states), float32 accumulation,
                            one rounding of the sum

``ScalarCorrection.apply(o0, q, w, S)`` is differentiable in all four. Forward: one pass over o0 (PyTorch's
matmul then scaled add wrote and re-read a tensor of o0's size, in bf16). Backward: one kernel per value
head and token tile gives dw (the product recomputed, summed in float32) and w * dout; per key head one
matrix product of that with S gives dq, one with q gives dS. K and V up to 128 (one tile each).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch.autograd.function import once_differentiable

__all__ = ["ScalarCorrection"]

BT = 64
MAX_DIM = 128  # K and V: one tile each


@triton.jit
def _tile(q, s, w, T, H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr,
          BK: tl.constexpr, BV: tl.constexpr):
    """The program's (batch row and value head, token tile): (flat token rows, their mask, the outputs' offsets
    and mask, w of the rows, q @ S in float32)."""
    i_bh, i_t = tl.program_id(0).to(tl.int64), tl.program_id(1)
    i_b, i_h = i_bh // HV, i_bh % HV
    o_t = (i_t * BT + tl.arange(0, BT)).to(tl.int64)
    m_t = o_t < T
    o_k, o_v = tl.arange(0, BK), tl.arange(0, BV)
    m_k, m_v = o_k < K, o_v < V
    rows = i_b * T + o_t
    b_q = tl.load(q + (rows[:, None] * H + i_h // (HV // H)) * K + o_k[None, :], mask=m_t[:, None] & m_k[None, :],
                  other=0.0)
    b_s = tl.load(s + i_bh * K * V + o_k[:, None] * V + o_v[None, :], mask=m_k[:, None] & m_v[None, :], other=0.0)
    b_qs = tl.dot(b_q, b_s.to(b_q.dtype))
    b_w = tl.load(w + rows * HV + i_h, mask=m_t, other=0.0)
    return rows * HV + i_h, m_t, (rows[:, None] * HV + i_h) * V + o_v[None, :], m_t[:, None] & m_v[None, :], b_w, b_qs


@triton.jit
def _fwd_kernel(o0, q, w, s, o, T, H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr):
    _, _, p, m_o, b_w, b_qs = _tile(q, s, w, T, H, HV, K, V, BT, BK, BV)
    b_o = tl.load(o0 + p, mask=m_o, other=0.0).to(tl.float32) + b_w[:, None] * b_qs
    tl.store(o + p, b_o.to(o.dtype.element_ty), mask=m_o)


@triton.jit
def _bwd_kernel(do, q, w, s, dw, dwo, T, H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr):
    # per (batch row and value head, token tile): dw = sum_v dout * (q @ S) in float32, and w * dout
    p_w, m_t, p, m_o, b_w, b_qs = _tile(q, s, w, T, H, HV, K, V, BT, BK, BV)
    b_do = tl.load(do + p, mask=m_o, other=0.0).to(tl.float32)
    tl.store(dw + p_w, tl.sum(b_do * b_qs, axis=1), mask=m_t)
    tl.store(dwo + p, (b_do * b_w[:, None]).to(dwo.dtype.element_ty), mask=m_o)


def _blocks(k: int, v: int) -> tuple[int, int]:
    return max(16, triton.next_power_of_2(k)), max(16, triton.next_power_of_2(v))


class ScalarCorrection(torch.autograd.Function):
    """o0 + w * (q @ S) per value head (the module's docstring); CUDA, or CPU under TRITON_INTERPRET=1."""

    @staticmethod
    def forward(ctx, o0, q, w, s):
        b, t, hv, v = o0.shape
        heads, k = q.shape[2], q.shape[3]
        if hv % heads or s.shape != (b, hv, k, v) or w.shape != (b, t, hv) or q.shape[:2] != (b, t) \
                or max(k, v) > MAX_DIM:
            raise ValueError(f"ScalarCorrection: shapes o0 {tuple(o0.shape)}, q {tuple(q.shape)}, w "
                             f"{tuple(w.shape)}, S {tuple(s.shape)} do not fit (B, T, HV, V), (B, T, H, K), "
                             f"(B, T, HV), (B, HV, K, V) with HV a multiple of H, K and V at most {MAX_DIM}")
        o0, q, w = o0.contiguous(), q.contiguous(), w.float().contiguous()
        s = s.to(o0.dtype).contiguous()  # rounded as fla rounds its chunk states for the output product
        o = torch.empty_like(o0)
        bk, bv = _blocks(k, v)
        _fwd_kernel[(b * hv, triton.cdiv(t, BT))](o0, q, w, s, o, t, H=heads, HV=hv, K=k, V=v, BT=BT, BK=bk, BV=bv)
        ctx.save_for_backward(q, w, s)
        return o

    @staticmethod
    @once_differentiable
    def backward(ctx, do):
        q, w, s = ctx.saved_tensors
        b, t, heads, k = q.shape
        hv, v = s.shape[1], s.shape[3]
        groups = hv // heads
        do = do.contiguous()
        dw = torch.empty_like(w)
        dwo = torch.empty_like(do)  # w * dout, the gradient of q @ S
        bk, bv = _blocks(k, v)
        _bwd_kernel[(b * hv, triton.cdiv(t, BT))](do, q, w, s, dw, dwo, t, H=heads, HV=hv, K=k, V=v, BT=BT, BK=bk,
                                                  BV=bv)
        # per key head, one product over its value heads for dq and one over the tokens for dS
        dwo_k = dwo.view(b, t, heads, groups * v).transpose(1, 2)  # (B, H, T, G V)
        s_k = s.view(b, heads, groups, k, v).transpose(2, 3).reshape(b, heads, k, groups * v)  # (B, H, K, G V)
        dq = torch.matmul(dwo_k, s_k.transpose(2, 3)).transpose(1, 2) if ctx.needs_input_grad[1] else None
        ds = None
        if ctx.needs_input_grad[3]:
            ds = torch.matmul(q.transpose(1, 2).transpose(2, 3), dwo_k)  # (B, H, K, G V)
            ds = ds.view(b, heads, k, groups, v).transpose(2, 3).reshape(b, hv, k, v).float()
        return do, dq, dw, ds
