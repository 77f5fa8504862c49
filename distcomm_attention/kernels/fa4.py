"""Block backend "fa4": flash-attn-4 (FlashAttention-4, CuTe DSL, Hopper and Blackwell) as ring block kernels.

    forward   flash_attn.cute.interface._flash_attn_fwd(q, k, v, softmax_scale=, causal=, softcap=,
                  window_size_left=, window_size_right=, cu_seqlens_q/k=, max_seqlen_q/k=,
                  return_lse=True) -> (out, lse, ...)
    backward  flash_attn.cute.interface._flash_attn_bwd(q, k, v, out, dout, lse, softmax_scale=, causal=,
                  softcap=, window_size_left/right=, cu_seqlens_q/k=, max_seqlen_q/k=) -> (dq, dk, dv)

Layout (B, S, H, D), the project's own; lse float32 (B, H, Sq), natural log; GQA native (k, v keep their kv
heads; dK/dV come back per kv head). The backward takes any out and lse, so it runs from the ring's merged
ones (Note [Merging block outputs] in distcomm_attention.kernels.contract). Causal blocks are square (as the ring
planner issues them), where FA4's bottom-right alignment equals top-left. Softcap: scores = softcap *
tanh(scale * q k^T / softcap), the project's definition. Windows and packed documents: the planner's
"interval" blocks run as FA4 window calls, several pieces at once through its varlen batches (Note [Window
calls] in distcomm_attention.kernels.contract), so they are exact. Key padding masks are not taken here: such calls
go to "triton".

flash-attn-4 is optional (``pip install "distcomm[fa4]"``) and imported lazily, on the first block call:
this is the only module of the project that imports ``flash_attn.cute``. Its first call of each new
kernel configuration JIT-compiles (a few seconds). fp16 and bf16; sm90 (head_dim multiple of 8 up to 256)
and sm100 (up to 128).
"""

from __future__ import annotations

import functools
import importlib
import importlib.metadata
import importlib.util

import torch
from torch import Tensor

from distcomm_attention.kernels.contract import BlockBackward, BlockForward, Varlen, call_features
from distcomm_attention.planning.visibility import Visibility

__all__ = ["FA4Forward", "FA4Backward", "can_use", "unsupported_feature", "VERIFIED_VERSION"]

# flash-attn-4 releases whose private _flash_attn_fwd / _flash_attn_bwd signatures this module calls; the
# pin of the "fa4" extra (pyproject.toml) is the verified one.
VERIFIED_VERSION = "4.0.0b36"
_MIN_VERSION, _MAX_VERSION = "4.0.0b36", "4.1"
_HALF = (torch.float16, torch.bfloat16)
_INSTALL = f'pip install "distcomm[fa4]" (flash-attn-4=={VERIFIED_VERSION})'


def unsupported_feature(vis: Visibility, softcap: float) -> str | None:
    """Why FA4 blocks cannot run a call with this visibility, or None if they can (windows, packed documents
    and softcap they can; a key padding mask they cannot)."""
    if "attention_mask" not in call_features(vis, softcap):
        return None
    return (
        "backend='fa4' runs full, causal, windowed and packed-document attention (with softcap and GQA), but "
        "not an attention_mask (key padding); use backend='triton' or backend='auto'"
    )


