"""all_to_all and all_to_all_single, each its own exact transpose with the splits swapped.

    forward                     grad on rank j                            adjoint collective
    all_to_all(_single)         the grads routed back, splits swapped     all_to_all(_single)

Both write into their output arguments (Note [Writing into output arguments] in
:mod:`distcomm._movement_args`). ``all_gather_variable`` sends uneven sizes through the raw all_to_all
here (Note [Variable sizes] in :mod:`distcomm._all_gather`).

Under ``torch.compile`` the public functions hand their validated arguments to the compiled path (Note
[Import direction of the compiled path] in :mod:`distcomm._dispatch`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch.autograd import Function

from distcomm import _check, _groups
from distcomm._dispatch import compiled_path
from distcomm._movement_args import (
    _is_direct,
    _needs_graph,
    _require_tensor,
    _require_tensor_list,
    _require_writable,
    _setup,
    _written,
)
from distcomm._reduce import _adjoint


__all__ = ["all_to_all", "all_to_all_single"]


# ---------------------------------------------------------------------------------------------------------
# Validation (local, before any communication)
# ---------------------------------------------------------------------------------------------------------


def _require_splits(name: str, splits, n: int, total: int, tensor_name: str) -> list[int] | None:
    """Validate split sizes along dim 0 (None: equal split) and return them as a list (or None)."""
    if splits is None:
        if total % n:
            raise ValueError(
                f"`{tensor_name}` has size {total} along dim 0, which does not split evenly over {n} ranks; "
                f"pass `{name}`"
            )
        return None
    if isinstance(splits, torch.Tensor):
        splits = splits.tolist()
    if not isinstance(splits, Sequence) or any(isinstance(s, bool) or not isinstance(s, int) for s in splits):
        raise TypeError(f"`{name}` must be a list of ints or None, got {splits!r}")
    splits = list(splits)
    if len(splits) != n or any(s < 0 for s in splits):
        raise ValueError(f"`{name}`={splits} must hold {n} non-negative ints (one per group rank)")
    if sum(splits) != total:
        raise ValueError(
            f"`{name}`={splits} adds up to {sum(splits)}, but `{tensor_name}` has size {total} along dim 0"
        )
    return splits


# ---------------------------------------------------------------------------------------------------------
# Raw communication (no autograd). ``group`` is None without a process group; a group of one copies.
# ---------------------------------------------------------------------------------------------------------


def _is_nccl(group, tensor: torch.Tensor) -> bool:
    return tensor.is_cuda and "nccl" in _groups.backend_name(group).lower()


def _raw_all_to_all(outputs: list[torch.Tensor], inputs: list[torch.Tensor], group, n: int) -> None:
    """outputs[i] receives rank i's inputs[this rank]; sizes may differ, outputs may be non-contiguous."""
    if n == 1:
        outputs[0].copy_(inputs[0].reshape(outputs[0].shape))
        return
    if _is_nccl(group, inputs[0]):  # NCCL's list form takes uneven sizes and needs no staging buffer
        recv = [o if o.is_contiguous() else torch.empty_like(o, memory_format=torch.contiguous_format) for o in outputs]
        dist.all_to_all(recv, [t.contiguous() for t in inputs], group=group)
        for o, r in zip(outputs, recv):
            if r is not o:
                o.copy_(r)
        return
    # gloo's list form needs equal sizes: go through one flat all_to_all_single.
    send = torch.cat([t.reshape(-1) for t in inputs])
    out_numels = [o.numel() for o in outputs]
    recv = send.new_empty(sum(out_numels))
    dist.all_to_all_single(recv, send, out_numels, [t.numel() for t in inputs], group=group)
    for o, piece in zip(outputs, recv.split(out_numels)):
        o.copy_(piece.view(o.shape))


