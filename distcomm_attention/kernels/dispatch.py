"""The block-kernel contract between the ring loop and the per-block attention kernels, and the backends.

Tensors are (batch, seq, heads, head_dim) ("BSHD"). q: (B, Sq, H, D); k, v: (B, Sk, Hkv, D) with
H % Hkv == 0 (query head h uses kv head h // (H // Hkv)); lse: (B, H, Sq), natural log. Each call gets a
``BlockMask`` (distcomm_attention.planning.visibility: "full", "causal" top-left, or "interval" arrays), an optional
key padding mask and a softcap; kernels execute that visibility, the ring planner decides it.

Backends (``backend=`` of ``ring_flash_attn``):

    name         forward          backward              devices / dtypes / features
    "torch"      TorchForward     TorchBackward         any device, any float dtype (exact: fp32 math,
                                                        fp64 for fp64 input); every feature
    "triton"     TritonForward    TritonBackward        CUDA fp16/bf16 (CPU fp16/bf16/fp32 only under
                                                        TRITON_INTERPRET=1); every feature
    "flash2"     TritonForward    AtenFlashBackward     CUDA fp16/bf16; plain full/causal attention only
                                                        (PyTorch's built-in FlashAttention-2 backward)
    "flash_attn" TritonForward    FlashAttnBackward     like "flash2" with the flash-attn package's backward
    "cudnn"      CudnnForward     CudnnBackward         CUDA fp16/bf16, sm80+; plain full/causal attention, GQA
                                                        (PyTorch's cuDNN attention ops; distcomm_attention.kernels.cudnn)
    "fa4"        FA4Forward       FA4Backward           CUDA fp16/bf16, sm90/sm100; every feature but a key
                                                        padding mask: windows and packed documents as FA4
                                                        window/varlen calls, softcap, GQA (flash-attn-4,
                                                        optional; distcomm_attention.kernels.fa4)
    "auto"       CPU, CUDA fp32/fp64 -> "torch"; CUDA fp16/bf16 -> the first backend of ``AUTO_PREFERENCE``
                 that can do the call (measured order, see docs/bench/backends.md)

Every backend answers one question, "can you run this call, and if not, why?" (``backend_problem``: None
or the ImportError / ValueError to raise). A forced backend raises its answer before any communication,
"auto" walks ``AUTO_PREFERENCE`` and takes the first backend with none, and ``which_kernels`` (public)
reports the choice and what was skipped. The block backends "cudnn" and "fa4" compute one (query block,
key block) pair at a time and are merged by distcomm_attention.kernels.contract. Kernel modules are imported here,
lazily, so ``import distcomm_attention`` needs neither triton nor flash_attn.
"""

from __future__ import annotations

import importlib.util
import os
from typing import NamedTuple, Protocol

import torch

from distcomm_attention.kernels import cudnn
from distcomm_attention.kernels import fa4
from distcomm_attention.kernels.contract import call_features
from distcomm_attention.planning.visibility import BlockMask, Visibility

__all__ = [
    "BACKENDS", "AUTO_PREFERENCE", "ForwardKernel", "BackwardKernel", "KernelChoice", "backend_problem",
    "check_backend", "check_flash_backward", "packs", "resolve_backend", "select_kernels", "unsupported_feature",
]

