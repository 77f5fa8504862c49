"""FlashAttention-2 backward of one ring block: ``AtenFlashBackward`` and ``FlashAttnBackward``.

Both implement the BackwardKernel contract (``step(dout, q, k, v, out, lse, delta, *, mask, scale, ...)``,
see distcomm_attention.kernels.dispatch) for the plain blocks only: ``mask`` "full" or "causal", no key mask, no
softcap (the backend selection never gives them anything else). They recompute the probabilities of one
(q, k) block from the GLOBAL ``lse`` and use the GLOBAL ``out`` (their own ``D = rowsum(dout * out)``; the
given ``delta`` is not needed).

- ``AtenFlashBackward``: PyTorch's built-in copy of the FlashAttention-2 backward,
  ``torch.ops.aten._scaled_dot_product_flash_attention_backward`` (always present in CUDA builds of
  torch). CUDA fp16/bf16, head dims multiples of 8 up to 256. It has no GQA: K/V heads are expanded
  locally (``repeat_interleave`` order, query head h uses kv head h // (H // Hkv)) and dK/dV are summed
  back over each group in fp32, so communication stays at kv-head size.
- ``FlashAttnBackward``: the optional ``flash_attn`` package (``pip install flash-attn``), imported lazily
  on first use. Its private ``_flash_attn_backward`` changed signature between releases; the versions
  handled are gated with ``packaging.version``: 2.6.x (``window_size`` tuple) and 2.7.x-2.8.x
  (``window_size_left``/``window_size_right``). It supports GQA natively. It cannot be installed on the
  project's test machines, so it is untested beyond its dispatch and error messages.

Causal alignment: both kernels align the causal diagonal bottom-right when Sq != Sk; the ring only issues
causal blocks with Sq == Sk, where top-left and bottom-right coincide, so causal blocks with Sq != Sk are
rejected.

This is the only module of the project that imports ``flash_attn``.
"""

import importlib
import importlib.metadata

import torch
from torch import Tensor

__all__ = ["AtenFlashBackward", "FlashAttnBackward"]

_FLASH_DTYPES = (torch.float16, torch.bfloat16)
_MAX_HEAD_DIM = 256


def _check_block(name: str, dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                 causal: bool) -> None:
    """Shape/dtype/device checks shared by the flash backward kernels."""
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(
            f"{name}: `q`, `k`, `v` must be 4-D (batch, seq, heads, head_dim); "
            f"got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        )
    batch, seqlen_q, heads, head_dim = q.shape
    if dout.shape != q.shape or out.shape != q.shape:
        raise ValueError(
            f"{name}: `dout` {tuple(dout.shape)} and `out` {tuple(out.shape)} must have q's shape {tuple(q.shape)}"
        )
    if k.shape != v.shape or k.shape[0] != batch or k.shape[3] != head_dim:
        raise ValueError(f"{name}: `k` {tuple(k.shape)} and `v` {tuple(v.shape)} do not match `q` {tuple(q.shape)}")
    if k.shape[2] == 0 or heads % k.shape[2]:
        raise ValueError(f"{name}: query heads {heads} must be a multiple of kv heads {k.shape[2]}")
    if tuple(lse.shape) != (batch, heads, seqlen_q):
        raise ValueError(f"{name}: `lse` must have shape {(batch, heads, seqlen_q)}; got {tuple(lse.shape)}")
    if causal and k.shape[1] != seqlen_q:
        raise ValueError(
            f"{name}: a causal block needs equal query and key lengths (got {seqlen_q} and {k.shape[1]}); "
            "the flash kernels align a non-square causal mask bottom-right"
        )
    for arg, x in (("q", q), ("k", k), ("v", v)):
        if x.device.type != "cuda":
            raise ValueError(f"{name}: `{arg}` is on {x.device}; this backward kernel needs CUDA tensors")
        if x.dtype not in _FLASH_DTYPES:
            raise TypeError(
                f"{name}: `{arg}` has dtype {x.dtype}; allowed: torch.float16, torch.bfloat16"
            )
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"{name}: `k` ({k.dtype}) and `v` ({v.dtype}) must have q's dtype ({q.dtype})")
    if head_dim % 8 or head_dim > _MAX_HEAD_DIM:
        raise ValueError(f"{name}: head_dim {head_dim} is not supported; allowed: multiples of 8 up to 256")


