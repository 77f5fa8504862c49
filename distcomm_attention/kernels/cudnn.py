"""Block backend "cudnn": PyTorch's cuDNN attention ops as ring block kernels.

    forward   torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, attn_bias, compute_log_sumexp,
                  dropout_p, is_causal, return_debug_mask, *, scale)
                  -> (out, logsumexp, cum_seq_q, cum_seq_k, max_q, max_k, philox_seed, philox_offset, debug)
    backward  torch.ops.aten._scaled_dot_product_cudnn_attention_backward(grad_out, q, k, v, out, logsumexp,
                  philox_seed, philox_offset, attn_bias, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p,
                  is_causal, *, scale) -> (dq, dk, dv)

Both take (B, H, S, D) views (our (B, S, H, D) tensors transposed, no copy); logsumexp is float32, natural
log, (B, H, Sq, 1) (torch >= 2.11; a (B, H, Sq) result is accepted too). The backward takes any out and
logsumexp, so it runs from the ring's merged ones (Note [Merging block outputs] in
distcomm_attention.kernels.contract). Features: plain full or causal blocks (causal top-left, square blocks only,
as the ring planner issues them), CUDA fp16/bf16, head_dim a multiple of 8 up to 128, sm80+ with cuDNN 9.
GQA: kv heads are expanded to the query heads for the call (one copy) and dK/dV summed back over each
group in fp32. Nothing to import: the ops ship with every CUDA build of torch that has cuDNN.
"""

from __future__ import annotations

import torch
from torch import Tensor

from distcomm_attention.kernels.contract import BlockBackward, BlockForward, call_features
from distcomm_attention.planning.visibility import Visibility

__all__ = ["CudnnForward", "CudnnBackward", "can_use", "unsupported_feature"]

_HALF = (torch.float16, torch.bfloat16)
_MIN_CUDNN = 90000  # cuDNN 9.0: the fused flash attention graphs torch's cuDNN SDPA builds
_MAX_HEAD_DIM = 128
# The rank of the logsumexp the forward op returns in this torch ((B, H, Sq, 1) since torch 2.6); the
# backward is handed the merged lse in the same shape.
_lse_dim = 4


def unsupported_feature(vis: Visibility, softcap: float) -> str | None:
    """Why the cuDNN ops cannot run a call with this visibility and softcap, or None if they can."""
    features = call_features(vis, softcap)
    if not features:
        return None
    return (
        f"backend='cudnn' runs plain full or causal attention only (PyTorch's cuDNN attention ops), but this "
        f"call uses {', '.join(features.values())}; use backend='triton' or backend='auto'"
    )


def _cudnn_version() -> int | None:
    """cuDNN's version number (e.g. 90100) as torch sees it, or None without cuDNN."""
    if not torch.backends.cudnn.is_available():
        return None
    return torch.backends.cudnn.version()


def _capability(device: torch.device) -> tuple[int, int] | None:
    """The (major, minor) compute capability of a CUDA device, or None when CUDA is unavailable."""
    if not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_capability(device)


def can_use(device: torch.device, dtype: torch.dtype, head_dim: int | None, vis: Visibility,
            softcap: float) -> Exception | None:
    """None if backend "cudnn" can run this call, else the error saying why (ImportError: cuDNN missing from
    this torch build; ValueError: the feature, device, dtype, GPU or head_dim). ``head_dim`` None: not
    checked."""
    reason = unsupported_feature(vis, softcap)
    if reason is not None:
        return ValueError(reason)
    if device.type != "cuda":
        return ValueError(
            f"backend='cudnn' supports CUDA tensors, got a tensor on {device.type}; use backend='torch' or "
            "backend='auto'"
        )
    if dtype not in _HALF:
        return ValueError(
            f"backend='cudnn' supports CUDA tensors of dtype float16 or bfloat16, got {dtype}; use "
            "backend='torch' (exact, any dtype) or backend='auto'"
        )
    version = _cudnn_version()
    if version is None or version < _MIN_CUDNN:
        found = "no cuDNN" if version is None else f"cuDNN {version}"
        return ImportError(
            f"backend='cudnn' needs PyTorch built with cuDNN >= 9.0 (its cuDNN attention ops), found {found}; "
            "install a CUDA build of torch, or use backend='triton' or backend='auto'"
        )
    capability = _capability(device)
    if capability is None:
        return ValueError(f"backend='cudnn' needs a CUDA GPU, but CUDA is not available; use backend='torch'")
    if capability[0] < 8:
        return ValueError(
            f"backend='cudnn': cuDNN attention needs sm80+ (compute capability >= 8.0), got "
            f"sm{capability[0]}{capability[1]} on {device}; use backend='torch'"
        )
    if head_dim is not None and not (8 <= head_dim <= _MAX_HEAD_DIM and head_dim % 8 == 0):
        return ValueError(
            f"backend='cudnn': head_dim={head_dim} is not supported (allowed: multiples of 8 up to "
            f"{_MAX_HEAD_DIM}); use backend='triton' or backend='auto'"
        )
    return None


