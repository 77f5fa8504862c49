"""distcomm.functional.scan: the prefix scan over ranks and its exact gradient.

Layers, cheapest first:
1. pure functions, one process: the local fold, the affine composition, the gradient formula of Note
   [Gradient of the affine scan], argument errors, the world of one without a process group;
2. gloo worlds of 1-4 ranks on CPU against a single-process float64 reference written here (a loop over
   the ranks' inputs, gradients by torch.autograd on it): sum, affine with a heads dim, user combines on a
   tuple and on a tensor, inclusive and exclusive; a subgroup, device meshes, errors decided on every
   rank, and torch.compile(fullgraph=True).
"""

from __future__ import annotations

import zlib

import pytest
import torch
import torch.distributed as dist

import distcomm
import distcomm.functional as F
from distcomm._scan import compose_affine, local_scan
from tests.dist_harness import run_world

TOL = dict(rtol=1e-12, atol=1e-12)
HEADS, K, V = 2, 3, 4


def _rand(shape, *key) -> torch.Tensor:
    g = torch.Generator().manual_seed(zlib.crc32(repr(key).encode()))
    return torch.randn(tuple(shape), generator=g, dtype=torch.float64)


def _decay(left, right):
    """A user combine on a tuple: the diagonal linear recurrence h -> h * a + b."""
    (a0, b0), (a1, b1) = left, right
    return a0 * a1, b0 * a1 + b1


def _product(left, right):
    """A user combine on a single tensor."""
    return left * right


# Every case: (inputs of rank r, scan keywords, the combine for the reference, the reference's identity).
def _case(name: str, r: int):
    if name == "sum":
        return _rand((2, 3), name, r), dict(combine="sum"), lambda a, b: a + b, torch.zeros(2, 3, dtype=torch.float64)
    if name == "affine":
        x = (_rand((HEADS, K, K), name, "A", r) * 0.5, _rand((HEADS, V, K), name, "B", r))
        ident = (torch.eye(K, dtype=torch.float64).expand(HEADS, K, K), torch.zeros(HEADS, V, K, dtype=torch.float64))
        return x, dict(combine="affine"), _affine_by_hand, ident
    if name == "decay":
        x = (torch.rand(5, generator=torch.Generator().manual_seed(r), dtype=torch.float64), _rand((5,), name, r))
        ident = (torch.ones(5, dtype=torch.float64), torch.zeros(5, dtype=torch.float64))
        return x, dict(combine=_decay, identity=(torch.ones((), dtype=torch.float64), torch.zeros(5, dtype=torch.float64))), _decay, ident
    if name == "product":
        x = 1 + 0.1 * _rand((4,), name, r)
        return x, dict(combine=_product, identity=torch.ones((), dtype=torch.float64)), _product, torch.ones(4, dtype=torch.float64)
    raise AssertionError(name)


CASES = ["sum", "affine", "decay", "product"]


def _affine_by_hand(left, right):
    """``left`` then ``right`` on states H (..., N, K), written out (checked on states by the first test)."""
    (a0, b0), (a1, b1) = left, right
    mm = lambda p, q: torch.einsum("...ik,...kj->...ij", p, q)  # noqa: E731
    return mm(a0, a1), mm(b0, a1) + b1


def _weights(name: str, r: int, out):
    parts = out if isinstance(out, tuple) else (out,)
    return tuple(_rand(p.shape, "w", name, r) for p in parts)


def _loss(out, weights):
    parts = out if isinstance(out, tuple) else (out,)
    return sum((p * w).sum() for p, w in zip(parts, weights))


