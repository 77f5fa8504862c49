"""One context-parallel attention call: resolve the strategy and its groups, prepare, run.

Strategies (see each module's Note):

    "ring"              k, v travel around the group (strategies/ring.py), or only the rows each step reads,
                        sent directly (strategies/sparse_ring.py)
    "ulysses"           all-to-all to head sharding, whole-sequence attention (strategies/ulysses.py)
    "allgather"         k, v gathered once, dK/dV reduce-scattered (strategies/allgather.py)
    "hybrid"            Ulysses over a mesh dimension "ulysses" x ring over a dimension "ring" (relaying, or
                        the sparse ring's direct sends where the ring strategy would take them)
    "hybrid_allgather"  Ulysses over "ulysses" x all-gather KV over "ring"
    "auto"              the cheapest applicable one by the cost model (planning/cost.py); on a 2-D mesh the
                        hybrids and the 1-D strategies over all the mesh's ranks

Layouts: for "ring", "ulysses" and "allgather" the layout splits the sequence over the whole group; for the
hybrids it splits it over the "ring" dimension, and each of those shards is cut into equal contiguous
pieces over the "ulysses" dimension (``hybrid_positions``).
"""

from __future__ import annotations

import dataclasses

import torch

from distcomm import _groups
from distcomm.ring import RingComm
from distcomm_attention import _validation, transport
from distcomm_attention.kernels import dispatch as kernel_dispatch
from distcomm_attention.planning import cost, layouts
from distcomm_attention.planning.layouts import hybrid_positions
from distcomm_attention.planning.exchange import compact_gathered_plan, gathered_exchange, sparse_ring
from distcomm_attention.planning.plans import gathered_plan, half_plans, local_plan, natural_inverse, natural_order
from distcomm_attention.planning.visibility import Visibility, ring_plan
from distcomm_attention.strategies import allgather as _allgather
from distcomm_attention.strategies import ulysses as _ulysses
from distcomm_attention.sharding import concrete_layout, is_2d_mesh, mesh_field, mesh_grid, resolve_layout
from distcomm_attention._device import on_device
from distcomm_attention.strategies.prepare import prepare
from distcomm_attention.strategies.ring import ring_backward, ring_forward
from distcomm_attention.strategies.sparse_ring import (ring_planner, run_ring, sparse_ring_backward,
                                                       sparse_ring_forward)

__all__ = ["STRATEGIES", "check_strategy", "is_2d_mesh", "resolve_mesh", "hybrid_positions", "choose", "run"]

STRATEGIES = ("auto", "ring", "ulysses", "allgather", "hybrid", "hybrid_allgather")
_CODES = {name: i for i, name in enumerate(STRATEGIES)}
_HYBRID = ("hybrid", "hybrid_allgather")
_ONE_D = ("ring", "ulysses", "allgather")


def check_strategy(strategy) -> None:
    """Raise ValueError unless ``strategy`` names a strategy."""
    if strategy not in STRATEGIES:
        raise ValueError(f"`strategy` must be one of {list(STRATEGIES)}, got {strategy!r}")


def resolve_mesh(group):
    """(ulysses group, ring group) of a 2-D DeviceMesh with dimensions "ulysses" and "ring", spanning every rank."""
    if not is_2d_mesh(group):
        raise ValueError(
            "the hybrid strategies need `group` to be a 2-D DeviceMesh with dimensions named 'ulysses' and "
            f"'ring' (e.g. init_device_mesh(device, (rings, ulysses), mesh_dim_names=('ring', 'ulysses'))), "
            f"got {type(group).__name__}"
        )
    names = tuple(group.mesh_dim_names or ())
    if sorted(names) != ["ring", "ulysses"]:
        raise ValueError(f"the hybrid strategies need mesh dimensions named 'ulysses' and 'ring', got {names}")
    whole = group.size() == _groups.group_size(None)
    if not whole:
        raise ValueError(
            f"the hybrid strategies need the 2-D mesh to span every rank of the default group (so that every "
            f"rank verifies the call together); the mesh has {group.size()} of {_groups.group_size(None)} ranks"
        )
    return group.get_group("ulysses"), group.get_group("ring")


