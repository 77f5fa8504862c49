"""Reductions and broadcast (distcomm._reduce, distcomm._reduce_scatter) against a float64 single-process simulation.

Layers, cheapest first:
1. in-process, no process group: the world-of-one identity and argument validation;
2. gloo worlds of 1..4 ranks (and the subgroup [1, 3] of a world of 4): every op and every ReduceOp,
   values and gradients (and double backward), compared with a reference that stacks the per-rank inputs
   into one float64 tensor, reduces it with torch.sum / mean / prod / amax / amin and takes the VJP with
   torch.autograd (torch.prod's gradient is zero-safe and torch.amax splits ties evenly, NaN included);
   error messages raised before any communication; check mode; the gradient torch gets wrong;
4. GPU: the same cases on NCCL with two GPUs (marked gpu2).
"""

from __future__ import annotations

import functools
import zlib

import pytest
import torch
import torch.distributed as dist

import distcomm
import distcomm.functional as F
from distcomm import _reduce, _reduce_scatter
from tests.dist_harness import run_world

R = dist.ReduceOp
FLOAT_OPS = ["SUM", "AVG", "PRODUCT", "MIN", "MAX", "PREMUL_SUM"]


# --------------------------------------------------------------------------------------------------------
# Cases: plain dicts, built identically in the parent and in every rank
# --------------------------------------------------------------------------------------------------------


def _values_for(op: str) -> str:
    return {"MIN": "ties", "MAX": "ties", "PRODUCT": "zeros"}.get(op, "normal")