def _reference(name: str, world: int, exclusive: bool):
    """Every rank's scan output and input grads, computed in one process by a loop over the ranks."""
    xs, outs = [], []
    for r in range(world):
        x, _, _, _ = _case(name, r)
        xs.append(tuple(t.clone().requires_grad_() for t in x) if isinstance(x, tuple) else x.clone().requires_grad_())
    _, _, combine, ident = _case(name, 0)
    total = 0
    for r in range(world):
        acc = None
        for s in range(r if exclusive else r + 1):
            acc = xs[s] if acc is None else combine(acc, xs[s])
        if acc is None:
            acc = ident
        outs.append(acc)
        total = total + _loss(acc, _weights(name, r, acc))
    flat = [t for x in xs for t in (x if isinstance(x, tuple) else (x,))]
    grads = torch.autograd.grad(total, flat, allow_unused=True) if total.requires_grad else [None] * len(flat)
    grads = [torch.zeros_like(t) if g is None else g for t, g in zip(flat, grads)]
    per = len(flat) // world
    detach = lambda o: tuple(t.detach() for t in o) if isinstance(o, tuple) else o.detach()  # noqa: E731
    return [detach(o) for o in outs], [tuple(grads[r * per : (r + 1) * per]) for r in range(world)]


def _run_scan(name: str, r: int, exclusive: bool, group=None, algorithm: str = "auto"):
    x, kwargs, _, _ = _case(name, r)
    x = tuple(t.clone().requires_grad_() for t in x) if isinstance(x, tuple) else x.clone().requires_grad_()
    out = F.scan(x, exclusive=exclusive, group=group, algorithm=algorithm, **kwargs)
    _loss(out, _weights(name, r, out)).backward()
    inputs = x if isinstance(x, tuple) else (x,)
    detached = tuple(t.detach() for t in out) if isinstance(out, tuple) else out.detach()
    return detached, tuple(t.grad for t in inputs)


def _assert_matches(got, ref, what):
    out, grads = got
    ref_out, ref_grads = ref
    if isinstance(ref_out, tuple):
        assert isinstance(out, tuple) and len(out) == len(ref_out), what
        for a, b in zip(out, ref_out):
            torch.testing.assert_close(a, b.expand_as(a), **TOL, msg=f"{what}: output")
    else:
        assert isinstance(out, torch.Tensor), what
        torch.testing.assert_close(out, ref_out.expand_as(out), **TOL, msg=f"{what}: output")
    for a, b in zip(grads, ref_grads):
        torch.testing.assert_close(a, b, **TOL, msg=f"{what}: grad")


# ---------------------------------------------------------------------------------------------------------
# 1. Pure functions
# ---------------------------------------------------------------------------------------------------------


def test_affine_reference_is_map_composition():
    """The tests' reference composes maps by their action on states, independently of compose_affine."""
    x0, _, _, _ = _case("affine", 0)
    x1, _, _, _ = _case("affine", 1)
    h = _rand((HEADS, V, K), "h")
    a, b = _affine_by_hand(x0, x1)
    step = (h @ x0[0] + x0[1]) @ x1[0] + x1[1]
    torch.testing.assert_close(h @ a + b, step, **TOL)
    ca, cb = compose_affine(x0, x1)
    torch.testing.assert_close(h @ ca + cb, step, **TOL)


def test_local_scan_folds_the_rows_in_rank_order():
    """Rank r's prefix of gathered rows: sums, non-commuting maps in order, identity on exclusive rank 0."""
    rows = (_rand((4, 3), "rows"),)
    for r in range(4):
        torch.testing.assert_close(local_scan(rows, r, combine="sum", exclusive=False, identity=())[0], rows[0][: r + 1].sum(0))
        torch.testing.assert_close(local_scan(rows, r, combine="sum", exclusive=True, identity=())[0], rows[0][:r].sum(0))
    maps = [_case("affine", r)[0] for r in range(3)]
    stacked = (torch.stack([m[0] for m in maps]), torch.stack([m[1] for m in maps]))
    a, b = local_scan(stacked, 2, combine=compose_affine, exclusive=False, identity=())
    ra, rb = _affine_by_hand(_affine_by_hand(maps[0], maps[1]), maps[2])
    torch.testing.assert_close(a, ra, **TOL)
    torch.testing.assert_close(b, rb, **TOL)
    ident = (torch.eye(K, dtype=torch.float64), torch.zeros((), dtype=torch.float64))
    a0, b0 = local_scan(stacked, 0, combine=compose_affine, exclusive=True, identity=ident)
    assert torch.equal(a0, torch.eye(K, dtype=torch.float64).expand(HEADS, K, K)) and torch.equal(b0, torch.zeros(HEADS, V, K, dtype=torch.float64))


