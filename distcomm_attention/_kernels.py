"""The block-kernel contract between the ring loop and the per-block attention kernels, and the backends.

Tensors are (batch, seq, heads, head_dim) ("BSHD"). q: (B, Sq, H, D); k, v: (B, Sk, Hkv, D) with
H % Hkv == 0 (query head h uses kv head h // (H // Hkv)); lse: (B, H, Sq), natural log. ``causal=True`` is
the mask j <= i with the diagonal at the top-left (query row i sees key columns 0..i); the ring loop slices
blocks so that Sq == Sk in causal calls.

Backends (``backend=`` of ``ring_flash_attn``):

    name        forward          backward              devices / dtypes
    "torch"     TorchForward     TorchBackward         any device, any float dtype (exact: fp32 math,
                                                       fp64 for fp64 input)
    "triton"    TritonForward    AtenFlashBackward     CUDA fp16/bf16
                                 TorchBackward         CPU fp16/bf16/fp32, only under TRITON_INTERPRET=1
    "flash_attn" TritonForward   FlashAttnBackward     CUDA fp16/bf16, needs `pip install flash-attn`
    "auto"      by device and dtype only: CPU -> "torch"; CUDA fp16/bf16 -> "triton" (an empty batch:
                "torch"); CUDA fp32/fp64 (the documented exact path) and other devices -> "torch"

Kernel modules are imported here, lazily, so ``import distcomm_attention`` needs neither triton nor
flash_attn.
"""

from __future__ import annotations

import importlib.util
import os
from typing import Protocol

import torch

__all__ = [
    "BACKENDS", "ForwardKernel", "BackwardKernel", "check_backend", "check_flash_backward", "resolve_backend",
    "select_kernels",
]

BACKENDS = ("auto", "torch", "triton", "flash_attn")
_HALF = (torch.float16, torch.bfloat16)


