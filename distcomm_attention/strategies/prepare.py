"""One ``ring_flash_attn`` call's preparation: per-rank checks, cross-rank verification, plan and kernels.

Shared by the eager entry point (api.py) and the compiled one (_compiled.py, which runs it inside its
custom op at run time), so both validate, verify and plan identically.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from distcomm.ring import RingComm
from distcomm_attention import _validation
from distcomm_attention.kernels import dispatch
from distcomm_attention.planning import balance, layouts
from distcomm_attention.planning.visibility import RingPlan, Visibility, ring_plan
from distcomm_attention.sharding import balance_window_of, resolve_layout

__all__ = ["Prepared", "prepare", "ring_comm"]


class Prepared(NamedTuple):
    """What the ring loop needs: the plan, the softmax scale and the block kernels."""

    plan: RingPlan
    scale: float
    fwd: object
    bwd: object
    layout: object = None  # the planner's layout: a static name or an Assignment (Note [Balanced layout])


def ring_comm(group, ring_size) -> tuple[RingComm, BaseException | None]:
    """The ring of ``group`` with ``ring_size`` ranks, or, for a ring size the group cannot take, the whole group
    and that error (decided with the peers by ``prepare``, Note [Collective verdicts])."""
    comm, error = _validation.verdict(RingComm, group, ring_size)
    return (comm, None) if comm is not None else (RingComm(group), error)


def prepare(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, comm: RingComm, *, layout: str | None, causal: bool,
    softmax_scale, window: tuple[int, int], softcap: float, attention_mask, cu_seqlens, backend: str,
    requires_grad: bool, extra: dict[str, object] | None = None, shards: tuple[int, int] | None = None,
    planner=None, error: BaseException | None = None, op: str = "ring_flash_attn",
) -> Prepared:
    """Check this rank's inputs, verify the ranks agree (Note [Collective verdicts]), plan and pick kernels.

    Every input error, this rank's or a peer's, is raised on every rank after the one exchange; ``error`` is
    one the caller found already (in arguments checked before the ring was known). ``op`` names the entry
    point in the messages.

    ``layout=None`` is resolved for ``comm``'s ring from the layout ``shard_sequence`` recorded
    (Note [Layout record] in sharding.py); the resolved layout is verified across the ring, and an ambiguous
    record raises after the exchange, on every rank alike.

    Strategies other than the ring pass ``extra``: more verified fields (the strategy, by name or by its index
    in ``strategies.dispatch.STRATEGIES``, and its degrees; ``"auto": True`` for a strategy the cost model
    picked, which then verifies the kernel calls it counted: a rank whose backend packs them and a rank whose
    backend does not may pick differently); ``shards``: (ranks, tokens per rank) the layout
    splits the sequence into, when not (comm.size, local length) (the hybrid's layout runs over its ring
    dimension); ``planner(vis, layout)``: the strategy's plan instead of this rank's ring plan (``layout``: the
    planner's layout, a static name or the ``Assignment`` of "balanced" / "auto").
    """
    ranks, shard_len = shards if shards is not None else (comm.size, None)
    docs = None
    placement: list = [None, None]  # the balance window of a data-dependent layout, or the error finding it

    def local_checks():
        nonlocal docs
        if error is not None:
            raise error
        resolved = resolve_layout(layout, comm)
        _validation.check_qkv(q, k, v)
        _validation.check_attention_mask(attention_mask, q)
        n = q.shape[1] if shard_len is None else shard_len
        if not resolved.ambiguous:  # raised after the exchange, by every rank alike (Note [Layout record])
            layouts.check_local_length(resolved.layout, n, ranks)
        docs = _validation.check_cu_seqlens(cu_seqlens, q.shape[1] * comm.size)
        try:  # a rank whose documents shard_sequence never sharded: shown as a verified field
            placement[:] = [balance_window_of(resolved.layout, comm, docs, op), None]
        except ValueError as e:
            placement[:] = [None, e]
        vis = Visibility(causal, window, docs, attention_mask is not None)
        kernels = dispatch.select_kernels(backend, q, vis, softcap)
        return resolved, vis, kernels, _validation.check_scale(softmax_scale, q.shape[3])

    checked, local_error = _validation.verdict(local_checks)
    resolved, vis, (_name, fwd, bwd), scale = checked or (None, None, (None, None, None), float("nan"))

    window_used, placement_error = placement
    if placement_error is not None:
        balance_window = _validation.Shown(("invalid", str(placement_error)), f"invalid here ({placement_error})")
    else:
        balance_window = _validation.Shown(-1, "None") if window_used is None else window_used
    fields = {
        "layout": resolved.field if resolved is not None else None,
        "causal": causal,
        "softmax_scale": scale,
        "window_left": window[0],
        "window_right": window[1],
        "softcap": softcap,
        "attention_mask": attention_mask is not None,
        "cu_seqlens": docs,
        # the window a balanced / auto layout placed the documents with (-1: none; Note [Balanced sharding])
        "balance_window": balance_window,
        # a rank whose inputs need no grad would skip the backward its peers wait in
        "requires_grad": requires_grad,
        # other strategies override these (the hybrids' degrees): every rank verifies the same fields
        "strategy": "ring",
        "ulysses": 0,
        "ring": 0,
        "ulysses_halves": False,  # Note [Ulysses halves]: the 1-D strategies pass the switch
        "mesh": (),  # the default group's rank at each (ring, ulysses) coordinate, for a call over a 2-D mesh
        # "auto"'s picks (below); every call verifies the same fields, so that a rank whose input error made it
        # skip its strategy still meets its peers' exchange
        "kernel calls auto counted": _validation.Shown(-1, "not asked"),
        **(extra or {}),
    }
    if fields.pop("auto", False):  # the pick counted the backend's packed calls: the ranks must agree on them
        packs = checked is not None and attention_mask is None and dispatch.packs(_name)
        fields["kernel calls auto counted"] = _validation.Shown(
            packs, f"{'packed' if packs else 'one per block'} (backend {_name!r})")
    if isinstance(fields["strategy"], int):  # an index into STRATEGIES: shown by name
        from distcomm_attention.strategies.dispatch import STRATEGIES  # (dispatch imports this module)

        fields["strategy"] = STRATEGIES[fields["strategy"]]
    # the dtype the sparse exchanges (the all-gather's, the sparse ring's) send dK/dV home in follows the backward
    # kernel (Note [Sparse gather], "What goes home"; Note [Sparse ring]): the ranks must agree, or one would send
    # what another does not expect ("auto" verifies the strategy it picked)
    home = _validation.Shown("not used", "not used")
    if fields["strategy"] in ("allgather", "hybrid_allgather", "ring", "hybrid") and checked is not None:
        dtype = "the inputs' dtype" if getattr(bwd, "dkv_in_input_dtype", False) else "fp32"
        home = _validation.Shown(dtype, f"{dtype} (backend {_name!r})")
    fields["sparse dK/dV home in"] = home
    _validation.verify_across_ring(op, comm, {"q": q, "k": k, "v": v}, extra=fields,
                                   error=local_error, mesh=bool(fields["mesh"]))
    resolved.raise_if_ambiguous(op)
    if placement_error is not None:
        raise placement_error
    n = q.shape[1] if shard_len is None else shard_len
    name, _ = layouts.split_spec(resolved.layout)
    concrete = balance.resolve(layouts.spec(name, window_used), n * ranks, ranks, docs)  # the planner's layout
    if planner is not None:
        return Prepared(planner(vis, concrete), scale, fwd, bwd, concrete)
    return Prepared(ring_plan(concrete, vis, comm.size, comm.rank, q.shape[1]), scale, fwd, bwd, concrete)