def test_affine_gradient_is_the_reverse_scan_of_the_note():
    """The reverse-scan formula of Note [Gradient of the affine scan] equals autograd on the sequential
    composition, so the Note documents what the code computes (W = 4, a heads dim)."""
    w = 4
    maps = [tuple(t.clone().requires_grad_() for t in _case("affine", r)[0]) for r in range(w)]
    prefixes, acc = [], None
    for m in maps:
        acc = m if acc is None else compose_affine(acc, m)
        prefixes.append(acc)
    g = [(_rand((HEADS, K, K), "ga", r), _rand((HEADS, V, K), "gb", r)) for r in range(w)]
    total = sum((p[0] * ga).sum() + (p[1] * gb).sum() for p, (ga, gb) in zip(prefixes, g))
    auto = torch.autograd.grad(total, [t for m in maps for t in m])
    mt = lambda t: t.transpose(-1, -2)  # noqa: E731
    with torch.no_grad():
        big_a, big_b = [None] * w, [None] * w
        big_a[w - 1], big_b[w - 1] = g[w - 1]
        for r in range(w - 2, -1, -1):
            big_a[r] = g[r][0] + big_a[r + 1] @ mt(maps[r + 1][0])
            big_b[r] = g[r][1] + big_b[r + 1] @ mt(maps[r + 1][0])
        for j in range(w):
            pa, pb = (torch.eye(K, dtype=torch.float64), torch.zeros(HEADS, V, K, dtype=torch.float64)) if j == 0 else prefixes[j - 1]
            torch.testing.assert_close(auto[2 * j], mt(pa) @ big_a[j] + mt(pb) @ big_b[j], **TOL)
            torch.testing.assert_close(auto[2 * j + 1], big_b[j], **TOL)


@pytest.mark.parametrize("name", CASES)
@pytest.mark.parametrize("exclusive", [False, True])
def test_world_of_one_without_a_process_group(name, exclusive):
    """No process group: inclusive returns x, exclusive the identity; gradients g and zeros."""
    assert not dist.is_initialized()
    outs, grads = _reference(name, 1, exclusive)
    _assert_matches(_run_scan(name, 0, exclusive), (outs[0], grads[0]), f"{name} exclusive={exclusive}")


def _bad_calls():
    x = torch.ones(3)
    a, b = torch.ones(2, 3, 3), torch.ones(2, 4, 3)
    return [
        (dict(x=x, combine="max"), ValueError, r"`combine`='max' is not recognised; allowed: 'sum', 'affine'"),
        (dict(x=x, combine=3), TypeError, r"`combine` must be 'sum', 'affine' or a callable, got int 3"),
        (dict(x=[1.0], combine="sum"), TypeError, r"`x` must be a torch.Tensor for combine='sum', got list"),
        (dict(x=(a,), combine="affine"), TypeError, r"`x` must be a pair \(A, B\)"),
        (dict(x=(a, 2.0), combine="affine"), TypeError, r"`x\[1\]` must be a torch.Tensor, got float"),
        (dict(x=(torch.ones(2, 3, 4), b), combine="affine"), ValueError, r"A must have shape \(\.\.\., K, K\), got \(2, 3, 4\)"),
        (dict(x=(a, torch.ones(2, 4, 4)), combine="affine"), ValueError, r"B must have shape \(2, N, 3\) for A of shape \(2, 3, 3\), got \(2, 4, 4\)"),
        (dict(x=(a, b.double()), combine="affine"), ValueError, r"A \(torch.float32 on cpu\) and B \(torch.float64 on cpu\)"),
        (dict(x=x, combine="sum", exclusive=1), TypeError, r"`exclusive` must be a bool, got int 1"),
        (dict(x=x, combine="sum", identity=x), ValueError, r"`identity` is only for a callable `combine`"),
        (dict(x=x, combine=_product, exclusive=True), ValueError, r"`identity` is required for an exclusive scan"),
        (dict(x=(x, x), combine=_decay, identity=(x,)), ValueError, r"`identity` holds 1 tensors; it must hold one per tensor of `x` \(2\)"),
        (dict(x=x, combine=_product, identity=torch.ones(2)), ValueError, r"`identity\[0\]` of shape \(2,\) does not broadcast"),
        (dict(x=x, combine=_product, identity=torch.ones(3).double()), ValueError, r"`identity\[0\]` has dtype torch.float64"),
        (dict(x=x, combine=lambda l, r: l.sum()), ValueError, r"`combine` returned shapes \[\(\)\]; it must keep the shapes of `x`"),
        (dict(x=(x, x), combine=lambda l, r: l[0]), TypeError, r"`combine` must return a tuple of 2 tensors"),
        (dict(x=x.bool(), combine="sum"), TypeError, r"`x` must be a numeric tensor for combine='sum'.*got torch.bool"),
    ]


