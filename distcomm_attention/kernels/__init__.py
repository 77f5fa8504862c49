"""Which kernel runs a block: one module per backend behind one contract.

- ``contract``: the block-kernel contract (block forward returning out and fp32 lse, block backward from
  the merged out / lse) and the helpers every backend shares.
- ``dispatch``: the backends' capability checks, ``backend="auto"``'s ordered preferences, and
  ``which_kernels``' answer.
- one module per backend: ``torch_exact`` (exact PyTorch math), ``triton_fwd`` / ``triton_bwd`` /
  ``triton_mask`` (our Triton kernels), ``fa4`` (flash-attn-4), ``cudnn`` (PyTorch's cuDNN ops), ``flash2``
  (FlashAttention-2 backward); ``triton_merge``: the block backends' fused output merge. These are the only
  modules that import triton, flash_attn or the cuDNN ops, each lazily.
"""
