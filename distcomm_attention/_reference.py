"""Reference attention for tests and the demo: plain float64 softmax attention on the whole sequence.

Deliberately the textbook formula (expanded kv heads, a full mask over global positions, torch.softmax), with
nothing shared with the block kernels, so it can judge them.
"""

from __future__ import annotations

import torch

__all__ = ["attention_reference"]


def attention_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = False,
    softmax_scale: float | None = None,
    positions: torch.Tensor | None = None,
    attention_mask: torch.Tensor | None = None,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    cu_seqlens: torch.Tensor | list[int] | None = None,
    upcast: bool = True,
) -> torch.Tensor:
    """softmax(q k^T * scale + mask) v in float64, differentiable (autograd gives the reference grads).

    Args:
        q: (batch, seq, heads, head_dim).
        k, v: (batch, seq_k, kv_heads, head_dim), heads % kv_heads == 0 (query head h uses kv head
            h // (heads // kv_heads)).
        causal: key j visible to query i iff pos(j) <= pos(i).
        softmax_scale: ``None`` means head_dim ** -0.5.
        positions: global position of each token (seq,) when q and k are the same permuted sequence;
            default 0..seq-1.
        attention_mask: bool (batch, seq) key padding mask in the same token order, True = attend.
        window_size: (left, right): key visible iff pos(i) - left <= pos(j) <= pos(i) + right (-1: unbounded).
        softcap: scores = softcap * tanh(scores / softcap) when > 0.
        cu_seqlens: document boundaries over positions; keys of another document are hidden.
        upcast: False computes in the inputs' dtype instead of float64 ("plain PyTorch attention in the same
            dtype", the yardstick of flash-attn's error criterion).

    Returns:
        (batch, seq, heads, head_dim) in float64 (``upcast``, else the inputs' dtype); a query with no visible
        key outputs zeros (and gets zero gradients); a NaN in q, k or v gives NaN in every output row it
        reaches.
    """
    if upcast:
        q, k, v = q.double(), k.double(), v.double()
    group = q.shape[2] // k.shape[2]
    k = k.repeat_interleave(group, dim=2)
    v = v.repeat_interleave(group, dim=2)
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale
    scores = torch.einsum("bihd,bjhd->bhij", q, k) * scale
    if softcap:
        scores = softcap * torch.tanh(scores / softcap)
    pos_q = torch.arange(q.shape[1]) if positions is None else positions.cpu()
    pos_k = torch.arange(k.shape[1]) if positions is None else positions.cpu()
    visible = torch.ones(len(pos_q), len(pos_k), dtype=torch.bool)
    left, right = window_size
    if causal:
        visible &= pos_k[None, :] <= pos_q[:, None]
    if left >= 0:
        visible &= pos_k[None, :] >= pos_q[:, None] - left
    if right >= 0:
        visible &= pos_k[None, :] <= pos_q[:, None] + right
    if cu_seqlens is not None:
        bounds = [int(x) for x in cu_seqlens]
        doc = torch.zeros(bounds[-1], dtype=torch.long)
        for d, (a, b) in enumerate(zip(bounds, bounds[1:])):
            doc[a:b] = d
        visible &= doc[pos_q][:, None] == doc[pos_k][None, :]
    visible = visible.to(scores.device)[None, None]
    if attention_mask is not None:
        visible = visible & attention_mask.to(scores.device)[:, None, None, :]
    scores = scores.masked_fill(~visible, float("-inf"))
    # A hidden key gets weight exactly 0, also in a row that is NaN (a NaN among the inputs reaches only the
    # rows and keys it meets); a query with no visible key: zero weights (softmax of a row of -inf is NaN).
    probs = torch.softmax(scores, dim=-1).masked_fill(~visible, 0.0)
    return torch.einsum("bhij,bjhd->bihd", probs, v)