@pytest.mark.parametrize("case", range(len(_bad_calls())))
def test_bad_arguments_name_the_argument(case):
    """Each bad argument raises a TypeError/ValueError naming it, the value and what is allowed. The
    combine's result is checked where it runs, so with one rank the calls use a world of two rows."""
    kwargs, error, match = _bad_calls()[case]
    x = kwargs.pop("x")
    if "returned" in match or "must return" in match:
        from distcomm._scan import _user_combine

        parts = x if isinstance(x, tuple) else (x,)
        fold = _user_combine(kwargs["combine"], parts, isinstance(x, torch.Tensor))
        with pytest.raises(error, match=match):
            local_scan(tuple(p.unsqueeze(0).expand(2, *p.shape) for p in parts), 1, combine=fold, exclusive=False, identity=())
        return
    with pytest.raises(error, match=match):
        F.scan(x, **kwargs)


# ---------------------------------------------------------------------------------------------------------
# 2. gloo worlds
# ---------------------------------------------------------------------------------------------------------


def _all_cases_rank(rank: int, world: int, algorithm: str = "auto"):
    return {(name, ex): _run_scan(name, rank, ex, algorithm=algorithm) for name in CASES for ex in (False, True)}


@pytest.mark.parametrize("world, algorithm", [(1, "auto"), (2, "auto"), (3, "auto"), (4, "auto"), (1, "log"),
                                              (2, "log"), (3, "log"), (4, "log"), (5, "log"), (8, "log")])
def test_scan_matches_the_single_process_reference(world, algorithm):
    """Every combine, inclusive and exclusive, by the all-gather ("auto" on these small summaries) and in log
    depth (Note [Log-depth scan], worlds that are and are not powers of two): outputs and gradients on every
    rank equal the float64 loop over the ranks' inputs."""
    results = run_world(_all_cases_rank, world, algorithm, timeout=180)
    for name in CASES:
        for ex in (False, True):
            outs, grads = _reference(name, world, ex)
            for r in range(world):
                _assert_matches(results[r][(name, ex)], (outs[r], grads[r]), f"W={world} rank {r} {name} exclusive={ex}")


def _integer_rank(rank: int, world: int):
    x = torch.full((3,), 100, dtype=torch.uint8)
    return {(algorithm, exclusive): F.scan(x, exclusive=exclusive, algorithm=algorithm)
            for algorithm in ("gather", "log") for exclusive in (False, True)}


def test_integer_sums_keep_their_dtype_in_every_algorithm():
    """An integer sum keeps x's dtype whichever algorithm runs (wrapping as all_reduce's sum does), and both
    algorithms agree: uint8 100 a rank at W = 4 gives (100 * (r + 1)) mod 256 inclusive."""
    world = 4
    results = run_world(_integer_rank, world, timeout=60)
    for r in range(world):
        for (algorithm, exclusive), got in results[r].items():
            count = r if exclusive else r + 1
            assert got.dtype == torch.uint8, (algorithm, exclusive, got.dtype)
            assert got.tolist() == [(100 * count) % 256] * 3, (r, algorithm, exclusive, got)
    alone = F.scan(torch.full((2,), 7, dtype=torch.int16))
    assert alone.dtype == torch.int16 and alone.tolist() == [7, 7]


def _subgroup_rank(rank: int, world: int):
    sub = dist.new_group([1, 2])
    if rank == 0:
        return None
    return {(name, ex): _run_scan(name, rank - 1, ex, group=sub) for name in ("sum", "affine") for ex in (False, True)}


