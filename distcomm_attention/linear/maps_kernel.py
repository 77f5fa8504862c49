"""Two state-only Triton passes for the gated delta rule's open segments (Note [Open segments in two passes]):
the map (A, B) of a run, and the gradient of its outputs with respect to its incoming state.

    delta_maps(k, w, u, g, cu_seqlens=None) -> (A, B)
    delta_state_grad(q, k, w, g, do, scale, cu_seqlens=None) -> dS_in   (N, HV, K, V) float32

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
columns (docs/bench: 2.40 ms against a 1.99 ms forward at 16k tokens on one H100). ``delta_state_grad`` is
fla's values' local gradient and reverse state pass without an end-state gradient, fused, storing dS_in alone.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["delta_maps", "delta_state_grad", "CHUNK", "MAX_K"]

CHUNK = 64
MAX_K = 128  # one [K, BV] tile of the state per program
# software-pipelined loops only: with Triton 3.6 on an H100 the reverse pass compiled with num_stages=1
# (BV=32, 4 warps) gave an illegal memory access on one input and different values on another, every other
# configuration agreeing; no masking error explains it (cause not found). fla's state passes tune over 2-4
# stages on Hopper too.
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


@triton.jit(do_not_specialize=["T"])
def _state_grad_kernel(q, k, w, g, do, dvl, out, cu_seqlens, scale, T, H: tl.constexpr, HV: tl.constexpr,
                       K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                       IS_VARLEN: tl.constexpr, HAS_DV: tl.constexpr):
    i_nh, i_v = tl.program_id(0).to(tl.int64), tl.program_id(1)
    i_h, bos, T = _sequence(i_nh, cu_seqlens, T, HV, IS_VARLEN)
    o_k = tl.arange(0, BK)
    m_k = o_k < K
    o_v = i_v * BV + tl.arange(0, BV)
    m_v = o_v < V
    b_dh = tl.zeros([BK, BV], dtype=tl.float32)

    q += (bos * H + i_h // (HV // H)) * K
    k += (bos * H + i_h // (HV // H)) * K
    w += (bos * HV + i_h) * K
    do += (bos * HV + i_h) * V
    dvl += (bos * HV + i_h) * V
    g += bos * HV + i_h
    for i_t in range(tl.cdiv(T, BT) - 1, -1, -1):
        o_t = (i_t * BT + tl.arange(0, BT)).to(tl.int64)  # row offsets reach T * HV * V
        m_t = o_t < T
        m_tk = m_t[:, None] & m_k[None, :]
        b_q = tl.load(q + o_t[:, None] * (H * K) + o_k[None, :], mask=m_tk, other=0.0)
        b_k = tl.load(k + o_t[:, None] * (H * K) + o_k[None, :], mask=m_tk, other=0.0)
        b_w = tl.load(w + o_t[:, None] * (HV * K) + o_k[None, :], mask=m_tk, other=0.0)
        b_do = tl.load(do + o_t[:, None] * (HV * V) + o_v[None, :], mask=m_t[:, None] & m_v[None, :], other=0.0)
        last = tl.minimum((i_t + 1) * BT, T) - 1
        b_g_last = tl.load(g + last * HV).to(tl.float32)
        b_g = tl.load(g + o_t * HV, mask=m_t, other=0.0).to(tl.float32)
        # the values' gradient inside the chunk (fla's chunk_bwd_dv_local: given, or made here), then through the
        # state (its dhu)
        if HAS_DV:
            b_dv = tl.load(dvl + o_t[:, None] * (HV * V) + o_v[None, :], mask=m_t[:, None] & m_v[None, :],
                           other=0.0).to(tl.float32)
        else:
            b_a = tl.dot(b_k, tl.trans(b_q)) * scale * tl.exp2(b_g[None, :] - b_g[:, None])
            b_a = tl.where((o_t[:, None] <= o_t[None, :]) & m_t[:, None] & m_t[None, :], b_a, 0.0)
            b_dv = tl.dot(b_a.to(b_do.dtype), b_do).to(b_do.dtype).to(tl.float32)
        b_dv += tl.dot(b_k, b_dh.to(b_k.dtype)) * tl.where(m_t, tl.exp2(b_g_last - b_g), 0.0)[:, None]
        b_qg = b_q * tl.exp2(b_g)[:, None]  # float32, as fla's reverse pass keeps it
        b_dh = b_dh * tl.exp2(b_g_last) + tl.dot(tl.trans(b_qg), b_do.to(tl.float32)) * scale \
            - tl.dot(tl.trans(b_w), b_dv.to(b_w.dtype))
    tl.store(out + i_nh * K * V + o_k[:, None] * V + o_v[None, :], b_dh, mask=m_k[:, None] & m_v[None, :])


_state_grad_tuned = _tuned(_state_grad_kernel)


def delta_maps(k: torch.Tensor, w: torch.Tensor, u: torch.Tensor, g: torch.Tensor,
               cu_seqlens: torch.Tensor | None = None, config: dict | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(A, B) of each sequence (the module's docstring); ``cu_seqlens`` on k's device, B = 1 with it. ``config``:
    one launch configuration (BV, num_warps, num_stages) instead of the tuned one (benchmarks)."""
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
    if config is not None:
        _maps_kernel[grid({"BV": config["BV"]})](*args, **meta, **config)
    else:
        _launch(_maps_kernel, _maps_tuned, grid, args, meta, k.is_cuda)
    return out[..., dv:], out[..., :dv]


def delta_state_grad(q: torch.Tensor, k: torch.Tensor, w: torch.Tensor, g: torch.Tensor, do: torch.Tensor,
                     scale: float, cu_seqlens: torch.Tensor | None = None,
                     dv_local: torch.Tensor | None = None, config: dict | None = None) -> torch.Tensor:
    """dS_in = (d o / d S_in)^T do of each sequence (N, HV, K, V) float32, by one reverse state-only pass: fla's
    local values' gradient and reverse state pass (``chunk_bwd_dv_local``, ``chunk_gated_delta_rule_bwd_dhu``
    without an end-state gradient) fused, nothing stored but dS_in. q, k (B, T, H, K); w (B, T, HV, K); g as
    ``delta_maps``; do (B, T, HV, V); ``dv_local`` (like do): the local gradient already made (fla's), read
    instead of made. ``config``: one launch configuration (BV, num_warps, num_stages) instead of the tuned one
    (benchmarks)."""
    b, t, heads, dk = k.shape
    hv, dv = do.shape[2], do.shape[3]
    if dk > MAX_K:
        raise ValueError(f"delta_state_grad: key dim {dk} > {MAX_K} (one state tile per program)")
    q, k, w, do, g = q.contiguous(), k.contiguous(), w.contiguous(), do.contiguous(), g.float().contiguous()
    n = b if cu_seqlens is None else len(cu_seqlens) - 1
    out = torch.empty(n, hv, dk, dv, dtype=torch.float32, device=k.device)
    has_dv = dv_local is not None
    args = (q, k, w, g, do, dv_local.contiguous() if has_dv else do, out, cu_seqlens, scale, t)
    meta = dict(H=heads, HV=hv, K=dk, V=dv, BT=CHUNK, BK=max(16, triton.next_power_of_2(dk)),
                IS_VARLEN=cu_seqlens is not None, HAS_DV=has_dv)
    grid = lambda m: (n * hv, triton.cdiv(dv, m["BV"]))  # noqa: E731
    if config is not None:
        _state_grad_kernel[grid({"BV": config["BV"]})](*args, **meta, **config)
    else:
        _launch(_state_grad_kernel, _state_grad_tuned, grid, args, meta, k.is_cuda)
    return out
