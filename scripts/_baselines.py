"""Single-GPU attention baselines for the ring benchmarks: the whole sequence on one GPU, by kernel.

    name          what runs                                                       layout  GQA
    "sdpa_flash"  ``scaled_dot_product_attention`` under SDPBackend.FLASH_ATTENTION  BHSD    enable_gqa=True
                  (PyTorch's FlashAttention-2)                                             where the backend
    "sdpa_cudnn"  ``scaled_dot_product_attention`` under SDPBackend.CUDNN_ATTENTION  BHSD    takes it (probed,
                  (cuDNN; CUDA only)                                                       fwd+bwd), else kv
                                                                                           expanded BEFORE
                                                                                           timing
    "fa4"         flash-attn-4's ``flash_attn.cute.interface.flash_attn_func``     BSHD    native
                  (optional package; Hopper / Blackwell; JIT-compiled on the first call of a shape)

A kernel that cannot run here is skipped with the reason (``problem``): cuDNN and FA4 need CUDA, FA4 needs
its package and an sm90 / sm100 GPU. Expanding the kv heads before timing hands the baseline the
expansion for free (and its backward returns dK/dV at the query head count without reducing them), so
an efficiency against it errs low, never high.
"""

from __future__ import annotations

import torch

KERNELS = ("sdpa_flash", "sdpa_cudnn", "fa4")
LABELS = {"sdpa_flash": "SDPA FA2", "sdpa_cudnn": "SDPA cuDNN", "fa4": "flash-attn-4", "sdpa_efficient":
          "SDPA mem-efficient"}
SDPA_BACKENDS = ("flash", "cudnn", "efficient")


def sdpa_ctx(backend: str = "flash"):
    """``sdpa_kernel`` restricted to one SDPA backend: "flash" (FlashAttention-2), "cudnn" or "efficient"."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    which = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
             "efficient": SDPBackend.EFFICIENT_ATTENTION}[backend]
    return sdpa_kernel(which)


def sdpa_call(q, k, v, causal: bool, gqa: str):
    """SDPA on (B, H, S, D) under the caller's backend; ``gqa``: "none", "native" (enable_gqa=True) or
    "expand" (kv heads repeated here, i.e. inside whatever the caller times)."""
    import torch.nn.functional as TF  # looked up at call time: context_parallel patches this attribute

    if gqa == "expand":
        rep = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    kwargs = {"enable_gqa": True} if gqa == "native" else {}
    return TF.scaled_dot_product_attention(q, k, v, is_causal=causal, **kwargs)


def sdpa_gqa_mode(h: int, hkv: int, d: int, causal: bool, device, dtype, backend: str = "flash") -> str:
    """How SDPA under ``backend`` takes GQA here: "none" (MHA), "native" (enable_gqa=True works for forward
    and backward) or "expand" (the kv heads must be repeated to the query heads)."""
    if h == hkv:
        return "none"
    try:
        q = torch.randn(1, h, 128, d, device=device, dtype=dtype, requires_grad=True)
        k, v = (torch.randn(1, hkv, 128, d, device=device, dtype=dtype, requires_grad=True) for _ in range(2))
        with sdpa_ctx(backend):
            sdpa_call(q, k, v, causal, "native").sum().backward()
        return "native"
    except Exception:
        return "expand"


def problem(kernel: str, device: torch.device, dtype: torch.dtype, head_dim: int) -> str | None:
    """Why ``kernel`` cannot run on this device and dtype ("skipped: ..."), or None when it can."""
    if kernel not in (*KERNELS, "sdpa_efficient"):
        raise ValueError(f"unknown single-GPU kernel {kernel!r}; choose from {', '.join(KERNELS)}")
    if kernel == "sdpa_cudnn" and device.type != "cuda":
        return "skipped: SDPA cuDNN needs CUDA"
    if kernel == "fa4":
        from distcomm_attention.kernels import fa4 as _fa4
        from distcomm_attention.planning.visibility import Visibility

        exc = _fa4.can_use(device, dtype, head_dim, Visibility(), 0.0)
        if exc is not None:
            return f"skipped: {' '.join(str(exc).split())}"
    return None


def make_call(kernel: str, b: int, s: int, h: int, hkv: int, d: int, causal: bool, device, dtype):
    """(call, q, k, v, dout, note): ``call(q, k, v) -> out`` runs ``kernel`` on the whole sequence; the
    tensors are fresh random leaves in the kernel's layout (q, k, v require grad)."""
    if kernel == "fa4":
        from distcomm_attention.kernels import fa4 as _fa4

        func = _fa4._interface().flash_attn_func
        q, dout = (torch.randn(b, s, h, d, device=device, dtype=dtype) for _ in range(2))
        k, v = (torch.randn(b, s, hkv, d, device=device, dtype=dtype) for _ in range(2))
        note = "GQA: native" if h != hkv else ""

        def call(q, k, v):
            out = func(q, k, v, causal=causal)
            return out[0] if isinstance(out, tuple) else out
    else:
        backend = kernel.removeprefix("sdpa_")
        gqa = sdpa_gqa_mode(h, hkv, d, causal, device, dtype, backend)
        kv_heads = h if gqa == "expand" else hkv  # expanded before timing: the baseline does not pay for it
        q, dout = (torch.randn(b, h, s, d, device=device, dtype=dtype) for _ in range(2))
        k, v = (torch.randn(b, kv_heads, s, d, device=device, dtype=dtype) for _ in range(2))
        mode = "none" if gqa == "expand" else gqa
        note = {"none": "", "native": "GQA: enable_gqa=True", "expand": "GQA: kv expanded before timing"}[gqa]

        def call(q, k, v):
            with sdpa_ctx(backend):
                return sdpa_call(q, k, v, causal, mode)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    return call, q, k, v, dout, note


def best(times: dict[str, float | None]) -> tuple[str | None, float | None]:
    """(name, seconds) of the fastest measured entry of {name: seconds or None}; (None, None) if none."""
    measured = {n: t for n, t in times.items() if t}
    if not measured:
        return None, None
    name = min(measured, key=measured.get)
    return name, measured[name]