def test_subgroup_scans_in_group_rank_order():
    """Ranks [1, 2] of a world of 3 scan over their own group: global rank 1 is the group's first."""
    results = run_world(_subgroup_rank, 3, timeout=180)
    assert results[0] is None
    for name in ("sum", "affine"):
        for ex in (False, True):
            outs, grads = _reference(name, 2, ex)
            for r in (0, 1):
                _assert_matches(results[r + 1][(name, ex)], (outs[r], grads[r]), f"subgroup rank {r} {name} exclusive={ex}")


def _mesh_rank(rank: int, world: int):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "cp"))
    cp = mesh.get_local_rank("cp")
    return {
        "cp": cp,
        "tuple": _run_scan("affine", cp, True, group=(mesh, "cp")),
        "sub-mesh": _run_scan("sum", cp, False, group=mesh["cp"]),
    }


def test_device_mesh_dims():
    """(mesh, "cp") and mesh["cp"] scan along the cp dim of a 2 x 2 mesh, each dp row on its own."""
    results = run_world(_mesh_rank, 4, timeout=180)
    aff, total = _reference("affine", 2, True), _reference("sum", 2, False)
    for rank, res in enumerate(results):
        cp = res["cp"]
        assert cp == rank % 2
        _assert_matches(res["tuple"], (aff[0][cp], aff[1][cp]), f"rank {rank} (mesh, 'cp')")
        _assert_matches(res["sub-mesh"], (total[0][cp], total[1][cp]), f"rank {rank} mesh['cp']")


def _errors_rank(rank: int, world: int):
    def caught(fn):
        try:
            fn()
        except (TypeError, ValueError) as e:
            return f"{type(e).__name__}: {e}"
        return "no error"

    a, b = torch.ones(2, 3, 3), torch.ones(2, 4, 3)
    res = {
        "same bad shapes": caught(lambda: F.scan((a, b[..., :2]), combine="affine")),
        "unknown combine": caught(lambda: F.scan(a, combine="prod")),
    }
    with distcomm.check_mode():
        bad_b = b[..., :2] if rank == 1 else b
        res["one rank's bad shapes"] = caught(lambda: F.scan((a, bad_b), combine="affine"))
        res["shapes differ"] = caught(lambda: F.scan(torch.ones(rank + 1)))
        x = torch.ones(3, requires_grad=rank == 0)
        res["requires_grad differs"] = caught(lambda: F.scan(x))
    res["after"] = F.scan(torch.ones(2)).tolist()  # the ranks are still in step
    return res


def test_errors_are_raised_on_every_rank():
    """Bad input every rank passes alike raises on every rank; in check mode one rank's bad shapes, shapes
    that differ and a requires_grad that differs raise the same error on every rank (none hangs)."""
    results = run_world(_errors_rank, 2, timeout=120)
    for key in set(results[0]) - {"after"}:
        assert results[0][key] == results[1][key], f"{key}: {results[0][key]} vs {results[1][key]}"
    res = results[0]
    assert res["same bad shapes"].startswith("ValueError: `x` = (A, B): B must have shape (2, N, 3)")
    assert "`combine`='prod' is not recognised" in res["unknown combine"]
    assert res["one rank's bad shapes"].startswith("ValueError: scan: the input of rank 1 was rejected")
    assert "B must have shape (2, N, 3)" in res["one rank's bad shapes"]
    assert "scan: shapes differ across ranks" in res["shapes differ"]
    assert "`requires_grad` differs across ranks" in res["requires_grad differs"]
    assert [res["after"] for res in results] == [[1.0, 1.0], [2.0, 2.0]]


def _compiled_rank(rank: int, world: int):
    def step(a, b, s):
        ca, cb = F.scan((a, b), combine="affine", exclusive=True)
        total = F.scan(s)
        return ca, cb, total

    out = {}
    for mode in ("eager", "compiled"):
        (a, b), _, _, _ = _case("affine", rank)
        s, _, _, _ = _case("sum", rank)
        a, b, s = (t.clone().requires_grad_() for t in (a, b, s))
        fn = step if mode == "eager" else torch.compile(step, fullgraph=True, backend="aot_eager")
        ys = fn(a, b, s)
        sum((y * _rand(y.shape, "cw", rank, i)).sum() for i, y in enumerate(ys)).backward()
        out[mode] = ([y.detach() for y in ys], [a.grad, b.grad, s.grad])
    return out