def _cases(n: int) -> list[dict]:
    """Every case for a group of n ranks; roots are group ranks."""
    last = n - 1
    cases = []
    for op in FLOAT_OPS:
        vals = _values_for(op)
        cases += [
            dict(kind="all_reduce", op=op, shape=(3, 4), values=vals, transpose=True),
            dict(kind="all_reduce", op=op, shape=(5,), values=vals),
            dict(kind="reduce", op=op, shape=(4, 3), values=vals, root=last, transpose=True),
            dict(kind="reduce_scatter", op=op, shapes=[(r + 1, 2) for r in range(n)], values=vals),
            dict(kind="reduce_scatter", op=op, shapes=[(3, 2)] * n, values=vals, transpose_out=True),
            dict(kind="reduce_scatter_tensor", op=op, shape=(3, 2 * n), dim=1, values=vals, transpose=True),
            dict(kind="reduce_scatter_tensor", op=op, shape=(2 * n, 3), dim=0, values=vals),
        ]
    cases += [
        dict(kind="all_reduce", op="MAX", shape=(3, 4), values="nan"),
        dict(kind="all_reduce", op="MIN", shape=(6,), values="nan"),
        dict(kind="reduce", op="MAX", shape=(6,), values="nan", root=0),
        dict(kind="reduce_scatter_tensor", op="MAX", shape=(3 * n,), dim=0, values="nan"),
        dict(kind="reduce_scatter", op="MIN", shapes=[(3,)] * n, values="nan"),
        dict(kind="all_reduce", op="PRODUCT", shape=(3, 4), values="zeros", transpose=True),
        dict(kind="reduce_scatter_tensor", op="SUM", shape=(2, 3, n), dim=-1, values="normal"),
        dict(kind="broadcast", shape=(2, 3), root=last, values="normal", transpose=True),
        dict(kind="broadcast", shape=(4,), root=0, values="normal"),
        dict(kind="reduce", op="SUM", shape=(2, 3), root=0, values="normal"),
        # 0-d and zero-size
        *[dict(kind="all_reduce", op=op, shape=(), values="normal") for op in ("SUM", "MAX", "PRODUCT")],
        dict(kind="all_reduce", op="MAX", shape=(0, 3), values="normal"),
        dict(kind="reduce", op="SUM", shape=(0, 3), root=last, values="normal"),
        dict(kind="broadcast", shape=(), root=last, values="normal"),
        dict(kind="reduce_scatter_tensor", op="MAX", shape=(0, 2 * n), dim=1, values="normal"),
        dict(kind="reduce_scatter", op="SUM", shapes=[(0, 2)] + [(r, 2) for r in range(1, n)], values="normal"),
        # integers: forward only
        *[dict(kind="all_reduce", op=op, shape=(6,), values="int") for op in ("SUM", "AVG", "PRODUCT", "MIN", "MAX")],
        *[dict(kind="all_reduce", op=op, shape=(6,), values="bits") for op in ("BAND", "BOR", "BXOR")],
        dict(kind="reduce", op="BXOR", shape=(6,), values="bits", root=last),
        dict(kind="reduce_scatter_tensor", op="MAX", shape=(2 * n,), dim=0, values="int"),
        # complex (SUM, AVG, PREMUL_SUM) and low precision (reduced in the dtype given)
        *[dict(kind="all_reduce", op=op, shape=(2, 3), values="complex", transpose=True)
          for op in ("SUM", "AVG", "PREMUL_SUM")],
        dict(kind="reduce", op="AVG", shape=(3,), root=last, values="complex"),
        dict(kind="broadcast", shape=(3,), root=last, values="complex"),
        dict(kind="reduce_scatter", op="SUM", shapes=[(r + 1,) for r in range(n)], values="complex"),
        dict(kind="reduce_scatter_tensor", op="PREMUL_SUM", shape=(2, 2 * n), dim=1, values="complex"),
        dict(kind="all_reduce", op="SUM", shape=(2, 3), values="normal", dtype="bfloat16", transpose=True),
        dict(kind="all_reduce", op="MAX", shape=(5,), values="ties", dtype="bfloat16"),
        dict(kind="all_reduce", op="PRODUCT", shape=(5,), values="zeros", dtype="float16"),
        dict(kind="reduce_scatter", op="AVG", shapes=[(r + 1,) for r in range(n)], values="normal", dtype="float16"),
        dict(kind="reduce_scatter_tensor", op="MIN", shape=(2 * n, 2), dim=0, values="ties", dtype="bfloat16"),
        # double backward: loss_r = sum(w_r * y_r^2), then sum(v_j * dL/dx_j) differentiated again
        *[dict(kind="all_reduce", op=op, shape=(2, 3), values="normal", double=True) for op in ("SUM", "AVG", "MAX")],
        dict(kind="all_reduce", op="PREMUL_SUM", shape=(3,), values="normal", double=True),
        dict(kind="reduce", op="SUM", shape=(2, 3), root=last, values="normal", double=True),
        dict(kind="reduce", op="MIN", shape=(4,), root=0, values="normal", double=True),
        dict(kind="broadcast", shape=(2, 3), root=last, values="normal", double=True),
        dict(kind="reduce_scatter", op="SUM", shapes=[(r + 1, 2) for r in range(n)], values="normal", double=True),
        dict(kind="reduce_scatter", op="MAX", shapes=[(2,)] * n, values="normal", double=True),
        dict(kind="reduce_scatter_tensor", op="SUM", shape=(2, 2 * n), dim=1, values="normal", double=True),
        dict(kind="reduce_scatter_tensor", op="AVG", shape=(2 * n,), dim=0, values="normal", double=True),
        # PRODUCT is differentiable once: the second backward raises
        dict(kind="all_reduce", op="PRODUCT", shape=(3,), values="normal", double=True, raises="only once"),
        dict(kind="reduce_scatter_tensor", op="PRODUCT", shape=(n,), dim=0, values="normal", double=True,
             raises="only once"),
    ]
    for i, case in enumerate(cases):
        case["id"] = i
    return cases


def _make(case: dict, grank: int, n: int, what: str = "x", entry: int = 0, shape=None) -> torch.Tensor:
    """Deterministic per-(case, rank, role) data; the parent and the ranks build the same tensors."""
    gen = torch.Generator().manual_seed(zlib.crc32(repr((case["id"], n, grank, what, entry)).encode()))
    if shape is None:
        shape = case["shapes"][entry] if case["kind"] == "reduce_scatter" else case["shape"]
    values = case["values"] if what == "x" or case["values"] == "complex" else "normal"
    if values == "int":
        return torch.randint(-4, 5, shape, generator=gen)
    if values == "bits":
        return torch.randint(0, 16, shape, generator=gen)
    # non-contiguous inputs: generated transposed, then transposed back (a strided view)
    transposed = what == "x" and case.get("transpose") and len(shape) == 2
    base_shape = tuple(reversed(shape)) if transposed else tuple(shape)
    if values == "ties":
        x = torch.randint(0, 3, base_shape, generator=gen).double()
    elif values == "complex":
        x = torch.randn(base_shape, generator=gen, dtype=torch.complex128)
    else:
        x = torch.randn(base_shape, generator=gen, dtype=torch.float64)
    flat = x.view(-1)
    if values == "zeros" and flat.numel() >= 3:
        # element 0: one zero (rank 0); element 1: two zeros (ranks 0, 1); element 2: zero on every rank
        flat[0] = 0.0 if grank == 0 else flat[0]
        flat[1] = 0.0 if grank in (0, 1) else flat[1]
        flat[2] = 0.0
    if values == "nan" and flat.numel() >= 3:
        flat[0] = float("nan") if grank == 0 else flat[0]
        flat[1] = float("nan") if grank == n - 1 else flat[1]
        flat[2] = 7.0  # a tie of every rank next to the NaNs
    x = x.to(getattr(torch, case.get("dtype", str(x.dtype).removeprefix("torch."))))
    return x.t() if transposed else x