def _raw_all_to_all_single(output, x, out_splits, in_splits, group, n: int) -> None:
    if n == 1:
        output.copy_(x)
        return
    recv = output if output.is_contiguous() else torch.empty_like(output, memory_format=torch.contiguous_format)
    dist.all_to_all_single(recv, x.contiguous(), out_splits, in_splits, group=group)
    if recv is not output:
        output.copy_(recv)


# ---------------------------------------------------------------------------------------------------------
# all_to_all <-> all_to_all (splits swapped)
# ---------------------------------------------------------------------------------------------------------


def _all_to_all_single_fresh(group, n: int, out_shape, out_splits, in_splits, tensor) -> torch.Tensor:
    out = tensor.new_empty(out_shape)
    _raw_all_to_all_single(out, tensor, out_splits, in_splits, group, n)
    return out


class _AllToAllSingle(Function):
    """Fresh-output form: y = all_to_all_single(x). Adjoint: itself with the splits swapped."""

    @staticmethod
    def forward(ctx, group, n, out_shape, out_splits, in_splits, tensor):
        ctx.group, ctx.n, ctx.in_shape = _groups.hold(group), n, tensor.shape
        ctx.out_splits, ctx.in_splits = out_splits, in_splits
        return _all_to_all_single_fresh(group, n, out_shape, out_splits, in_splits, tensor)

    @staticmethod
    def backward(ctx, grad):
        args = (_groups.unhold(ctx.group), ctx.n, ctx.in_shape, ctx.in_splits, ctx.out_splits, grad.contiguous())
        return None, None, None, None, None, _adjoint(_AllToAllSingle, _all_to_all_single_fresh, *args)


class _AllToAllSingleWrite(Function):
    """Writes all_to_all_single(x) into the caller's output. Adjoint: _AllToAllSingle, splits swapped."""

    @staticmethod
    def forward(ctx, output, tensor, group, n, out_splits, in_splits, direct):
        ctx.group, ctx.n, ctx.in_shape = _groups.hold(group), n, tensor.shape
        ctx.out_splits, ctx.in_splits = out_splits, in_splits
        _raw_all_to_all_single(output, tensor, out_splits, in_splits, group, n)
        if direct:
            ctx.mark_dirty(output)
            return output
        return output.view_as(output)

    @staticmethod
    def backward(ctx, grad):
        args = (_groups.unhold(ctx.group), ctx.n, ctx.in_shape, ctx.in_splits, ctx.out_splits, grad.contiguous())
        return None, _adjoint(_AllToAllSingle, _all_to_all_single_fresh, *args), None, None, None, None, None