def test_compiles_in_one_graph_like_eager():
    """torch.compile(fullgraph=True): one graph (the all-gather's compiled op, no break), forward and
    backward equal to eager."""
    results = run_world(_compiled_rank, 2, timeout=300)
    for rank, res in enumerate(results):
        for got, want in zip(res["compiled"][0] + res["compiled"][1], res["eager"][0] + res["eager"][1]):
            torch.testing.assert_close(got, want, **TOL, msg=f"rank {rank}")


# ---------------------------------------------------------------------------------------------------------
# Several pieces per rank (Note [Scan of pieces])
# ---------------------------------------------------------------------------------------------------------

# Every rank's places: a zigzag-like interleave, a rank without pieces, uneven counts.
PLACES = {
    1: [[2, 0, 1]],
    2: [[0, 3], [1, 2]],
    3: [[5, 0], [], [1, 4, 2, 3]],
    4: [[0, 7], [1, 6], [2, 5], [3, 4]],
}


def _piece_inputs(name: str, world: int, r: int):
    """Rank r's pieces (leading dim P_r) built from the one-piece case's inputs of (r, i)."""
    places = PLACES[world][r]
    cases = [_case(name, 100 * r + i) for i in range(len(places))]
    x0, kw, combine, ident = _case(name, 0)
    if isinstance(x0, tuple):
        x = tuple(torch.stack([c[0][k] for c in cases]) if cases else x0[k].new_zeros((0, *x0[k].shape))
                  for k in range(len(x0)))
    else:
        x = torch.stack([c[0] for c in cases]) if cases else x0.new_zeros((0, *x0.shape))
    return x, kw, combine, ident, places


def _pieces_reference(name: str, world: int, exclusive: bool):
    """Per rank: (outputs, grads of its pieces) from one float64 process folding every piece by place."""
    per_rank = [_piece_inputs(name, world, r) for r in range(world)]
    leaves = [tuple(t.clone().requires_grad_() for t in (x if isinstance(x, tuple) else (x,)))
              for x, *_ in per_rank]
    combine, ident = per_rank[0][2], per_rank[0][3]
    pieces = []  # (place, rank, index, parts)
    for r, (x, _, _, _, places) in enumerate(per_rank):
        for i, p in enumerate(places):
            pieces.append((p, r, i, tuple(t[i] for t in leaves[r])))
    pieces.sort()
    out = {}
    acc = None
    for place, r, i, parts in pieces:
        value = parts if len(parts) > 1 else parts[0]
        if exclusive:
            out[(r, i)] = ident if acc is None else acc
        acc = value if acc is None else combine(acc, value)
        if not exclusive:
            out[(r, i)] = acc
    results = []
    for r, (x, *_rest) in enumerate(per_rank):
        count = len(PLACES[world][r])
        rows = [out[(r, i)] for i in range(count)]
        if isinstance(x, tuple):
            y = tuple(torch.stack([torch.broadcast_to(row[k], x[k].shape[1:]) for row in rows]) if rows else x[k]
                      for k in range(len(x)))
        else:
            y = torch.stack([torch.broadcast_to(row, x.shape[1:]) for row in rows]) if rows else x
        results.append(y)
    loss = sum(_loss(y, _weights(name, r, y)) for r, y in enumerate(results) if _flat(y))
    grads = torch.autograd.grad(loss, [t for ls in leaves for t in ls], allow_unused=True)
    it = iter(grads)
    return [(tuple(t.detach() for t in (y if isinstance(y, tuple) else (y,))),
             tuple(next(it) for _ in ls)) for y, ls in zip(results, leaves)]


def _flat(y) -> int:
    return sum(t.numel() for t in (y if isinstance(y, tuple) else (y,)))


