"""Process-group resolution, done at call time.

Nothing here is cached: a rank looked up before ``init_process_group`` would otherwise stay 0 forever.
Without an initialised default group ``group=None`` is a world of one process; an explicit ProcessGroup
answers for itself (Note [Groups without global ranks]).

Every public ``group=`` argument goes through :func:`resolve` or :func:`resolve_group`, which accept:

- ``None``: the default group (WORLD); no group at all without an initialised default group;
- a ``torch.distributed.ProcessGroup``;
- a 1-D ``torch.distributed.device_mesh.DeviceMesh`` (e.g. ``mesh["cp"]``): the group of its only dim;
- a tuple ``(mesh, dim)`` with ``dim`` a dim name or index of a mesh of any number of dims: the group of
  that mesh dim that this process belongs to.

A mesh is turned into its ProcessGroup here, once per call; nothing downstream sees a mesh.

Note [Groups without global ranks]
    A group's size and this process's position in it come from the group itself (``group.size()``,
    ``group.rank()``), so a ProcessGroup works without a default group (``init_process_group`` never
    called) and whether or not torch.distributed registered it. ``src``/``dst`` are global ranks, as in
    torch.distributed, where global ranks exist: the default group is initialised and the group is
    registered with it (``init_process_group``, ``new_group``, a DeviceMesh). For any other group there is
    no global numbering, and ``src``/``dst`` are the group's own ranks, 0 .. size - 1. The collectives
    themselves always address peers by group rank (``group_src``/``group_dst``/``group_peer``).

    A bare backend object (``dist.ProcessGroupGloo(store, rank, size)``) is not a ProcessGroup: it lacks
    the flat collectives (all_gather into one tensor, reduce-scatter, all_to_all_single), so it raises a
    TypeError saying so instead of failing half-way.
"""

from __future__ import annotations

import weakref

import torch
import torch.distributed as dist

__all__ = [
    "is_initialized",
    "as_process_group",
    "resolve",
    "resolve_group",
    "group_size",
    "group_rank",
    "to_global_rank",
    "to_group_rank",
    "check_rank_in_group",
    "check_group",
    "global_ranks",
    "is_registered",
    "backend_name",
]


def _world():
    """The default group now, or None without an initialised one."""
    return dist.group.WORLD if dist.is_available() else None


def is_initialized() -> bool:
    return _world() is not None


def _not_a_member() -> ValueError:
    who = f"global rank {dist.get_rank()}" if is_initialized() else "no default group"
    return ValueError(
        f"this process ({who}) is not a member of the group passed as `group`; "
        "only members may call a collective on it"
    )


def _mesh_dims(mesh) -> str:
    names = mesh.mesh_dim_names
    return ", ".join(map(repr, names)) if names else ", ".join(map(str, range(mesh.ndim)))


def _mesh_group(mesh, dim) -> dist.ProcessGroup:
    """The ProcessGroup of ``mesh`` along ``dim`` (None: a 1-D mesh's only dim) holding this process."""
    names = mesh.mesh_dim_names or ()
    if dim is None and mesh.ndim != 1:
        if names:
            how = f"`group=(mesh, {names[-1]!r})` or the 1-D sub-mesh `group=mesh[{names[-1]!r}]`"
        else:
            how = f"`group=(mesh, {mesh.ndim - 1})` (a dim index; name the dims to use names)"
        raise ValueError(
            f"`group` is a {mesh.ndim}-D DeviceMesh with dims ({_mesh_dims(mesh)}); pick the dim to communicate "
            f"over: {how}"
        )
    if dim is not None:
        if isinstance(dim, bool) or not isinstance(dim, (int, str)):
            raise TypeError(
                f"the dim in `group=(mesh, dim)` must be a dim name (str) or index (int), got "
                f"{type(dim).__name__} {dim!r}"
            )
        if isinstance(dim, int) and not 0 <= dim < mesh.ndim:
            raise ValueError(
                f"`group=(mesh, {dim})`: dim index {dim} is out of range for a {mesh.ndim}-D DeviceMesh "
                f"(dims: {_mesh_dims(mesh)})"
            )
    if mesh.get_coordinate() is None:
        raise ValueError(
            f"this process (global rank {dist.get_rank()}) is not part of the DeviceMesh passed as `group` "
            f"(its ranks: {mesh.mesh.flatten().tolist()}); only members may call a collective on it"
        )
    if isinstance(dim, str) and dim not in names:
        try:  # a flattened dim (mesh._flatten("dp_cp")) is known to the mesh by name only
            return mesh.get_group(dim)
        except (KeyError, RuntimeError, ValueError, AssertionError):
            raise ValueError(
                f"`group=(mesh, {dim!r})`: the DeviceMesh has no dim named {dim!r}; its dims are "
                f"({_mesh_dims(mesh)})"
            ) from None
    return mesh.get_group(dim)