def _expand_heads(x: Tensor, heads: int) -> Tensor:
    """(B, S, Hkv, D) -> (B, S, H, D), kv head j serving query heads j*G .. j*G + G-1 (one copy)."""
    b, s, hkv, d = x.shape
    if hkv == heads:
        return x
    return x.unsqueeze(3).expand(b, s, hkv, heads // hkv, d).reshape(b, s, heads, d)


def _bhsd(x: Tensor) -> Tensor:
    """(B, S, H, D) -> the (B, H, S, D) view the ops take (last dim made contiguous if it is not)."""
    return (x if x.stride(-1) == 1 else x.contiguous()).transpose(1, 2)


def _op_lse(lse: Tensor) -> Tensor:
    """The merged lse (B, H, Sq) in the shape the forward op returns its logsumexp."""
    lse = lse.to(torch.float32).contiguous()
    return lse.unsqueeze(-1) if _lse_dim == 4 else lse


class CudnnForward(BlockForward):
    """ForwardKernel: cuDNN attention per block, merged by logsumexp (distcomm_attention.kernels.contract)."""

    def block(self, q, k, v, *, causal, scale, softcap):
        heads = q.shape[2]
        k, v = _expand_heads(k, heads), _expand_heads(v, heads)
        res = torch.ops.aten._scaled_dot_product_cudnn_attention(
            _bhsd(q), _bhsd(k), _bhsd(v), None, True, 0.0, bool(causal), False, scale=float(scale)
        )
        global _lse_dim
        out, lse = res[0].transpose(1, 2), res[1]
        _lse_dim = lse.dim()
        return out, (lse.squeeze(-1) if lse.dim() == 4 else lse)


class CudnnBackward(BlockBackward):
    """BackwardKernel: the cuDNN attention backward of one block from the merged out and lse."""

    def __init__(self):
        self._philox: dict[torch.device, tuple[Tensor, Tensor]] = {}

    def _seed_offset(self, device: torch.device) -> tuple[Tensor, Tensor]:
        """The op's dropout seed and offset: unused without dropout, so one read-only pair per device."""
        if device not in self._philox:
            self._philox[device] = (torch.zeros((), dtype=torch.int64, device=device),
                                    torch.zeros((), dtype=torch.int64, device=device))
        return self._philox[device]

    def block(self, dout, q, k, v, out, lse, *, causal, scale, softcap):
        batch, seqlen_q, heads, _ = q.shape
        seqlen_k, kv_heads = k.shape[1], k.shape[2]
        k_x, v_x = _expand_heads(k, heads), _expand_heads(v, heads)
        seed, offset = self._seed_offset(q.device)
        dq, dk, dv = torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
            _bhsd(dout.to(q.dtype)), _bhsd(q), _bhsd(k_x), _bhsd(v_x), _bhsd(out.to(q.dtype)),
            _op_lse(lse), seed, offset, None, None, None,
            seqlen_q, seqlen_k, 0.0, bool(causal), scale=float(scale),
        )
        dq, dk, dv = (x.transpose(1, 2) for x in (dq, dk, dv))
        if kv_heads != heads:
            dk = dk.unflatten(2, (kv_heads, heads // kv_heads)).sum(3, dtype=torch.float32)
            dv = dv.unflatten(2, (kv_heads, heads // kv_heads)).sum(3, dtype=torch.float32)
        return dq, dk, dv
