"""The collectives as ``torch.library`` custom ops: what a graph compiled by ``torch.compile`` calls.

Note [Compiled collectives]
    Under ``torch.compile`` (``torch.compiler.is_compiling()``) each public function of
    :mod:`distcomm.functional` validates its arguments as in eager mode, then calls one of the ops below
    (through :mod:`distcomm._compile.path`) instead of its autograd Function:

        F.all_reduce(x, op=MAX)                      eager:     _AllReduce.apply(x, op, group, size)
              │ compiling
              ▼
        torch.ops.distcomm.all_reduce(x, "MAX", "0")  one node in the graph
              impl      the eager raw collective (same code, so the same bits)
              fake      the output's shape and dtype, no communication (used while tracing)
              autograd  the exact VJP of Note [Reduction gradients], built from these same ops, so the
                        adjoint collectives are nodes of the compiled backward graph

    - A ProcessGroup cannot be a custom-op argument: the ops take the group's name (``group.group_name``;
      "" without a process group, a world of one) and look the group up when they run, as PyTorch's
      functional collectives do. Ranks (``src``/``dst``) are positions in the group.
    - Whatever an output's shape depends on is an argument (the group size, this rank's position), never
      looked up by the fake implementation: Inductor caches compiled graphs by their text and inputs, and a
      graph that ran on rank 0, or in a world of another size, must not be reused where shapes differ.
    - The ops are functional: they never modify their inputs and return new contiguous tensors, so
      AOTAutograd and Inductor treat them like any other op, except that they are registered as having side
      effects (``torch.fx.has_side_effect``): dead-code elimination keeps a collective whose result a rank
      does not use, since its peers wait for it. The graph keeps them in program order.
    - The ops run the eager modules' raw collectives, imported at the top: the compiled path imports the
      eager modules, never the other way (Note [Import direction of the compiled path] in
      :mod:`distcomm._dispatch`).
    - PREMUL_SUM is the SUM of ``factor * x`` (Note [Backend emulation]); the multiplication is an ordinary
      graph op whose own gradient supplies conj(factor).
    - First order only: torch.compile does not differentiate a compiled backward again (double backward
      runs in eager mode, where every op supports it).
"""

from __future__ import annotations

import torch
from torch.distributed.distributed_c10d import _resolve_process_group

from distcomm import _all_gather, _all_to_all, _gather_scatter, _reduce_raw, ring
from distcomm._reduce_ops import _OPS

__all__: list[str] = []

_BY_NAME = {op.name: op for op in _OPS.values()}  # "SUM" -> the parsed _Op (PREMUL_SUM never reaches the ops)


def _group(group_name: str):
    """(group, size, rank) of the group named ``group_name``; "" is no process group (a world of one)."""
    if not group_name:
        return None, 1, 0
    group = _resolve_process_group(group_name)
    return group, group.size(), group.rank()


def _size(group_name: str) -> int:
    return _resolve_process_group(group_name).size() if group_name else 1


def _contiguous(t: torch.Tensor) -> torch.Tensor:
    return t if t.is_contiguous() else t.contiguous()


def _empty(t: torch.Tensor, shape) -> torch.Tensor:
    return t.new_empty(tuple(shape))


def _along(shape, dim: int, size) -> list:
    out = list(shape)
    out[dim] = size
    return out


# --------------------------------------------------------------------------------------------------------
# Reductions (Note [Reduction gradients] in distcomm._reduce)
# --------------------------------------------------------------------------------------------------------


@torch.library.custom_op("distcomm::all_reduce", mutates_args=())
def all_reduce(x: torch.Tensor, op: str, group_name: str) -> torch.Tensor:
    """y = op_i x_i on every rank."""
    group, size, _ = _group(group_name)
    return _reduce_raw._raw_all_reduce(x, _BY_NAME[op], group, size)


@torch.library.custom_op("distcomm::reduce", mutates_args=())
def reduce(x: torch.Tensor, dst: int, op: str, group_name: str) -> torch.Tensor:
    """y = op_i x_i on the group rank ``dst``, zeros on the other ranks."""
    group, size, rank = _group(group_name)
    return _reduce_raw._raw_reduce(x, dst, _BY_NAME[op], group, size, rank == dst)