def _module_available(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except ImportError:  # a parent package that is missing or broken
        return False


@functools.lru_cache(maxsize=1)
def _package_problem() -> str | None:
    """Why flash-attn-4 cannot be used here (not installed, or a release this module was not written for),
    or None. Read once per process."""
    if not _module_available("flash_attn.cute"):
        return f"backend='fa4' needs flash-attn-4 (FlashAttention-4, CUDA Hopper/Blackwell): {_INSTALL}"
    try:
        version = importlib.metadata.version("flash-attn-4")
    except importlib.metadata.PackageNotFoundError:
        return None  # a source checkout on the path: no release metadata to check
    try:
        from packaging.version import InvalidVersion, Version
    except ImportError:
        return "backend='fa4' needs `packaging` to check flash-attn-4's version: pip install packaging"
    try:
        parsed = Version(version)
    except InvalidVersion:
        return f"backend='fa4': cannot parse the installed flash-attn-4 version {version!r}"
    if not Version(_MIN_VERSION) <= parsed < Version(_MAX_VERSION):
        return (
            f"flash-attn-4 {version} is installed, but backend='fa4' supports versions >= {_MIN_VERSION}, "
            f"< {_MAX_VERSION} (it calls FA4's private block functions, whose signatures change between "
            f"releases): {_INSTALL}"
        )
    return None


def _capability(device: torch.device) -> tuple[int, int] | None:
    """The (major, minor) compute capability of a CUDA device, or None when CUDA is unavailable."""
    if not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_capability(device)


_NEEDS = "backend='fa4' needs a Hopper (sm90) or Blackwell (sm100) GPU and CUDA float16/bfloat16 tensors"


def _hardware_problem(device: torch.device, dtype: torch.dtype) -> tuple[str, tuple[int, int] | None]:
    """(why these tensors or this GPU cannot run FA4, naming what they are, or "" if they can; the GPU's
    compute capability when it was read)."""
    if device.type != "cuda" or dtype not in _HALF:
        return (f"{_NEEDS}, got {dtype} tensors on {device}; use backend='torch' (exact, any device and dtype) "
                "or backend='auto'"), None
    capability = _capability(device)
    if capability is None:
        return (f"{_NEEDS}, got {dtype} tensors on {device}, but CUDA is not available; use backend='torch'"), None
    major, minor = capability
    if major not in (9, 10):
        return (f"{_NEEDS}, got an sm{major}{minor} GPU ({device}); use backend='cudnn', backend='triton' or "
                "backend='auto'"), capability
    return "", capability


def can_use(device: torch.device, dtype: torch.dtype, head_dim: int | None, vis: Visibility,
            softcap: float) -> Exception | None:
    """None if backend "fa4" can run this call, else the error saying why, in this order: ValueError for
    the call's features, then for the device, dtype or GPU (and, when flash-attn-4 is missing too, how to
    install it, second), ImportError when only the package is missing or an unsupported release, ValueError
    for head_dim. ``head_dim`` None: not checked."""
    reason = unsupported_feature(vis, softcap)
    if reason is not None:
        return ValueError(reason)
    hardware, capability = _hardware_problem(device, dtype)
    problem = _package_problem()
    if hardware:
        return ValueError(hardware + (f". Also: {problem}" if problem is not None else ""))
    if problem is not None:
        return ImportError(problem)
    major, minor = capability
    max_head_dim = 256 if major == 9 else 128
    if head_dim is not None and not (8 <= head_dim <= max_head_dim and head_dim % 8 == 0):
        return ValueError(
            f"backend='fa4': head_dim={head_dim} is not supported on sm{major}{minor} (allowed: multiples of 8 "
            f"up to {max_head_dim}); use backend='triton' or backend='auto'"
        )
    return None


@functools.lru_cache(maxsize=1)
def _interface():
    """flash_attn.cute.interface, imported on first use (ImportError saying what to install)."""
    problem = _package_problem()
    if problem is not None:
        raise ImportError(problem)
    return importlib.import_module("flash_attn.cute.interface")


def _extra(window, varlen: Varlen | None) -> dict:
    """FA4's keyword arguments for a window and a packed (varlen) call."""
    kwargs = {}
    if window is not None:
        kwargs.update(window_size_left=window[0], window_size_right=window[1])
    if varlen is not None:
        kwargs.update(cu_seqlens_q=varlen.cu_q, cu_seqlens_k=varlen.cu_k, max_seqlen_q=varlen.max_q,
                      max_seqlen_k=varlen.max_k)
        if varlen.used_q is not None:
            kwargs.update(seqused_q=varlen.used_q, seqused_k=varlen.used_k)
    return kwargs


class FA4Forward(BlockForward):
    """ForwardKernel: FA4 per block, merged by logsumexp (distcomm_attention.kernels.contract)."""

    takes_windows = True
    packs = True
    writes_segments_only = True  # (tests/test_gpu_backends.py::test_fa4_packed_calls_write_only_their_segments)

    def __init__(self):
        self._fwd = _interface()._flash_attn_fwd

    def block(self, q, k, v, *, causal, scale, softcap, window=None, varlen=None, out=None, lse=None):
        res = self._fwd(q, k, v, softmax_scale=float(scale), causal=bool(causal), softcap=float(softcap),
                        return_lse=True, out=out, lse=lse, **_extra(window, varlen))
        return res[0], res[1]


class FA4Backward(BlockBackward):
    """BackwardKernel: FA4's backward of one block from the merged out and lse."""

    takes_windows = True
    packs = True
    writes_segments_only = True  # (tests/test_gpu_backends.py::test_fa4_packed_calls_write_only_their_segments)
    dkv_in_input_dtype = True  # (a GQA group's query heads are summed in fp32 inside the kernel, rounded once)

    def __init__(self):
        self._bwd = _interface()._flash_attn_bwd

    def block(self, dout, q, k, v, out, lse, *, causal, scale, softcap, window=None, varlen=None, dq=None, dk=None,
              dv=None):
        dq, dk, dv = self._bwd(q, k, v, out.to(q.dtype), dout.to(q.dtype), lse.to(torch.float32).contiguous(),
                               softmax_scale=float(scale), causal=bool(causal), softcap=float(softcap), dq=dq,
                               dk=dk, dv=dv, **_extra(window, varlen))[:3]
        return dq, dk, dv