def as_process_group(group) -> dist.ProcessGroup | None:
    """``group`` as a ProcessGroup (or None, the default group), without looking up sizes or ranks.

    Accepts None, a ProcessGroup, a 1-D DeviceMesh or ``(mesh, dim)`` (see the module docstring). Raises
    TypeError for anything else, and ValueError for a multi-dimensional mesh without a dim, an unknown
    dim, or a mesh or group this process is not a member of.
    """
    if group is None or isinstance(group, dist.ProcessGroup):
        return group
    if dist.is_available():
        if group is dist.GroupMember.NON_GROUP_MEMBER:
            raise ValueError(
                "`group` is the placeholder torch.distributed.new_group returns to processes outside the group "
                f"(this process, global rank {dist.get_rank()}, is not a member); only its members may call a "
                "collective on it"
            )
        if isinstance(group, torch._C._distributed_c10d.Backend):
            raise TypeError(
                f"`group` is a bare {type(group).__name__} backend object, not a torch.distributed.ProcessGroup; "
                "it has no flat collectives (all_gather into one tensor, reduce-scatter, all_to_all_single). Pass "
                "a ProcessGroup: from init_process_group / new_group, a DeviceMesh, or torch.distributed.ProcessGroup "
                "with this backend registered on it (Note [Groups without global ranks] in distcomm/_groups.py)"
            )
        from torch.distributed.device_mesh import DeviceMesh  # imported here: only meshes pay for it

        if isinstance(group, DeviceMesh):
            return _mesh_group(group, None)
        if isinstance(group, tuple) and len(group) == 2 and isinstance(group[0], DeviceMesh):
            return _mesh_group(*group)
    raise TypeError(
        "`group` must be a torch.distributed.ProcessGroup, a 1-D DeviceMesh, a tuple (DeviceMesh, dim name) "
        f"or None (the default group), got {type(group).__name__} {group!r}"
    )


def check_group(group) -> None:
    """Validate a user-given ``group`` (see :func:`as_process_group` for what is accepted).

    ``torch.distributed.new_group`` hands processes outside the new group a placeholder (an int), which
    would otherwise surface as a confusing type error; it raises the ValueError a non-member gets.
    """
    as_process_group(group)


def resolve(group) -> tuple[dist.ProcessGroup | None, int, int]:
    """(group, its size, this process's rank in it), all looked up now: one lookup per collective call.

    ``group=None`` is the default group; without an initialised default group the answer is
    ``(None, 1, 0)``, a world of one process. A ProcessGroup answers for itself, with or without a default
    group (Note [Groups without global ranks]). A DeviceMesh or ``(mesh, dim)`` resolves to its
    ProcessGroup. Raises TypeError for something that is not a group and ValueError if this process is not
    a member (:func:`as_process_group`).
    """
    group = resolve_group(group)
    if group is None:
        return None, 1, 0
    return group, group.size(), group_rank(group)


def resolve_group(group):
    """Return the process group to use: ``None`` means the default (WORLD) group, or no group at all.

    A DeviceMesh or ``(mesh, dim)`` becomes its ProcessGroup; anything else that is not a group raises
    (see :func:`as_process_group`). An explicit ProcessGroup is used as given, also without a default group.
    """
    if group is not None and not isinstance(group, dist.ProcessGroup):
        group = as_process_group(group)
    if group is None:
        return _world()
    return group


class _Held:
    """A process group an autograd node keeps for its backward without keeping it alive (see ``hold``)."""

    __slots__ = ("_ref",)

    def __init__(self, group):
        self._ref = weakref.ref(group)

    def get(self):
        group = self._ref()
        if group is None:
            raise RuntimeError(
                "the process group of this collective was destroyed, or no longer referenced, before its backward "
                "ran: run the backward before destroy_process_group(), and keep a ProcessGroup built by hand "
                "referenced until then"
            )
        return group


