"""Plain-PyTorch block kernels: exact, any device, any float dtype (the CPU path and the exact CUDA path).

The math runs in float32, or float64 for float64 input, whatever the input dtype. GQA is a grouped matmul:
q (B, Sq, H, D) is viewed as (B, Hkv, G, Sq, D) with G = H // Hkv, so query head h = kv * G + g meets kv
head kv without copying K/V. Each block materialises its (Sq, Sk) score matrix: meant for correctness and
small shards, not for long sequences on GPU (use the Triton backend there).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from distcomm_attention.planning.visibility import BlockMask

__all__ = ["TorchForward", "TorchBackward", "TorchState"]


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """float64 for float64 input, float32 for everything else."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _grouped(x: torch.Tensor, kv_heads: int, dtype: torch.dtype) -> torch.Tensor:
    """(B, S, H, D) -> (B, Hkv, G, S, D) in ``dtype`` (a view when no cast is needed)."""
    b, s, h, d = x.shape
    return x.to(dtype).view(b, s, kv_heads, h // kv_heads, d).permute(0, 2, 3, 1, 4)


def _kv(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """(B, S, Hkv, D) -> (B, Hkv, 1, S, D), broadcasting over the query heads of each group."""
    return x.to(dtype).permute(0, 2, 1, 3).unsqueeze(2)


def _element_mask(mask: BlockMask, key_mask: torch.Tensor | None, sq: int, sk: int, device) -> torch.Tensor | None:
    """The block's visibility as a bool tensor broadcastable to (B, Hkv, G, Sq, Sk), or None when all visible."""
    visible = None
    if mask.mode == "causal":
        visible = torch.ones(sq, sk, dtype=torch.bool, device=device).tril_()
    elif mask.mode == "interval":
        j = torch.arange(sk, device=device)
        lo, hi = mask.row_lo.to(device).long(), mask.row_hi.to(device).long()
        visible = (lo[:, None] <= j) & (j < hi[:, None])
    elif mask.mode != "full":
        raise ValueError(f"unknown BlockMask mode {mask.mode!r}")
    if key_mask is not None:
        keys = key_mask.to(device=device, dtype=torch.bool)[:, None, None, None, :]  # (B, 1, 1, 1, Sk)
        visible = keys if visible is None else visible & keys
    return visible


def _scores(q: torch.Tensor, k: torch.Tensor, scale: float, softcap: float, visible: torch.Tensor | None):
    """Scaled (and soft-capped) scores (B, Hkv, G, Sq, Sk), -inf where not visible; and tanh of the capped
    scores (for the backward), or None without a softcap."""
    s = torch.matmul(q, k.transpose(-1, -2)) * scale
    tanh = None
    if softcap:
        tanh = torch.tanh(s / softcap)
        s = tanh * softcap
    if visible is not None:
        s = s.masked_fill(~visible, float("-inf"))
    return s, tanh


@dataclass
class TorchState:
    """Running softmax state of one rank's queries: acc (B, H, Sq, D) unnormalised, m and l (B, H, Sq)."""

    acc: torch.Tensor
    m: torch.Tensor
    l: torch.Tensor  # noqa: E741 (the flash-attention name)


class TorchForward:
    """ForwardKernel in plain PyTorch (online softmax over blocks, state in fp32 / fp64)."""

    @staticmethod
    def supports_head_dim(head_dim: int) -> bool:
        return head_dim >= 1

    def init_state(self, q: torch.Tensor) -> TorchState:
        b, s, h, d = q.shape
        dt = compute_dtype(q.dtype)
        return TorchState(
            acc=torch.zeros(b, h, s, d, dtype=dt, device=q.device),
            m=torch.full((b, h, s), float("-inf"), dtype=dt, device=q.device),
            l=torch.zeros(b, h, s, dtype=dt, device=q.device),
        )

    def step(
        self,
        state: TorchState,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        mask: BlockMask,
        scale: float,
        softcap: float = 0.0,
        key_mask: torch.Tensor | None = None,
        q_slice: slice = slice(None),
        final: bool = False,
    ) -> None:
        """Accumulate q[:, q_slice] over (k, v) into the state rows q_slice (``final`` changes nothing here).

        ``mask``: the block's visibility (see distcomm_attention.planning.visibility); ``key_mask``: bool (B, Sk),
        True = attend; ``softcap``: scores = softcap * tanh(scores / softcap) when > 0.
        """
        q = q[:, q_slice]
        if q.shape[1] == 0 or k.shape[1] == 0:
            return
        kv_heads = k.shape[2]
        dt = state.acc.dtype
        visible = _element_mask(mask, key_mask, q.shape[1], k.shape[1], q.device)
        s, _ = _scores(_grouped(q, kv_heads, dt), _kv(k, dt), scale, softcap, visible)
        # Views of the state rows this step updates, split into (B, Hkv, G, Sq[, D]).
        acc = state.acc[:, :, q_slice].unflatten(1, (kv_heads, -1))
        m = state.m[:, :, q_slice].unflatten(1, (kv_heads, -1))
        l = state.l[:, :, q_slice].unflatten(1, (kv_heads, -1))  # noqa: E741
        m_new = torch.maximum(m, s.amax(dim=-1))
        # A row with no visible key so far keeps m = -inf; shifting by 0 instead keeps exp() free of NaN.
        shift = m_new.masked_fill(m_new == float("-inf"), 0.0)
        p = torch.exp(s - shift.unsqueeze(-1))
        alpha = torch.exp(m - shift)
        l.mul_(alpha).add_(p.sum(dim=-1))
        acc.mul_(alpha.unsqueeze(-1)).add_(torch.matmul(p, _kv(v, dt)))
        m.copy_(m_new)

    def finalize(self, state: TorchState, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """-> out (B, Sq, H, D) in ``dtype`` and lse (B, H, Sq) in the state dtype (fp32; fp64 for fp64).

        Rows that saw no key (l == 0): out 0, lse -inf. A NaN score makes l NaN, so its row gives NaN out and lse
        (never the no-key case)."""
        empty = state.l == 0
        out = torch.where(empty.unsqueeze(-1), 0.0, state.acc / state.l.unsqueeze(-1))
        lse = torch.where(empty, float("-inf"), state.m + torch.log(state.l))
        return out.transpose(1, 2).to(dtype).contiguous(), lse


class TorchBackward:
    """BackwardKernel in plain PyTorch: the FlashAttention-2 backward of one block.

    P = exp(S - lse) with the global lse, D = rowsum(dout * out) with the global out, then
    dV = P^T dout, dP = dout V^T, dS = P (dP - D), dQ = scale dS K, dK = scale dS^T Q, with dK and dV summed
    over the query heads of each kv head (GQA).
    """

    @staticmethod
    def supports_head_dim(head_dim: int) -> bool:
        return head_dim >= 1

    def step(
        self,
        dout: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        out: torch.Tensor,
        lse: torch.Tensor,
        delta: torch.Tensor,
        *,
        mask: BlockMask,
        scale: float,
        softcap: float = 0.0,
        key_mask: torch.Tensor | None = None,
        dq_acc: torch.Tensor | None = None,
        dkv_dtype: torch.dtype | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """dout, q, out: (B, Sq, H, D); lse, delta: (B, H, Sq) (global: delta = rowsum(dout * out));
        k, v: (B, Sk, Hkv, D). ``dq_acc``: a (B, Sq, H, D) buffer the block's dq is added into (and
        returned); ``dkv_dtype``: dtype of the returned dk, dv (default: the compute dtype)."""
        b, sq, h, d = q.shape
        kv_heads = k.shape[2]
        dt = compute_dtype(q.dtype)
        qg, dog = _grouped(q, kv_heads, dt), _grouped(dout, kv_heads, dt)
        kg, vg = _kv(k, dt), _kv(v, dt)
        lse = lse.to(dt).unflatten(1, (kv_heads, -1))
        # Rows that saw no key (lse = -inf) have P = 0: shift them by +inf rather than computing inf - inf.
        lse = lse.masked_fill(lse == float("-inf"), float("inf"))
        visible = _element_mask(mask, key_mask, sq, k.shape[1], q.device)
        s, tanh = _scores(qg, kg, scale, softcap, visible)
        p = torch.exp(s - lse.unsqueeze(-1))
        delta = delta.to(dt).unflatten(1, (kv_heads, -1)).unsqueeze(-1)
        ds = p * (torch.matmul(dog, vg.transpose(-1, -2)) - delta)
        if tanh is not None:
            ds = ds * (1 - tanh * tanh)  # d(c tanh(x / c)) / dx
        dq = torch.matmul(ds, kg) * scale  # (B, Hkv, G, Sq, D)
        dk = torch.matmul(ds.transpose(-1, -2), qg).sum(dim=2) * scale  # (B, Hkv, Sk, D)
        dv = torch.matmul(p.transpose(-1, -2), dog).sum(dim=2)
        dq = dq.permute(0, 3, 1, 2, 4).reshape(b, sq, h, d)
        if dq_acc is not None:
            dq = dq_acc.add_(dq)
        dk, dv = dk.transpose(1, 2), dv.transpose(1, 2)
        if dkv_dtype is not None:
            dk, dv = dk.to(dkv_dtype), dv.to(dkv_dtype)
        return dq, dk, dv
