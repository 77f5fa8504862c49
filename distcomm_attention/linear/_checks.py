"""Argument checks of the linear-attention room: local, raising nothing themselves (see
Note [Collective verdicts] in distcomm_attention/_validation.py: the callers run them under ``verdict`` and
every rank raises the same error after one exchange)."""

from __future__ import annotations

import functools
import math

import torch

from distcomm.ring import RingComm
from distcomm_attention import _validation
from distcomm_attention.linear import plan as planning
from distcomm_attention.planning import layouts
from distcomm_attention.sharding import (_mesh_coords, concrete_layout, fallback_group, is_2d_mesh, merge_sharding,
                                         mesh_grid, resolve_layout)

__all__ = ["resolve_ring", "ring_verdict", "check_layout_call", "check_recurrence", "FLOATS"]

FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
# why the operators run eagerly inside a compiled model (one graph break each)
EAGER = "context-parallel linear attention runs eagerly: its planning is host code, fla's kernels are opaque"


def resolve_ring(sharding, layout, group) -> tuple[RingComm, str | None, tuple | None]:
    """The ring (the whole group), the layout as given (``sharding`` or ``layout``; None: left out) and, for the
    hybrid strategies' 2-D mesh (dimensions "ring" and "ulysses"), its grid: the default group's rank at each
    (ring, ulysses) coordinate, the ring then the default group in the mesh's token order (None otherwise)."""
    layout, group, ring_size = merge_sharding(sharding, layout, group, None)
    coords = _mesh_coords(group, ring_size)
    if coords is not None:
        comm, grid = coords[0], mesh_grid(group)
        if comm.size != len(grid) * len(grid[0]):
            raise ValueError(
                f"the 2-D mesh has {len(grid) * len(grid[0])} ranks but the default group {comm.size}: context-"
                "parallel linear attention on a mesh runs over the default group, in the mesh's token order; "
                "make the mesh span every rank")
        return comm, layout, grid
    comm = RingComm(group)
    if ring_size is not None and ring_size != comm.size:
        raise ValueError(
            f"`sharding` has ring_size={ring_size}: context-parallel linear attention runs over the whole group "
            f"({comm.size} ranks); pass a Sharding without ring_size, over the group of the ring"
        )
    return comm, layout, None


def ring_verdict(sharding, layout, group) -> tuple[RingComm, str | None, tuple | None, BaseException | None]:
    """``resolve_ring``'s (ring, layout, grid) and None, or, where the arguments cannot be read (a layout that
    conflicts with ``sharding``, a ``sharding`` that is not one, a ring size): a ring over the group the
    arguments name, no layout or grid, and the error, for every rank to raise after the exchange (Note
    [Collective verdicts]); the ranks whose arguments read well exchange over the same ranks."""
    resolved, error = _validation.verdict(resolve_ring, sharding, layout, group)
    if error is None:
        return (*resolved, None)
    fallback = fallback_group(sharding, group)
    return RingComm(None if is_2d_mesh(fallback) else fallback), None, None, error


def _shape(t) -> str:
    return str(tuple(t.shape)) if isinstance(t, torch.Tensor) else type(t).__name__


def check_layout_call(op: str, comm: RingComm, layout, local_len: int, cu_seqlens, grid=None):
    """(verified layout field, documents, the planner's layout) of a call whose shard holds ``local_len``
    tokens; ValueError for a layout that cannot split that length or documents that do not fit it. On a 2-D
    mesh (``grid``, ``resolve_ring``'s) the layout runs over the "ring" dimension, each ring position's shard
    cut into equal pieces over "ulysses", as ``shard_sequence(x, layout, group=mesh)`` shards."""
    resolved = resolve_layout(layout, comm)
    resolved.raise_if_ambiguous(op)
    rings, per_ring = (comm.size, local_len) if grid is None else (len(grid), local_len * len(grid[0]))
    layouts.check_local_length(resolved.layout, per_ring, rings,
                               name="the local sequence length" if grid is None else
                               "the local sequence length times the mesh's 'ulysses' size")
    seq_len = local_len * comm.size
    docs = _validation.check_cu_seqlens(cu_seqlens, seq_len)
    concrete = concrete_layout(resolved.layout, comm, seq_len, rings, docs, op)
    if grid is not None:
        concrete = layouts.mesh_assignment(concrete, seq_len, grid)
    return resolved.field, docs, concrete


