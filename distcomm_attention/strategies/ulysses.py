"""Ulysses: all-to-all from sequence sharding to head sharding, attention over the whole sequence, and back.

Note [Ulysses]
    W ranks, rank r holding n tokens of every head (any layout). Two all-to-alls (distcomm's, whose
    backward is the adjoint all-to-all) move the sequence dimension for the head dimension:

        q (B, n, H, D)  --a2a-->  (B, W n, H / W, D)   rank r gets heads [r H/W, (r+1) H/W) of every token,
                                                        rank w's tokens at rows [w n, (w+1) n)
        attention over the whole sequence for those heads: ONE kernel call per block of the local plan
        out (B, W n, H / W, D)  --a2a-->  (B, n, H, D)

    The rows arrive in source order; for the zigzag and striped layouts they are put into natural order
    (one index_select) so that packed documents and windows keep their global positions and the local plan
    is the plain one (a packed batch is a single varlen call). The key padding mask is all-gathered.

    GQA, with G = H / Hkv query heads per kv head and h = H / W query heads per rank:
        Hkv % W == 0         kv heads split like the query heads: Hkv / W per rank, traffic at kv size
        G % h == 0           every rank's query heads share one kv head: that head is sent to the rank
                             (kv heads replicated, as DeepSpeed's ALST does): one kv head per rank
        otherwise            kv heads expanded to one per query head
    H % W != 0 is an error naming both numbers. With a 2-D mesh the "inner" attention is itself a ring or
    all-gather over the other mesh dimension (the hybrid, strategies/hybrid.py).
"""

from __future__ import annotations

import torch

from torch.autograd.function import once_differentiable

import distcomm.functional as dfunc
from distcomm_attention.strategies.ring import _no_autocast

__all__ = ["check_heads", "kv_head_index", "seq_to_heads", "heads_to_seq", "gather_key_mask", "ulysses"]


def check_heads(heads: int, kv_heads: int, degree: int) -> None:
    """Raise ValueError unless the query heads split evenly over the Ulysses degree."""
    if heads % degree:
        allowed = [d for d in range(1, heads + 1) if heads % d == 0]
        raise ValueError(
            f"strategy 'ulysses' splits the query heads over the Ulysses degree: heads={heads} is not divisible "
            f"by the degree {degree} (degrees that divide heads={heads}: {allowed}); use strategy='ring' or "
            f"'allgather', or the hybrid with a Ulysses dimension that divides the heads"
        )


def kv_head_index(heads: int, kv_heads: int, degree: int) -> list[int] | None:
    """The kv heads to send, in rank-major order, or None to send k, v as they are (see Note [Ulysses])."""
    if kv_heads % degree == 0:
        return None
    group, per_rank = heads // kv_heads, heads // degree
    if group % per_rank == 0:
        return [(r * per_rank) // group for r in range(degree)]
    return [h // group for h in range(heads)]


def _a2a(send: torch.Tensor, group) -> torch.Tensor:
    """distcomm's all-to-all of dim 0 (equal splits), outside autograd: the Function below is the adjoint."""
    with torch.no_grad():
        return dfunc.all_to_all_single(torch.empty_like(send), send, group=group)


def seq_to_heads(x: torch.Tensor, group, degree: int) -> torch.Tensor:
    """(B, n, H, D) sequence-sharded -> (B, W n, H / W, D) head-sharded, rows in source order."""
    if degree == 1:
        return x
    b, n, h, d = x.shape
    recv = _a2a(x.reshape(b, n, degree, h // degree, d).permute(2, 0, 1, 3, 4).contiguous(), group)
    return recv.permute(1, 0, 2, 3, 4).reshape(b, degree * n, h // degree, d)


def heads_to_seq(y: torch.Tensor, group, degree: int) -> torch.Tensor:
    """(B, W n, H / W, D) head-sharded, rows in source order -> (B, n, H, D) sequence-sharded."""
    if degree == 1:
        return y
    b, s, h, d = y.shape
    n = s // degree
    recv = _a2a(y.reshape(b, degree, n, h, d).permute(1, 0, 2, 3, 4).contiguous(), group)
    return recv.permute(1, 2, 0, 3, 4).reshape(b, n, degree * h, d)


def gather_key_mask(key_mask: torch.Tensor | None, group, degree: int) -> torch.Tensor | None:
    """Every rank's key padding mask rows, concatenated in source order (no autograd)."""
    if key_mask is None or degree == 1:
        return key_mask
    with torch.no_grad():
        return dfunc.all_gather_tensor(key_mask.contiguous().view(torch.uint8), 1, group).view(torch.bool)


class _UlyssesAttn(torch.autograd.Function):
    """out = attention over the whole sequence, head-sharded in between; see Note [Ulysses].

    Adjoint: all_to_all <-> all_to_all in the other direction; the kv heads' selection <-> a sum over the
    copies of each kv head (in fp32). ``inner`` computes the head-sharded attention: ``inner.forward(q, k,
    v, key_mask) -> (out, lse)`` and ``inner.backward(dout, q, k, v, out, lse, key_mask) -> (dq, dk, dv)``.
    """

    @staticmethod
    def forward(ctx, q, k, v, key_mask, group, degree: int, inner):
        kv_heads = k.shape[2]
        index = kv_head_index(q.shape[2], kv_heads, degree)
        ids = None if index is None else torch.tensor(index, device=k.device)
        if ids is not None:
            k, v = k.index_select(2, ids), v.index_select(2, ids)
        qh, kh, vh = (seq_to_heads(t, group, degree) for t in (q, k, v))
        km = gather_key_mask(key_mask, group, degree)
        out, lse = inner.forward(qh, kh, vh, km)
        ctx.save_for_backward(qh, kh, vh, out, lse, km, ids)
        ctx.group, ctx.degree, ctx.inner, ctx.kv_heads = group, degree, inner, kv_heads
        return heads_to_seq(out, group, degree)

    @staticmethod
    @once_differentiable
    def backward(ctx, dout):
        qh, kh, vh, out, lse, km, ids = ctx.saved_tensors
        group, degree = ctx.group, ctx.degree
        dq, dk, dv = ctx.inner.backward(seq_to_heads(dout.contiguous(), group, degree), qh, kh, vh, out, lse, km)
        dq, dk, dv = (heads_to_seq(t, group, degree) for t in (dq, dk, dv))
        if ids is not None:  # the copies of each kv head sum to its gradient
            b, n, _, d = dk.shape
            acc = torch.float64 if dk.dtype == torch.float64 else torch.float32
            dk = torch.zeros(b, n, ctx.kv_heads, d, dtype=acc, device=dk.device).index_add_(2, ids, dk.to(acc))
            dv = torch.zeros(b, n, ctx.kv_heads, d, dtype=acc, device=dv.device).index_add_(2, ids, dv.to(acc))
            dk, dv = dk.to(dout.dtype), dv.to(dout.dtype)
        return dq, dk, dv, None, None, None, None


def ulysses(q, k, v, key_mask, group, degree: int, inner) -> torch.Tensor:
    """Head-shard q, k, v over ``group``, run ``inner`` on the gathered rows (source order), shard back."""
    with _no_autocast(q.device):
        return _UlyssesAttn.apply(q, k, v, key_mask, group, degree, inner)
