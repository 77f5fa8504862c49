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

    Returns:
        (batch, seq, heads, head_dim) in float64.
    """
    q, k, v = q.double(), k.double(), v.double()
    group = q.shape[2] // k.shape[2]
    k = k.repeat_interleave(group, dim=2)
    v = v.repeat_interleave(group, dim=2)
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale
    scores = torch.einsum("bihd,bjhd->bhij", q, k) * scale
    if causal:
        pos_q = torch.arange(q.shape[1]) if positions is None else positions
        pos_k = torch.arange(k.shape[1]) if positions is None else positions
        visible = pos_k[None, :] <= pos_q[:, None]
        scores = scores.masked_fill(~visible.to(scores.device), float("-inf"))
    return torch.einsum("bhij,bjhd->bihd", torch.softmax(scores, dim=-1), v)
