"""One ``ring_flash_attn`` call's preparation: per-rank checks, cross-rank verification, plan and kernels.

Shared by the eager entry point (api.py) and the compiled one (_compiled.py, which runs it inside its
custom op at run time), so both validate, verify and plan identically.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from distcomm import _check
from distcomm.ring import RingComm
from distcomm_attention import _validation
from distcomm_attention.kernels import dispatch
from distcomm_attention.planning import balance, layouts
from distcomm_attention.planning.visibility import RingPlan, Visibility, ring_plan
from distcomm_attention.sharding import balance_window_of, resolve_layout

__all__ = ["Prepared", "prepare"]


class Prepared(NamedTuple):
    """What the ring loop needs: the plan, the softmax scale and the block kernels."""

    plan: RingPlan
    scale: float
    fwd: object
    bwd: object
    layout: object = None  # the planner's layout: a static name or an Assignment (Note [Balanced layout])


def prepare(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, comm: RingComm, *, layout: str | None, causal: bool,
    softmax_scale, window: tuple[int, int], softcap: float, attention_mask, cu_seqlens, backend: str,
    requires_grad: bool, extra: dict[str, object] | None = None, shards: tuple[int, int] | None = None,
    planner=None,
) -> Prepared:
    """Check this rank's inputs, verify the ring agrees (see Note [Verified signatures]), plan and pick kernels.

    Raises the per-rank errors on the rank that sees them and cross-rank disagreements on every rank.

    ``layout=None`` is resolved for ``comm``'s ring from the layout ``shard_sequence`` recorded
    (Note [Layout record] in sharding.py); the resolved layout is verified across the ring, and an ambiguous
    record raises after the exchange, on every rank alike.

    Strategies other than the ring pass ``extra``: more verified fields (the strategy, by name or by its index
    in ``strategies.dispatch.STRATEGIES``, and its degrees); ``shards``: (ranks, tokens per rank) the layout
    splits the sequence into, when not (comm.size, local length) (the hybrid's layout runs over its ring
    dimension); ``planner(vis, layout)``: the strategy's plan instead of this rank's ring plan (``layout``: the
    planner's layout, a static name or the ``Assignment`` of "balanced" / "auto").
    """
    ranks, shard_len = shards if shards is not None else (comm.size, None)
    resolved = resolve_layout(layout, comm)
    layout = resolved.layout
    docs = None
    docs_field = None  # the verified cu_seqlens: the boundaries, None, or why this rank's are invalid
    placement: list = [None, None]  # the balance window of a data-dependent layout, or the error finding it

    def find_placement():
        # Found before the exchange and raised after it (``concrete_layout``): a rank whose documents
        # shard_sequence never sharded must not raise while its peers wait in the exchange.
        try:
            placement[:] = [balance_window_of(layout, comm, docs, "ring_flash_attn"), None]
        except ValueError as e:
            placement[:] = [None, e]

    def placement_field():
        window_used, error = placement
        if error is not None:
            return _validation.Shown(("invalid", str(error)), f"invalid here ({error})")
        return _validation.Shown(-1, "None") if window_used is None else window_used

    def local_checks():
        nonlocal docs
        _validation.check_qkv(q, k, v)
        _validation.check_attention_mask(attention_mask, q)
        n = q.shape[1] if shard_len is None else shard_len
        layouts.check_local_length(layout, n, ranks)
        docs = _validation.check_cu_seqlens(cu_seqlens, q.shape[1] * comm.size)
        find_placement()
        vis = Visibility(causal, window, docs, attention_mask is not None)
        return vis, dispatch.select_kernels(backend, q, vis, softcap)

    def concrete_layout():
        if placement[1] is not None:
            raise placement[1]
        n = q.shape[1] if shard_len is None else shard_len
        name, _ = layouts.split_spec(layout)
        return balance.resolve(layouts.spec(name, placement[0]), n * ranks, ranks, docs)

    def verify(scale: float) -> None:
        fields = {
            "layout": resolved.field,
            "causal": causal,
            "softmax_scale": scale,
            "window_left": window[0],
            "window_right": window[1],
            "softcap": softcap,
            "attention_mask": attention_mask is not None,
            "cu_seqlens": docs if docs_field is None else docs_field,
            # the window a balanced / auto layout placed the documents with (-1: none; Note [Balanced sharding])
            "balance_window": placement_field(),
            # a rank whose inputs need no grad would skip the backward its peers wait in
            "requires_grad": requires_grad,
            # other strategies override these (the hybrids' degrees): every rank verifies the same fields
            "strategy": "ring",
            "ulysses": 0,
            "ring": 0,
            **(extra or {}),
        }
        if isinstance(fields["strategy"], int):  # an index into STRATEGIES: shown by name
            from distcomm_attention.strategies.dispatch import STRATEGIES  # (dispatch imports this module)

            fields["strategy"] = STRATEGIES[fields["strategy"]]
        _validation.verify_across_ring("ring_flash_attn", comm, {"q": q, "k": k, "v": v}, extra=fields)

    if _check.is_check_mode() or resolved.ambiguous:
        # Cross-rank facts first: ranks whose shapes differ then all raise the same error, instead of one
        # raising a local error while its peers wait in the exchange (see Note [Verified signatures]); an
        # ambiguous layout is raised after the exchange, by every rank alike (Note [Layout record]).
        if isinstance(q, torch.Tensor) and q.dim() == 4:  # the boundaries are part of the signature
            try:
                docs = _validation.check_cu_seqlens(cu_seqlens, q.shape[1] * comm.size)
            except (TypeError, ValueError) as e:  # reported by the local checks below, on this rank
                docs_field = _validation.Shown(("invalid", str(e)), f"invalid here ({e})")
            else:
                find_placement()
        verify(_validation.check_scale(softmax_scale, q.shape[-1] if q.dim() else 1))
        resolved.raise_if_ambiguous("ring_flash_attn")
        vis, (_name, fwd, bwd) = local_checks()
        scale = _validation.check_scale(softmax_scale, q.shape[3])
    else:
        vis, (_name, fwd, bwd) = local_checks()
        scale = _validation.check_scale(softmax_scale, q.shape[3])
        verify(scale)
    concrete = concrete_layout()  # the planner's layout
    if planner is not None:
        return Prepared(planner(vis, concrete), scale, fwd, bwd, concrete)
    return Prepared(ring_plan(concrete, vis, comm.size, comm.rank, q.shape[1]), scale, fwd, bwd, concrete)