def _weight(case: dict, grank: int, n: int, shape) -> torch.Tensor:
    """Rank grank's incoming grad (loss_r = sum(w_r * y_r)); for 2-d outputs a non-contiguous one."""
    if len(shape) == 2:
        return _make(case, grank, n, "w", shape=tuple(reversed(shape))).t()
    return _make(case, grank, n, "w", shape=shape)


def _op(name: str, grank: int):
    if name == "PREMUL_SUM":
        return dist._make_nccl_premul_sum(0.5 + grank)
    return getattr(R, name)


# --------------------------------------------------------------------------------------------------------
# The reference: one float64 tensor holding every rank's data
# --------------------------------------------------------------------------------------------------------


def _reduce_ref(op: str, stacked: torch.Tensor) -> torch.Tensor:
    n = stacked.shape[0]
    if op == "SUM":
        return stacked.sum(0)
    if op == "AVG":
        if stacked.is_floating_point() or stacked.is_complex():
            return stacked.mean(0)
        return torch.div(stacked.sum(0), n, rounding_mode="trunc")
    if op == "PREMUL_SUM":
        factors = torch.tensor([0.5 + r for r in range(n)], dtype=stacked.dtype)
        return (factors.view(-1, *[1] * (stacked.dim() - 1)) * stacked).sum(0)
    if op == "PRODUCT":
        return stacked.prod(0)
    if op == "MAX":
        return stacked.amax(0)
    if op == "MIN":
        return stacked.amin(0)
    bitwise = {"BAND": torch.bitwise_and, "BOR": torch.bitwise_or, "BXOR": torch.bitwise_xor}[op]
    return functools.reduce(bitwise, stacked.unbind(0))


def _reference(case: dict, n: int) -> list[dict]:
    """Per group rank: the expected output and gradient(s)."""
    kind, op, root = case["kind"], case.get("op"), case.get("root")
    if kind == "reduce_scatter":
        leaves = [torch.stack([_make(case, j, n, entry=r) for j in range(n)]) for r in range(n)]
    else:
        leaves = [torch.stack([_make(case, j, n) for j in range(n)])]
    differentiable = leaves[0].is_floating_point() or leaves[0].is_complex()
    wide = torch.complex128 if leaves[0].is_complex() else torch.float64
    leaves = [leaf.to(wide).requires_grad_() if differentiable else leaf for leaf in leaves]
    if kind == "all_reduce":
        ys = [_reduce_ref(op, leaves[0])] * n
    elif kind == "reduce":
        full = _reduce_ref(op, leaves[0])
        ys = [full if r == root else torch.zeros_like(full).detach() for r in range(n)]
    elif kind == "broadcast":
        ys = [leaves[0][root]] * n
    elif kind == "reduce_scatter":
        ys = [_reduce_ref(op, leaves[r]) for r in range(n)]
    else:
        ys = list(_reduce_ref(op, leaves[0]).chunk(n, case["dim"]))
    out = [{"y": y.detach()} for y in ys]
    if not differentiable:
        return out
    ws = [_weight(case, r, n, ys[r].shape).to(wide) for r in range(n)]

    def grad_of(leaf_grads, j):
        if kind == "reduce_scatter":
            return [leaf_grads[r][j] for r in range(n)]
        return [leaf_grads[0][j]]

    if not case.get("double"):
        used = [(y, w) for y, w in zip(ys, ws) if y.requires_grad]
        grads = torch.autograd.grad([y for y, _ in used], leaves, grad_outputs=[w for _, w in used])
        for j in range(n):
            out[j]["grad"] = grad_of(grads, j)
        return out
    loss = sum((w * y * y).sum() for y, w in zip(ys, ws))
    first = torch.autograd.grad(loss, leaves, create_graph=True)
    if case.get("raises"):
        return out
    vs = [[_make(case, j, n, "v", e, shape=g.shape) for e, g in enumerate(grad_of(first, j))] for j in range(n)]
    loss2 = sum((g * v).sum() for j in range(n) for g, v in zip(grad_of(first, j), vs[j]))
    second = torch.autograd.grad(loss2, leaves)
    for j in range(n):
        out[j]["grad"] = [g.detach() for g in grad_of(first, j)]
        out[j]["grad2"] = grad_of(second, j)
    return out


