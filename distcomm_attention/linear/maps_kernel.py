"""The state-only Triton pass of the gated delta rule's open segments (Note [Open segments in two passes]): the
map (A, B) of a run.

    delta_maps(k, w, u, g, cu_seqlens=None) -> (A, B)

        k        (B, T, H, K)      the keys
        w, u     (B, T, HV, K/V)   the WY representation of fla's forward (``chunk_gated_delta_rule_fwd_intra``)
        g        (B, T, HV)        float32, the chunk-local cumulative log decay in log2 units (fla's layout)
        A, B     (N, HV, K, K), (N, HV, K, V) float32: the end state is A S_in + B

fla's state pass (``chunk_gated_delta_rule_fwd_h``) run twice, from I with zero values (A) and from zero with
the values u (B), computes the same columns but also writes every chunk's state and new values, which the
map does not need, and needs the zero values and the identity materialised. Here one launch runs both column
groups: programs over the V columns of B and the K columns of A, the state kept in float32 and rounded to the
inputs' dtype for its products exactly as fla's pass rounds it, nothing stored but the end state. fla-core's
own summary kernel (``fla/ops/cp``) composes A as K x K products in float32, four times the work of these
columns (docs/bench: 2.40 ms against a 1.99 ms forward at 16k tokens on one H100).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["delta_maps", "CHUNK", "MAX_K"]

CHUNK = 64
MAX_K = 128  # one [K, BV] tile of the state per program
# software-pipelined loops only: with Triton 3.6 on an H100 a reverse state pass of this shape compiled with
# num_stages=1 (BV=32, 4 warps) gave an illegal memory access on one input and different values on another,
# every other configuration agreeing; no masking error explains it (cause not found). fla's state passes tune
# over 2-4 stages on Hopper too.
STAGES = (2, 3, 4)


def _tuned(kernel):
    """On CUDA the tile width and launch shape are tuned per shape (``_launch``)."""
    return triton.autotune(
    configs=[triton.Config({"BV": bv}, num_warps=warps, num_stages=stages)
             for bv in (32, 64) for warps in (2, 4) for stages in STAGES],
    key=["H", "HV", "K", "V", "BK"],
)(kernel)


def _launch(kernel, tuned, grid, args, meta, on_cuda: bool):
    """The tuned kernel on CUDA; the interpreter (CPU) runs one configuration."""
    if on_cuda:
        tuned[grid](*args, **meta)
    else:
        kernel[grid](*args, BV=32, **meta)


@triton.jit
def _sequence(i_nh, cu_seqlens, T, HV: tl.constexpr, IS_VARLEN: tl.constexpr):
    """(value head, first token, length) of the program's (sequence, value head) ``i_nh``."""
    i_n = i_nh // HV
    if IS_VARLEN:
        bos = tl.load(cu_seqlens + i_n).to(tl.int64)
        T = (tl.load(cu_seqlens + i_n + 1).to(tl.int64) - bos).to(tl.int32)
    else:
        bos = i_n * T
    return i_nh % HV, bos, T


@triton.jit(do_not_specialize=["T"])
def _maps_kernel(k, w, u, g, out, cu_seqlens, T, H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr,
                 V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, IS_VARLEN: tl.constexpr):
    i_nh, i_c = tl.program_id(0).to(tl.int64), tl.program_id(1)
    i_h, bos, T = _sequence(i_nh, cu_seqlens, T, HV, IS_VARLEN)
    nv = tl.cdiv(V, BV)
    is_b = i_c < nv  # this program's columns: B's (values u, zero start) or A's (zero values, start I)
    o_k = tl.arange(0, BK)
    m_k = o_k < K
    o_c = tl.where(is_b, i_c, i_c - nv) * BV + tl.arange(0, BV)
    m_c = o_c < tl.where(is_b, V, K)
    b_h = tl.where((~is_b) & (o_k[:, None] == o_c[None, :]), 1.0, 0.0).to(tl.float32)

    k += (bos * H + i_h // (HV // H)) * K
    w += (bos * HV + i_h) * K
    u += (bos * HV + i_h) * V
    g += bos * HV + i_h
    m_u = m_c & (i_c + 0 * o_c < nv)  # B's columns read values, A's are zero
    for i_t in range(tl.cdiv(T, BT)):
        o_t = (i_t * BT + tl.arange(0, BT)).to(tl.int64)  # row offsets reach T * HV * V
        m_t = o_t < T
        b_w = tl.load(w + o_t[:, None] * (HV * K) + o_k[None, :], mask=m_t[:, None] & m_k[None, :], other=0.0)
        b_v = tl.load(u + o_t[:, None] * (HV * V) + o_c[None, :], mask=m_t[:, None] & m_u[None, :], other=0.0)
        b_v = b_v.to(tl.float32) - tl.dot(b_w, b_h.to(b_w.dtype))
        last = tl.minimum((i_t + 1) * BT, T) - 1
        b_g_last = tl.load(g + last * HV).to(tl.float32)
        b_g = tl.load(g + o_t * HV, mask=m_t, other=0.0).to(tl.float32)
        b_v = b_v * tl.where(m_t, tl.exp2(b_g_last - b_g), 0.0)[:, None]
        b_h *= tl.exp2(b_g_last)
        b_k = tl.load(k + o_k[:, None] + o_t[None, :] * (H * K), mask=m_k[:, None] & m_t[None, :], other=0.0)
        b_h = tl.dot(b_k, b_v.to(b_k.dtype), b_h)

    col = tl.where(is_b, o_c, V + o_c)
    tl.store(out + i_nh * K * (V + K) + o_k[:, None] * (V + K) + col[None, :], b_h,
             mask=m_k[:, None] & m_c[None, :])


_maps_tuned = _tuned(_maps_kernel)




def delta_maps(k: torch.Tensor, w: torch.Tensor, u: torch.Tensor, g: torch.Tensor,
               cu_seqlens: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(A, B) of each sequence (the module's docstring); ``cu_seqlens`` on k's device, B = 1 with it."""
    b, t, heads, dk = k.shape
    hv, dv = u.shape[2], u.shape[3]
    if dk > MAX_K:
        raise ValueError(f"delta_maps: key dim {dk} > {MAX_K} (one state tile per program)")
    k, w, u, g = k.contiguous(), w.contiguous(), u.contiguous(), g.float().contiguous()
    n = b if cu_seqlens is None else len(cu_seqlens) - 1
    out = torch.empty(n, hv, dk, dv + dk, dtype=torch.float32, device=k.device)
    bk = max(16, triton.next_power_of_2(dk))

    def grid(meta):
        return n * hv, triton.cdiv(dv, meta["BV"]) + triton.cdiv(dk, meta["BV"])

    args = (k, w, u, g, out, cu_seqlens, t)
    meta = dict(H=heads, HV=hv, K=dk, V=dv, BT=CHUNK, BK=bk, IS_VARLEN=cu_seqlens is not None)
    _launch(_maps_kernel, _maps_tuned, grid, args, meta, k.is_cuda)
    return out[..., dv:], out[..., :dv]