@torch.library.custom_op("distcomm::broadcast", mutates_args=())
def broadcast(x: torch.Tensor, src: int, group_name: str) -> torch.Tensor:
    """y_r = x_src (``src`` a group rank)."""
    group, size, rank = _group(group_name)
    return _reduce_raw._raw_broadcast(x, src, group, size, rank == src)


@torch.library.custom_op("distcomm::reduce_scatter_tensor", mutates_args=())
def reduce_scatter_tensor(x: torch.Tensor, dim: int, group_size: int, op: str, group_name: str) -> torch.Tensor:
    """Chunk r along ``dim`` of op_i x_i lands on rank r."""
    group, size, _ = _group(group_name)
    return _reduce_raw._raw_reduce_scatter_dim(x, dim, _BY_NAME[op], group, size)


@torch.library.custom_op("distcomm::all_gather_tensor", mutates_args=())
def all_gather_tensor(x: torch.Tensor, dim: int, group_size: int, group_name: str) -> torch.Tensor:
    """cat(x_0, ..., x_{W-1}; dim) on every rank."""
    group, size, _ = _group(group_name)
    return _reduce_raw._raw_all_gather_dim(x, dim, group, size)


@all_reduce.register_fake
def _(x, op, group_name):
    return _empty(x, x.shape)


@reduce.register_fake
def _(x, dst, op, group_name):
    return _empty(x, x.shape)


@broadcast.register_fake
def _(x, src, group_name):
    return _empty(x, x.shape)