# --------------------------------------------------------------------------------------------------------
# What each rank runs
# --------------------------------------------------------------------------------------------------------


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and bool(((a == b) | (a.isnan() & b.isnan())).all())


def _run_case(case: dict, group, members: list[int], grank: int, n: int, device: str) -> dict:
    kind, root = case["kind"], case.get("root")
    entries = range(n) if kind == "reduce_scatter" else [0]
    xs = [_make(case, grank, n, entry=e).to(device) for e in entries]
    originals = [x.clone() for x in xs]
    differentiable = xs[0].is_floating_point() or xs[0].is_complex()
    xs = [x.detach().requires_grad_(differentiable) for x in xs]
    op = _op(case["op"], grank) if "op" in case else None
    if kind == "all_reduce":
        y = F.all_reduce(xs[0], op, group=group)
    elif kind == "reduce":
        y = F.reduce(xs[0], members[root], op, group=group)
    elif kind == "broadcast":
        y = F.broadcast(xs[0], members[root], group=group)
    elif kind == "reduce_scatter_tensor":
        y = F.reduce_scatter_tensor(xs[0], case["dim"], op, group=group)
    else:
        shape = case["shapes"][grank]
        output = torch.empty(shape[::-1], dtype=xs[0].dtype, device=device).t() if case.get("transpose_out") else (
            torch.empty(shape, dtype=xs[0].dtype, device=device)
        )
        y = F.reduce_scatter(output, xs, op, group=group)
        assert y is output, "reduce_scatter must return its output argument"
    assert y.requires_grad == differentiable, "every output requires grad when the input does"
    result = {"y": y.detach().cpu()}
    if differentiable:
        w = _weight(case, grank, n, y.shape).to(device)
        if not case.get("double"):
            w_before = w.clone()
            y.backward(w)  # 2-d: w, hence the grad reaching the collective's backward, is non-contiguous
            assert _same(w_before, w), "the incoming gradient was modified"
            result["grad"] = [x.grad.cpu() for x in xs]
        else:
            first = torch.autograd.grad((w * y * y).sum(), xs, create_graph=True)
            vs = [_make(case, grank, n, "v", e, shape=g.shape).to(device) for e, g in enumerate(first)]
            loss2 = sum((g * v).sum() for g, v in zip(first, vs))
            if case.get("raises"):
                try:
                    loss2.backward()
                except RuntimeError as exc:
                    result["error"] = str(exc)
            else:
                loss2.backward()
                result["grad"] = [g.detach().cpu() for g in first]
                result["grad2"] = [x.grad.cpu() for x in xs]
    assert all(_same(a, x.detach()) for a, x in zip(originals, xs)), "the caller's input was modified"
    return result


def _cases_rank(rank, world, members, select, device="cpu"):
    if device == "cuda":
        device = f"cuda:{torch.cuda.current_device()}"
    group = dist.new_group(members) if members is not None else None
    members = members if members is not None else list(range(world))
    if rank not in members:
        try:
            F.all_reduce(torch.ones(2), group=group)
        except ValueError as exc:
            return str(exc)
        return None
    n, grank = len(members), members.index(rank)
    return [_run_case(c, group, members, grank, n, device) for c in _cases(n) if select is None or c["id"] in select]


def _compare(results: list, members: list[int], select=None) -> None:
    n = len(members)
    for case in _cases(n):
        if select is not None and case["id"] not in select:
            continue
        idx = case["id"] if select is None else sorted(select).index(case["id"])
        expected = _reference(case, n)
        for grank, rank in enumerate(members):
            got, want = results[rank][idx], expected[grank]
            where = f"case {case} group rank {grank}"
            tol = {}
            if got["y"].dtype in (torch.bfloat16, torch.float16):
                tol = dict(rtol=2e-2, atol=2e-2, check_dtype=False)
            torch.testing.assert_close(got["y"], want["y"], equal_nan=True, msg=lambda m: f"{where}: y: {m}", **tol)
            if case.get("raises"):
                assert case["raises"] in got.get("error", ""), f"{where}: expected an error, got {got}"
                continue
            for key in ("grad", "grad2"):
                for a, b in zip(got.get(key, []), want.get(key, []), strict=True):
                    torch.testing.assert_close(a, b, equal_nan=True, msg=lambda m: f"{where}: {key}: {m}", **tol)


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_every_op_matches_reference(world):
    """Every op x every ReduceOp, ties, zeros, NaN, 0-d, zero-size, uneven, strided and double backward."""
    results = run_world(_cases_rank, world, None, None)
    _compare(results, list(range(world)))


