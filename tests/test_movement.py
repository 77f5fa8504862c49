"""Layer 2: data-movement collectives (gather, scatter, all_gather family, all_to_all) on gloo worlds of
1..4 ranks, against a single-process float64 simulation written here from the definitions.

Every case builds all ranks' inputs from seeds (in the ranks and again in the parent), runs the collective
with loss_r = sum_k <y_rk, w_rk> (random weights, applied through a transpose so the incoming grads are
non-contiguous), and compares outputs, input grads and, for these linear ops, the double backward
(d/dw of <x̄, v>) with autograd on the simulation. Cases loop inside one world per world size.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass, field
from typing import Callable

import pytest
import torch
import torch.distributed as dist

import distcomm
import distcomm.functional as F
from distcomm import _all_gather, _all_to_all, _check, _gather_scatter
from tests.dist_harness import run_world

TOL = dict(rtol=1e-12, atol=1e-12)


# ---------------------------------------------------------------------------------------------------------
# Cases: make(r, W) -> inputs of group rank r; run(xs, r, W, env) -> outputs; sim(X, W) -> outputs per rank
# ---------------------------------------------------------------------------------------------------------


def _rand(shape, *key, noncontig: bool = False) -> torch.Tensor:
    g = torch.Generator().manual_seed(zlib.crc32(repr(key).encode()))
    t = torch.randn(tuple(shape), generator=g, dtype=torch.float64)
    if noncontig and t.dim() >= 2:
        t = t.mT.contiguous().mT  # same values, transposed strides
    return t


@dataclass
class Env:
    group: object
    members: list[int]  # global ranks of the group, in group-rank order
    device: torch.device = torch.device("cpu")
    info: dict = field(default_factory=dict)

    def empty(self, *shape):
        return torch.empty(*shape, dtype=torch.float64, device=self.device)

    def empty_transposed(self, *shape):
        """A non-contiguous tensor that is not a view (column-major strides)."""
        strides = [1] * len(shape)
        for d in range(1, len(shape)):
            strides[d] = strides[d - 1] * shape[d - 1]
        return torch.empty_strided(shape, strides, dtype=torch.float64, device=self.device)


@dataclass(frozen=True)
class Case:
    make: Callable
    run: Callable
    sim: Callable
    double: bool = True


def _var(r: int) -> int:
    return [2, 0, 3, 1][r % 4]  # all_gather_variable sizes: uneven, with a zero


def _rows(i: int, j: int) -> int:
    return (i + 2 * j) % 3  # all_to_all: rows sent from rank i to rank j (zeros included)


def _a2as_in(r: int, w: int) -> list[int]:
    return [(r + j) % 3 for j in range(w)]


def _a2as_out(r: int, w: int) -> list[int]:
    return [_a2as_in(i, w)[r] for i in range(w)]


def _same(x_list):
    return lambda X, W: [tuple(x_list(X, W))] * W


def _ag_tensor(shape, dim, name):
    return Case(
        lambda r, W: [_rand(shape, name, r, noncontig=True)],
        lambda xs, r, W, env: (F.all_gather_tensor(xs[0], dim=dim, group=env.group),),
        lambda X, W: [(torch.cat([X[i][0] for i in range(W)], dim),)] * W,
    )


def _ag_variable(shape_of, dim, name, given: bool):
    def run(xs, r, W, env):
        sizes = [shape_of(i)[dim] for i in range(W)] if given else None
        y, got = F.all_gather_variable(xs[0], dim=dim, sizes=sizes, group=env.group)
        env.info[name] = got
        return (y,)

    return Case(
        lambda r, W: [_rand(shape_of(r), name, r, noncontig=True)],
        run,
        lambda X, W: [(torch.cat([X[i][0] for i in range(W)], dim),)] * W,
    )


def _agb(out_shape, name, *, view=False, noncontig=False, stack=False):
    def run(xs, r, W, env):
        shape = out_shape(W)
        if view:
            out = env.empty(shape[0] + 1, *shape[1:])[1:]
        elif noncontig:
            out = env.empty_transposed(*shape)
        else:
            out = env.empty(*shape)
        y = F._all_gather_base(out, xs[0], group=env.group)
        env.info[name] = {"same_object": y is out, "shares_memory": y.data_ptr() == out.data_ptr()}
        return (y,)

    cat = torch.stack if stack else torch.cat
    return Case(
        lambda r, W: [_rand((2, 3), name, r, noncontig=True)],
        run,
        lambda X, W: [(cat([X[i][0] for i in range(W)]),)] * W,
    )


def _a2a(name, *, views=False):
    def run(xs, r, W, env):
        rows = [_rows(i, r) for i in range(W)]
        outs = list(env.empty(sum(rows), 2).split(rows)) if views else [env.empty(n, 2) for n in rows]
        ys = F.all_to_all(outs, xs, group=env.group)
        env.info[name] = {
            "same_objects": all(y is o for y, o in zip(ys, outs)),
            "shares_memory": all(y.data_ptr() == o.data_ptr() for y, o in zip(ys, outs)),
        }
        return ys

    return Case(
        lambda r, W: [_rand((_rows(r, j), 2), name, r, j) for j in range(W)],
        run,
        lambda X, W: [tuple(X[i][r] for i in range(W)) for r in range(W)],
    )


def _a2as(name, *, equal=False, noncontig_out=False):
    def splits(r, W):
        return ([2] * W, [2] * W) if equal else (_a2as_in(r, W), _a2as_out(r, W))

    def run(xs, r, W, env):
        ins, outs = splits(r, W)
        n = sum(outs)
        out = env.empty_transposed(n, 3) if noncontig_out else env.empty(n, 3)
        y = F.all_to_all_single(out, xs[0], None if equal else outs, None if equal else ins, group=env.group)
        env.info[name] = {"same_object": y is out}
        return (y,)

    return Case(
        lambda r, W: [_rand((sum(splits(r, W)[0]), 3), name, r, noncontig=True)],
        run,
        lambda X, W: [
            (torch.cat([X[i][0].split(splits(i, W)[0])[r] for i in range(W)]),) for r in range(W)
        ],
    )


CASES: dict[str, Case] = {
    "all_gather": Case(
        lambda r, W: [_rand((3, 2), "ag", r, noncontig=True)],
        lambda xs, r, W, env: F.all_gather(xs[0], group=env.group),
        _same(lambda X, W: [X[i][0] for i in range(W)]),
    ),
    "all_gather_0d": Case(
        lambda r, W: [_rand((), "ag0", r)],
        lambda xs, r, W, env: F.all_gather(xs[0], env.group),
        _same(lambda X, W: [X[i][0] for i in range(W)]),
    ),
    "gather": Case(  # dst = the last group rank (not 0 when W > 1)
        lambda r, W: [_rand((2, 3), "ga", r, noncontig=True)],
        lambda xs, r, W, env: F.gather(xs[0], env.members[W - 1], env.group),
        lambda X, W: [
            tuple(X[i][0] if r == W - 1 else torch.zeros(2, 3, dtype=torch.float64) for i in range(W))
            for r in range(W)
        ],
    ),
    "scatter": Case(  # src = the last group rank; every rank passes real tensors (as torch requires)
        lambda r, W: [_rand((2, 3), "sc", r, j, noncontig=True) for j in range(W)],
        lambda xs, r, W, env: (F.scatter(xs, env.members[W - 1], env.group),),
        lambda X, W: [(X[W - 1][r],) for r in range(W)],
    ),
    "scatter_none": Case(  # receivers pass None: they learn the shape and that the output needs grad
        lambda r, W: [_rand((4,), "scn", r, j) for j in range(W)] if r == W - 1 else [],
        lambda xs, r, W, env: (F.scatter(xs or None, env.members[W - 1], env.group),),
        lambda X, W: [(X[W - 1][r],) for r in range(W)],
        double=False,
    ),
    "agt_dim0": _ag_tensor((2, 3), 0, "agt0"),
    "agt_dim1": _ag_tensor((2, 3, 2), 1, "agt1"),
    "agt_dim-1": _ag_tensor((2, 2, 3), -1, "agtn"),
    "agt_lead1": _ag_tensor((1, 2, 3), 1, "agtl"),
    "agt_empty": _ag_tensor((0, 3), 0, "agte"),
    "var_dim0": _ag_variable(lambda r: (_var(r), 3), 0, "var_dim0", given=False),
    "var_dim1_sizes": _ag_variable(lambda r: (2, _var(r), 3), 1, "var_dim1_sizes", given=True),
    "var_dim-1": _ag_variable(lambda r: (3, 2, _var(r)), -1, "var_dim-1", given=False),
    "var_equal_sizes": _ag_variable(lambda r: (2, 2, 3), 1, "var_equal_sizes", given=True),
    "var_lead1": _ag_variable(lambda r: (1, _var(r), 2), 1, "var_lead1", given=True),
    "var_all_zero": _ag_variable(lambda r: (0, 3), 0, "var_all_zero", given=False),
    "agb_cat": _agb(lambda W: (2 * W, 3), "agb_cat"),
    "agb_stack": _agb(lambda W: (W, 2, 3), "agb_stack", stack=True),
    "agb_noncontig_out": _agb(lambda W: (2 * W, 3), "agb_noncontig_out", noncontig=True),
    "agb_view_out": _agb(lambda W: (2 * W, 3), "agb_view_out", view=True),
    "a2a": _a2a("a2a"),
    "a2a_split_views": _a2a("a2a_split_views", views=True),
    "a2as": _a2as("a2as"),
    "a2as_equal": _a2as("a2as_equal", equal=True),
    "a2as_noncontig_out": _a2as("a2as_noncontig_out", noncontig_out=True),
}


def _weight(name: str, r: int, k: int, shape) -> torch.Tensor:
    return _rand(tuple(shape), "w", name, r, k)


def _t(y: torch.Tensor) -> torch.Tensor:
    return y.transpose(0, 1) if y.dim() >= 2 else y


# ---------------------------------------------------------------------------------------------------------
# Running a case on one rank, and the reference in the parent
# ---------------------------------------------------------------------------------------------------------


def _run_case(name: str, r: int, W: int, env: Env) -> dict:
    case = CASES[name]
    xs = [x.to(env.device).detach().requires_grad_() for x in case.make(r, W)]
    before = [x.detach().clone() for x in xs]
    ys = case.run(xs, r, W, env)
    # loss = sum_k <y_k, w_k>, through a transpose: the grads reaching the collective are non-contiguous
    leaves = [_t(_weight(name, r, k, y.shape)).contiguous().to(env.device).requires_grad_() for k, y in enumerate(ys)]
    loss = sum((_t(y) * w).sum() for y, w in zip(ys, leaves))
    out = {
        "y": [y.detach().cpu() for y in ys],
        "requires_grad": all(y.requires_grad for y in ys),
        "unchanged": all(torch.equal(b, x.detach()) for b, x in zip(before, xs)),
        "info": env.info.get(name),
    }
    if not xs:  # a receiver of scatter(None): nothing to differentiate, but it takes part in the backward
        loss.backward()
        out["gx"] = []
        return out
    gx = torch.autograd.grad(loss, xs, create_graph=case.double, allow_unused=True)
    out["gx"] = [None if g is None else g.detach().cpu() for g in gx]
    if case.double:
        vs = [_weight(name, r, 100 + j, x.shape).to(env.device) for j, x in enumerate(xs)]
        second = sum((g * v).sum() for g, v in zip(gx, vs) if g is not None)
        wg = torch.autograd.grad(second, leaves, allow_unused=True)
        out["wg"] = [None if g is None else _t(g).detach().cpu() for g in wg]
    return out


def _reference(name: str, W: int) -> list[dict]:
    """The float64 single-process simulation: outputs, input grads and double-backward grads per rank."""
    case = CASES[name]
    X = [[x.requires_grad_() for x in case.make(r, W)] for r in range(W)]
    Y = case.sim(X, W)
    ws = [[_weight(name, r, k, y.shape).requires_grad_() for k, y in enumerate(Y[r])] for r in range(W)]
    loss = sum((y * w).sum() for r in range(W) for y, w in zip(Y[r], ws[r]))
    flat = [x for xs in X for x in xs]
    grads = list(torch.autograd.grad(loss, flat, create_graph=True, allow_unused=True)) if flat else []
    refs = []
    for r in range(W):
        gx = [grads.pop(0) for _ in X[r]]
        gx = [torch.zeros_like(x) if g is None else g for g, x in zip(gx, X[r])]
        refs.append({"y": [y.detach() for y in Y[r]], "gx": gx})
    if case.double:
        second = sum(
            (g * _weight(name, r, 100 + j, x.shape)).sum()
            for r in range(W)
            for j, (g, x) in enumerate(zip(refs[r]["gx"], X[r]))
        )
        flat_w = [w for wr in ws for w in wr]
        wg = torch.autograd.grad(second, flat_w, allow_unused=True)
        k = 0
        for r in range(W):
            refs[r]["wg"] = [torch.zeros_like(w) if g is None else g for g, w in zip(wg[k : k + len(ws[r])], ws[r])]
            k += len(ws[r])
    for ref in refs:
        ref["gx"] = [g.detach() for g in ref["gx"]]
    return refs


def _compare(name: str, got: list[dict], W: int) -> None:
    for r, (g, ref) in enumerate(zip(got, _reference(name, W))):
        where = f"{name}, group rank {r} of {W}"
        assert g["requires_grad"], f"{where}: an output does not require grad"
        assert g["unchanged"], f"{where}: the input was modified"
        assert len(g["y"]) == len(ref["y"]), where
        for a, b in zip(g["y"], ref["y"]):
            torch.testing.assert_close(a, b, **TOL, msg=f"{where}: output")
        for a, b in zip(g["gx"], ref["gx"]):
            torch.testing.assert_close(torch.zeros_like(b) if a is None else a, b, **TOL, msg=f"{where}: grad")
        if "wg" in ref:
            for a, b in zip(g["wg"], ref["wg"]):
                torch.testing.assert_close(torch.zeros_like(b) if a is None else a, b, **TOL, msg=f"{where}: 2nd")


def _check_info(name: str, info, W: int) -> None:
    if name.startswith("var_"):
        shape_of = {"var_dim0": lambda r: _var(r), "var_dim1_sizes": _var, "var_dim-1": _var,
                    "var_lead1": _var, "var_equal_sizes": lambda r: 2, "var_all_zero": lambda r: 0}[name]
        assert info == [shape_of(i) for i in range(W)], name
    elif name in ("agb_cat", "agb_stack", "agb_noncontig_out"):
        assert info["same_object"], f"{name}: the caller's output object must be returned"
    elif name in ("agb_view_out", "a2a_split_views"):  # views come back as aliases of the written memory
        assert info["shares_memory"], name
    elif name in ("a2as", "a2as_equal", "a2as_noncontig_out", "a2a"):
        key = "same_objects" if name == "a2a" else "same_object"
        assert info[key], f"{name}: the caller's output objects must be returned"


def _cases_rank(rank: int, world: int, subgroups: bool, backend_device: str) -> dict:
    device = torch.device("cuda", rank) if backend_device == "cuda" else torch.device("cpu")
    if subgroups:
        g13, g02 = dist.new_group([1, 3]), dist.new_group([0, 2])  # every rank creates every group
        members = [1, 3] if rank in (1, 3) else [0, 2]
        env_group = g13 if rank in (1, 3) else g02
    else:
        members, env_group = list(range(world)), None
    env = Env(env_group, members, device)
    r, W = members.index(rank), len(members)
    return {name: _run_case(name, r, W, env) for name in CASES}


def _check_world(results: list[dict], groups: list[list[int]]) -> None:
    for members in groups:
        W = len(members)
        for name in CASES:
            got = [results[m][name] for m in members]
            _compare(name, got, W)
            for g in got:
                _check_info(name, g["info"], W)


# ---------------------------------------------------------------------------------------------------------
# Tests
# ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_every_op_matches_simulation(world):
    """Every op, forward, backward and double backward, uneven and zero-size shards, non-contiguous tensors
    and grads, any dim, dst/src != 0: exactly the float64 simulation on every rank."""
    results = run_world(_cases_rank, world, False, "cpu")
    _check_world(results, [list(range(world))])


def test_subgroups_with_ranks_not_starting_at_zero():
    """Groups [1, 3] and [0, 2] of a world of 4 run every case at once; src/dst are global ranks."""
    results = run_world(_cases_rank, 4, True, "cpu")
    _check_world(results, [[1, 3], [0, 2]])


def test_without_process_group_is_single_process_identity():
    """With no process group every op is the identity of a world of one (1-tuples for the tuple ops)."""
    assert not dist.is_initialized()
    env = Env(None, [0])
    results = [{name: _run_case(name, 0, 1, env) for name in CASES}]
    _check_world(results, [[0]])
    x = torch.randn(3)
    assert len(F.all_gather(x)) == 1 and len(F.gather(x)) == 1
    y, sizes = F.all_gather_variable(x)
    assert sizes == [3] and torch.equal(y, x)


@pytest.mark.gpu2
def test_nccl_every_op_matches_simulation():
    """The same cases on NCCL with cuda:rank tensors (the list all_to_all path and flat collectives)."""
    results = run_world(_cases_rank, 2, False, "cuda", backend="nccl", timeout=120)
    _check_world(results, [[0, 1]])


def _bad_inputs_rank(rank: int, world: int) -> dict:
    x = torch.randn(2, 3, dtype=torch.float64)
    n = world
    groups = [dist.new_group([0]), dist.new_group([1])]
    outside = groups[1 - rank]  # the placeholder new_group returned to this process, not a member
    cases = {
        "gather_type": lambda: F.gather([x]),
        "gather_dst_type": lambda: F.gather(x, dst="0"),
        "gather_dst_range": lambda: F.gather(x, dst=5),
        "scatter_type": lambda: F.scatter("abc"),
        "scatter_len": lambda: F.scatter([x]),
        "scatter_entry": lambda: F.scatter([x, 3]),
        "scatter_none_on_src": lambda: F.scatter(None, src=rank),  # every rank names itself the source
        "scatter_src_range": lambda: F.scatter([x, x], src=-1),
        "all_gather_type": lambda: F.all_gather(3.0),
        "all_gather_group": lambda: F.all_gather(x, group="world"),
        "agt_dim_range": lambda: F.all_gather_tensor(x, dim=2),
        "agt_dim_type": lambda: F.all_gather_tensor(x, dim=1.0),
        "agt_0d": lambda: F.all_gather_tensor(torch.tensor(1.0)),
        "var_sizes_len": lambda: F.all_gather_variable(x, sizes=[2]),
        "var_sizes_negative": lambda: F.all_gather_variable(x, sizes=[2, -1]),
        "var_sizes_type": lambda: F.all_gather_variable(x, sizes=[2.0, 2]),
        "var_sizes_tensor": lambda: F.all_gather_variable(x, sizes=torch.tensor([2, 2])),
        "var_sizes_own": lambda: F.all_gather_variable(x, sizes=[5, 5]),
        "var_dim_range": lambda: F.all_gather_variable(x, dim=-3),
        "agb_requires_grad": lambda: F._all_gather_base(torch.zeros(2 * n, 3, requires_grad=True), x),
        "agb_shape": lambda: F._all_gather_base(torch.empty(2 * n + 1, 3, dtype=x.dtype), x),
        "agb_dtype": lambda: F._all_gather_base(torch.empty(2 * n, 3), x),
        "agb_type": lambda: F._all_gather_base(None, x),
        "a2a_len": lambda: F.all_to_all([x], [x, x]),
        "a2a_in_type": lambda: F.all_to_all([x, x], x),
        "a2a_dtype": lambda: F.all_to_all([x, x], [x, x.float()]),
        "a2a_requires_grad": lambda: F.all_to_all([x, x.clone().requires_grad_()], [x, x]),
        "a2as_splits_sum": lambda: F.all_to_all_single(
            torch.empty(2, 3, dtype=x.dtype), torch.randn(3, 3, dtype=x.dtype), [1, 1], [1, 1]),
        "a2as_splits_out_sum": lambda: F.all_to_all_single(x.clone(), x, [3, 0], [1, 1]),
        "a2as_splits_len": lambda: F.all_to_all_single(x.clone(), x, [2], None),
        "a2as_splits_type": lambda: F.all_to_all_single(x.clone(), x, "ab", None),
        "a2as_uneven_default": lambda: F.all_to_all_single(torch.empty(3, 3, dtype=x.dtype),
                                                           torch.randn(3, 3, dtype=x.dtype)),
        "a2as_row_shape": lambda: F.all_to_all_single(torch.empty(2, 4, dtype=x.dtype), x),
        "a2as_0d": lambda: F.all_to_all_single(torch.tensor(1.0), torch.tensor(1.0)),
        "a2as_requires_grad": lambda: F.all_to_all_single(x.clone().requires_grad_(), x),
        "outside_gather": lambda: F.gather(x, dst=1 - rank, group=outside),
        "outside_scatter": lambda: F.scatter(None, src=1 - rank, group=outside),
        "outside_all_gather": lambda: F.all_gather(x, group=outside),
        "outside_agt": lambda: F.all_gather_tensor(x, group=outside),
        "outside_var": lambda: F.all_gather_variable(x, group=outside),
        "outside_agb": lambda: F._all_gather_base(torch.empty(2, 3, dtype=x.dtype), x, group=outside),
        "outside_a2a": lambda: F.all_to_all([x.clone()], [x], group=outside),
        "outside_a2as": lambda: F.all_to_all_single(x.clone(), x, group=outside),
    }
    out = {}
    for key, fn in cases.items():
        try:
            fn()
            out[key] = None
        except (TypeError, ValueError) as e:
            out[key] = f"{type(e).__name__}: {e}"
    # nothing was sent: the next collective still pairs up correctly on every rank
    out["after"] = torch.cat(F.all_gather(torch.tensor([float(rank)])))
    return out


BAD_INPUTS = {
    "gather_type": r"TypeError: `tensor` must be a torch.Tensor, got list",
    "gather_dst_type": r"TypeError: `dst` must be an int \(a global rank\), got str '0'",
    "gather_dst_range": r"ValueError: `dst`=5 is not a member of the group; .* must be one of \[0, 1\]",
    "scatter_type": r"TypeError: `tensors` must be a list or tuple of tensors, got str",
    "scatter_len": r"ValueError: .*`tensors` must hold one tensor per group rank \(2\), got 1",
    "scatter_entry": r"TypeError: `tensors\[1\]` must be a torch.Tensor, got int",
    "scatter_none_on_src": r"ValueError: .*`tensors` must hold 2 tensors on the source rank \(global rank \d\), got None",
    "scatter_src_range": r"ValueError: .*`src`=-1 is not a member of the group",
    "all_gather_type": r"TypeError: `tensor` must be a torch.Tensor, got float",
    "all_gather_group": r"TypeError: `group` must be a torch.distributed.ProcessGroup, a 1-D DeviceMesh, a tuple "
                        r"\(DeviceMesh, dim name\) or None \(the default group\), got str 'world'",
    "agt_dim_range": r"ValueError: `dim`=2 is out of range for a tensor of 2 dims \(allowed: -2 to 1\)",
    "agt_dim_type": r"TypeError: `dim` must be an int, got 1.0",
    "agt_0d": r"ValueError: a 0-d tensor has no dim to concatenate along",
    "var_sizes_len": r"ValueError: .*`sizes`=\[2\] must hold 2 non-negative ints \(one per group rank\)",
    "var_sizes_negative": r"ValueError: .*`sizes`=\[2, -1\] must hold 2 non-negative ints",
    "var_sizes_type": r"TypeError: `sizes` must be a list of ints or None, got \[2.0, 2\]",
    "var_sizes_tensor": r"TypeError: `sizes` must be a list of ints or None, got Tensor",
    "var_sizes_own": r"ValueError: `sizes`\[\d\]=5 but this rank's tensor has size 2 along dim 0",
    "var_dim_range": r"ValueError: .*`dim`=-3 is out of range for a tensor of 2 dims \(allowed: -2 to 1\)",
    "agb_requires_grad": r"ValueError: `output_tensor` requires grad, but it is overwritten",
    "agb_shape": r"ValueError: `output_tensor` has shape \(5, 3\); .* must be one of \[\(4, 3\), \(2, 2, 3\)\]",
    "agb_dtype": r"ValueError: `output_tensor` has dtype torch.float32 on cpu, but the input has dtype torch.float64",
    "agb_type": r"TypeError: `output_tensor` must be a torch.Tensor, got NoneType",
    "a2a_len": r"ValueError: `output_tensor_list` must hold one tensor per group rank \(2\), got 1",
    "a2a_in_type": r"TypeError: `input_tensor_list` must be a list or tuple of tensors, got Tensor",
    "a2a_dtype": r"ValueError: `input_tensor_list\[1\]` has dtype torch.float32 on cpu, but `input_tensor_list\[0\]`",
    "a2a_requires_grad": r"ValueError: `output_tensor_list\[1\]` requires grad",
    "a2as_splits_sum": r"ValueError: `input_split_sizes`=\[1, 1\] adds up to 2, but `input` has size 3 along dim 0",
    "a2as_splits_out_sum": r"ValueError: `output_split_sizes`=\[3, 0\] adds up to 3, but `output` has size 2",
    "a2as_splits_len": r"ValueError: `output_split_sizes`=\[2\] must hold 2 non-negative ints",
    "a2as_splits_type": r"TypeError: `output_split_sizes` must be a list of ints or None, got 'ab'",
    "a2as_uneven_default": r"ValueError: `output` has size 3 along dim 0, which does not split evenly over 2 ranks; "
                           r"pass `output_split_sizes`",
    "a2as_row_shape": r"ValueError: `output` has shape \(2, 4\); its dims after the first must equal the input's",
    "a2as_0d": r"ValueError: all_to_all_single splits along dim 0",
    "a2as_requires_grad": r"ValueError: `output` requires grad",
    **{
        f"outside_{op}": r"ValueError: `group` is the placeholder torch.distributed.new_group returns to processes "
                         r"outside the group \(this process, global rank \d, is not a member\); only its members may"
        for op in ("gather", "scatter", "all_gather", "agt", "var", "agb", "a2a", "a2as")
    },
}


def test_bad_inputs_raise_before_communicating():
    """Every bad argument raises TypeError/ValueError naming it and the allowed values, before any traffic."""
    import re

    results = run_world(_bad_inputs_rank, 2)
    for rank, res in enumerate(results):
        for key, pattern in BAD_INPUTS.items():
            msg = res[key]
            assert msg is not None, f"{key} did not raise on rank {rank}"
            if pattern is not None:
                assert re.search(pattern, msg), f"{key} on rank {rank}: {msg!r}"
        torch.testing.assert_close(res["after"], torch.tensor([0.0, 1.0]))
    assert set(BAD_INPUTS) | {"after"} == set(results[0])


def _mismatch_rank(rank: int, world: int) -> dict:
    out = {}

    def attempt(key, fn):
        try:
            fn()
            out[key] = None
        except ValueError as e:
            out[key] = str(e)

    f64 = torch.float64
    # all_gather_variable(sizes=None) always checks the other dims and the dtype
    attempt("var_other_dims", lambda: F.all_gather_variable(torch.zeros(rank + 1, 4 if rank == 1 else 3)))
    attempt("var_dtype", lambda: F.all_gather_variable(torch.zeros(2, dtype=torch.float32 if rank == 2 else f64)))
    attempt("var_ndim", lambda: F.all_gather_variable(torch.zeros(2, 1) if rank == 0 else torch.zeros(2)))
    # scatter always learns the shape from the source, so malformed source tensors fail everywhere
    uneven = [torch.zeros(2), torch.zeros(3), torch.zeros(2)]
    attempt("scatter_uneven", lambda: F.scatter(uneven if rank == 0 else None))
    with distcomm.check_mode():
        # each rank's own entry is right, the others are not: only the exchange can tell
        attempt("var_sizes_disagree", lambda: F.all_gather_variable(
            torch.zeros(rank + 1), sizes=[rank + 1 if i == rank else 7 for i in range(world)]))
        attempt("all_gather", lambda: F.all_gather(torch.zeros(3 if rank == 1 else 2)))
        attempt("gather", lambda: F.gather(torch.zeros(2, dtype=torch.float32 if rank == 1 else f64)))
        attempt("all_gather_tensor", lambda: F.all_gather_tensor(torch.zeros(2, 2 + (rank == 2)), dim=1))
        part = torch.zeros(2 + (rank == 0))
        attempt("_all_gather_base", lambda: F._all_gather_base(torch.empty(world * part.numel()), part))
        # rank 0 expects 2 rows from rank 1, which sends 1
        outs = [1] * world
        if rank == 0:
            outs[1] = 2
        attempt("all_to_all_single",
                lambda: F.all_to_all_single(torch.empty(sum(outs)), torch.zeros(world), outs, [1] * world))
        # rank 2 sends rank 0 a (2, 2) tensor where rank 0 expects (2, 3)
        attempt("all_to_all", lambda: F.all_to_all(
            [torch.empty(2, 3) for _ in range(world)],
            [torch.zeros(2, 2 if (rank == 2 and j == 0) else 3) for j in range(world)]))
        # sizes given and wrong for rank 2's own tensor: the exchange runs first, so every rank raises
        attempt("var_sizes_own", lambda: F.all_gather_variable(
            torch.zeros(4 if rank == 2 else rank + 1), sizes=[1, 2, 3]))
        # dtypes outside the common set (same itemsize, so only the dtype tells them apart)
        attempt("uncommon_dtypes", lambda: F.all_gather(
            torch.zeros(2, dtype=torch.float8_e5m2 if rank == 1 else torch.float8_e4m3fn)))
        # rank 1's input needs no grad: it would skip the backward collective the others wait in
        grad = rank != 1

        def leaf(*shape):
            return torch.zeros(*shape).requires_grad_(grad)

        for key, fn in _grad_disagreements(leaf, world).items():
            attempt(f"grad_{key}", fn)
        # a consistent call passes the checks
        y, sizes = F.all_gather_variable(torch.full((rank,), float(rank)), sizes=list(range(world)))
        out["ok_in_check_mode"] = (y, sizes)
        x = torch.full((2,), float(rank), requires_grad=True)
        sum(t.sum() for t in F.all_gather(x)).backward()
        out["ok_grad_in_check_mode"] = x.grad
    out["after"] = torch.cat(F.all_gather(torch.tensor([float(rank)])))
    return out


def _grad_disagreements(leaf, world: int) -> dict:
    """One call per movement op whose backward is a collective, with the input made by ``leaf(*shape)``."""
    return {
        "gather": lambda: F.gather(leaf(2)),
        "all_gather": lambda: F.all_gather(leaf(2)),
        "all_gather_tensor": lambda: F.all_gather_tensor(leaf(2, 3), dim=1),
        "_all_gather_base": lambda: F._all_gather_base(torch.empty(2 * world), leaf(2)),
        "all_gather_variable": lambda: F.all_gather_variable(leaf(2)),
        "all_gather_variable_sizes": lambda: F.all_gather_variable(leaf(2), sizes=[2] * world),
        "all_to_all": lambda: F.all_to_all([torch.empty(2) for _ in range(world)], [leaf(2) for _ in range(world)]),
        "all_to_all_single": lambda: F.all_to_all_single(torch.empty(world), leaf(world)),
    }


def test_cross_rank_mismatches_raise_the_same_error_everywhere():
    """Shape/dtype/size/requires_grad mismatches between ranks raise one identical ValueError on every rank, not a
    hang (in check mode a rank whose own `sizes` entry is wrong does not raise alone; float8 dtypes differ)."""
    world = 3
    results = run_world(_mismatch_rank, world)
    expected = {
        "var_other_dims": "all_gather_variable: sizes of the dims other than dim 0 differ across ranks",
        "var_dtype": "all_gather_variable: dtypes differ across ranks",
        "var_ndim": "all_gather_variable: numbers of dims differ across ranks",
        "scatter_uneven": "scatter: the tensors passed on the source rank (global rank 0) differ",
        "var_sizes_disagree": "all_gather_variable: the `sizes` passed differ across ranks (rank 0: [1, 7, 7]",
        "all_gather": "all_gather: shapes differ across ranks",
        "gather": "gather: dtypes differ across ranks",
        "all_gather_tensor": "all_gather_tensor: shapes differ across ranks",
        "_all_gather_base": "_all_gather_base: shapes differ across ranks",
        "all_to_all_single": "all_to_all_single: rank 1 sends 1 rows to rank 0 (its input_split_sizes), but rank 0 "
                             "expects 2 rows from rank 1",
        "all_to_all": "all_to_all: rank 2's input for rank 0 has shape (2, 2) and dtype torch.float32, but rank 0's "
                      "output for rank 2 has shape (2, 3)",
        "var_sizes_own": "all_gather_variable: `sizes`=[1, 2, 3] but the tensors have sizes [1, 2, 4] along dim 0",
        "uncommon_dtypes": "all_gather: dtypes differ across ranks (rank 0: shape=(2,) dtype=torch.float8_e4m3fn, "
                           "rank 1: shape=(2,) dtype=torch.float8_e5m2, rank 2: shape=(2,) dtype=torch.float8_e4m3fn)",
    }
    for key in _grad_disagreements(None, world):
        op = key.removesuffix("_sizes")
        expected[f"grad_{key}"] = (
            f"{op}: `requires_grad` differs across ranks (rank 0: True, rank 1: False, rank 2: True); every rank "
            "must pass the same (the ranks that require grad would wait forever in the backward)"
        )
    for key, start in expected.items():
        msgs = [res[key] for res in results]
        assert msgs[0] is not None and msgs[0].startswith(start), f"{key}: {msgs[0]!r}"
        assert all(m == msgs[0] for m in msgs), f"{key}: the ranks raised different errors: {msgs}"
    for res in results:
        y, sizes = res["ok_in_check_mode"]
        torch.testing.assert_close(y, torch.tensor([1.0, 2.0, 2.0]))
        assert sizes == [0, 1, 2]
        # loss_r = sum_k sum(y_rk): every rank's x feeds every rank's loss once
        torch.testing.assert_close(res["ok_grad_in_check_mode"], torch.full((2,), float(world)))
        torch.testing.assert_close(res["after"], torch.tensor([0.0, 1.0, 2.0]))


def _grad_flags_rank(rank: int, world: int) -> dict:
    out = {}
    # the source's tensors decide whether every rank's scatter output requires grad
    plain = [torch.ones(2) for _ in range(world)]
    leaves = [torch.ones(2, requires_grad=True) for _ in range(world)]
    out["scatter_src_no_grad"] = F.scatter(plain if rank == 0 else leaves).requires_grad
    y = F.scatter(leaves if rank == 0 else None)
    out["scatter_none_requires_grad"] = y.requires_grad
    (y * (rank + 1)).sum().backward()
    out["scatter_src_grads"] = [t.grad for t in leaves] if rank == 0 else None
    # gather: the zeros off dst require grad too, and the backward reaches every rank
    x = torch.full((2,), float(rank), requires_grad=True)
    ys = F.gather(x, dst=1)
    out["gather_requires_grad"] = [t.requires_grad for t in ys]
    sum((t * (i + 1)).sum() for i, t in enumerate(ys)).backward()
    out["gather_grad"] = x.grad
    # sizes given: no exchange at all (the metadata all-gather must not run)
    real_gather_meta = _check.gather_meta
    _check.gather_meta = None  # calling it would raise TypeError
    try:
        y, _ = F.all_gather_variable(torch.full((rank + 1,), float(rank)), sizes=[1, 2])
        out["variable_sizes_given"] = y
    finally:
        _check.gather_meta = real_gather_meta
    # without autograd, output arguments come back untouched by autograd (the same objects)
    with torch.no_grad():
        o = torch.empty(2 * world)
        out["agb_no_grad_same"] = F._all_gather_base(o, torch.full((2,), float(rank))) is o
        out["agb_no_grad_value"] = o
    return out


def test_requires_grad_follows_the_root_on_every_rank():
    """Every rank's output requires grad exactly when the data's owner does, so no rank skips a backward;
    all_gather_variable with `sizes` sends no metadata; without autograd outputs come back as passed."""
    results = run_world(_grad_flags_rank, 2)
    for rank, res in enumerate(results):
        assert res["scatter_src_no_grad"] is False
        assert res["scatter_none_requires_grad"] is True
        assert res["gather_requires_grad"] == [True, True]
        # loss_1 = sum_i (i + 1) * <x_i, 1>: rank j's grad is (j + 1); loss_0 uses zeros only
        torch.testing.assert_close(res["gather_grad"], torch.full((2,), float(rank + 1)))
        assert res["agb_no_grad_same"] is True
        torch.testing.assert_close(res["variable_sizes_given"], torch.tensor([0.0, 1.0, 1.0]))
        torch.testing.assert_close(res["agb_no_grad_value"], torch.tensor([0.0, 0.0, 1.0, 1.0]))
    # loss_r = (r + 1) * sum(y_r): the source's tensors[r] receives r + 1
    torch.testing.assert_close(results[0]["scatter_src_grads"], [torch.full((2,), 1.0), torch.full((2,), 2.0)])


def _torch_vs_ours_rank(rank: int, world: int) -> dict:
    import torch.distributed.nn.functional as TF

    g13, _ = dist.new_group([1, 3]), dist.new_group([0, 2])
    out = {}
    # (a) subgroup whose ranks are not 0..n-1
    if rank in (1, 3):
        for name, fn in (("torch", TF.all_gather), ("ours", F.all_gather)):
            x = torch.full((2,), float(rank), requires_grad=True)
            ys = fn(x, group=g13)
            try:
                sum(((i + 1) * (rank + 1) * t).sum() for i, t in enumerate(ys)).backward()
                out[f"sub_{name}"] = x.grad
            except Exception as e:  # noqa: BLE001 - reporting torch's failure
                out[f"sub_{name}"] = f"{type(e).__name__}: {e}"
    # (b) non-contiguous incoming grads on gloo (the loss goes through a transpose)
    for name, fn in (("torch", TF.all_gather), ("ours", F.all_gather)):
        x = torch.arange(6.0).reshape(2, 3).add(10 * rank).requires_grad_()
        ys = fn(x)
        w = torch.arange(6.0 * world).reshape(world, 3, 2) + rank
        sum((t.t() * w[i]).sum() for i, t in enumerate(ys)).backward()
        out[f"noncontig_{name}"] = x.grad
    return out


def test_torch_all_gather_backward_is_wrong_where_ours_is_right():
    """torch's all_gather backward fails on a [1, 3] subgroup and scrambles transposed grads; ours is exact."""
    world = 4
    res = run_world(_torch_vs_ours_rank, world)
    # (a) loss_r = sum_i (i + 1)(r + 1) <y_i, 1> on global ranks r in {1, 3}: x̄ at group rank j = (j + 1)(2 + 4)
    for j, rank in enumerate((1, 3)):
        torch.testing.assert_close(res[rank]["sub_ours"], torch.full((2,), 6.0 * (j + 1)))
        torch_result = res[rank]["sub_torch"]
        assert isinstance(torch_result, str) or not torch.allclose(torch_result, res[rank]["sub_ours"])
    # (b) x̄_j = sum_r w_r[j].t()
    for j in range(world):
        expected = sum((torch.arange(6.0 * world).reshape(world, 3, 2) + r)[j].t() for r in range(world))
        torch.testing.assert_close(res[j]["noncontig_ours"], expected)
    assert any(not torch.allclose(res[j]["noncontig_torch"], res[j]["noncontig_ours"]) for j in range(world))