def _reorder(t: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """t's rows (dim 1) in ``index``'s order: one row gather of the (rows, the rest) view for a contiguous CUDA
    tensor of one batch element (``triton_rows.take_rows``: short rows 1.6-1.9x index_select on one H100)."""
    if t.is_cuda and t.shape[0] == 1 and t.dim() > 2 and t.is_contiguous():
        from distcomm_attention.kernels import triton_rows

        return triton_rows.take_rows(t.view(t.shape[1], -1), index).view(1, index.shape[0], *t.shape[2:])
    return t.index_select(1, index)


class _Ring:
    """A ring over ``comm`` as Ulysses' inner computation (the hybrid's ring dimension, or a ring of one for
    plain Ulysses, whose rows are put into natural order and back: Note [Ulysses]).

    ``natural`` / ``source`` move rows (dim 1) between the all-to-all's source order and the order the plan
    computes in; ``forward`` and ``backward`` take and return rows in the plan's order, so Ulysses reorders
    each tensor once and saves the reordered ones for the backward."""

    def __init__(self, comm: RingComm, plan, softcap: float, scale: float, fwd, bwd, order=None, parts=None,
                 halves=None, inverse=None):
        self.comm, self.plan, self.softcap, self.scale, self.fwd, self.bwd = comm, plan, softcap, scale, fwd, bwd
        self.order, self.inverse = order, inverse  # plans.natural_order / natural_inverse (cached host tensors)
        # Note [Ulysses halves]: the split of the rows (``halves``) and the plans of its two parts
        self.halves = halves if parts is not None and comm.size == 1 else None
        self._parts = parts

    def natural(self, *ts):
        if self.order is None:
            return ts
        return tuple(None if t is None else _reorder(t, on_device(self.order, t.device)) for t in ts)

    def source(self, *ts):
        if self.inverse is None:
            return ts
        return tuple(_reorder(t, on_device(self.inverse, t.device)) for t in ts)

    def forward(self, q, k, v, key_mask):
        return ring_forward(q, k, v, key_mask, self.comm, self.plan, self.softcap, self.scale, self.fwd)

    def backward(self, dout, q, k, v, out, lse, key_mask):
        return ring_backward(dout, q, k, v, out, lse, key_mask, self.comm, self.plan, self.softcap, self.scale,
                             self.bwd)

    def forward_part(self, part: int, q, k, v, key_mask):
        """``forward`` of the queries of one part of ``halves`` (Note [Ulysses halves])."""
        return ring_forward(q, k, v, key_mask, self.comm, self._parts[part], self.softcap, self.scale, self.fwd)

    def backward_part(self, part: int, dout, q, k, v, out, lse, key_mask):
        """The backward of one part: dq in q's dtype, dk, dv of the keys it read in the accumulation dtype."""
        return _allgather.local_backward(dout, q, k, v, out, lse, key_mask, self._parts[part], self.softcap,
                                         self.scale, self.bwd)


class _SparseRing:
    """The hybrid's ring dimension with direct sparse sends (Note [Sparse ring]) as Ulysses' inner computation,
    over transport ``t``; rows in source order. One forward, then its backward: the rows the forward keeps for
    the backward (``sp.keep``) wait on the object in between, and the first backward takes them (another
    backward through the same graph sends the rows again)."""

    def __init__(self, t, sp, softcap: float, scale: float, fwd, bwd):
        self.t, self.sp, self.softcap, self.scale, self.fwd, self.bwd = t, sp, softcap, scale, fwd, bwd
        self._kept = None

    @staticmethod
    def natural(*ts):
        return ts

    source = natural

    def forward(self, q, k, v, key_mask):
        if self._kept is not None:
            raise RuntimeError("the sparse ring's inner computation ran a second forward before its backward")
        out, lse, self._kept = sparse_ring_forward(q, k.contiguous(), v.contiguous(), key_mask, self.t, self.sp,
                                                   self.softcap, self.scale, self.fwd)
        return out, lse

    def backward(self, dout, q, k, v, out, lse, key_mask):
        kept, self._kept = self._kept, None
        return sparse_ring_backward(dout, q, k.contiguous(), v.contiguous(), out, lse, key_mask, self.t, self.sp,
                                    kept, self.softcap, self.scale, self.bwd)


def ulysses_inner(comm: RingComm, vis: Visibility, layout, ranks: int, local_len: int, softcap: float, scale: float,
                  fwd, bwd, *, plan=None, split: bool | None = None) -> _Ring:
    """Plain Ulysses' inner computation: the whole sequence's plan in natural order on one rank (``plan``, made
    when not given), in two parts where Note [Ulysses halves] applies and ``split`` (None: ``ulysses.HALVES``)."""
    split = _ulysses.HALVES if split is None else split
    seq_len = ranks * local_len
    plan = local_plan(vis, seq_len) if plan is None else plan
    split_rows = _ulysses.halves(layout, ranks, local_len) if split and ranks > 1 else None
    parts = None if split_rows is None else half_plans(vis, seq_len, split_rows.cut)
    return _Ring(comm, plan, softcap, scale, fwd, bwd, natural_order(layout, ranks, local_len), parts, split_rows,
                 natural_inverse(layout, ranks, local_len))


def _verification_comm(group) -> RingComm:
    """The ring a call verifies over (and whose recorded layout it uses): the default group for a 2-D mesh."""
    return RingComm(None) if is_2d_mesh(group) else RingComm(group)


def _local_layout(layout: str | None, group) -> str:
    """The layout for planning: as given, or the recorded one (ambiguity raised by ``prepare`` on every rank
    after its exchange; planners never run then)."""
    return resolve_layout(layout, _verification_comm(group)).layout or "contiguous"


def choose(q, k, *, group, layout: str, causal: bool, window, attention_mask, cu_seqlens,
           hardware: cost.Hardware | None = None, backend: str = "auto", softcap: float = 0.0) -> cost.StrategyChoice:
    """The strategy "auto" runs for this call, with every applicable strategy's prediction (Note [Cost model]).

    Per-rank input checks come first (the same errors as the call itself); nothing is communicated.
    ``backend``: the block kernels' backend (a name, or "auto": the one the call would run), whose packed
    calls the model counts where it packs a step's pieces.
    """
    _validation.check_qkv(q, k, k)
    layout = _local_layout(layout, group)
    if is_2d_mesh(group):
        ulysses_group, _ = resolve_mesh(group)
        u, world = _groups.group_size(ulysses_group), group.size()
        candidates = _HYBRID
    else:
        u, world = 1, RingComm(group).size
        candidates = _ONE_D
    docs = _validation.check_cu_seqlens(cu_seqlens, q.shape[1] * world)
    vis = Visibility(causal, window, docs, attention_mask is not None)
    layouts.check_local_length(layout, q.shape[1] * u, world // u)
    concrete = concrete_layout(layout, _verification_comm(group), q.shape[1] * world, world // u, docs,
                               "which_strategy")
    call = cost.Call(q.shape[0], q.shape[1], q.shape[2], k.shape[2], q.shape[3], q.element_size(), concrete, vis,
                     world, u, _packs(backend, q, vis, softcap) and attention_mask is None,
                     ulysses_halves=_ulysses.HALVES)
    hw = hardware or cost.Hardware()
    if not is_2d_mesh(group) or concrete == "striped":
        return cost.choose(call, candidates, hw)
    # a 2-D mesh: also the 1-D strategies over all its ranks, on its sharding, over the links across (not for
    # "striped", whose pieces of one token each would make thousands of blocks per rank)
    flat = dataclasses.replace(call, layout=layouts.mesh_assignment(concrete, q.shape[1] * world, mesh_grid(group)),
                               ulysses=1)
    return cost.choose_among((call, candidates, hw), (flat, _ONE_D, cost.links_across(hw)))


def _packs(backend: str, q, vis: Visibility, softcap: float) -> bool:
    """Whether the call's block kernels pack a step's pieces (the cost model then counts their calls). A named
    backend is asked whether it can do the call's features (not its device or dtype: ``which_strategy`` may
    ask about a GPU run from CPU tensors); "auto" resolves the backend the call would use, and where none
    can run it (the call itself raises that) the model counts one call per block."""
    kernel_dispatch.check_backend(backend)
    if backend != "auto":
        problem = kernel_dispatch.unsupported_feature(backend, vis, softcap)
        if problem is not None:
            raise ValueError(problem)
        return kernel_dispatch.packs(backend)
    try:
        return kernel_dispatch.packs(kernel_dispatch.choose(backend, q, vis, softcap).backend)
    except (ImportError, ValueError, TypeError):
        return False


def _gathered(layout, vis, world: int, rank: int, n: int):
    """(plan, exchange) of the all-gather computation: the gathered plan, re-indexed to the compacted buffer
    when only some keys move (Note [Sparse gather])."""
    exchange = gathered_exchange(layout, vis, world, n)
    if exchange is None:
        return gathered_plan(layout, vis, world, rank, n), None
    return compact_gathered_plan(layout, vis, world, rank, n), exchange


def _group_error(strategy: str, group) -> ValueError | None:
    """Why ``group`` cannot carry ``strategy`` (a 2-D mesh for a 1-D strategy, or the reverse), or None."""
    if strategy in _HYBRID:
        if is_2d_mesh(group) and group.size() != _groups.group_size(None):
            resolve_mesh(group)  # raised at once, alike on the mesh's ranks: the others never join the exchange
        return _validation.verdict(resolve_mesh, group)[1]
    if is_2d_mesh(group):
        return ValueError(
            f"strategy {strategy!r} runs over one group; a 2-D DeviceMesh is for strategy='hybrid' or "
            f"'hybrid_allgather' (or pass one of its dimensions, (mesh, 'ring'))"
        )
    return None


def run(q, k, v, *, strategy: str, group, layout: str, causal: bool, softmax_scale, window, softcap,
        attention_mask, cu_seqlens, backend: str, requires_grad: bool, error: BaseException | None = None,
        hardware: cost.Hardware | None = None):
    """Validate, verify, plan and run one call of ``strategy`` ("auto": the cost model's pick on ``hardware``).

    ``error``: an input error the caller found; like every input error it is raised on every rank after the
    exchange (Note [Collective verdicts]).
    """
    common = dict(layout=layout, causal=causal, softmax_scale=softmax_scale, window=window, softcap=softcap,
                  attention_mask=attention_mask, cu_seqlens=cu_seqlens, backend=backend,
                  requires_grad=requires_grad, op="context_parallel_attn")
    if error is None and strategy == "auto":
        picked, error = _validation.verdict(choose, q, k, group=group, layout=layout, causal=causal, window=window,
                                            attention_mask=attention_mask, cu_seqlens=cu_seqlens, backend=backend,
                                            softcap=softcap, hardware=hardware)
        # its error (an input's) is raised by ``prepare`` below, on every rank of the group the call was given
        strategy = ("hybrid" if is_2d_mesh(group) else "ring") if picked is None else picked.strategy
        auto = {"auto": True}
    else:
        auto = {}
    over_mesh = bool(auto) and strategy in _ONE_D and is_2d_mesh(group)  # auto's 1-D pick over a whole mesh
    if error is None and not over_mesh:
        error = _group_error(strategy, group)
    if error is not None:
        prepare(q, k, v, _verification_comm(group), error=error, **common)  # raises on every rank
    n = q.shape[1] if isinstance(q, torch.Tensor) and q.dim() == 4 else 0
    if strategy in _HYBRID:
        ulysses_group, ring_group = resolve_mesh(group)
        comm = RingComm(None)  # verification over the default group: every rank of the mesh
        wu, wr = _groups.group_size(ulysses_group), _groups.group_size(ring_group)
        ring_rank = _groups.group_rank(ring_group)
        extra = {"strategy": _CODES[strategy], "ulysses": wu, "ring": wr,
                 "mesh": mesh_field(mesh_grid(group)), **auto}

        def planner(vis, concrete):  # (plan, exchange): the sparse ring's schedule, or the gathered exchange
            if strategy == "hybrid":
                return (ring_plan(concrete, vis, wr, ring_rank, wu * n),
                        sparse_ring(concrete, vis, wr, ring_rank, wu * n) if wr > 1 else None)
            return _gathered(concrete, vis, wr, ring_rank, wu * n)

        (plan, exchange), scale, fwd, bwd, layout = prepare(q, k, v, comm, extra=extra, shards=(wr, wu * n),
                                                            planner=planner, **common)
        _ulysses.check_heads(q.shape[2], k.shape[2], wu)
        if strategy == "hybrid" and exchange is not None:
            inner = _SparseRing(transport.for_group(ring_group), exchange, softcap, scale, fwd, bwd)
        elif strategy == "hybrid":
            inner = _Ring(RingComm(ring_group), plan, softcap, scale, fwd, bwd)
        else:
            inner = _allgather.AllGatherKV(_groups.resolve_group(ring_group), layout, wu * n, plan, softcap, scale,
                                           fwd, bwd, exchange)
        return _ulysses.ulysses(q, k, v, attention_mask, ulysses_group, wu, inner)

    # every 1-D strategy verifies the same fields; Ulysses' all-to-alls are posted in one piece or in two
    # (Note [Ulysses halves])
    extra = {"strategy": _CODES[strategy], "ulysses_halves": bool(_ulysses.HALVES), **auto}
    if over_mesh:  # the default group in the mesh's sharding (``layouts.mesh_assignment``), verified as the hybrids
        ulysses_group, ring_group = resolve_mesh(group)
        comm = RingComm(None)
        wu, wr = _groups.group_size(ulysses_group), _groups.group_size(ring_group)
        grid = mesh_grid(group)
        extra.update(ulysses=wu, ring=wr, mesh=mesh_field(grid))
        shards = (wr, wu * n)
    else:
        comm, shards, grid = RingComm(group), None, None
    world, rank = comm.size, comm.rank

    def planned(make):
        """``prepare`` with the strategy's planner ``make(vis, layout)`` on the layout it runs on: (its plan,
        that layout, scale, fwd, bwd)."""
        def planner(vis, lay):
            lay = lay if grid is None else layouts.mesh_assignment(lay, world * n, grid)
            return make(vis, lay), lay

        (plan, lay), scale, fwd, bwd, _ = prepare(q, k, v, comm, extra=extra, shards=shards, planner=planner,
                                                  **common)
        return plan, lay, scale, fwd, bwd

    if strategy == "ring":
        plan, _, scale, fwd, bwd = planned(ring_planner(comm, q))
        return run_ring(q, k, v, comm, plan, key_mask=attention_mask, softcap=softcap, scale=scale, fwd=fwd, bwd=bwd)
    if strategy == "allgather":
        (plan, exchange), layout, scale, fwd, bwd = planned(lambda vis, lay: _gathered(lay, vis, world, rank, n))
        return _allgather.allgather_attention(q, k, v, comm.group, layout=layout, plan=plan, exchange=exchange,
                                              key_mask=attention_mask, softcap=softcap, scale=scale, fwd=fwd,
                                              bwd=bwd)
    if strategy == "ulysses":
        (plan, vis), layout, scale, fwd, bwd = planned(lambda vis, lay: (local_plan(vis, world * n), vis))
        _ulysses.check_heads(q.shape[2], k.shape[2], world)
        one = RingComm(comm.group, 1) if world > 1 else RingComm(None)
        inner = ulysses_inner(one, vis, layout, world, n, softcap, scale, fwd, bwd, plan=plan)
        return _ulysses.ulysses(q, k, v, attention_mask, comm.group, world, inner)
    raise ValueError(f"`strategy` must be one of {list(STRATEGIES)}, got {strategy!r}")