@functools.lru_cache(maxsize=64)
def cached_plan(concrete, seq_len: int, world: int, docs, finals: bool) -> planning.Plan:
    return planning.make_plan(planning.rank_positions(concrete, seq_len, world), seq_len, docs, finals)


def _check_dtype(name: str, t: torch.Tensor) -> None:
    if t.dtype not in FLOATS:
        raise TypeError(f"`{name}` must be a floating tensor ({', '.join(map(str, FLOATS))}), got {t.dtype}")


def check_recurrence(q, k, v, g, beta, scale, initial_state, delta: bool) -> float:
    """The tensors of a recurrence call, fla's shapes; returns the scale. ``delta``: beta is required."""
    named = {"q": q, "k": k, "v": v, "g": g} | ({"beta": beta} if delta else {})
    for name, t in named.items():
        _validation.check_is_tensor(name, t)
        _check_dtype(name, t)
    if q.dim() != 4:
        raise ValueError(f"`q` must have shape (B, T, H, K) (batch, local tokens, heads, head dim), got {_shape(q)}")
    b, t, h, dk = q.shape
    if k.shape != q.shape:
        raise ValueError(f"`k` must have the shape of `q`, {tuple(q.shape)}, got {_shape(k)}")
    if v.dim() != 4 or v.shape[:2] != q.shape[:2]:
        raise ValueError(f"`v` must have shape ({b}, {t}, HV, V) (the batch and tokens of `q`), got {_shape(v)}")
    hv, dv = v.shape[2], v.shape[3]
    for name, x, size, what in (("q", q, b, "batch rows B"), ("q", q, t, "local tokens T"), ("q", q, h, "heads H"),
                                ("q", q, dk, "head dim K"), ("v", v, hv, "heads HV"), ("v", v, dv, "head dim V")):
        if size < 1:
            raise ValueError(f"`{name}` must have {what} >= 1, got shape {_shape(x)}")
    if hv % h:
        raise ValueError(
            f"`v` has {hv} heads, which is not a multiple of the {h} heads of `q` and `k` (GVA: value head i "
            f"reads key head i // (HV // H)); allowed: HV = H * n"
        )
    if q.dtype != k.dtype or q.dtype != v.dtype:
        raise TypeError(f"`q`, `k` and `v` must share one dtype, got {q.dtype}, {k.dtype} and {v.dtype}")
    for name, gate in (("g", g), ("beta", beta if delta else None)):
        if gate is not None and tuple(gate.shape) != (b, t, hv):
            raise ValueError(
                f"`{name}` must have shape (B, T, HV) = {(b, t, hv)}, one value per token and value head, got "
                f"{_shape(gate)}"
            )
    if any(x.device != q.device for x in named.values()):
        where = ", ".join(f"{n} on {x.device}" for n, x in named.items())
        raise ValueError(f"all tensors must be on one device, got {where}")
    if scale is None:
        scale = dk**-0.5
    elif isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale) or scale <= 0:
        raise ValueError(f"`scale` must be a finite positive float or None (1 / sqrt(K)), got {scale!r}")
    if initial_state is not None:
        _validation.check_is_tensor("initial_state", initial_state)
        _check_dtype("initial_state", initial_state)
        if initial_state.device != q.device:
            raise ValueError(f"`initial_state` is on {initial_state.device}, but `q` is on {q.device}")
    return float(scale)


def check_state(name: str, state, count: int, per: str, hv: int, dk: int, dv: int) -> None:
    """``state`` None or (count, HV, K, V): one state per sequence (``per`` says what counts)."""
    if state is not None and tuple(state.shape) != (count, hv, dk, dv):
        raise ValueError(
            f"`{name}` must have shape (N, HV, K, V) = {(count, hv, dk, dv)} with N = {count} ({per}), got "
            f"{tuple(state.shape)}"
        )