class ForwardKernel(Protocol):
    """Accumulates attention over key/value blocks into a running fp32 state, then finalizes once."""

    def init_state(self, q: torch.Tensor) -> object:
        """A fresh state for this rank's queries q (B, Sq, H, D): running max, running sum and the
        unnormalised output accumulator, in fp32 (fp64 for fp64 q)."""

    def step(
        self,
        state: object,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        causal: bool,
        scale: float,
        q_slice: slice = slice(None),
        final: bool = False,
    ) -> None:
        """Accumulate attention of q[:, q_slice] over (k, v) into the state rows q_slice, in place.

        q is the full local q; k, v (B, Sk, Hkv, D) are already sliced (views, any strides). ``final``:
        the last call of this forward, covering every row; a kernel may normalise and write out/lse
        right away (``finalize`` then returns them)."""

    def finalize(self, state: object, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """-> out (B, Sq, H, D) in ``dtype``, lse (B, H, Sq) float32 (float64 from the torch kernels for
        float64 input, so the exact path stays exact). Rows that saw no key: out 0, lse -inf."""


class BackwardKernel(Protocol):
    """The FlashAttention-2 backward of one block, recomputing P from the global lse."""

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
        """dout, q, out: (B, Sq, H, D) (out: the global output rows); lse: (B, H, Sq) (global);
        k, v: (B, Sk, Hkv, D). Returns dq (B, Sq, H, D), dk, dv (B, Sk, Hkv, D) in any float dtype."""


def check_backend(backend) -> None:
    """Raise ValueError unless ``backend`` names a known backend."""
    if not isinstance(backend, str) or backend not in BACKENDS:
        raise ValueError(f"Invalid backend {backend!r}. Must be one of: {', '.join(map(repr, BACKENDS))}")


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _triton_importable() -> bool:
    """Whether ``import triton`` succeeds (a broken install counts as missing)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def _cuda_capability(device: torch.device) -> tuple[int, int]:
    """The (major, minor) compute capability of a CUDA device."""
    return torch.cuda.get_device_capability(device)


def check_flash_backward(name: str, device: torch.device, batch: int) -> None:
    """Raise ValueError, before any communication, where a FlashAttention-2 backward (PyTorch's or the
    flash-attn package's, used by backends "triton" and "flash_attn" on CUDA) would fail only in the
    backward pass: an empty batch, or a GPU older than sm80."""
    if device.type != "cuda" or name not in ("triton", "flash_attn"):
        return
    if batch == 0:
        raise ValueError(
            f"backend={name!r} on CUDA does not support batch size 0 (its FlashAttention-2 backward rejects "
            "empty batches); use backend='torch' or backend='auto'"
        )
    major, minor = _cuda_capability(device)
    if major < 8:
        raise ValueError(
            f"backend={name!r}: FlashAttention-2 backward needs sm80+ (compute capability >= 8.0), got "
            f"sm{major}{minor} on {device}; use backend='torch'"
        )


def resolve_backend(backend: str, device: torch.device, dtype: torch.dtype) -> str:
    """The concrete backend for ``backend`` on tensors of ``device``/``dtype``.

    "auto" chooses by device and dtype only; where that choice is "triton", a missing triton raises
    ImportError rather than failing later. An explicit backend is checked for the device and dtype
    (ValueError) and for its package (ImportError naming what to install).
    """
    check_backend(backend)
    if backend == "auto":
        if device.type != "cuda" or dtype not in _HALF:
            return "torch"
        if not _triton_importable():
            raise ImportError(
                f"backend='auto' on CUDA {dtype} tensors uses the Triton forward kernel, but triton cannot be "
                "imported: pip install triton, or use backend='torch'"
            )
        return "triton"
    if backend == "torch":
        return backend
    if backend == "flash_attn" and importlib.util.find_spec("flash_attn") is None:
        raise ImportError(
            "backend='flash_attn' needs the flash-attn package (CUDA only, built from source): "
            "pip install flash-attn --no-build-isolation; or use backend='triton' (same forward, PyTorch's "
            "built-in copy of the FlashAttention-2 backward)"
        )
    if not _triton_importable():
        raise ImportError(
            f"backend={backend!r} needs the Triton compiler, which cannot be imported: pip install triton, "
            "or use backend='torch'"
        )
    if device.type == "cuda":
        if dtype not in _HALF:
            raise ValueError(
                f"backend={backend!r} supports CUDA tensors of dtype float16 or bfloat16, got {dtype}; "
                "use backend='torch' (exact, any dtype) or backend='auto'"
            )
        return backend
    if backend == "triton" and device.type == "cpu":
        if not _interpreting():
            raise ValueError(
                "backend='triton' on CPU tensors runs only in the Triton interpreter: set TRITON_INTERPRET=1 "
                "before distcomm_attention's Triton kernel is first imported, or use backend='torch'"
            )
        if dtype not in (torch.float16, torch.bfloat16, torch.float32):
            raise ValueError(
                f"backend='triton' on CPU (interpreter) supports float16, bfloat16 and float32, got {dtype}; "
                "use backend='torch'"
            )
        return backend
    where = "CUDA tensors (and CPU ones under TRITON_INTERPRET=1)" if backend == "triton" else "CUDA tensors"
    raise ValueError(
        f"backend={backend!r} supports {where}, got a tensor on {device.type}; use backend='torch' or backend='auto'"
    )


def select_kernels(backend: str, q: torch.Tensor):
    """Resolve ``backend`` for queries ``q`` (B, n, H, D) and return (name, ForwardKernel, BackwardKernel).

    Everything the kernels would reject is checked here, before any communication.

    Raises:
        ValueError / TypeError: unknown backend, a backend that does not run on this device/dtype, a
            head_dim its kernels do not support, or (CUDA FlashAttention-2 backward) batch size 0 or a GPU
            older than sm80.
        ImportError: the backend's package is not installed (for "auto": triton, on CUDA fp16/bf16).
    """
    if backend == "auto" and q.shape[0] == 0:
        backend = "torch"  # nothing to compute: the exact path handles an empty batch on any device
    name = resolve_backend(backend, q.device, q.dtype)
    check_flash_backward(name, q.device, q.shape[0])
    if name == "torch":
        from distcomm_attention._torch_kernels import TorchBackward, TorchForward

        return name, TorchForward(), TorchBackward()
    from distcomm_attention._triton_fwd import TritonForward

    head_dim = q.shape[-1]
    if not TritonForward.supports_head_dim(head_dim):
        raise ValueError(
            f"backend={name!r}: head_dim={head_dim} is not supported by the Triton forward kernel "
            "(allowed: multiples of 8 from 16 to 256); use backend='torch'"
        )
    TritonForward.check_tensor("q", q)  # e.g. a kernel module imported before TRITON_INTERPRET was set
    if name == "flash_attn":
        from distcomm_attention._flash_bwd import FlashAttnBackward

        return name, TritonForward(), FlashAttnBackward()
    if q.device.type == "cuda":
        from distcomm_attention._flash_bwd import AtenFlashBackward

        return name, TritonForward(), AtenFlashBackward()
    from distcomm_attention._torch_kernels import TorchBackward

    return name, TritonForward(), TorchBackward()