def test_metadata_codes_tell_every_dtype_apart():
    """Check mode's metadata gives every torch dtype (float8, uint16/32/64, ...) its own code and decodes it back."""
    dtypes = {v for v in vars(torch).values() if isinstance(v, torch.dtype)}
    codes = {_check.dtype_code(dtype): dtype for dtype in dtypes}
    assert len(codes) == len(dtypes) and all(0 <= c < 2**63 for c in codes)  # distinct, and fit the int64 row
    for code, dtype in codes.items():
        assert _check.decode_meta([1, code, 4] + [0] * (_check.MAX_DIMS - 1)).dtype is dtype
    uncommon = [torch.float8_e4m3fn, torch.float8_e5m2, torch.uint16, torch.uint32, torch.uint64, torch.float32]
    rows = [_check.encode_meta(torch.empty(2, 3, dtype=dtype)) for dtype in uncommon]
    assert len({row[1] for row in rows}) == len(uncommon)
    assert [_check.decode_meta(row) for row in rows] == [((2, 3), dtype) for dtype in uncommon]


def test_all_lists_the_public_functions():
    """functional re-exports exactly these names, each a callable of the data-movement module that defines it."""
    modules = (_gather_scatter, _all_gather, _all_to_all)
    names = [name for module in modules for name in module.__all__]
    assert len(names) == len(set(names))
    assert set(names) == {
        "gather", "scatter", "all_gather", "_all_gather_base", "all_to_all", "all_to_all_single",
        "all_gather_tensor", "all_gather_variable",
    }
    for module in modules:
        for name in module.__all__:
            assert name in F.__all__
            assert callable(getattr(F, name)) and getattr(F, name) is getattr(module, name)
