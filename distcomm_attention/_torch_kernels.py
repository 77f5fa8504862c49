"""Plain-PyTorch block kernels: exact, any device, any float dtype (the CPU path and the exact CUDA path).

The math runs in float32, or float64 for float64 input, whatever the input dtype. GQA is a grouped matmul:
q (B, Sq, H, D) is viewed as (B, Hkv, G, Sq, D) with G = H // Hkv, so query head h = kv * G + g meets kv
head kv without copying K/V. Each block materialises its (Sq, Sk) score matrix: meant for correctness and
small shards, not for long sequences on GPU (use the Triton backend there).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

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


def _scores(q: torch.Tensor, k: torch.Tensor, scale: float, causal: bool) -> torch.Tensor:
    """Scaled scores (B, Hkv, G, Sq, Sk), -inf above the top-left diagonal when causal."""
    s = torch.matmul(q, k.transpose(-1, -2)) * scale
    if causal:
        sq, sk = s.shape[-2], s.shape[-1]
        hidden = torch.ones(sq, sk, dtype=torch.bool, device=s.device).triu_(1)
        s = s.masked_fill(hidden, float("-inf"))
    return s


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
        causal: bool,
        scale: float,
        q_slice: slice = slice(None),
        final: bool = False,
    ) -> None:
        """Accumulate q[:, q_slice] over (k, v) into the state rows q_slice (``final`` changes nothing here)."""
        q = q[:, q_slice]
        if q.shape[1] == 0 or k.shape[1] == 0:
            return
        kv_heads = k.shape[2]
        dt = state.acc.dtype
        s = _scores(_grouped(q, kv_heads, dt), _kv(k, dt), scale, causal)
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
        """-> out (B, Sq, H, D) in ``dtype`` and lse (B, H, Sq) in the state dtype (fp32; fp64 for fp64)."""
        seen = state.l > 0
        out = torch.where(seen.unsqueeze(-1), state.acc / state.l.unsqueeze(-1), 0.0)
        lse = torch.where(seen, state.m + torch.log(state.l), float("-inf"))
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
        *,
        causal: bool,
        scale: float,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        b, sq, h, d = q.shape
        kv_heads = k.shape[2]
        dt = compute_dtype(q.dtype)
        qg, dog = _grouped(q, kv_heads, dt), _grouped(dout, kv_heads, dt)
        kg, vg = _kv(k, dt), _kv(v, dt)
        lse = lse.to(dt).unflatten(1, (kv_heads, -1))
        # Rows that saw no key (lse = -inf) have P = 0: shift them by +inf rather than computing inf - inf.
        lse = lse.masked_fill(lse == float("-inf"), float("inf"))
        p = torch.exp(_scores(qg, kg, scale, causal) - lse.unsqueeze(-1))
        delta = (dog * _grouped(out, kv_heads, dt)).sum(dim=-1, keepdim=True)
        ds = p * (torch.matmul(dog, vg.transpose(-1, -2)) - delta)
        dq = torch.matmul(ds, kg) * scale  # (B, Hkv, G, Sq, D)
        dk = torch.matmul(ds.transpose(-1, -2), qg).sum(dim=2) * scale  # (B, Hkv, Sk, D)
        dv = torch.matmul(p.transpose(-1, -2), dog).sum(dim=2)
        dq = dq.permute(0, 3, 1, 2, 4).reshape(b, sq, h, d)
        return dq, dk.transpose(1, 2), dv.transpose(1, 2)
