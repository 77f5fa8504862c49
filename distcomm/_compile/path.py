"""The compiled path of the public functions: what they run under ``torch.compile``.

Each public function of :mod:`distcomm.functional` validates its arguments, then, when
``torch.compiler.is_compiling()``, hands the validated arguments to the function of the same name here
(reached through :func:`distcomm._dispatch.compiled_path`, Note [Import direction of the compiled path]
there), which calls the custom ops of :mod:`distcomm._compile.ops` (Note [Compiled collectives] there).
Forms the ops do not cover are rewritten with them:

    op                           compiled as
    all_reduce / reduce /        the op of the same name; PREMUL_SUM as SUM of factor * x
      reduce_scatter_tensor
    reduce_scatter (list)        entries zero-padded and stacked, reduce_scatter_tensor, unpadded
    all_gather (list)            all_gather_tensor of x[None], unbound
    _all_gather_base             all_gather_tensor, viewed as the output
    all_to_all (list)            all_to_all_single of the flattened entries, split
    output arguments             written with ``output.copy_`` (autograd records the write) and returned

Check mode does not run in compiled code (its exchange needs a host sync); the forms that learn shapes at
run time (``all_gather_variable`` without ``sizes``, ``ring_pass`` without ``recv_shape``, ``scatter``
without tensors off the source) run in eager mode: a graph break, an error under ``fullgraph=True``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as nnf

from distcomm import _all_gather, _gather_scatter
from distcomm import ring as _ring
from distcomm._compile import ops as _ops
from distcomm._reduce_ops import _PREMUL_SUM, ReduceOp, _Op, _parse_op, _premul_op

__all__: list[str] = []


def group_name(group) -> str:
    """The name the ops take for ``group`` (a resolved group, or None without a process group). A group built
    by hand and never registered has no name (""), which the ops would read as no process group: refused."""
    if group is None:
        return ""
    if not group.group_name:
        raise ValueError(
            "`group` is a ProcessGroup built by hand (never registered, no group_name): the compiled collectives "
            "find their group by name, so under torch.compile pass a group made by init_process_group / "
            "dist.new_group / a DeviceMesh, or call the collective outside the compiled region")
    return group.group_name


def _size(group) -> int:
    return 1 if group is None else group.size()


def parse_op(op) -> _Op:
    """``_parse_op`` under torch.compile, where a ``ReduceOp`` object (PREMUL_SUM with its factor) is opaque
    to dynamo except for its ``factor`` (torch >= 2.13). Older torch cannot read the object while tracing
    (dynamo: "ReduceOp is not a constant", seen on torch 2.11): there the call breaks the graph and runs
    eagerly, with eager's result, and ``fullgraph=True`` reports the break."""
    if type(op) is not ReduceOp:
        return _parse_op(op)
    if _FACTOR_READABLE:
        return _premul_op(op.factor)  # only PREMUL_SUM ops carry a factor
    torch._dynamo.graph_break()
    return _parse_op(op)


_FACTOR_READABLE = hasattr(ReduceOp, "factor")


def _premultiplied(tensor: torch.Tensor, op: _Op) -> tuple[torch.Tensor, str]:
    """(tensor, op name) for the ops: PREMUL_SUM(f) becomes the SUM of f * tensor (Note [Backend emulation])."""
    if op.kind is _PREMUL_SUM:
        factor = op.factor.to(tensor.device) if isinstance(op.factor, torch.Tensor) else op.factor
        return tensor * factor, "SUM"
    return tensor, op.name