BACKENDS = ("auto", "torch", "triton", "flash2", "flash_attn", "cudnn", "fa4")
# The order in which "auto" tries the CUDA fp16/bf16 backends; the first that can do a call wins. Measured
# (docs/bench/backends.md, one H100, bf16, d=128, S = 8k and 32k, causal and full, heads 32/32 and 32/8):
# ring_flash_attn at world 1, fwd+bwd TFLOP/s: fa4 557-649, cudnn 469-560, triton 330-394, flash2 287-344;
# direct kernels: FA4 588-669, cuDNN 526-591, SDPA FA2 291-322. At 16k causal, fwd+bwd, the same calls on fa4
# against triton: 4k window 1.7x, packed documents 1.9-2.1x, softcap 1.26x faster.
AUTO_PREFERENCE = ("fa4", "cudnn", "triton", "flash2")
_PLAIN_ONLY = ("flash2", "flash_attn")
_BLOCK_BACKENDS = {"cudnn": cudnn, "fa4": fa4}
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
        mask: BlockMask,
        scale: float,
        softcap: float = 0.0,
        key_mask: torch.Tensor | None = None,
        q_slice: slice = slice(None),
        final: bool = False,
    ) -> None:
        """Accumulate attention of q[:, q_slice] over (k, v) into the state rows q_slice, in place, under the
        block's visibility ``mask`` and the key padding mask ``key_mask`` (B, Sk) (True = attend).

        q is the full local q; k, v (B, Sk, Hkv, D) are already sliced (views, any strides). ``final``:
        the last call of this forward, covering every row; a kernel may normalise and write out/lse
        right away (``finalize`` then returns them)."""

    def finalize(self, state: object, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """-> out (B, Sq, H, D) in ``dtype``, lse (B, H, Sq) float32 (float64 from the torch kernels for
        float64 input, so the exact path stays exact). Rows that saw no key: out 0, lse -inf."""


class BackwardKernel(Protocol):
    """The FlashAttention-2 backward of one block, recomputing P from the global lse.

    ``uses_delta``: whether ``step`` reads ``delta``; False (the block backends, which compute
    rowsum(dout * out) inside their kernels) lets a caller pass ``delta=None``. Kernels without the
    attribute read it.
    """

    uses_delta: bool

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
        """dout, q, out: (B, Sq, H, D) (out: the global output rows); lse, delta = rowsum(dout * out):
        (B, H, Sq) (global); k, v: (B, Sk, Hkv, D). Adds the block's dq into ``dq_acc`` (B, Sq, H, D) and
        returns it (a new dq without one); dk, dv (B, Sk, Hkv, D) in ``dkv_dtype``."""


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
    flash-attn package's, used by backends "flash2" and "flash_attn" on CUDA) would fail only in the
    backward pass: an empty batch, or a GPU older than sm80."""
    if device.type != "cuda" or name not in _PLAIN_ONLY:
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


def unsupported_feature(name: str, vis: Visibility, softcap: float) -> str | None:
    """Why backend ``name`` cannot execute a call with this visibility and softcap, or None if it can."""
    if name in _BLOCK_BACKENDS:
        return _BLOCK_BACKENDS[name].unsupported_feature(vis, softcap)
    if name not in _PLAIN_ONLY:
        return None
    features = call_features(vis, softcap)
    if not features:
        return None
    return (
        f"backend={name!r} runs plain full or causal attention only (FlashAttention-2 backward), but this call "
        f"uses {', '.join(features.values())}; use backend='triton' or backend='auto'"
    )


def _module_available(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except ImportError:  # a parent package that is missing or broken
        return False


def _check_package(name: str) -> None:
    if name == "flash_attn" and not _module_available("flash_attn.flash_attn_interface"):
        raise ImportError(
            "backend='flash_attn' needs the flash-attn package (CUDA only, built from source): "
            "pip install flash-attn --no-build-isolation; or use backend='flash2' (same kernels, PyTorch's "
            "built-in copy of the FlashAttention-2 backward) or backend='triton'"
        )
    if not _triton_importable():
        raise ImportError(
            f"backend={name!r} needs the Triton compiler, which cannot be imported: pip install triton, "
            "or use backend='torch'"
        )


def _triton_family_problem(name: str, device: torch.device, dtype: torch.dtype, vis: Visibility,
                           softcap: float, head_dim: int | None, batch: int | None) -> Exception | None:
    """The capability check of "triton", "flash2" and "flash_attn" (our Triton forward, and our Triton or a
    FlashAttention-2 backward)."""
    try:
        _check_package(name)
    except ImportError as exc:
        return exc
    reason = unsupported_feature(name, vis, softcap)
    if reason is not None:
        return ValueError(reason)
    if device.type == "cuda":
        if dtype not in _HALF:
            return ValueError(
                f"backend={name!r} supports CUDA tensors of dtype float16 or bfloat16, got {dtype}; "
                "use backend='torch' (exact, any dtype) or backend='auto'"
            )
        if batch is not None:
            try:
                check_flash_backward(name, device, batch)
            except ValueError as exc:
                return exc
    elif name == "triton" and device.type == "cpu":
        if not _interpreting():
            return ValueError(
                "backend='triton' on CPU tensors runs only in the Triton interpreter: set TRITON_INTERPRET=1 "
                "before distcomm_attention's Triton kernels are first imported, or use backend='torch'"
            )
        if dtype not in (torch.float16, torch.bfloat16, torch.float32):
            return ValueError(
                f"backend='triton' on CPU (interpreter) supports float16, bfloat16 and float32, got {dtype}; "
                "use backend='torch'"
            )
    else:
        where = "CUDA tensors (and CPU ones under TRITON_INTERPRET=1)" if name == "triton" else "CUDA tensors"
        return ValueError(
            f"backend={name!r} supports {where}, got a tensor on {device.type}; use backend='torch' or "
            "backend='auto'"
        )
    if head_dim is not None and not (isinstance(head_dim, int) and 16 <= head_dim <= 256 and head_dim % 8 == 0):
        return ValueError(
            f"backend={name!r}: head_dim={head_dim} is not supported by the Triton kernels "
            "(allowed: multiples of 8 from 16 to 256); use backend='torch'"
        )
    return None


def backend_problem(name: str, device: torch.device, dtype: torch.dtype, vis: Visibility = Visibility(),
                    softcap: float = 0.0, *, head_dim: int | None = None,
                    batch: int | None = None) -> Exception | None:
    """None if backend ``name`` (not "auto") can run a call on tensors of ``device``/``dtype`` with this
    visibility, softcap, head_dim and batch size, else the error that says why: ImportError (a package to
    install) or ValueError (a feature, device, dtype, GPU or shape it does not support). ``head_dim`` /
    ``batch`` None: not checked."""
    if name == "torch":
        return None
    if name in _BLOCK_BACKENDS:
        return _BLOCK_BACKENDS[name].can_use(device, dtype, head_dim, vis, softcap)
    return _triton_family_problem(name, device, dtype, vis, softcap, head_dim, batch)


def resolve_backend(backend: str, device: torch.device, dtype: torch.dtype,
                    vis: Visibility = Visibility(), softcap: float = 0.0, *, head_dim: int | None = None,
                    batch: int | None = None) -> tuple[str, str]:
    """The concrete backend for ``backend`` on tensors of ``device``/``dtype`` for a call with visibility
    ``vis``, ``softcap``, ``head_dim`` and ``batch`` size (None: not checked), and the reason for the choice.

    "auto" takes "torch" for CPU tensors and CUDA fp32/fp64 (the exact path), else the first backend of
    ``AUTO_PREFERENCE`` whose ``backend_problem`` is None. An explicit backend raises its problem:
    ValueError (feature, device, dtype, GPU, head_dim) or ImportError (what to install).
    """
    check_backend(backend)
    if backend != "auto":
        problem = backend_problem(backend, device, dtype, vis, softcap, head_dim=head_dim, batch=batch)
        if problem is not None:
            raise problem
        return backend, "requested"
    if device.type != "cuda" or dtype not in _HALF:
        return "torch", f"{device.type} {dtype}: the exact PyTorch path"
    skipped = []
    for name in AUTO_PREFERENCE:
        problem = backend_problem(name, device, dtype, vis, softcap, head_dim=head_dim, batch=batch)
        if problem is None:
            reason = f"the first of AUTO_PREFERENCE={AUTO_PREFERENCE} that can do this call"
            return name, reason + (f" (skipped: {'; '.join(skipped)})" if skipped else "")
        skipped.append(f"{name}: {problem}")
    if not _triton_importable():
        raise ImportError(
            f"backend='auto' on CUDA {dtype} tensors found no backend for this call, and the Triton kernels that "
            f"run every call need triton, which cannot be imported: pip install triton "
            f"(skipped: {'; '.join(skipped)}); or use backend='torch'"
        )
    raise ValueError(
        f"backend='auto' found no backend for this call on CUDA {dtype} tensors (skipped: {'; '.join(skipped)}); "
        "use backend='torch'"
    )


class KernelChoice(NamedTuple):
    """What a ``ring_flash_attn`` call runs: the backend and its forward / backward kernels, and why."""

    backend: str
    forward: str
    backward: str
    reason: str


_KERNEL_NAMES = {
    "torch": ("TorchForward", "TorchBackward"),
    "triton": ("TritonForward", "TritonBackward"),
    "flash2": ("TritonForward", "AtenFlashBackward"),
    "flash_attn": ("TritonForward", "FlashAttnBackward"),
    "cudnn": ("CudnnForward", "CudnnBackward"),
    "fa4": ("FA4Forward", "FA4Backward"),
}


def choose(backend: str, q: torch.Tensor, vis: Visibility, softcap: float) -> KernelChoice:
    """The backend and kernel names for queries ``q`` (B, n, H, D); raises what ``select_kernels`` raises."""
    if backend == "auto" and q.shape[0] == 0:
        name, reason = "torch", "empty batch: nothing to compute"
    else:
        name, reason = resolve_backend(backend, q.device, q.dtype, vis, softcap, head_dim=q.shape[-1],
                                       batch=q.shape[0])
    return KernelChoice(name, *_KERNEL_NAMES[name], reason)


def packs(name: str) -> bool:
    """Whether backend ``name``'s kernels run a step's pieces as packed varlen calls (Note [Packed steps] in
    distcomm_attention/kernels/contract.py): the cost model then counts those calls, not the blocks."""
    return name == "fa4" and fa4.FA4Forward.packs and fa4.FA4Backward.packs


def select_kernels(backend: str, q: torch.Tensor, vis: Visibility = Visibility(), softcap: float = 0.0):
    """Resolve ``backend`` for queries ``q`` (B, n, H, D) and return (name, ForwardKernel, BackwardKernel).

    Everything the kernels would reject is checked here, before any communication.

    Raises:
        ValueError / TypeError: unknown backend, a backend that does not run on this device/dtype/GPU or
            cannot do this call's features, a head_dim its kernels do not support, or (CUDA
            FlashAttention-2 backward) batch size 0 or a GPU older than sm80.
        ImportError: the backend's package is not installed (for "auto": no backend can run the call and
            triton, which runs every call, is missing).
    """
    name = choose(backend, q, vis, softcap).backend
    if name == "torch":
        from distcomm_attention.kernels.torch_exact import TorchBackward, TorchForward

        return name, TorchForward(), TorchBackward()
    if name == "cudnn":
        return name, cudnn.CudnnForward(), cudnn.CudnnBackward()
    if name == "fa4":
        return name, fa4.FA4Forward(), fa4.FA4Backward()
    from distcomm_attention.kernels.triton_fwd import TritonForward

    TritonForward.check_tensor("q", q)  # e.g. a kernel module imported before TRITON_INTERPRET was set
    if name == "flash_attn":
        from distcomm_attention.kernels.flash2 import FlashAttnBackward

        return name, TritonForward(), FlashAttnBackward()
    if name == "flash2":
        from distcomm_attention.kernels.flash2 import AtenFlashBackward

        return name, TritonForward(), AtenFlashBackward()
    from distcomm_attention.kernels.triton_bwd import TritonBackward

    return name, TritonForward(), TritonBackward()
