"""Two state-only Triton passes for the gated delta rule's open segments (Note [Open segments in two passes]):
the map (A, B) of a run, and the part of the reverse state pass that its end-state gradient adds.

    delta_maps(k, w, u, g, cu_seqlens=None) -> (A, B)
    delta_end_state_grad(k, w, g, dht, dh, dv, cu_seqlens=None, chunk_offsets=None)   dh, dv added to in place

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

fla's reverse state pass (``chunk_gated_delta_rule_bwd_dhu``) is linear in its end-state gradient dht: run with
dht = None it gives dS_in (the gradient of the outputs alone with respect to the incoming state) and the
gradients of the chunks' states and new values without dht's part; ``delta_end_state_grad`` adds that part
once dht is known, by the same recurrence with no output gradient (two products per chunk where fla's pass has
three), so the segment's backward runs fla's pass once instead of a separate pass for dS_in.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["delta_maps", "delta_end_state_grad", "CHUNK", "MAX_K"]

CHUNK = 64
MAX_K = 128  # one [K, BV] tile of the state per program
# software-pipelined loops only: with Triton 3.6 on an H100 the reverse pass compiled with num_stages=1
# (BV=32, 4 warps) gave an illegal memory access on one input and different values on another, every other
# configuration agreeing; no masking error explains it (cause not found). fla's state passes tune over 2-4
# stages on Hopper too.
STAGES = (2, 3, 4)


def _tuned(kernel, restore: tuple[str, ...] = ()):
    """On CUDA the tile width and launch shape are tuned per shape (``_launch``); ``restore``: the arguments the
    kernel adds into, restored before each configuration tried."""
    return triton.autotune(
        configs=[triton.Config({"BV": bv}, num_warps=warps, num_stages=stages)
                 for bv in (32, 64) for warps in (2, 4) for stages in STAGES],
        key=["H", "HV", "K", "V", "BK"],
        restore_value=list(restore) or None,
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
def _end_grad_kernel(k, w, g, dht, dh, dv, cu_seqlens, chunk_offsets, T, H: tl.constexpr, HV: tl.constexpr,
                     K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                     IS_VARLEN: tl.constexpr):
    i_nh, i_v = tl.program_id(0).to(tl.int64), tl.program_id(1)
    i_h, bos, T = _sequence(i_nh, cu_seqlens, T, HV, IS_VARLEN)
    nt = tl.cdiv(T, BT)
    if IS_VARLEN:
        boh = tl.load(chunk_offsets + i_nh // HV).to(tl.int64)
    else:
        boh = (i_nh // HV) * nt
    o_k = tl.arange(0, BK)
    m_k = o_k < K
    o_v = i_v * BV + tl.arange(0, BV)
    m_v = o_v < V
    m_kv = m_k[:, None] & m_v[None, :]
    b_dh = tl.load(dht + i_nh * K * V + o_k[:, None] * V + o_v[None, :], mask=m_kv, other=0.0).to(tl.float32)

    k += (bos * H + i_h // (HV // H)) * K
    w += (bos * HV + i_h) * K
    dv += (bos * HV + i_h) * V
    g += bos * HV + i_h
    dh += ((boh + nt - 1) * HV + i_h) * K * V  # the last chunk's (int64: the offsets reach NT * HV * K * V)
    # what each chunk adds to is read one chunk ahead (these loads feed no product, so the compiler's pipelining
    # leaves them in line: their latency would be paid twice a chunk)
    p_dh = dh + o_k[:, None] * V + o_v[None, :]
    o_t = ((nt - 1) * BT + tl.arange(0, BT)).to(tl.int64)  # row offsets reach T * HV * V
    m_tv = (o_t < T)[:, None] & m_v[None, :]
    b_old = tl.load(p_dh, mask=m_kv, other=0.0).to(tl.float32)
    b_dv_old = tl.load(dv + o_t[:, None] * (HV * V) + o_v[None, :], mask=m_tv, other=0.0).to(tl.float32)
    b_g_last = tl.load(g + (T - 1) * HV).to(tl.float32)
    b_g = tl.load(g + o_t * HV, mask=o_t < T, other=0.0).to(tl.float32)
    for i_t in range(nt - 1, -1, -1):
        o_t = (i_t * BT + tl.arange(0, BT)).to(tl.int64)
        m_t = o_t < T
        # the state after chunk i_t: its gradient gains b_dh
        tl.store(p_dh, (b_old + b_dh).to(p_dh.dtype.element_ty), mask=m_kv)
        m_tk = m_t[:, None] & m_k[None, :]
        b_k = tl.load(k + o_t[:, None] * (H * K) + o_k[None, :], mask=m_tk, other=0.0)
        b_w = tl.load(w + o_t[:, None] * (HV * K) + o_k[None, :], mask=m_tk, other=0.0)
        # the chunk's new values' gradient gains what flows back through the state (fla's dhu without do)
        b_dv = tl.dot(b_k, b_dh.to(b_k.dtype)) * tl.where(m_t, tl.exp2(b_g_last - b_g), 0.0)[:, None]
        p_dv = dv + o_t[:, None] * (HV * V) + o_v[None, :]
        tl.store(p_dv, (b_dv_old + b_dv).to(p_dv.dtype.element_ty), mask=m_t[:, None] & m_v[None, :])
        decay = tl.exp2(b_g_last)
        # the chunk before's (none before the first)
        more = i_t > 0
        p_dh -= HV * K * V
        b_old = tl.load(p_dh, mask=m_kv & more, other=0.0).to(tl.float32)
        o_p = o_t - BT
        m_p = (o_p >= 0) & more
        b_dv_old = tl.load(dv + o_p[:, None] * (HV * V) + o_v[None, :], mask=m_p[:, None] & m_v[None, :],
                           other=0.0).to(tl.float32)
        b_g_last = tl.load(g + (i_t * BT - 1) * HV, mask=more, other=0.0).to(tl.float32)
        b_g = tl.load(g + o_p * HV, mask=m_p, other=0.0).to(tl.float32)
        b_dh = b_dh * decay - tl.dot(tl.trans(b_w), b_dv.to(b_w.dtype))


_end_grad_tuned = _tuned(_end_grad_kernel, restore=("dh", "dv"))


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


def delta_end_state_grad(k: torch.Tensor, w: torch.Tensor, g: torch.Tensor, dht: torch.Tensor, dh: torch.Tensor,
                         dv: torch.Tensor, cu_seqlens: torch.Tensor | None = None,
                         chunk_offsets: torch.Tensor | None = None) -> None:
    """Add the end-state gradient ``dht`` (N, HV, K, V) to fla's reverse state pass's outputs in place: ``dh``
    (B, NT, HV, K, V), the gradient of the state after each chunk, and ``dv`` (B, T, HV, V), the chunks' new
    values' gradient, as ``chunk_gated_delta_rule_bwd_dhu`` run with ``dht=None`` left them (Note [Open segments
    in two passes]: the pass is linear in its end-state gradient). k (B, T, H, K); w, g as ``delta_maps``;
    ``chunk_offsets`` (N,) the first chunk of each of ``cu_seqlens``' sequences (fla's
    ``prepare_chunk_offsets``), made here where not given."""
    b, t, heads, dk = k.shape
    hv, dvd = dv.shape[2], dv.shape[3]
    if dk > MAX_K:
        raise ValueError(f"delta_end_state_grad: key dim {dk} > {MAX_K} (one state tile per program)")
    if not (dh.is_contiguous() and dv.is_contiguous()):
        raise ValueError("delta_end_state_grad: dh and dv are added to in place and must be contiguous")
    k, w, g, dht = k.contiguous(), w.contiguous(), g.float().contiguous(), dht.float().contiguous()
    n = b if cu_seqlens is None else len(cu_seqlens) - 1
    if cu_seqlens is not None and chunk_offsets is None:
        counts = (cu_seqlens[1:] - cu_seqlens[:-1] + CHUNK - 1).div(CHUNK, rounding_mode="floor")
        chunk_offsets = torch.cat([counts.new_zeros(1), counts.cumsum(0)[:-1]])
    args = (k, w, g, dht, dh, dv, cu_seqlens, chunk_offsets, t)
    meta = dict(H=heads, HV=hv, K=dk, V=dvd, BT=CHUNK, BK=max(16, triton.next_power_of_2(dk)),
                IS_VARLEN=cu_seqlens is not None)
    _launch(_end_grad_kernel, _end_grad_tuned, lambda m: (n * hv, triton.cdiv(dvd, m["BV"])), args, meta,
            k.is_cuda)