def _pieces_rank(rank: int, world: int, exclusive: bool):
    out = {}
    for name in CASES:
        x, kw, _, _, places = _piece_inputs(name, world, rank)
        leaves = tuple(t.clone().requires_grad_() for t in (x if isinstance(x, tuple) else (x,)))
        arg = leaves if isinstance(x, tuple) else leaves[0]
        y = F.scan(arg, exclusive=exclusive, positions=places, **kw)
        _loss(y, _weights(name, rank, y)).backward()
        out[name] = (tuple(t.detach() for t in (y if isinstance(y, tuple) else (y,))),
                     tuple(t.grad for t in leaves))
    return out


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("exclusive", [False, True])
def test_pieces_scan_in_the_order_of_their_places(world, exclusive):
    """Several pieces per rank (none on one rank): outputs and gradients equal a float64 fold of every piece
    by place, for sum, affine and user combines."""
    got = run_world(_pieces_rank, world, exclusive, timeout=120)
    for name in CASES:
        ref = _pieces_reference(name, world, exclusive)
        for r in range(world):
            (y, g), (y_ref, g_ref) = got[r][name], ref[r]
            for a, b in zip(y, y_ref):
                torch.testing.assert_close(a, b, **TOL, msg=lambda m: f"{name} rank {r} out: {m}")
            for a, b in zip(g, g_ref):
                if b is None:
                    b = torch.zeros_like(a)
                torch.testing.assert_close(a, b, **TOL, msg=lambda m: f"{name} rank {r} grad: {m}")


def _duplicate_places_rank(rank: int, world: int):
    try:
        F.scan(torch.ones(1, 2, dtype=torch.float64), positions=[7])
    except ValueError as exc:
        return str(exc)
    return "no error"


def test_duplicate_places_raise_the_same_error_on_every_rank():
    messages = run_world(_duplicate_places_rank, 2, timeout=60)
    assert messages[0] == messages[1] and "distinct across the group" in messages[0] and "[7]" in messages[0]


def test_pieces_arguments_name_the_argument():
    x = torch.ones(2, 3, dtype=torch.float64)
    with pytest.raises(ValueError, match="`positions` holds 3 places; `x` has 2 pieces"):
        F.scan(x, positions=[0, 1, 2])
    with pytest.raises(ValueError, match="`positions` must be distinct"):
        F.scan(x, positions=[4, 4])
    with pytest.raises(TypeError, match="`positions` must be a sequence of ints"):
        F.scan(x, positions=["a", "b"])
    with pytest.raises(ValueError, match="leading dim of pieces"):
        F.scan(torch.ones((), dtype=torch.float64), positions=[])


def _log_traffic_rank(rank: int, world: int):
    """Bytes this rank sends in one forward of each algorithm (ring passes vs the all-gather), counted where
    distcomm calls torch.distributed (its point-to-point sends and its all-gather into a tensor)."""
    import distcomm._reduce_raw as ag

    sent = {"log": 0, "gather": 0}
    which = {"now": None}
    original_isend, original_batch, original_flat = dist.isend, dist.batch_isend_irecv, ag._all_gather_into

    def isend(tensor, *a, **k):
        sent[which["now"]] += tensor.numel() * tensor.element_size()
        return original_isend(tensor, *a, **k)

    def batch_isend_irecv(ops):
        for op in ops:
            if op.op is isend or op.op is original_isend:
                sent[which["now"]] += op.tensor.numel() * op.tensor.element_size()
        return original_batch(ops)

    def all_gather_flat(out, tensor, *a, **k):
        sent[which["now"]] += tensor.numel() * tensor.element_size() * (world - 1)
        return original_flat(out, tensor, *a, **k)

    dist.isend, dist.batch_isend_irecv, ag._all_gather_into = isend, batch_isend_irecv, all_gather_flat
    try:
        x = torch.ones(1024, dtype=torch.float64)
        for algorithm in ("log", "gather"):
            which["now"] = algorithm
            F.scan(x, algorithm=algorithm)
    finally:
        dist.isend, dist.batch_isend_irecv, ag._all_gather_into = original_isend, original_batch, original_flat
    return sent


def test_log_depth_moves_one_summary_a_round():
    """W = 8: the log-depth scan sends 3 summaries per rank (one a round), the all-gather 7."""
    got = run_world(_log_traffic_rank, 8, timeout=120)
    summary = 1024 * 8
    for sent in got:
        assert sent == {"log": 3 * summary, "gather": 7 * summary}, sent