def _subgroup_select() -> list[int]:
    keep = {("reduce", "PRODUCT"), ("broadcast", None), ("all_reduce", "MAX"), ("reduce_scatter", "MIN"),
            ("reduce_scatter_tensor", "AVG"), ("reduce", "SUM"), ("reduce_scatter", "SUM")}
    return [c["id"] for c in _cases(2) if (c["kind"], c.get("op")) in keep]


def test_subgroup_without_rank_zero():
    """The group [1, 3] of a world of 4: src/dst are global ranks, and torch's group/global rank mix-ups are avoided."""
    select = _subgroup_select()
    results = run_world(_cases_rank, 4, [1, 3], select)
    for outsider in (0, 2):
        assert "placeholder torch.distributed.new_group returns to processes outside the group" in results[outsider]
    _compare(results, [1, 3], select)


def test_single_process_identity():
    """Without a process group every op is the world-of-one identity, returning a new tensor."""
    x = torch.randn(3, 2, dtype=torch.float64).t().requires_grad_()
    for fn in (
        lambda t: F.all_reduce(t, R.MAX),
        lambda t: F.reduce(t, 0, R.PRODUCT),
        lambda t: F.broadcast(t, 0),
        lambda t: F.reduce_scatter_tensor(t, dim=1, op=R.MIN),
        lambda t: F.reduce_scatter(torch.empty(t.shape, dtype=t.dtype), [t]),
    ):
        x.grad = None
        y = fn(x)
        assert y is not x and y.is_contiguous()
        torch.testing.assert_close(y, x, rtol=0, atol=0)
        weight = torch.randn(y.shape, dtype=torch.float64)
        y.backward(weight)
        torch.testing.assert_close(x.grad, weight, rtol=0, atol=0)
    y = F.all_reduce(x, dist._make_nccl_premul_sum(3.0))
    torch.testing.assert_close(y, 3.0 * x)


def test_all_lists_the_public_functions():
    """functional re-exports exactly these names, each a callable of the reduction module that defines it."""
    modules = (_reduce, _reduce_scatter)
    names = [name for module in modules for name in module.__all__]
    assert len(names) == len(set(names))
    assert set(names) == {"all_reduce", "reduce", "broadcast", "reduce_scatter", "reduce_scatter_tensor"}
    for module in modules:
        for name in module.__all__:
            assert name in F.__all__
            assert callable(getattr(F, name)) and getattr(F, name) is getattr(module, name)


# --------------------------------------------------------------------------------------------------------
# Errors: raised before any communication, with messages naming the argument
# --------------------------------------------------------------------------------------------------------