def _write(output: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """Write ``value`` into the caller's ``output`` and return it (autograd records the copy)."""
    return output.copy_(value.view(output.shape))


# --------------------------------------------------------------------------------------------------------
# Reductions
# --------------------------------------------------------------------------------------------------------


def all_reduce(tensor: torch.Tensor, op: _Op, group) -> torch.Tensor:
    tensor, name = _premultiplied(tensor, op)
    return _ops.all_reduce(tensor, name, group_name(group))


def reduce(tensor: torch.Tensor, dst: int, op: _Op, group) -> torch.Tensor:
    """``dst``: the destination's position in the group."""
    tensor, name = _premultiplied(tensor, op)
    return _ops.reduce(tensor, dst, name, group_name(group))


def broadcast(tensor: torch.Tensor, src: int, group) -> torch.Tensor:
    """``src``: the source's position in the group."""
    return _ops.broadcast(tensor, src, group_name(group))


def reduce_scatter_tensor(tensor: torch.Tensor, dim: int, op: _Op, group) -> torch.Tensor:
    tensor, name = _premultiplied(tensor, op)
    return _ops.reduce_scatter_tensor(tensor, dim, _size(group), name, group_name(group))


def reduce_scatter(output: torch.Tensor, inputs, op: _Op, group, rank: int) -> torch.Tensor:
    """Entry ``rank`` of every rank's ``inputs``, reduced, written into ``output``: one reduce-scatter of
    the entries zero-padded to the largest (the eager path's layout)."""
    width = max(t.numel() for t in inputs)
    rows = []
    for t in inputs:
        t, name = _premultiplied(t, op)
        rows.append(nnf.pad(t.reshape(-1), (0, width - t.numel())))
    mine = _ops.reduce_scatter_tensor(torch.stack(rows), 0, _size(group), name, group_name(group))
    return _write(output, mine[0, : inputs[rank].numel()])


# --------------------------------------------------------------------------------------------------------
# Data movement
# --------------------------------------------------------------------------------------------------------


def all_gather(tensor: torch.Tensor, group) -> tuple[torch.Tensor, ...]:
    return _ops.all_gather_tensor(tensor.unsqueeze(0), 0, _size(group), group_name(group)).unbind(0)


def all_gather_tensor(tensor: torch.Tensor, dim: int, group) -> torch.Tensor:
    return _ops.all_gather_tensor(tensor, dim, _size(group), group_name(group))


def all_gather_base(output: torch.Tensor, tensor: torch.Tensor, group) -> torch.Tensor:
    rows = _ops.all_gather_tensor(tensor.reshape(1, tensor.numel()), 0, _size(group), group_name(group))
    return _write(output, rows)


def all_gather_variable(tensor: torch.Tensor, dim: int, sizes: list[int], group) -> torch.Tensor:
    return _ops.all_gather_variable(tensor, dim, list(sizes), group_name(group))


def all_to_all_single(output, tensor, out_splits, in_splits, group, n: int) -> torch.Tensor:
    """``out_splits``/``in_splits`` None: equal splits of ``output``/``tensor`` along dim 0."""
    out_splits = [output.shape[0] // n] * n if out_splits is None else list(out_splits)
    in_splits = [tensor.shape[0] // n] * n if in_splits is None else list(in_splits)
    return _write(output, _ops.all_to_all_single(tensor, out_splits, in_splits, group_name(group)))


def all_to_all(outputs, inputs, group) -> tuple[torch.Tensor, ...]:
    """outputs[i] receives rank i's inputs[this rank]: one all_to_all_single of the flattened entries."""
    out_numels = [o.numel() for o in outputs]
    flat = torch.cat([t.reshape(-1) for t in inputs])
    received = _ops.all_to_all_single(flat, out_numels, [t.numel() for t in inputs], group_name(group))
    return tuple(_write(o, piece) for o, piece in zip(outputs, received.split(out_numels)))


def gather(tensor: torch.Tensor, dst: int, group) -> tuple[torch.Tensor, ...]:
    """``dst``: the destination's position in the group."""
    return tuple(_ops.gather(tensor, dst, _size(group), group_name(group)))


def scatter(tensors, src: int, requires_grad: bool, group) -> torch.Tensor:
    """``src``: the source's position in the group; every rank passes W tensors of the output's shape,
    ``requires_grad`` whether this rank's do (the op's exchange checks both against the source's)."""
    return _ops.scatter(list(tensors), src, requires_grad, group_name(group))


def ring_pass(tensor: torch.Tensor, shift: int, ring_size: int, recv_shape, group) -> torch.Tensor:
    return _ops.ring_pass(tensor, shift, ring_size, list(recv_shape), group_name(group))


@torch.compiler.disable(reason="all_gather_variable without `sizes` learns them with a host sync; pass `sizes`")
def all_gather_variable_eagerly(tensor, dim, sizes, group):
    """all_gather_variable outside the compiled graph (Note [Compiled collectives] in distcomm._compile.ops)."""
    return _all_gather.all_gather_variable(tensor, dim, sizes, group)


@torch.compiler.disable(reason="scatter without tensors off the source learns their shape with a host sync; pass "
                        "placeholder tensors")
def scatter_eagerly(tensors, src, group):
    """scatter outside the compiled graph (Note [Compiled collectives] in distcomm._compile.ops)."""
    return _gather_scatter.scatter(tensors, src, group)


@torch.compiler.disable(reason="ring_pass without `recv_shape` learns the incoming shape with a host sync; pass "
                        "`recv_shape`")
def ring_pass_eagerly(tensor, shift, group, ring_size):
    """ring_pass outside the compiled graph (Note [Compiled collectives] in distcomm._compile.ops)."""
    return _ring.ring_pass(tensor, shift, group, ring_size)
