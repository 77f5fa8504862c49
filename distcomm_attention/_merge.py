"""Block backends: a kernel that attends one query block to one key block becomes the ring's kernels.

A block backend (cuDNN, flash-attn-4) offers two calls on plain full or causal blocks:

    forward(q, k, v, *, causal, scale, softcap)                 -> out (B, Sq, H, D) in q's dtype,
                                                                    lse (B, H, Sq) float32, natural log
    backward(dout, q, k, v, out, lse, *, causal, scale, softcap) -> dq, dk, dv in q's dtype

``BlockForward`` turns the first into the ring's ForwardKernel and ``BlockBackward`` the second into its
BackwardKernel (contracts in distcomm_attention._kernels). ``call_features`` names what a call asks for
beyond plain full/causal attention, for the backends' capability checks.

Note [Merging block outputs]
    A block backend normalises each block on its own: it returns out_b = softmax(S_b) V_b and
    lse_b = log sum exp(S_b) per row. Two blocks of the same rows combine exactly by

        lse = log(exp(lse_a) + exp(lse_b))
        out = exp(lse_a - lse) out_a + exp(lse_b - lse) out_b

    (both weights <= 1, so nothing overflows). The running state is (out, lse) in fp32 for the rows a
    step touches; a row no block has reached has lse = -inf and weight 0, and finalizes to out 0,
    lse -inf like the other kernels. The state adopts the first block that covers every row as it is,
    without a copy: a ring of one (one block) is exactly one kernel call, its out and lse returned
    untouched. Only a second block converts the state to fp32 and merges, so each block's output is
    rounded once, by its kernel, and the sum is rounded once, by ``finalize``.

    The backward needs no merging: given the merged (global) out and lse of a row, the block kernels'
    own backward (P = exp(S - lse), D = rowsum(dout * out)) yields exactly this block's share of dq and
    its dk, dv.
"""

from __future__ import annotations

import torch
from torch import Tensor

from distcomm_attention._visibility import BlockMask, Visibility

__all__ = ["BlockForward", "BlockBackward", "MergeState", "merge_block", "call_features"]


def call_features(vis: Visibility, softcap: float) -> dict[str, str]:
    """What a call asks for beyond plain full or causal attention, by feature name, as it reads in messages.

    Keys: "attention_mask", "window_size", "cu_seqlens", "softcap" (only those the call uses).
    """
    features = {}
    if vis.key_mask:
        features["attention_mask"] = "attention_mask"
    if vis.window != (-1, -1) and not (vis.causal and vis.left is None):
        features["window_size"] = f"window_size={vis.window}"
    if vis.cu_seqlens is not None:
        features["cu_seqlens"] = "cu_seqlens (packed documents)"
    if softcap:
        features["softcap"] = f"softcap={softcap}"
    return features


def _block_causal(name: str, mask: BlockMask, key_mask: Tensor | None) -> bool:
    """The block's causal flag; ValueError for a visibility a block backend cannot express (the backend
    selection never gives it one)."""
    if mask.mode not in ("full", "causal") or key_mask is not None:
        raise ValueError(
            f"{name}: only full or causal blocks without a key mask are supported (got mode {mask.mode!r}, key "
            f"mask {'given' if key_mask is not None else 'none'}); use backend='triton'"
        )
    return mask.mode == "causal"


def _covers(rows: slice, n: int) -> bool:
    """Whether ``rows`` (step 1) selects all n rows."""
    start, stop, _ = rows.indices(n)
    return start == 0 and stop == n


class MergeState:
    """Running (out, lse) of one rank's queries (see Note [Merging block outputs]).

    ``out`` is None (nothing seen yet), the first whole-coverage block's own output (q's dtype) or the
    fp32 merged output (B, Sq, H, D); ``lse`` (B, H, Sq) fp32 alongside (fp64 both when the blocks' lse
    is fp64, as from exact float64 kernels).
    """

    __slots__ = ("shape", "device", "out", "lse", "merged")

    def __init__(self, shape: torch.Size, device: torch.device):
        self.shape = shape
        self.device = device
        self.out: Tensor | None = None
        self.lse: Tensor | None = None
        self.merged = False