_ERRORS = [
    (TypeError, r"`op` must be a torch.distributed.ReduceOp \(one of SUM, AVG", lambda x, xi: F.all_reduce(x, "sum")),
    (ValueError, r"`op`=PREMUL_SUM needs a factor", lambda x, xi: F.all_reduce(x, R.PREMUL_SUM)),
    (ValueError, r"the PREMUL_SUM factor requires grad",
     lambda x, xi: F.all_reduce(x, dist._make_nccl_premul_sum(torch.tensor(2.0, requires_grad=True)))),
    (TypeError, r"PREMUL_SUM needs a floating-point or complex tensor, got dtype torch.int64",
     lambda x, xi: F.all_reduce(xi, dist._make_nccl_premul_sum(2.0))),
    (ValueError, r"all_reduce: `op`=BAND is not differentiable, but the input requires grad",
     lambda x, xi: F.all_reduce(x, R.BAND)),
    (TypeError, r"`op`=BOR needs an integer or bool tensor, got dtype torch.float64",
     lambda x, xi: F.all_reduce(x.detach(), R.BOR)),
    (TypeError, r"`op`=MAX is not defined for complex tensors",
     lambda x, xi: F.all_reduce(torch.ones(2, dtype=torch.complex64), R.MAX)),
    (TypeError, r"`tensor` must be a torch.Tensor, got list", lambda x, xi: F.all_reduce([1.0, 2.0])),
    (TypeError, r"`group` must be a torch.distributed.ProcessGroup, a 1-D DeviceMesh, a tuple \(DeviceMesh, dim name\) or None",
     lambda x, xi: F.all_reduce(x, group="world")),
    (ValueError, r"`dst`=5 is not a member of the group; `dst` is a global rank and must be one of \[0, 1\]",
     lambda x, xi: F.reduce(x, 5)),
    (TypeError, r"`dst` must be an int \(a global rank\), got float 1.0", lambda x, xi: F.reduce(x, 1.0)),
    (ValueError, r"`src`=-1 is not a member of the group", lambda x, xi: F.broadcast(x, -1)),
    (ValueError, r"reduce_scatter: `input_list` has 1 tensors, expected 2 \(one per rank of the group\)",
     lambda x, xi: F.reduce_scatter(torch.empty(3), [x])),
    (TypeError, r"`input_list` must be a list of tensors, got Tensor",
     lambda x, xi: F.reduce_scatter(torch.empty(3), x)),
    (TypeError, r"`input_list\[1\]` must be a torch.Tensor, got NoneType",
     lambda x, xi: F.reduce_scatter(torch.empty(3), [x, None])),
    (ValueError, r"reduce_scatter: `output` requires grad, but it is a buffer written in place",
     lambda x, xi: F.reduce_scatter(torch.empty(3, dtype=torch.float64, requires_grad=True), [x, x])),
    (ValueError, r"`output` has shape \(4,\), but `input_list\[0\]` \(the entry this rank receives\) has shape \(3,\)",
     lambda x, xi: F.reduce_scatter(torch.empty(4, dtype=torch.float64), [x, x])),
    (ValueError, r"`input_list\[1\]` is torch.float32 on cpu, but `output` is torch.float64 on cpu",
     lambda x, xi: F.reduce_scatter(torch.empty(3, dtype=torch.float64), [x, x.float()])),
    (ValueError, r"`tensor` has size 3 along `dim`=0, which the group size 2 does not divide",
     lambda x, xi: F.reduce_scatter_tensor(x)),
    (ValueError, r"`dim`=2 is out of range for a tensor of 1 dims \(allowed: -1 to 0\)",
     lambda x, xi: F.reduce_scatter_tensor(x, dim=2)),
    (TypeError, r"`dim` must be an int, got float 0.5", lambda x, xi: F.reduce_scatter_tensor(x, dim=0.5)),
    (ValueError, r"`tensor` is 0-d; it needs a dimension to split", lambda x, xi: F.reduce_scatter_tensor(x.sum())),
]


def _errors_rank(rank, world):
    if rank != 0:  # rank 1 never communicates: an op that did would hang rank 0 and fail by timeout
        return None
    x = torch.randn(3, dtype=torch.float64, requires_grad=True)
    xi = torch.arange(4)
    messages = []
    for exc_type, _, call in _ERRORS:
        try:
            call(x, xi)
        except exc_type as exc:
            messages.append(str(exc))
        else:
            messages.append(None)
    return messages


def test_bad_input_errors_before_communicating():
    """Each bad argument raises a TypeError/ValueError naming it, on one rank alone (so nothing was sent)."""
    import re

    messages = run_world(_errors_rank, 2)[0]
    for (_, pattern, _), message in zip(_ERRORS, messages, strict=True):
        assert message is not None and re.search(pattern, message), (pattern, message)


def test_bad_input_single_process():
    """The same validation applies without a process group (world of one: dst 1 does not exist)."""
    with pytest.raises(ValueError, match=r"`dst`=1 is not a rank of this single-process run"):
        F.reduce(torch.ones(2), 1)
    with pytest.raises(TypeError, match=r"`op` must be a torch.distributed.ReduceOp"):
        F.reduce_scatter_tensor(torch.ones(2), op=max)


# --------------------------------------------------------------------------------------------------------
# Check mode: a cross-rank mismatch raises the same error on every rank instead of hanging
# --------------------------------------------------------------------------------------------------------


def _check_mode_rank(rank, world):
    messages = []
    attempts = [
        lambda: F.all_reduce(torch.ones(3 + rank)),
        lambda: F.all_reduce(torch.ones(3), R.SUM if rank == 0 else R.MAX),
        lambda: F.reduce(torch.ones(3, requires_grad=rank == 1), 0),
        lambda: F.broadcast(torch.ones(2, dtype=torch.float32 if rank == 0 else torch.float64), 0),
        lambda: F.reduce_scatter(torch.empty(2), [torch.ones(2), torch.ones(3 - rank)]),
        lambda: F.reduce_scatter_tensor(torch.ones(4, 2), dim=rank),
    ]
    with distcomm.check_mode():
        for attempt in attempts:
            try:
                attempt()
                messages.append(None)
            except ValueError as exc:
                messages.append(str(exc))
        ok = F.reduce_scatter(torch.empty(1 + rank), [torch.ones(1), torch.ones(2)], R.MAX)
    return messages, ok