def _last_dim_contiguous(x: Tensor) -> Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def _plain_causal(name: str, mask, softcap: float, key_mask) -> bool:
    """The block's causal flag; ValueError for a visibility the FlashAttention-2 backward cannot express."""
    if mask.mode not in ("full", "causal") or softcap or key_mask is not None:
        raise ValueError(
            f"{name}: only plain full or causal blocks are supported (got mode {mask.mode!r}, softcap "
            f"{softcap}, key mask {'given' if key_mask is not None else 'none'}); use backend='triton'"
        )
    return mask.mode == "causal"


def _finish(dq: Tensor, dk: Tensor, dv: Tensor, dq_acc, dkv_dtype):
    """Apply the contract's accumulation and dtype options to one block's gradients."""
    if dq_acc is not None:
        dq = dq_acc.add_(dq)
    if dkv_dtype is not None:
        dk, dv = dk.to(dkv_dtype), dv.to(dkv_dtype)
    return dq, dk, dv


class AtenFlashBackward:
    """BackwardKernel using ``torch.ops.aten._scaled_dot_product_flash_attention_backward``.

    CUDA fp16/bf16 only; the aten op is already traceable by ``torch.compile`` (it has a meta kernel), so
    it is called directly.
    """

    def __init__(self):
        self._rng_state: dict[torch.device, tuple[Tensor, Tensor]] = {}

    @staticmethod
    def supports_head_dim(head_dim: int) -> bool:
        """Multiples of 8 up to 256."""
        return isinstance(head_dim, int) and 8 <= head_dim <= _MAX_HEAD_DIM and head_dim % 8 == 0

    def _philox(self, device: torch.device) -> tuple[Tensor, Tensor]:
        """The op's dropout seed and offset: unused without dropout, so one read-only pair per device."""
        if device not in self._rng_state:
            self._rng_state[device] = (torch.zeros(2, dtype=torch.uint64, device=device),
                                       torch.zeros((), dtype=torch.uint64, device=device))
        return self._rng_state[device]

    def step(self, dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, delta=None, *,
             mask, scale: float, softcap: float = 0.0, key_mask=None, dq_acc=None,
             dkv_dtype=None) -> tuple[Tensor, Tensor, Tensor]:
        """Backward of one block (``mask`` "full" or "causal"; ``dq_acc``/``dkv_dtype`` as in the contract).

        Args:
            dout, q, out: (B, Sq, H, D), fp16/bf16 (dout/out are cast to q's dtype if they differ).
            k, v: (B, Sk, Hkv, D), H % Hkv == 0.
            lse: (B, H, Sq) float32, natural log, of the GLOBAL softmax these rows belong to.
            causal: top-left causal block (requires Sq == Sk).
            scale: softmax scale.

        Returns:
            dq (B, Sq, H, D) in q's dtype; dk, dv (B, Sk, Hkv, D) (fp32 when reduced over a GQA group).
        """
        causal = _plain_causal("AtenFlashBackward", mask, softcap, key_mask)
        _check_block("AtenFlashBackward", dout, q, k, v, out, lse, causal)
        batch, seqlen_q, heads, _ = q.shape
        seqlen_k, kv_heads = k.shape[1], k.shape[2]
        group = heads // kv_heads
        if group > 1:  # repeat_interleave order, by expand + reshape (one copy, never a host sync)
            k = k.unsqueeze(3).expand(batch, seqlen_k, kv_heads, group, k.shape[3]).reshape(batch, seqlen_k, heads, -1)
            v = v.unsqueeze(3).expand(batch, seqlen_k, kv_heads, group, v.shape[3]).reshape(batch, seqlen_k, heads, -1)
        # The aten op takes (B, H, S, D) views; BSHD memory transposed is its native layout.
        q_t, k_t, v_t, out_t, dout_t = (
            _last_dim_contiguous(x.to(q.dtype)).transpose(1, 2) for x in (q, k, v, out, dout)
        )
        seed, offset = self._philox(q.device)
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_backward(
            dout_t, q_t, k_t, v_t, out_t, lse.to(torch.float32).contiguous(),
            None, None, seqlen_q, seqlen_k, 0.0, bool(causal), seed, offset, scale=float(scale),
        )
        dq, dk, dv = (x.transpose(1, 2) for x in (dq, dk, dv))
        if group > 1:
            dk = dk.unflatten(2, (kv_heads, group)).sum(3, dtype=torch.float32)
            dv = dv.unflatten(2, (kv_heads, group)).sum(3, dtype=torch.float32)
        return _finish(dq, dk, dv, dq_acc, dkv_dtype)


