"""Argument checks and output-argument writes shared by the data-movement collectives.

The data-movement collectives (:mod:`distcomm._gather_scatter`, :mod:`distcomm._all_gather`,
:mod:`distcomm._all_to_all`) are linear, so each backward is the transposed collective (Note [Gradient
convention] in :mod:`distcomm.functional`), built from the other op's autograd Function so double
backward works. A backward builds its adjoint as a graph node only when a graph is being built (double
backward); otherwise it runs the raw collective, skipping the cost of an autograd node nobody uses.

Every rank must agree on whether its input requires grad: the backward is a collective too, and a rank
that skips it leaves the others waiting. Check mode verifies this (scatter needs no check: the source's
tensors decide for every rank).

Note [Writing into output arguments]
    ``_all_gather_base``, ``all_to_all_single`` and ``all_to_all`` write into tensors the caller passes,
    as torch.distributed does, straight from the collective (no staging copy when they are contiguous).
    Autograd is told in the same Function: the outputs are marked dirty, so the returned tensors are the
    caller's objects with their grad_fn set. Autograd cannot mark views dirty from a Function that
    returns several tensors (and forbids in-place writes into multi-output views such as those of
    ``buf.split(...)``), so when an output is a view every returned tensor is instead a new alias of the
    written memory carrying the graph, which is what torch returns: use the returned tensors. Without
    autograd (no input requires grad, or grad mode off) the outputs themselves are returned.
"""

from __future__ import annotations

import torch

from distcomm import _groups
from distcomm._reduce_ops import _require_tensor  # noqa: F401  (shared argument check)


# ---------------------------------------------------------------------------------------------------------
# Validation (local, before any communication)
# ---------------------------------------------------------------------------------------------------------


def _setup(group):
    """Resolve ``group`` and return (group, size, rank); ``group`` is None without a process group.

    Raises TypeError for a ``group`` that is not one and ValueError where this process is not a member.
    """
    return _groups.resolve(group)


def _require_tensor_list(name: str, value, n: int) -> list[torch.Tensor]:
    if not isinstance(value, (list, tuple)):
        raise TypeError(f"`{name}` must be a list or tuple of tensors, got {type(value).__name__}")
    for i, t in enumerate(value):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"`{name}[{i}]` must be a torch.Tensor, got {type(t).__name__}")
    if len(value) != n:
        raise ValueError(f"`{name}` must hold one tensor per group rank ({n}), got {len(value)}")
    return list(value)


def _require_writable(name: str, output: torch.Tensor, like: torch.Tensor, index: int | None = None) -> None:
    """``output`` may be overwritten for an input ``like``; ``index`` names an entry of the list ``name``."""
    if output.requires_grad:
        if index is not None:
            name = f"{name}[{index}]"
        raise ValueError(
            f"`{name}` requires grad, but it is overwritten by the collective; pass a tensor that does not "
            "require grad (e.g. torch.empty(...) or .detach()) and use the returned tensor for autograd"
        )
    if output.dtype != like.dtype or output.device != like.device:
        if index is not None:
            name = f"{name}[{index}]"
        raise ValueError(
            f"`{name}` has dtype {output.dtype} on {output.device}, but the input has dtype {like.dtype} on "
            f"{like.device}; they must match"
        )


def _needs_graph(*tensors: torch.Tensor) -> bool:
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


# ---------------------------------------------------------------------------------------------------------
# Output arguments (Note [Writing into output arguments])
# ---------------------------------------------------------------------------------------------------------


def _written(ctx, outputs: list[torch.Tensor], direct: bool) -> tuple[torch.Tensor, ...]:
    """Return freshly written ``outputs`` from a Function's forward (Note [Writing into output arguments])."""
    if direct:
        ctx.mark_dirty(*outputs)
        return tuple(outputs)
    return tuple(o.view_as(o) for o in outputs)


def _is_direct(outputs: list[torch.Tensor]) -> bool:
    return all(o._base is None for o in outputs)