def test_check_mode_raises_same_error_everywhere():
    """Shape, dtype, op, root, requires_grad and dim mismatches give one identical ValueError on every rank."""
    (m0, ok0), (m1, ok1) = run_world(_check_mode_rank, 2)
    assert m0 == m1
    assert m0 == [
        "all_reduce: shapes differ across ranks (rank 0: shape=(3,) dtype=torch.float32, rank 1: shape=(4,) "
        "dtype=torch.float32)",
        "all_reduce: `op` differs across ranks (rank 0: SUM, rank 1: MAX); every rank must pass the same",
        "reduce: `requires_grad` differs across ranks (rank 0: False, rank 1: True); every rank must pass the same "
        "(the ranks that require grad would wait forever in the backward)",
        "broadcast: dtypes differ across ranks (rank 0: shape=(2,) dtype=torch.float32, rank 1: shape=(2,) "
        "dtype=torch.float64)",
        "reduce_scatter: shapes of `input_list[1]` differ across ranks (rank 0: (3,), rank 1: (2,))",
        "reduce_scatter_tensor: `dim` differs across ranks (rank 0: 0, rank 1: 1); every rank must pass the same",
    ]
    torch.testing.assert_close(ok0, torch.ones(1))
    torch.testing.assert_close(ok1, torch.ones(2))


# --------------------------------------------------------------------------------------------------------
# Backend choice: NCCL is decided per tensor; AVG's backward issues the forward's op
# --------------------------------------------------------------------------------------------------------

_MIXED_CASES = [
    dict(id=1000, kind="all_reduce", op="AVG", shape=(2, 3), values="normal", transpose=True),
    dict(id=1001, kind="all_reduce", op="AVG", shape=(5,), values="int"),
    dict(id=1002, kind="reduce_scatter_tensor", op="AVG", shape=(4, 3), dim=0, values="normal"),
    dict(id=1003, kind="all_reduce", op="BAND", shape=(6,), values="bits"),
]
_NATIVE_AVG_CASE = dict(id=1004, kind="all_reduce", op="AVG", shape=(2, 3), values="normal", double=True)


def _backend_choice_rank(rank, world):
    from distcomm import _reduce_ops

    members = list(range(world))
    out = {}
    real_all_reduce, real_get_backend, real_is_nccl = dist.all_reduce, dist.get_backend, _reduce_ops._is_nccl
    issued = []
    native_avg = False

    def logged_all_reduce(tensor, op=R.SUM, group=None, async_op=False):
        issued.append(R.RedOpType(op).name)
        if op == R.AVG and native_avg:  # NCCL's native AVG, emulated on gloo
            real_all_reduce(tensor, op=R.SUM, group=group)
            tensor.div_(dist.get_world_size(group))
            return None
        return real_all_reduce(tensor, op=op, group=group, async_op=async_op)

    dist.all_reduce = logged_all_reduce
    try:
        # A "cpu:gloo,cuda:nccl" group cannot be built without CUDA: report that backend string for the
        # default gloo group. CPU tensors must still take gloo's path (emulated AVG, bitwise ops allowed).
        dist.get_backend = lambda group=None: "cpu:gloo,cuda:nccl"
        try:
            out["is_nccl_cpu"] = _reduce_ops._is_nccl(dist.group.WORLD, torch.ones(1))
            out["mixed"] = [_run_case(c, None, members, rank, world, "cpu") for c in _MIXED_CASES]
        finally:
            dist.get_backend = real_get_backend
        out["issued_mixed"], issued[:] = list(issued), []
        # Native AVG (as on NCCL): the backward must issue AVG too.
        native_avg, _reduce_ops._is_nccl = True, lambda group, tensor: True
        try:
            out["native"] = _run_case(_NATIVE_AVG_CASE, None, members, rank, world, "cpu")
        finally:
            _reduce_ops._is_nccl = real_is_nccl
        out["issued_native"] = issued
    finally:
        dist.all_reduce = real_all_reduce
    return out