@reduce_scatter_tensor.register_fake
def _(x, dim, group_size, op, group_name):
    return _empty(x, _along(x.shape, dim, x.shape[dim] // group_size))


@all_gather_tensor.register_fake
def _(x, dim, group_size, group_name):
    return _empty(x, _along(x.shape, dim, x.shape[dim] * group_size))


def _others_product(x: torch.Tensor, group_name: str) -> torch.Tensor:
    """prod_{i != j} x_i, zero-safe: distcomm._reduce_raw._others_product written with the ops."""
    zero = x == 0
    zeros = all_reduce(zero.to(_reduce_raw._count_dtype(_size(group_name))), "SUM", group_name)
    safe = torch.where(zero, torch.ones_like(x), x)
    nonzero_product = all_reduce(safe, "PRODUCT", group_name)
    return torch.where(
        zeros == 0,
        nonzero_product / safe,
        torch.where((zeros == 1) & zero, nonzero_product, torch.zeros_like(nonzero_product)),
    )


def _local_vjp(op: str, total: torch.Tensor, group_name: str, x=None, y=None) -> torch.Tensor:
    """x̄_j from ``total`` (G, or g_dst for reduce): distcomm._reduce._local_vjp written with the ops."""
    if op == "SUM":
        return total
    if op == "AVG":
        return total / _size(group_name)
    if op == "PRODUCT":
        return total * _others_product(x, group_name)
    mask = x == y
    count = all_reduce(mask.to(_reduce_raw._count_dtype(_size(group_name))), "SUM", group_name)
    return total / count * mask


def _save_for_vjp(ctx, op: str, x: torch.Tensor, y: torch.Tensor) -> None:
    if op in ("MAX", "MIN"):
        ctx.save_for_backward(x, y)
    elif op == "PRODUCT":
        ctx.save_for_backward(x, None)
    else:
        ctx.save_for_backward(None, None)


def _setup_reduction(ctx, inputs, output):
    """all_reduce, reduce and reduce_scatter_tensor: the op, the group and what the local VJP needs."""
    x, *args = inputs
    ctx.args = args
    ctx.op, ctx.group_name = args[-2], args[-1]
    _save_for_vjp(ctx, ctx.op, x, output)


def _all_reduce_backward(ctx, grad):
    op, name = ctx.op, ctx.group_name
    if op == "AVG":  # self-adjoint
        return all_reduce(grad, "AVG", name), None, None
    x, y = ctx.saved_tensors
    return _local_vjp(op, all_reduce(grad, "SUM", name), name, x, y), None, None


def _reduce_backward(ctx, grad):
    dst, op, name = ctx.args
    x, y = ctx.saved_tensors
    total = broadcast(grad, dst, name)
    if y is not None:
        y = broadcast(y, dst, name)
    return _local_vjp(op, total, name, x, y), None, None, None


def _broadcast_backward(ctx, grad):
    src, name = ctx.args
    return reduce(grad, src, "SUM", name), None, None


def _reduce_scatter_tensor_backward(ctx, grad):
    dim, size, op, name = ctx.args
    none = (None,) * 4
    if op == "AVG":  # divide the chunk before gathering: 1/N of the elements of the full grad
        return all_gather_tensor(grad / size, dim, size, name), *none
    if op == "SUM":
        return all_gather_tensor(grad, dim, size, name), *none
    x, y = ctx.saved_tensors
    if op == "PRODUCT":
        return all_gather_tensor(grad, dim, size, name) * _others_product(x, name), *none
    mask = x == all_gather_tensor(y, dim, size, name)
    count = reduce_scatter_tensor(mask.to(_reduce_raw._count_dtype(size)), dim, size, "SUM", name)
    return all_gather_tensor(grad / count, dim, size, name) * mask, *none


def _setup_args(ctx, inputs, output):
    ctx.args = inputs[1:]


def _all_gather_tensor_backward(ctx, grad):
    dim, size, name = ctx.args
    return reduce_scatter_tensor(grad, dim, size, "SUM", name), None, None, None


all_reduce.register_autograd(_all_reduce_backward, setup_context=_setup_reduction)
reduce.register_autograd(_reduce_backward, setup_context=_setup_reduction)
broadcast.register_autograd(_broadcast_backward, setup_context=_setup_args)
reduce_scatter_tensor.register_autograd(_reduce_scatter_tensor_backward, setup_context=_setup_reduction)
all_gather_tensor.register_autograd(_all_gather_tensor_backward, setup_context=_setup_args)


# --------------------------------------------------------------------------------------------------------
# Data movement (the transposes of Note [Gradient convention] in distcomm.functional)
# --------------------------------------------------------------------------------------------------------


@torch.library.custom_op("distcomm::all_gather_variable", mutates_args=())
def all_gather_variable(x: torch.Tensor, dim: int, sizes: list[int], group_name: str) -> torch.Tensor:
    """cat(x_0, ..., x_{W-1}; dim), rank r's x of size sizes[r] along ``dim`` (Note [Variable sizes])."""
    group, _, _ = _group(group_name)
    return _all_gather._gather_concat(x, dim, tuple(sizes), group)


@torch.library.custom_op("distcomm::reduce_scatter_variable", mutates_args=())
def reduce_scatter_variable(x: torch.Tensor, dim: int, sizes: list[int], rank: int, group_name: str) -> torch.Tensor:
    """Rank j's slice (sizes[j] along ``dim``) of sum_r x_r: the transpose of all_gather_variable (``rank``:
    this rank's position in the group)."""
    group, _, rank = _group(group_name)
    return _contiguous(_all_gather._reduce_scatter_concat(x, dim, tuple(sizes), group, rank))


@torch.library.custom_op("distcomm::all_to_all_single", mutates_args=())
def all_to_all_single(
    x: torch.Tensor, output_split_sizes: list[int], input_split_sizes: list[int], group_name: str
) -> torch.Tensor:
    """Rows input_split_sizes[j] of x go to rank j; rank i's rows arrive in order (output_split_sizes[i])."""
    group, size, _ = _group(group_name)
    out_shape = (sum(output_split_sizes), *x.shape[1:])
    return _all_to_all._all_to_all_single_fresh(group, size, out_shape, output_split_sizes, input_split_sizes, x)


@torch.library.custom_op("distcomm::gather", mutates_args=())
def gather(x: torch.Tensor, dst: int, group_size: int, group_name: str) -> list[torch.Tensor]:
    """(x_0, ..., x_{W-1}) on the group rank ``dst``, zeros elsewhere."""
    group, size, rank = _group(group_name)
    return list(_gather_scatter._raw_gather(dst, group, size, rank, x))


@torch.library.custom_op("distcomm::scatter", mutates_args=())
def scatter(tensors: list[torch.Tensor], src: int, requires_grad: bool | None, group_name: str) -> torch.Tensor:
    """tensors[r] of the group rank ``src`` lands on rank r; every rank's tensors give the shape.

    With ``requires_grad`` (whether this rank's tensors require grad) the eager path's exchange comes
    first, so compiled and eager ranks interoperate, and every rank's tensors and flag are checked against
    the source's. ``None``: no exchange (gather's backward, whose grads have the same shape everywhere).
    """
    group, size, rank = _group(group_name)
    if size > 1 and requires_grad is not None:
        _gather_scatter._exchange(tensors, rank == src, src, group, requires_grad, placeholders=True)
    first = tensors[0]
    like = (first.shape, first.dtype, first.device)
    return _gather_scatter._raw_scatter(src, group, size, rank, like, *tensors)


@torch.library.custom_op("distcomm::ring_pass", mutates_args=())
def ring_pass(x: torch.Tensor, shift: int, ring_size: int, recv_shape: list[int], group_name: str) -> torch.Tensor:
    """y = x of the ring member ``shift`` positions to the left (Note [Ring layout] in distcomm.ring)."""
    group, _, _ = _group(group_name)
    comm = ring.RingComm(group, ring_size)
    (out,) = comm.send_recv(x, shift=shift, recv_like=[recv_shape]).wait()
    return out


@all_gather_variable.register_fake
def _(x, dim, sizes, group_name):
    return _empty(x, _along(x.shape, dim, sum(sizes)))


@reduce_scatter_variable.register_fake
def _(x, dim, sizes, rank, group_name):
    return _empty(x, _along(x.shape, dim, sizes[rank]))


@all_to_all_single.register_fake
def _(x, output_split_sizes, input_split_sizes, group_name):
    return _empty(x, (sum(output_split_sizes), *x.shape[1:]))


@gather.register_fake
def _(x, dst, group_size, group_name):
    return [_empty(x, x.shape) for _ in range(group_size)]


@scatter.register_fake
def _(tensors, src, requires_grad, group_name):
    return _empty(tensors[0], tensors[0].shape)


@ring_pass.register_fake
def _(x, shift, ring_size, recv_shape, group_name):
    return _empty(x, recv_shape)


def _all_gather_variable_backward(ctx, grad):
    dim, sizes, name = ctx.args
    return reduce_scatter_variable(grad, dim, sizes, _group(name)[2], name), None, None, None


def _reduce_scatter_variable_backward(ctx, grad):
    dim, sizes, _, name = ctx.args
    return all_gather_variable(grad, dim, sizes, name), None, None, None, None


def _all_to_all_single_backward(ctx, grad):
    out_splits, in_splits, name = ctx.args
    return all_to_all_single(grad, in_splits, out_splits, name), None, None, None


def _gather_backward(ctx, grads):
    dst, _, name = ctx.args
    return scatter(list(grads), dst, None, name), None, None, None


def _scatter_backward(ctx, grad):
    src, _, name = ctx.args
    # Off the source the gathered grads are zeros: the placeholders' grads.
    return gather(grad, src, _size(name), name), None, None, None


def _setup_ring_pass(ctx, inputs, output):
    x, shift, ring_size, _, name = inputs
    ctx.args = (shift, ring_size, list(x.shape), name)


def _ring_pass_backward(ctx, grad):
    shift, ring_size, shape, name = ctx.args
    return ring_pass(grad, -shift, ring_size, shape, name), None, None, None, None


all_gather_variable.register_autograd(_all_gather_variable_backward, setup_context=_setup_args)
reduce_scatter_variable.register_autograd(_reduce_scatter_variable_backward, setup_context=_setup_args)
all_to_all_single.register_autograd(_all_to_all_single_backward, setup_context=_setup_args)
gather.register_autograd(_gather_backward, setup_context=_setup_args)
scatter.register_autograd(_scatter_backward, setup_context=_setup_args)
ring_pass.register_autograd(_ring_pass_backward, setup_context=_setup_ring_pass)



for _name in ("all_reduce", "reduce", "broadcast", "reduce_scatter_tensor", "all_gather_tensor", "all_gather_variable",
              "reduce_scatter_variable", "all_to_all_single", "gather", "scatter", "ring_pass"):
    torch.fx.has_side_effect(getattr(torch.ops.distcomm, _name).default)