def _all_to_all_fresh(group, n: int, out_likes, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    outs = [torch.empty(s, dtype=dt, device=dev) for s, dt, dev in out_likes]
    _raw_all_to_all(outs, list(tensors), group, n)
    return tuple(outs)


class _AllToAll(Function):
    """Fresh-output list form: y[i] = rank i's x[this rank]. Adjoint: itself, shapes swapped."""

    @staticmethod
    def forward(ctx, group, n, out_likes, *tensors):
        ctx.group, ctx.n, ctx.in_likes = _groups.hold(group), n, [(t.shape, t.dtype, t.device) for t in tensors]
        return _all_to_all_fresh(group, n, out_likes, *tensors)

    @staticmethod
    def backward(ctx, *grads):
        back = _adjoint(_AllToAll, _all_to_all_fresh, _groups.unhold(ctx.group), ctx.n, ctx.in_likes,
                        *[g.contiguous() for g in grads])
        return (None, None, None, *back)


class _AllToAllWrite(Function):
    """Writes y[i] = rank i's x[this rank] into the caller's outputs. Adjoint: _AllToAll, shapes swapped."""

    @staticmethod
    def forward(ctx, group, direct, n, *tensors):
        outputs, inputs = list(tensors[:n]), list(tensors[n:])
        ctx.group, ctx.n, ctx.in_likes = _groups.hold(group), n, [(t.shape, t.dtype, t.device) for t in inputs]
        _raw_all_to_all(outputs, inputs, group, n)
        return _written(ctx, outputs, direct)

    @staticmethod
    def backward(ctx, *grads):
        back = _adjoint(_AllToAll, _all_to_all_fresh, _groups.unhold(ctx.group), ctx.n, ctx.in_likes,
                        *[g.contiguous() for g in grads])
        return (None, None, None) + (None,) * ctx.n + tuple(back)


def _check_all_to_all(
    op: str, inputs: list[torch.Tensor], outputs: list[torch.Tensor], needs_grad: bool, group, n: int
) -> None:
    """Check mode: rank i's inputs[j] must match rank j's outputs[i] in shape and dtype, and every rank's
    inputs must agree on needing a backward, on every rank."""
    if n == 1 or not _check.is_check_mode():
        return
    rows = [_check.encode_meta(t) for t in [*inputs, *outputs]]
    _, extras = _check.gather_meta(None, group, extra=[int(needs_grad), *(v for row in rows for v in row)])
    width = len(rows[0])
    _check.refuse_wide((rank, e[1 + k * width]) for rank, e in enumerate(extras) for k in range(len(rows)))

    def meta(rank: int, k: int):
        return _check.decode_meta(extras[rank][1 + k * width : 1 + (k + 1) * width])

    for i in range(n):
        for j in range(n):
            sent, received = meta(i, j), meta(j, n + i)
            if sent != received:
                raise ValueError(
                    f"{op}: rank {i}'s input for rank {j} has shape {tuple(sent.shape)} and dtype {sent.dtype}, "
                    f"but rank {j}'s output for rank {i} has shape {tuple(received.shape)} and dtype "
                    f"{received.dtype}; they must match"
                )
    _check.require_agreement(op, "requires_grad", [e[0] for e in extras])


def _list_args(output_tensor_list, input_tensor_list, n: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """all_to_all's checks of this rank's arguments: (outputs, inputs) as lists."""
    outputs = _require_tensor_list("output_tensor_list", output_tensor_list, n)
    inputs = _require_tensor_list("input_tensor_list", input_tensor_list, n)
    for i, t in enumerate(inputs):
        if t.dtype != inputs[0].dtype or t.device != inputs[0].device:
            raise ValueError(
                f"`input_tensor_list[{i}]` has dtype {t.dtype} on {t.device}, but `input_tensor_list[0]` has "
                f"dtype {inputs[0].dtype} on {inputs[0].device}; all must match"
            )
    for i, o in enumerate(outputs):
        _require_writable("output_tensor_list", o, inputs[0], i)
    return outputs, inputs


def _single_args(output, input, output_split_sizes, input_split_sizes, n: int):
    """all_to_all_single's checks of this rank's arguments: (output splits, input splits), None for equal."""
    if input.dim() == 0 or output.dim() == 0:
        raise ValueError("all_to_all_single splits along dim 0: `input` and `output` need at least 1 dim")
    _require_writable("output", output, input)
    if output.shape[1:] != input.shape[1:]:
        raise ValueError(
            f"`output` has shape {tuple(output.shape)}; its dims after the first must equal the input's "
            f"{tuple(input.shape[1:])}"
        )
    out_splits = _require_splits("output_split_sizes", output_split_sizes, n, output.shape[0], "output")
    in_splits = _require_splits("input_split_sizes", input_split_sizes, n, input.shape[0], "input")
    return out_splits, in_splits


def all_to_all(
    output_tensor_list: Sequence[torch.Tensor],
    input_tensor_list: Sequence[torch.Tensor],
    group: dist.ProcessGroup | None = None,
) -> tuple[torch.Tensor, ...]:
    """Send ``input_tensor_list[j]`` to rank j and receive rank i's tensor into ``output_tensor_list[i]``.

    Sizes may differ per pair (uneven), on gloo too; differentiable.

    Args:
        output_tensor_list: W tensors; entry i has the shape of rank i's ``input_tensor_list[this rank]``
            and this rank's dtype and device; must not require grad. Overwritten.
        input_tensor_list: W tensors of one dtype and device, any shapes.
        group: process group (``None``: the default group).

    Returns:
        The tuple of outputs, with autograd told of the writes (Note [Writing into output arguments]).
        The backward routes the grads back: ``input_tensor_list[j]`` receives rank j's grad of its output
        from this rank.
    """
    group, n, _ = _setup(group)
    outputs, inputs = _check.decide("all_to_all", group, n, _list_args, output_tensor_list, input_tensor_list, n)
    if torch.compiler.is_compiling():
        return compiled_path().all_to_all(outputs, inputs, group)
    needs_grad = _needs_graph(*inputs)
    _check_all_to_all("all_to_all", inputs, outputs, needs_grad, group, n)
    if not needs_grad:
        _raw_all_to_all(outputs, inputs, group, n)
        return tuple(outputs)
    return _AllToAllWrite.apply(group, _is_direct(outputs), n, *outputs, *inputs)


def all_to_all_single(
    output: torch.Tensor,
    input: torch.Tensor,
    output_split_sizes: Sequence[int] | None = None,
    input_split_sizes: Sequence[int] | None = None,
    group: dist.ProcessGroup | None = None,
) -> torch.Tensor:
    """Split ``input`` along dim 0, send piece j to rank j, and concatenate the received pieces into ``output``.

    Args:
        output: shape (sum(output_split_sizes), *input.shape[1:]), same dtype and device as the input;
            must not require grad. Overwritten.
        input: shape (sum(input_split_sizes), ...).
        output_split_sizes: rows received from each rank (``None``: ``output.shape[0] / W`` each).
        input_split_sizes: rows sent to each rank (``None``: ``input.shape[0] / W`` each). Rank i's
            ``input_split_sizes[j]`` must equal rank j's ``output_split_sizes[i]`` (checked in check mode).
        group: process group (``None``: the default group).

    Returns:
        ``output`` with autograd told of the write (Note [Writing into output arguments]). The backward is
        all_to_all_single of the grad with the split sizes swapped.
    """
    _require_tensor("output", output)
    _require_tensor("input", input)
    group, n, _ = _setup(group)
    out_splits, in_splits = _check.decide(
        "all_to_all_single", group, n, _single_args, output, input, output_split_sizes, input_split_sizes, n
    )
    if torch.compiler.is_compiling():
        return compiled_path().all_to_all_single(output, input, out_splits, in_splits, group, n)
    needs_grad = _needs_graph(input)
    if n > 1 and _check.is_check_mode():
        _check_all_to_all_single(input, out_splits or [output.shape[0] // n] * n,
                                 in_splits or [input.shape[0] // n] * n, needs_grad, group, n)
    if not needs_grad:
        _raw_all_to_all_single(output, input, out_splits, in_splits, group, n)
        return output
    return _AllToAllSingleWrite.apply(output, input, group, n, out_splits, in_splits, output._base is None)


def _check_all_to_all_single(
    tensor, out_splits: list[int], in_splits: list[int], needs_grad: bool, group, n: int
) -> None:
    """Check mode: dtypes, trailing dims, matching splits and the requires_grad flag, on every rank."""
    metas, extras = _check.gather_meta(tensor, group, extra=[*in_splits, *out_splits, int(needs_grad)])
    ref = metas[0]
    if any(m.dtype != ref.dtype or tuple(m.shape[1:]) != tuple(ref.shape[1:]) for m in metas):
        _check.raise_mismatch("all_to_all_single", "dtypes or sizes of the dims after the first", metas)
    for i in range(n):
        for j in range(n):
            if extras[i][j] != extras[j][n + i]:
                raise ValueError(
                    f"all_to_all_single: rank {i} sends {extras[i][j]} rows to rank {j} (its input_split_sizes), "
                    f"but rank {j} expects {extras[j][n + i]} rows from rank {i} (its output_split_sizes)"
                )
    _check.require_agreement("all_to_all_single", "requires_grad", [e[2 * n] for e in extras])
