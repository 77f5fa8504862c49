"""Process-group resolution, done at call time.

Nothing here is cached: a rank looked up before ``init_process_group`` would otherwise stay 0 forever.
Without an initialised default group every helper answers as a world of one process.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = [
    "is_initialized",
    "resolve",
    "resolve_group",
    "group_size",
    "group_rank",
    "to_global_rank",
    "to_group_rank",
    "check_rank_in_group",
    "check_group",
]


def _world():
    """The default group now, or None without an initialised one."""
    return dist.group.WORLD if dist.is_available() else None


def is_initialized() -> bool:
    return _world() is not None


def resolve_group(group):
    """Return the process group to use: ``None`` means the default (WORLD) group, or no group at all."""
    world = _world()
    if world is None:
        return None
    if group is None:
        return world
    return group


def _not_a_member() -> ValueError:
    return ValueError(
        f"this process (global rank {dist.get_rank()}) is not a member of the group passed as `group`; "
        "only members may call a collective on it"
    )


def check_group(group) -> None:
    """Validate a user-given ``group``: None or a process group this process belongs to.

    ``torch.distributed.new_group`` hands processes outside the new group a placeholder (an int), which
    would otherwise surface as a confusing type error; it raises the ValueError a non-member gets.
    """
    if group is None or isinstance(group, dist.ProcessGroup):
        return
    if dist.is_available() and group is dist.GroupMember.NON_GROUP_MEMBER:
        raise ValueError(
            "`group` is the placeholder torch.distributed.new_group returns to processes outside the group "
            f"(this process, global rank {dist.get_rank()}, is not a member); only its members may call a "
            "collective on it"
        )
    raise TypeError(
        f"`group` must be a torch.distributed.ProcessGroup or None (the default group), got "
        f"{type(group).__name__} {group!r}"
    )


def resolve(group) -> tuple[dist.ProcessGroup | None, int, int]:
    """(group, its size, this process's rank in it), all looked up now: one lookup per collective call.

    ``group=None`` is the default group; without an initialised default group the answer is
    ``(None, 1, 0)``, a world of one process. Raises TypeError for something that is not a group and
    ValueError if this process is not a member (:func:`check_group`).
    """
    if group is not None and not isinstance(group, dist.ProcessGroup):
        check_group(group)
    world = dist.group.WORLD if dist.is_available() else None
    if world is None:
        return None, 1, 0
    if group is None or group is world:
        return world, world.size(), world.rank()
    rank = dist.get_rank(group)
    if rank < 0:
        raise _not_a_member()
    return group, dist.get_world_size(group), rank


def group_size(group=None) -> int:
    world = _world()
    if world is None:
        return 1
    if group is None or group is world:
        return world.size()
    return dist.get_world_size(group)


def group_rank(group=None) -> int:
    world = _world()
    if world is None:
        return 0
    if group is None or group is world:
        return world.rank()
    rank = dist.get_rank(group)
    if rank < 0:
        raise _not_a_member()
    return rank


def to_global_rank(group, rank: int) -> int:
    """Global rank of the member at position ``rank`` of ``group``."""
    group = resolve_group(group)
    if group is None or group is dist.group.WORLD:
        return rank
    return dist.get_global_rank(group, rank)


def to_group_rank(group, global_rank: int) -> int:
    """Position in ``group`` of the process with global rank ``global_rank`` (-1 if not a member)."""
    group = resolve_group(group)
    if group is None or group is dist.group.WORLD:
        return global_rank
    try:
        return dist.get_group_rank(group, global_rank)
    except (ValueError, RuntimeError):
        return -1


def check_rank_in_group(name: str, global_rank, group) -> int:
    """Validate a user-given global rank (``src``/``dst``) and return its position in ``group``."""
    if isinstance(global_rank, bool) or not isinstance(global_rank, int):
        raise TypeError(f"`{name}` must be an int (a global rank), got {type(global_rank).__name__} {global_rank!r}")
    world = _world()
    if world is None:
        if global_rank != 0:
            raise ValueError(f"`{name}`={global_rank} is not a rank of this single-process run; the only rank is 0")
        return 0
    if group is None or group is world:
        size = world.size()
        if 0 <= global_rank < size:
            return global_rank
        members = list(range(size))
    else:
        members = [dist.get_global_rank(group, i) for i in range(dist.get_world_size(group))]
        if global_rank in members:
            return members.index(global_rank)
    raise ValueError(
        f"`{name}`={global_rank} is not a member of the group; `{name}` is a global rank and must be one of "
        f"{members}"
    )


def comm_device(tensor: torch.Tensor | None, group=None) -> torch.device:
    """Device on which small bookkeeping tensors travel for ``group`` (CUDA for NCCL, else CPU)."""
    if tensor is not None and tensor.device.type != "meta":
        return tensor.device
    group = resolve_group(group)
    if group is not None and "nccl" in str(dist.get_backend(group)):
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
