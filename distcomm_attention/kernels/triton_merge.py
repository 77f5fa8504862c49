"""One Triton kernel for the block backends' output merge (Note [Merging block outputs] in
distcomm_attention.kernels.contract): the running state of some rows and one block's normalised output
combined in a single pass.

    new  = logaddexp(lse, lse_b)                      (B, H, R) fp32; a row no block reached stays -inf,
                                                      a NaN lse stays NaN
    dst  = exp(lse - new) * src + exp(lse_b - new) * out_b        (B, R, H, D), summed in fp32
    lse <- new

``src`` is the state's previous output for these rows (the adopted block output in its own dtype, or the
fp32 running sum: then ``src`` may be ``dst``, each element is read before it is written by the same
program); ``dst`` is fp32. The PyTorch composition of the same math takes five passes over the rows (two
products, a sum, a conversion, a copy) and allocates two fp32 temporaries; this reads src and out_b once and
writes dst once.

Any strides: the tensors are views of the state's rows and of a packed kernel output. One program takes
BLOCK_R rows of one (batch element, head).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

__all__ = ["merge_rows"]


@triton.jit
def _merge_kernel(
    dst, src, lse, out_b, lse_b,
    s_dst_b, s_dst_r, s_dst_h,
    s_src_b, s_src_r, s_src_h,
    s_lse_b, s_lse_h, s_lse_r,
    s_ob_b, s_ob_r, s_ob_h,
    s_lb_b, s_lb_h, s_lb_r,
    R, H, D,
    BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr,
):
    pid_r, pid_h, pid_b = tl.program_id(0), tl.program_id(1).to(tl.int64), tl.program_id(2).to(tl.int64)
    rows = (pid_r * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)  # offsets in int64: states of > 2^31 elements
    cols = tl.arange(0, BLOCK_D)
    in_r = rows < R
    lse_ptr = lse + pid_b * s_lse_b + pid_h * s_lse_h + rows * s_lse_r
    old = tl.load(lse_ptr, mask=in_r, other=float("-inf")).to(tl.float32)
    blk = tl.load(lse_b + pid_b * s_lb_b + pid_h * s_lb_h + rows * s_lb_r, mask=in_r,
                  other=float("-inf")).to(tl.float32)
    hi = tl.maximum(old, blk)
    shift = tl.where(hi == float("-inf"), 0.0, hi)  # rows no block reached: weights 0, not NaN
    e_old = tl.exp(old - shift)
    e_blk = tl.exp(blk - shift)
    total = e_old + e_blk
    # total == 0: no block reached the row. A NaN (a NaN lse) is kept: log and the weights carry it.
    safe = tl.where(total == 0, 1.0, total)
    new = tl.where(total == 0, float("-inf"), shift + tl.log(safe))
    w_old = e_old / safe
    w_blk = e_blk / safe
    tile = in_r[:, None] & (cols[None, :] < D)
    src_ptr = src + pid_b * s_src_b + pid_h * s_src_h + rows[:, None] * s_src_r + cols[None, :]
    ob_ptr = out_b + pid_b * s_ob_b + pid_h * s_ob_h + rows[:, None] * s_ob_r + cols[None, :]
    a = tl.load(src_ptr, mask=tile, other=0.0).to(tl.float32)
    b = tl.load(ob_ptr, mask=tile, other=0.0).to(tl.float32)
    res = a * w_old[:, None] + b * w_blk[:, None]
    dst_ptr = dst + pid_b * s_dst_b + pid_h * s_dst_h + rows[:, None] * s_dst_r + cols[None, :]
    tl.store(dst_ptr, res, mask=tile)
    tl.store(lse_ptr, new, mask=in_r)


def merge_rows(dst: Tensor, src: Tensor, lse: Tensor, out_b: Tensor, lse_b: Tensor) -> None:
    """The merge above, in place on ``dst`` (B, R, H, D) fp32 and ``lse`` (B, H, R) fp32; ``src`` and ``out_b``
    (B, R, H, D) in any float dtype, ``lse_b`` (B, H, R). The last dimension of every (B, R, H, D) tensor
    must be contiguous."""
    b, r, h, d = dst.shape
    if r == 0 or b == 0:
        return
    for x in (dst, src, out_b):
        if x.stride(-1) != 1:
            raise ValueError(f"merge_rows: the head dimension must be contiguous (strides {tuple(x.stride())})")
    block_r = 32 if d <= 128 else 16
    grid = (triton.cdiv(r, block_r), h, b)
    _merge_kernel[grid](
        dst, src, lse, out_b, lse_b,
        dst.stride(0), dst.stride(1), dst.stride(2),
        src.stride(0), src.stride(1), src.stride(2),
        lse.stride(0), lse.stride(1), lse.stride(2),
        out_b.stride(0), out_b.stride(1), out_b.stride(2),
        lse_b.stride(0), lse_b.stride(1), lse_b.stride(2),
        r, h, d,
        BLOCK_R=block_r, BLOCK_D=triton.next_power_of_2(d),
    )


def fused_available(device: torch.device) -> bool:
    """Whether the merge of tensors on ``device`` runs as this kernel: on CUDA (CPU tensors take the PyTorch
    composition; the tests run the kernel there under the Triton interpreter)."""
    return device.type == "cuda"
