"""``RingAttention``: a multi-head (GQA) attention layer over a sequence sharded across a ring of ranks."""

from __future__ import annotations

import torch
from torch import nn

from distcomm_attention import _validation
from distcomm_attention.kernels import dispatch
from distcomm_attention.planning import layouts
from distcomm_attention.planning.cost import Hardware, check_hardware
from distcomm_attention.strategies.dispatch import check_strategy
from distcomm_attention.api import context_parallel_attn, ring_flash_attn
from distcomm_attention.sharding import Sharding, merge_sharding

__all__ = ["RingAttention"]


def _positive_int(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"`{name}` must be a positive int, got {value!r}")
    return value


class RingAttention(nn.Module):
    """Fused q/k/v projection, ring flash attention, output projection.

    Args:
        dim: model width (input and output feature size).
        heads: query heads.
        dim_head: features per head.
        kv_heads: key/value heads (``None``: ``heads``); ``heads`` must be a multiple (GQA/MQA).
        causal: causal mask over global token positions.
        layout: how the sequence is sharded ("contiguous", "zigzag", "striped"; see ``ring_flash_attn``).
            ``None`` (default): resolved at each call like ``ring_flash_attn``'s (``sharding``'s layout, else
            the one ``shard_sequence`` recorded for the ring, else "contiguous"; Note [Layout record]).
        ring_size: ranks per ring (``None``: the whole group).
        group: process group of the ring (a 1-D DeviceMesh or ``(mesh, dim_name)`` too).
        backend: kernel backend, as in ``ring_flash_attn``.
        bias: whether the projections have biases.
        window_size: (left, right) sliding window over global positions, as in ``ring_flash_attn``.
        softcap: attention logit soft-capping (0: off), as in ``ring_flash_attn``.
        sharding: a :class:`Sharding` giving layout, group and ring size at once (the explicit handle);
            ``layout``, ``group`` or ``ring_size`` beside it must repeat its values.
        strategy: "ring" (default: ``ring_flash_attn``), or any strategy of ``context_parallel_attn``
            ("ulysses", "allgather", "hybrid", "hybrid_allgather", "auto"), which run over the whole
            ``group`` (``ring_size`` must be None).
        hardware: what ``strategy="auto"`` predicts with (``context_parallel_attn``'s ``hardware``).

    Shapes:
        input (batch, local_seq, dim), this rank's shard of the sequence -> output of the same shape.

    The parameters are replicated on every rank: with the summing convention (total loss = sum of the
    per-rank losses), the gradient of the total loss is the sum of the ranks' parameter gradients, e.g. an
    all_reduce(SUM) of each ``.grad`` (or DDP, which averages, for a mean of the per-rank losses).
    """

    def __init__(
        self,
        dim: int,
        heads: int,
        dim_head: int = 64,
        kv_heads: int | None = None,
        causal: bool = False,
        layout: str | None = None,
        ring_size: int | None = None,
        group=None,
        backend: str = "auto",
        bias: bool = False,
        window_size: tuple[int, int] = (-1, -1),
        softcap: float = 0.0,
        *,
        sharding: Sharding | None = None,
        strategy: str = "ring",
        hardware: Hardware | None = None,
    ):
        super().__init__()
        _positive_int("dim", dim)
        _positive_int("heads", heads)
        _positive_int("dim_head", dim_head)
        kv_heads = heads if kv_heads is None else _positive_int("kv_heads", kv_heads)
        if heads % kv_heads:
            raise ValueError(f"`heads`={heads} must be a multiple of `kv_heads`={kv_heads}")
        layout, group, ring_size = merge_sharding(sharding, layout, group, ring_size)
        check_strategy(strategy)
        if strategy != "ring" and ring_size is not None:
            raise ValueError(f"`strategy`={strategy!r} runs over the whole group: `ring_size`={ring_size} applies to "
                             f"strategy 'ring' only")
        self.strategy = strategy
        check_hardware(hardware)
        self.hardware = hardware
        if layout is not None:
            layouts.check_layout(layout)
        dispatch.check_backend(backend)
        self.heads, self.kv_heads, self.dim_head = heads, kv_heads, dim_head
        self.causal, self.layout, self.ring_size, self.group, self.backend = causal, layout, ring_size, group, backend
        self.window_size = _validation.check_window(window_size)
        self.softcap = _validation.check_softcap(softcap)
        self.to_qkv = nn.Linear(dim, (heads + 2 * kv_heads) * dim_head, bias=bias)
        self.to_out = nn.Linear(heads * dim_head, dim, bias=bias)

    def forward(
        self,
        x: torch.Tensor,
        *,
        attention_mask: torch.Tensor | None = None,
        cu_seqlens: torch.Tensor | list[int] | None = None,
    ) -> torch.Tensor:
        """x: (batch, local_seq, dim) -> (batch, local_seq, dim).

        ``attention_mask`` (bool (batch, local_seq), True = attend: this rank's shard of the key padding
        mask) and ``cu_seqlens`` (global document boundaries) are passed to ``ring_flash_attn``.
        """
        _, error = _validation.verdict(self._check_input, x)
        options = dict(causal=self.causal, layout=self.layout, group=self.group, backend=self.backend,
                       attention_mask=attention_mask, window_size=self.window_size, softcap=self.softcap,
                       cu_seqlens=cu_seqlens)
        if error is not None:  # raised by every rank, through the attention's own exchange of verdicts
            weight = self.to_qkv.weight
            # stand-ins of the peers' shapes where x has its batch and tokens (a wrong width), so that the
            # error is all the message says; else the stand-ins' shapes differ from the peers' too
            b, n = x.shape[:2] if isinstance(x, torch.Tensor) and x.dim() == 3 else (1, 1)
            q, k, v = (weight.new_zeros(b, n, h, self.dim_head) for h in (self.heads, self.kv_heads, self.kv_heads))
            with _validation.pending_error(error):
                self._attend(q, k, v, options)
            raise error  # (not reached: the call raises it on every rank)
        b, n, _ = x.shape
        q, k, v = self.to_qkv(x).split(
            [self.heads * self.dim_head, self.kv_heads * self.dim_head, self.kv_heads * self.dim_head], dim=-1
        )
        q, k, v = (t.view(b, n, h, self.dim_head) for t, h in ((q, self.heads), (k, self.kv_heads), (v, self.kv_heads)))
        out = self._attend(q, k, v, options)
        return self.to_out(out.reshape(b, n, self.heads * self.dim_head))

    def _check_input(self, x) -> None:
        dim = self.to_qkv.in_features
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"RingAttention expects `x`, a tensor (batch, local_seq, {dim}), got {type(x).__name__}")
        if x.dim() != 3 or x.shape[-1] != dim:
            raise ValueError(f"RingAttention expects `x` of shape (batch, local_seq, {dim}) (dim={dim}), got shape "
                             f"{tuple(x.shape)}")

    def _attend(self, q, k, v, options):
        if self.strategy == "ring":
            return ring_flash_attn(q, k, v, ring_size=self.ring_size, **options)
        return context_parallel_attn(q, k, v, strategy=self.strategy, hardware=self.hardware, **options)

    def extra_repr(self) -> str:
        return (
            f"heads={self.heads}, kv_heads={self.kv_heads}, dim_head={self.dim_head}, causal={self.causal}, "
            f"layout={self.layout!r}, ring_size={self.ring_size}, backend={self.backend!r}, strategy={self.strategy!r}"
        )