# Signatures of flash_attn.flash_attn_interface._flash_attn_backward, by release:
#   2.6.x:       (dout, q, k, v, out, softmax_lse, dq, dk, dv, dropout_p, softmax_scale, causal,
#                 window_size, softcap, alibi_slopes, deterministic, rng_state=None)
#   2.7.x-2.8.x: (dout, q, k, v, out, softmax_lse, dq, dk, dv, dropout_p, softmax_scale, causal,
#                 window_size_left, window_size_right, softcap, alibi_slopes, deterministic, rng_state=None)
# Both write dq/dk/dv in place. Other releases are refused rather than guessed at.
_FLASH_ATTN_MIN, _FLASH_ATTN_SPLIT_WINDOW, _FLASH_ATTN_MAX = "2.6.0", "2.7.0", "2.9.0"


def _flash_attn_backward_fn():
    """Import flash_attn lazily; return (its private backward function, whether it takes a split window)."""
    try:
        interface = importlib.import_module("flash_attn.flash_attn_interface")
    except ImportError as exc:
        raise ImportError(
            "backend 'flash_attn' needs the flash_attn package (FlashAttention-2 >= 2.6, < 2.9): "
            "pip install flash-attn --no-build-isolation"
        ) from exc
    try:
        from packaging.version import InvalidVersion, Version
    except ImportError as exc:
        raise ImportError(
            "backend 'flash_attn' needs `packaging` to check flash_attn's version: pip install packaging"
        ) from exc
    try:
        version = importlib.metadata.version("flash_attn")
    except importlib.metadata.PackageNotFoundError:
        version = str(getattr(importlib.import_module("flash_attn"), "__version__", "unknown"))
    try:
        parsed = Version(version)
    except InvalidVersion as exc:
        raise ImportError(f"cannot parse the installed flash_attn version {version!r}") from exc
    if not Version(_FLASH_ATTN_MIN) <= parsed < Version(_FLASH_ATTN_MAX):
        raise ImportError(
            f"flash_attn {version} is installed, but backend 'flash_attn' supports versions "
            f">= {_FLASH_ATTN_MIN}, < {_FLASH_ATTN_MAX} (its private backward API changes between releases); "
            "install one of those (pip install 'flash-attn>=2.6,<2.9') or use backend='triton'"
        )
    return interface._flash_attn_backward, parsed >= Version(_FLASH_ATTN_SPLIT_WINDOW)


def _call_flash_attn_backward(backward, split_window: bool, dout: Tensor, q: Tensor, k: Tensor, v: Tensor,
                              out: Tensor, lse: Tensor, *, causal: bool, scale: float):
    """Call flash_attn's private backward with the argument layout of its release; returns dq, dk, dv."""
    q, k, v, out, dout = (_last_dim_contiguous(x.to(q.dtype)) for x in (q, k, v, out, dout))
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    lse = lse.to(torch.float32).contiguous()
    window = (-1, -1) if split_window else ((-1, -1),)  # no sliding window
    backward(
        dout, q, k, v, out, lse, dq, dk, dv,
        0.0, float(scale), bool(causal), *window,
        0.0, None, False, None,  # softcap, alibi_slopes, deterministic, rng_state (no dropout)
    )
    return dq, dk, dv


class FlashAttnBackward:
    """BackwardKernel using the optional ``flash_attn`` package (FlashAttention-2, GQA native).

    Constructing it imports ``flash_attn``: ImportError (saying ``pip install flash-attn``) when it is
    missing, or naming the installed version when that version's private API is not one handled here.
    """

    def __init__(self):
        self._backward, self._split_window = _flash_attn_backward_fn()

    @staticmethod
    def supports_head_dim(head_dim: int) -> bool:
        """Multiples of 8 up to 256."""
        return AtenFlashBackward.supports_head_dim(head_dim)

    def step(self, dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, delta=None, *,
             mask, scale: float, softcap: float = 0.0, key_mask=None, dq_acc=None,
             dkv_dtype=None) -> tuple[Tensor, Tensor, Tensor]:
        """Backward of one block; same arguments and results as ``AtenFlashBackward.step``."""
        causal = _plain_causal("FlashAttnBackward", mask, softcap, key_mask)
        _check_block("FlashAttnBackward", dout, q, k, v, out, lse, causal)
        grads = _call_flash_attn_backward(self._backward, self._split_window, dout, q, k, v, out, lse,
                                          causal=causal, scale=scale)
        return _finish(*grads, dq_acc, dkv_dtype)