def test_nccl_is_decided_per_tensor_and_avg_backward_reuses_the_forward_op():
    """CPU tensors on a mixed cpu:gloo/cuda:nccl group get gloo's emulated AVG and bitwise ops (not NCCL's), and
    all_reduce(AVG)'s backward (and double backward) issues native AVG where the forward did, with exact grads."""
    world = 2
    results = run_world(_backend_choice_rank, world)
    for rank, res in enumerate(results):
        assert res["is_nccl_cpu"] is False
        # the float AVG case (forward, backward) and the int AVG case as SUM, then BAND: no AVG reaches gloo
        assert res["issued_mixed"] == ["SUM", "SUM", "SUM", "BAND"], res["issued_mixed"]
        # forward, backward, then the double backward through the backward's node and the forward's (the
        # first grad depends on y): native AVG every time, never SUM followed by a separate division
        assert res["issued_native"] == ["AVG", "AVG", "AVG", "AVG"], res["issued_native"]
    for name, cases in (("mixed", _MIXED_CASES), ("native", [_NATIVE_AVG_CASE])):
        for i, case in enumerate(cases):
            expected = _reference(case, world)
            for rank, res in enumerate(results):
                got = res[name][i] if name == "mixed" else res[name]
                torch.testing.assert_close(got["y"], expected[rank]["y"])
                for key in ("grad", "grad2"):
                    for a, b in zip(got.get(key, []), expected[rank].get(key, []), strict=True):
                        torch.testing.assert_close(a, b, msg=lambda m: f"{case} rank {rank} {key}: {m}")


# --------------------------------------------------------------------------------------------------------
# What torch.distributed.nn.functional gets wrong
# --------------------------------------------------------------------------------------------------------


def _torch_vs_ours_rank(rank, world):
    import torch.distributed.nn.functional as torch_functional

    x = torch.tensor([1.0, 5.0, 2.0], dtype=torch.float64) * (rank + 1)
    weight = torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64) + rank
    grads = {}
    for name, fn in (("torch", torch_functional.all_reduce), ("ours", F.all_reduce)):
        leaf = x.clone().requires_grad_()
        (fn(leaf, op=R.MAX) * weight).sum().backward()
        grads[name] = leaf.grad
    return grads


def test_max_gradient_fixes_torch():
    """torch's all_reduce(MAX) backward re-applies MAX to the grads; ours sends the summed grad to the argmax."""
    results = run_world(_torch_vs_ours_rank, 2)
    # rank 1 holds the maximum of every element; the summed weights are (1+2, 2+3, 3+4)
    expected = [torch.zeros(3, dtype=torch.float64), torch.tensor([3.0, 5.0, 7.0], dtype=torch.float64)]
    for rank in range(2):
        torch.testing.assert_close(results[rank]["ours"], expected[rank])
    # torch gives every rank max_r(weight_r) = weight_1 = (2, 3, 4), even the rank that lost
    torch.testing.assert_close(results[0]["torch"], torch.tensor([2.0, 3.0, 4.0], dtype=torch.float64))
    assert not torch.equal(results[0]["torch"], expected[0])


def _conj_reduce_rank(rank, world):
    from distcomm import _reduce_raw

    # Take the NCCL-only path (non-root ranks hand their buffer over uncopied) on gloo: a lazily conjugated
    # input must still be resolved by a copy first, or view_as_real raises on the non-root ranks only.
    _reduce_raw._is_nccl = lambda group, tensor: True
    z = torch.tensor([1 + 2j, 3 - 1j], dtype=torch.complex128) * (rank + 1)
    y = F.reduce(z.conj(), 0)
    return y, z.conj().resolve_conj()


def test_reduce_resolves_lazy_conjugates_before_the_uncopied_path():
    results = run_world(_conj_reduce_rank, 2)
    total = sum(inp for _, inp in results)
    torch.testing.assert_close(results[0][0], total)
    torch.testing.assert_close(results[1][0], torch.zeros_like(total))


# --------------------------------------------------------------------------------------------------------
# NCCL
# --------------------------------------------------------------------------------------------------------


@pytest.mark.gpu2
def test_nccl_matches_reference():
    """The same cases on NCCL (native AVG, padded uneven reduce_scatter, NaN masks) with cuda tensors."""
    select = [c["id"] for c in _cases(2) if c.get("op") not in ("BAND", "BOR", "BXOR")]
    results = run_world(_cases_rank, 2, None, select, "cuda", backend="nccl", timeout=240)
    _compare(results, [0, 1], select)