def merge_block(state: MergeState, out_b: Tensor, lse_b: Tensor, rows: slice = slice(None)) -> None:
    """Merge one block's normalised output ``out_b`` (B, n, H, D) and ``lse_b`` (B, H, n) fp32 into the state
    rows ``rows`` (n of them), in place; the sums run in fp32 (fp64 for an fp64 ``lse_b``)."""
    b, sq, h, d = state.shape
    dtype = torch.float64 if lse_b.dtype == torch.float64 else torch.float32
    if state.out is None:
        if _covers(rows, sq):
            state.out, state.lse = out_b, lse_b  # adopted as returned: no copy, no merge
            return
        state.out = torch.zeros(b, sq, h, d, dtype=dtype, device=state.device)
        state.lse = torch.full((b, h, sq), float("-inf"), dtype=dtype, device=state.device)
        state.merged = True
    elif not state.merged:
        state.out = state.out.to(dtype)
        state.merged = True
    acc, lse = state.out[:, rows], state.lse[:, :, rows]
    new = torch.logaddexp(lse, lse_b)
    shift = new.masked_fill(new == float("-inf"), 0.0)  # rows still empty keep weight 0 instead of NaN
    w_old = torch.exp(lse - shift).transpose(1, 2).unsqueeze(-1)
    w_new = torch.exp(lse_b - shift).transpose(1, 2).unsqueeze(-1)
    acc.mul_(w_old).add_(out_b * w_new)
    lse.copy_(new)


class BlockForward:
    """ForwardKernel over a block backend's forward (``block``, set by subclasses)."""

    def block(self, q: Tensor, k: Tensor, v: Tensor, *, causal: bool, scale: float,
              softcap: float) -> tuple[Tensor, Tensor]:
        """One block: out (B, Sq, H, D) in q's dtype, lse (B, H, Sq) float32."""
        raise NotImplementedError

    def init_state(self, q: Tensor) -> MergeState:
        """An empty state for queries q (B, Sq, H, D); nothing is allocated until a block arrives."""
        return MergeState(q.shape, q.device)

    def step(self, state: MergeState, q: Tensor, k: Tensor, v: Tensor, *, mask: BlockMask, scale: float,
             softcap: float = 0.0, key_mask: Tensor | None = None, q_slice: slice = slice(None),
             final: bool = False) -> None:
        """Attend q[:, q_slice] to (k, v) under ``mask`` ("full" or "causal") and merge the block into the
        state rows q_slice. A block covering every row of a fresh state is kept as the kernel returned it,
        whether or not ``final`` is set, so a ring of one is one kernel call."""
        causal = _block_causal(type(self).__name__, mask, key_mask)
        rows = q[:, q_slice]
        if rows.numel() == 0 or k.shape[1] == 0:
            return
        out_b, lse_b = self.block(rows, k, v, causal=causal, scale=scale, softcap=softcap)
        merge_block(state, out_b, lse_b, q_slice)

    def finalize(self, state: MergeState, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """-> out (B, Sq, H, D) in ``dtype``, lse (B, H, Sq) float32 (the blocks' lse dtype); rows that saw no
        key: out 0, lse -inf."""
        if state.out is None:
            b, sq, h, _ = state.shape
            return (torch.zeros(state.shape, dtype=dtype, device=state.device),
                    torch.full((b, h, sq), float("-inf"), dtype=torch.float32, device=state.device))
        return state.out.to(dtype), state.lse


class BlockBackward:
    """BackwardKernel over a block backend's backward (``block``, set by subclasses); see
    Note [Merging block outputs]. ``delta`` is not read (``uses_delta`` False): the kernels compute
    rowsum(dout * out) themselves."""

    uses_delta = False

    def block(self, dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, *, causal: bool,
              scale: float, softcap: float) -> tuple[Tensor, Tensor, Tensor]:
        """One block from the merged out / lse: dq (B, Sq, H, D), dk, dv (B, Sk, Hkv, D) in q's dtype."""
        raise NotImplementedError

    def step(self, dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
             delta: Tensor | None = None, *, mask: BlockMask, scale: float, softcap: float = 0.0,
             key_mask: Tensor | None = None, dq_acc: Tensor | None = None,
             dkv_dtype: torch.dtype | None = None) -> tuple[Tensor, Tensor, Tensor]:
        """dout, q, out: (B, Sq, H, D); lse: (B, H, Sq) of the merged (global) rows; k, v: (B, Sk, Hkv, D).
        Adds the block's dq into ``dq_acc`` and returns it (the kernel's dq without one); dk, dv in
        ``dkv_dtype`` (the kernel's dtype without one)."""
        causal = _block_causal(type(self).__name__, mask, key_mask)
        if q.numel() == 0 or k.shape[1] == 0:
            dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        else:
            dq, dk, dv = self.block(dout, q, k, v, out, lse, causal=causal, scale=scale, softcap=softcap)
        if dq_acc is not None:
            dq = dq_acc.add_(dq)
        if dkv_dtype is not None:
            dk, dv = dk.to(dkv_dtype), dv.to(dkv_dtype)
        return dq, dk, dv