def hold(group):
    """``group`` as a collective's autograd node keeps it: a ProcessGroup by weak reference (None, or an
    unresolved group such as a DeviceMesh, as it is).

    Note [Groups held weakly]
        A node that held its ProcessGroup strongly kept the group alive after ``destroy_process_group()``
        for as long as the graph lived; a graph in cyclic garbage (an attention layer's, say) then lived until
        the interpreter's exit, and the group's destructor running during the interpreter's finalization
        aborted the process ("terminate called without an active exception", 2-6 of 16 two-rank gloo runs
        of an all-gather's output left in a cycle; none with the group held weakly). A backward after the
        group is gone raises a RuntimeError saying so. Groups registered with torch.distributed (the default
        group, ``new_group``, a DeviceMesh's) stay referenced by its group table until
        ``destroy_process_group()``; a ProcessGroup built by hand is the caller's to keep until the backward.
        A group the program itself keeps to its end (a DeviceMesh in a global, the group of a registered
        Hugging Face attention) is still freed at the interpreter's exit.
    """
    return _Held(group) if isinstance(group, dist.ProcessGroup) else group


def unhold(held):
    """The group ``hold`` kept (RuntimeError if it was destroyed); anything else as it is."""
    return held.get() if isinstance(held, _Held) else held


def group_size(group=None) -> int:
    group = resolve_group(group)
    return 1 if group is None else group.size()


def group_rank(group=None) -> int:
    group = resolve_group(group)
    if group is None:
        return 0
    rank = group.rank()
    if rank < 0:
        raise _not_a_member()
    return rank


def is_registered(group) -> bool:
    """Whether torch.distributed knows ``group`` (the default group, or a group registered with it): only
    such groups work with ``batch_isend_irecv`` and ``get_backend``."""
    world = _world()
    group = resolve_group(group)
    return world is not None and (group is world or global_ranks(group) is not None)


def global_ranks(group) -> list[int] | None:
    """The global ranks of ``group``'s members in group-rank order, or None where there are none to map:
    no default group, the default group itself, or a group not registered with the default group
    (Note [Groups without global ranks]); then a rank of the group is its own "global" rank."""
    world = _world()
    group = resolve_group(group)
    if group is None or world is None or group is world:
        return None
    try:
        return dist.get_process_group_ranks(group)
    except (KeyError, ValueError, RuntimeError):
        return None


def to_global_rank(group, rank: int) -> int:
    """Global rank of the member at position ``rank`` of ``group`` (Note [Groups without global ranks])."""
    members = global_ranks(group)
    return rank if members is None else members[rank]


def to_group_rank(group, global_rank: int) -> int:
    """Position in ``group`` of the process with global rank ``global_rank`` (-1 if not a member)."""
    members = global_ranks(group)
    if members is None:
        return global_rank if 0 <= global_rank < group_size(group) else -1
    return members.index(global_rank) if global_rank in members else -1


def check_rank_in_group(name: str, global_rank, group) -> int:
    """Validate a user-given global rank (``src``/``dst``) and return its position in ``group``."""
    if isinstance(global_rank, bool) or not isinstance(global_rank, int):
        raise TypeError(f"`{name}` must be an int (a global rank), got {type(global_rank).__name__} {global_rank!r}")
    group = resolve_group(group)
    if group is None:
        if global_rank != 0:
            raise ValueError(f"`{name}`={global_rank} is not a rank of this single-process run; the only rank is 0")
        return 0
    position = to_group_rank(group, global_rank)
    if position >= 0:
        return position
    members = global_ranks(group)
    if members is None and group is not _world():
        raise ValueError(
            f"`{name}`={global_rank} is not a rank of the group; the group has no global ranks (no default group, "
            f"or one it is not registered with), so `{name}` is a rank of the group itself and must be one of "
            f"{list(range(group.size()))}"
        )
    members = list(range(group.size())) if members is None else members
    raise ValueError(
        f"`{name}`={global_rank} is not a member of the group; `{name}` is a global rank and must be one of "
        f"{members}"
    )


def backend_name(group) -> str:
    """The backend of ``group`` as torch.distributed names it (``"gloo"``, ``"nccl"``, ``"cpu:gloo,cuda:nccl"``)."""
    try:
        return str(dist.get_backend(group))
    except (ValueError, RuntimeError):  # not registered with a default group: the group names its backend
        return group.name()


def batches_p2p(group) -> bool:
    """Whether CUDA point-to-point transfers over ``group`` go as one NCCL batch (``batch_isend_irecv``): an
    NCCL group registered with torch.distributed."""
    return "nccl" in backend_name(group) and is_registered(group)


def comm_device(tensor: torch.Tensor | None, group=None) -> torch.device:
    """Device on which small bookkeeping tensors travel for ``group`` (CUDA for NCCL, else CPU)."""
    if tensor is not None and tensor.device.type != "meta":
        return tensor.device
    group = resolve_group(group)
    if group is not None and "nccl" in backend_name(group):
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
