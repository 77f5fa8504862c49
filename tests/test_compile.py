"""torch.compile of the collectives (distcomm._compile.ops, distcomm._compile.path).

Layers, cheapest first:
1. in-process, no process group: compiled ops are the world-of-one identity, like eager;
2. gloo worlds of 2-3 ranks on CPU. Two programs, one with every reduction (every ReduceOp, reduce,
   broadcast, both reduce-scatters, a subgroup whose ranks are not 0..n-1) and one with every
   data-movement op (uneven sizes and splits, output arguments, gather/scatter, ring_pass), compiled with
   ``fullgraph=True`` (one graph: any break would raise), the compiled values and gradients equal eager's
   bit for bit (the ops run the eager raw collectives), and both equal a float64
   single-process reference written here from the definitions. Then the forms that learn shapes at run
   time (a graph break, an error under fullgraph), compiled autograd, and Inductor (the default backend;
   the other worlds use ``aot_eager``, which traces the same graphs without generating kernels, because
   Inductor's C++ compilation costs tens of seconds per world on a small CPU);
4. GPU: both programs on NCCL with Inductor (marked gpu2).
"""

from __future__ import annotations

import zlib

import pytest
import torch
import torch.distributed as dist

import distcomm.functional as F
from tests.dist_harness import run_world

R = dist.ReduceOp
TOL = dict(rtol=1e-12, atol=1e-12)
VAR = [2, 0, 3]  # all_gather_variable sizes per rank (uneven, with a zero)


# ---------------------------------------------------------------------------------------------------------
# Inputs: deterministic per (name, rank), built identically in the ranks and in the parent
# ---------------------------------------------------------------------------------------------------------


def _gen(*key) -> torch.Generator:
    return torch.Generator().manual_seed(zlib.crc32(repr(key).encode()))


def _rand(shape, *key) -> torch.Tensor:
    return torch.randn(tuple(shape), generator=_gen(*key), dtype=torch.float64)


def _ties(shape, *key) -> torch.Tensor:
    """Small integers: MAX/MIN ties between ranks are common."""
    return torch.randint(0, 3, tuple(shape), generator=_gen(*key)).double()


def _with_zeros(shape, r: int, *key) -> torch.Tensor:
    """PRODUCT inputs: element 0 zero on rank 0 only, element 1 on ranks 0 and 1, element 2 on every rank."""
    x = _rand(shape, *key, r)
    flat = x.view(-1)
    flat[0] = 0.0 if r == 0 else flat[0]
    flat[1] = 0.0 if r in (0, 1) else flat[1]
    flat[2] = 0.0
    return x


def _weight(r: int, name: str, shape) -> torch.Tensor:
    """Rank r's incoming grad of output ``name``: loss_r = sum_k <y_k, w_k>; non-contiguous for 2-d outputs."""
    if len(shape) == 2:
        return _rand(tuple(shape)[::-1], "w", r, name).t()
    return _rand(shape, "w", r, name)


def _loss(outs: dict, r: int) -> torch.Tensor:
    return sum((y * _weight(r, k, y.shape).to(y.device)).sum() for k, y in outs.items() if y.is_floating_point())


def _a2a_in(r: int, w: int) -> list[int]:
    return [(r + j) % 3 for j in range(w)]  # rows rank r sends to rank j (zeros included)


def _a2a_out(r: int, w: int) -> list[int]:
    return [_a2a_in(i, w)[r] for i in range(w)]


def _rows(i: int, j: int) -> int:
    return (i + 2 * j) % 3  # all_to_all (list): rows of the entry rank i sends to rank j


def _factor(r: int, tensor: bool):
    return torch.tensor(0.25 * (r + 2), dtype=torch.float64) if tensor else 0.5 * (r + 1)


# ---------------------------------------------------------------------------------------------------------
# The programs: every reduction, every data-movement op
# ---------------------------------------------------------------------------------------------------------


def _reduction_inputs(r: int, w: int) -> dict[str, torch.Tensor]:
    x = {
        "sum": _rand((4, 3), "sum", r),
        "avg": _rand((4, 3), "avg", r),
        "product": _with_zeros((4, 3), r, "product"),
        "max": _ties((4, 3), "max", r),
        "min": _ties((3,), "min", r),
        "premul": _rand((4, 3), "premul", r),
        "premul_tensor": _rand((2,), "premul_tensor", r),
        "reduce_max": _ties((4, 3), "reduce_max", r),
        "reduce_avg": _rand((2, 3), "reduce_avg", r),
        "reduce_product": _with_zeros((3,), r, "reduce_product"),
        "broadcast": _rand((2, 3), "broadcast", r),
        "rst_min": _ties((2, 3 * w), "rst_min", r),
        "rst_product": _with_zeros((2 * w, 2), r, "rst_product"),
        "rst_avg": _rand((2, 2 * w), "rst_avg", r),
        "rst_max_0d_rows": _ties((w, 2), "rst_max", r),
    }
    x.update({f"rs_max_{j}": _ties((j + 1, 2), "rs_max", r, j) for j in range(w)})
    return x


# torch >= 2.13 exposes a PREMUL_SUM op's factor to dynamo: the op compiles into the graph. Older torch
# breaks the graph at such a call and runs it eagerly (distcomm/_compile/path.py: parse_op).
PREMUL_IN_GRAPH = hasattr(dist.ReduceOp, "factor")
PREMUL_KEYS = ("premul", "premul_tensor")


def _reductions(x: dict, ops: tuple | None, bits: torch.Tensor, rank: int, w: int) -> dict[str, torch.Tensor]:
    """``ops``: the two PREMUL_SUM ops, or None to leave them out."""
    premul, premul_tensor = ops or (None, None)
    out = {
        "sum": F.all_reduce(x["sum"]),
        "avg": F.all_reduce(x["avg"], R.AVG),
        "product": F.all_reduce(x["product"], R.PRODUCT),
        "max": F.all_reduce(x["max"], op=R.MAX),
        "min": F.all_reduce(x["min"], R.MIN),
        "reduce_max": F.reduce(x["reduce_max"], w - 1, R.MAX),
        "reduce_avg": F.reduce(x["reduce_avg"], 0, R.AVG),
        "reduce_product": F.reduce(x["reduce_product"], 1, R.PRODUCT),
        "broadcast": F.broadcast(x["broadcast"], 1),
        "rst_min": F.reduce_scatter_tensor(x["rst_min"], 1, R.MIN),
        "rst_product": F.reduce_scatter_tensor(x["rst_product"], 0, R.PRODUCT),
        "rst_avg": F.reduce_scatter_tensor(x["rst_avg"], -1, R.AVG),
        "rst_max_0d_rows": F.reduce_scatter_tensor(x["rst_max_0d_rows"], 0, R.MAX),
    }
    if ops is not None:
        out["premul"] = F.all_reduce(x["premul"], premul)
        out["premul_tensor"] = F.all_reduce(x["premul_tensor"], premul_tensor)
    if not bits.is_cuda:  # NCCL has no bitwise reductions
        out["bxor"] = F.all_reduce(bits, R.BXOR)  # forward only
    largest = F.all_reduce(bits, R.MAX)
    if rank == 0:  # the other ranks do not use it, but rank 0 waits for them in it
        out["used_on_rank_0"] = largest
    output = x["rs_max_0"].new_empty(rank + 1, 2)
    out["rs_max"] = F.reduce_scatter(output, [x[f"rs_max_{j}"] for j in range(w)], R.MAX)
    return out


def _reductions_reference(w: int, bitwise: bool = True):
    """Per rank: (outputs, grads) from one float64 process holding every rank's inputs."""
    leaves = [{k: v.requires_grad_() for k, v in _reduction_inputs(r, w).items()} for r in range(w)]

    def stack(k):
        return torch.stack([leaves[j][k] for j in range(w)])

    def premul(k, tensor):
        return sum(float(_factor(j, tensor)) * leaves[j][k] for j in range(w))

    bits = _xor_all([_bits(r) for r in range(w)])
    outs = []
    for r in range(w):
        outs.append({
            "sum": stack("sum").sum(0),
            "avg": stack("avg").mean(0),
            "product": stack("product").prod(0),
            "max": stack("max").amax(0),
            "min": stack("min").amin(0),
            "premul": premul("premul", False),
            "premul_tensor": premul("premul_tensor", True),
            "reduce_max": stack("reduce_max").amax(0) if r == w - 1 else torch.zeros(4, 3, dtype=torch.float64),
            "reduce_avg": stack("reduce_avg").mean(0) if r == 0 else torch.zeros(2, 3, dtype=torch.float64),
            "reduce_product": stack("reduce_product").prod(0) if r == 1 else torch.zeros(3, dtype=torch.float64),
            "broadcast": leaves[1]["broadcast"],
            "rst_min": stack("rst_min").amin(0).chunk(w, 1)[r],
            "rst_product": stack("rst_product").prod(0).chunk(w, 0)[r],
            "rst_avg": stack("rst_avg").mean(0).chunk(w, -1)[r],
            "rst_max_0d_rows": stack("rst_max_0d_rows").amax(0).chunk(w, 0)[r],
            "rs_max": stack(f"rs_max_{r}").amax(0),
        })
    outs[0]["used_on_rank_0"] = torch.stack([_bits(r) for r in range(w)]).amax(0)
    for o in outs if bitwise else ():
        o["bxor"] = bits
    return _with_grads(outs, leaves)


def _bits(r: int) -> torch.Tensor:
    return torch.randint(0, 16, (5,), generator=_gen("bits", r))


def _xor_all(tensors: list[torch.Tensor]) -> torch.Tensor:
    out = tensors[0]
    for t in tensors[1:]:
        out = out ^ t
    return out


def _movement_inputs(r: int, w: int) -> dict[str, torch.Tensor]:
    x = {
        "all_gather": _rand((2, 3), "all_gather", r),
        "all_gather_tensor": _rand((2, 3), "all_gather_tensor", r),
        "all_gather_base": _rand((2, 3), "all_gather_base", r),
        "variable": _rand((VAR[r], 2), "variable", r),
        "a2a_single": _rand((sum(_a2a_in(r, w)), 2), "a2a_single", r),
        "gather": _rand((2, 3), "gather", r),
        "ring": _rand((r + 1, 2), "ring", r),  # ring shapes differ per rank
    }
    x.update({f"a2a_{j}": _rand((_rows(r, j), 2), "a2a", r, j) for j in range(w)})
    # On the source, the tensors scattered; elsewhere placeholders that require grad like the source's.
    x.update({f"scatter_{j}": _rand((3, 2), "scatter", r, j) for j in range(w)})
    return x


def _movement_buffers(r: int, w: int) -> dict[str, torch.Tensor]:
    """Output arguments, passed into the compiled function from outside (the writes mutate graph inputs)."""
    bufs = {
        "all_gather_base": torch.empty(w, 2, 3, dtype=torch.float64),
        "a2a_single": torch.empty(sum(_a2a_out(r, w)), 2, dtype=torch.float64),
    }
    bufs.update({f"a2a_{i}": torch.empty(_rows(i, r), 2, dtype=torch.float64) for i in range(w)})
    return bufs


def _movement(x: dict, bufs: dict, rank: int, w: int) -> dict[str, torch.Tensor]:
    out = {f"all_gather_{j}": t for j, t in enumerate(F.all_gather(x["all_gather"]))}
    out["all_gather_tensor"] = F.all_gather_tensor(x["all_gather_tensor"], dim=1)
    out["all_gather_base"] = F._all_gather_base(bufs["all_gather_base"], x["all_gather_base"])
    out["variable"], _ = F.all_gather_variable(x["variable"], 0, sizes=VAR[:w])
    out["a2a_single"] = F.all_to_all_single(bufs["a2a_single"], x["a2a_single"], _a2a_out(rank, w), _a2a_in(rank, w))
    received = F.all_to_all([bufs[f"a2a_{i}"] for i in range(w)], [x[f"a2a_{j}"] for j in range(w)])
    out.update({f"a2a_{i}": t for i, t in enumerate(received)})
    out.update({f"gather_{j}": t for j, t in enumerate(F.gather(x["gather"], dst=w - 1))})
    out["scatter"] = F.scatter([x[f"scatter_{j}"] for j in range(w)], src=0)
    out["ring"] = F.ring_pass(x["ring"], 1, recv_shape=((rank - 1) % w + 1, 2))
    return out


def _movement_reference(w: int):
    leaves = [{k: v.requires_grad_() for k, v in _movement_inputs(r, w).items()} for r in range(w)]
    outs = []
    for r in range(w):
        o = {f"all_gather_{j}": leaves[j]["all_gather"] for j in range(w)}
        o["all_gather_tensor"] = torch.cat([leaves[j]["all_gather_tensor"] for j in range(w)], 1)
        o["all_gather_base"] = torch.stack([leaves[j]["all_gather_base"] for j in range(w)])
        o["variable"] = torch.cat([leaves[j]["variable"] for j in range(w)])
        o["a2a_single"] = torch.cat([leaves[i]["a2a_single"].split(_a2a_in(i, w))[r] for i in range(w)])
        o.update({f"a2a_{i}": leaves[i][f"a2a_{r}"] for i in range(w)})
        zeros = torch.zeros(2, 3, dtype=torch.float64)
        o.update({f"gather_{j}": leaves[j]["gather"] if r == w - 1 else zeros for j in range(w)})
        o["scatter"] = leaves[0][f"scatter_{r}"]
        o["ring"] = leaves[(r - 1) % w]["ring"]
        outs.append(o)
    return _with_grads(outs, leaves)


def _with_grads(outs: list[dict], leaves: list[dict]):
    """(outputs, grads) per rank: the VJP of sum_r loss_r by autograd on the float64 simulation."""
    flat = [(r, k, v) for r, d in enumerate(leaves) for k, v in d.items()]
    total = sum(_loss(o, r) for r, o in enumerate(outs))
    grads = torch.autograd.grad(total, [v for _, _, v in flat], allow_unused=True)
    per_rank = [{} for _ in leaves]
    for (r, k, v), g in zip(flat, grads):
        per_rank[r][k] = torch.zeros_like(v) if g is None else g
    return [({k: y.detach() for k, y in o.items()}, g) for o, g in zip(outs, per_rank)]


# ---------------------------------------------------------------------------------------------------------
# What each rank runs
# ---------------------------------------------------------------------------------------------------------


def _explain(fn, *args) -> tuple[int, int, list[str]]:
    e = torch._dynamo.explain(fn)(*args)
    return e.graph_count, e.graph_break_count, [str(b.reason).split("\n")[0] for b in e.break_reasons]


def _run(fn, make, device, r: int):
    """fn(x)'s outputs and the grads of x with loss_r; ``make`` builds fresh inputs x."""
    x = {k: v.to(device).requires_grad_() for k, v in make().items()}
    outs = fn(x)
    _loss(outs, r).backward()
    return outs, {k: v.grad for k, v in x.items()}


def _differences(a: tuple, b: tuple) -> list[str]:
    """Names whose outputs or grads differ in any bit between two runs (compiled vs eager)."""
    bad = []
    for what, da, db in (("y", a[0], b[0]), ("grad", a[1], b[1])):
        for k in da:
            if not (da[k] is None and db[k] is None) and not torch.equal(da[k], db[k]):
                bad.append(f"{what} {k}")
    return bad


def _cpu(pair: tuple) -> tuple:
    return tuple({k: (None if v is None else v.detach().cpu()) for k, v in d.items()} for d in pair)


def _premul_outside_graph(ops, rank: int, w: int, backend: str, device) -> bool:
    """Older torch: each PREMUL_SUM op, compiled without fullgraph, gives eager's bits."""
    x = _reduction_inputs(rank, w)
    fn = torch.compile(lambda t, op: F.all_reduce(t, op), backend=backend)
    return all(torch.equal(fn(x[k].to(device), op), F.all_reduce(x[k].to(device), op))
               for k, op in zip(PREMUL_KEYS, ops))


def _programs_rank(rank: int, w: int, program: str, backend: str, device: str):
    """Compile ``program`` with fullgraph=True (one graph, or an error naming the break); report the
    compiled-vs-eager differences and the compiled results."""
    device = torch.device(device, rank) if device == "cuda" else torch.device(device)
    res = {"writes_return_the_buffers": []}
    if program == "reductions":
        ops = (dist._make_nccl_premul_sum(_factor(rank, False)),
               dist._make_nccl_premul_sum(_factor(rank, True).to(device)))
        bits = _bits(rank).to(device)
        if not PREMUL_IN_GRAPH:  # compiled on their own below, where the graph may break
            res["premul_falls_back_to_eager"] = _premul_outside_graph(ops, rank, w, backend, device)
            ops = None

        def make():
            x = _reduction_inputs(rank, w)
            return x if ops is not None else {k: v for k, v in x.items() if k not in PREMUL_KEYS}

        def call(fn, x):
            return fn(x, ops, bits, rank, w)

        program_fn = _reductions
    else:
        def make():
            return _movement_inputs(rank, w)

        def call(fn, x):
            bufs = {k: v.to(device) for k, v in _movement_buffers(rank, w).items()}
            out = fn(x, bufs, rank, w)
            res["writes_return_the_buffers"].append(all(out[k] is bufs[k] for k in bufs))
            return out

        program_fn = _movement
    eager = _run(lambda x: call(program_fn, x), make, device, rank)
    compiled_fn = torch.compile(program_fn, fullgraph=True, backend=backend)
    compiled = _run(lambda x: call(compiled_fn, x), make, device, rank)
    res["differences"] = _differences(compiled, eager)
    res["compiled"] = _cpu(compiled)
    if program == "movement" and w == 3:
        res["subgroup"] = _subgroup_rank(rank, backend, device)
    return res


# The subgroup {0, 2} of a world of 3: group ranks differ from global ranks, src/dst are global.
SUB = [0, 2]


def _subgroup_inputs(r: int) -> dict[str, torch.Tensor]:
    return {k: _ties((2, 2), "sub", k, r) for k in ("broadcast", "reduce", "all_gather", "ring")}


def _subgroup(x: dict, group) -> dict[str, torch.Tensor]:
    return {
        "broadcast": F.broadcast(x["broadcast"], src=2, group=group),
        "reduce": F.reduce(x["reduce"], dst=2, op=R.MIN, group=group),
        "all_gather": F.all_gather_tensor(x["all_gather"], 0, group=group),
        "ring": F.ring_pass(x["ring"], 1, group=group, recv_shape=(2, 2)),
    }


def _subgroup_rank(rank: int, backend: str, device):
    group = dist.new_group(SUB)
    if rank not in SUB:
        return None
    fn = torch.compile(_subgroup, fullgraph=True, backend=backend)
    return _cpu(_run(lambda x: fn(x, group), lambda: _subgroup_inputs(rank), device, rank))


def _subgroup_reference():
    leaves = {r: {k: v.requires_grad_() for k, v in _subgroup_inputs(r).items()} for r in SUB}
    outs = {}
    smallest = torch.stack([leaves[j]["reduce"] for j in SUB]).amin(0)
    for r in SUB:
        outs[r] = {
            "broadcast": leaves[2]["broadcast"],
            "reduce": smallest if r == 2 else torch.zeros(2, 2, dtype=torch.float64),
            "all_gather": torch.cat([leaves[j]["all_gather"] for j in SUB]),
            "ring": leaves[SUB[1 - SUB.index(r)]]["ring"],  # a ring of two: the other member
        }
    total = sum(_loss(outs[r], r) for r in SUB)
    flat = [(r, k, v) for r in SUB for k, v in leaves[r].items()]
    grads = torch.autograd.grad(total, [v for _, _, v in flat], allow_unused=True)
    out = {r: ({k: y.detach() for k, y in outs[r].items()}, {}) for r in SUB}
    for (r, k, v), g in zip(flat, grads):
        out[r][1][k] = torch.zeros_like(v) if g is None else g
    return out


def _assert_matches(got: tuple, want: tuple, where: str) -> None:
    for what, dg, dw in (("y", got[0], want[0]), ("grad", got[1], want[1])):
        assert dg.keys() == dw.keys(), f"{where}: {what} names differ"
        for k in dw:
            torch.testing.assert_close(dg[k], dw[k], **TOL, msg=lambda m: f"{where}: {what} {k}: {m}")


def _check_programs(results: list, program: str, w: int, device: str = "cpu") -> None:
    if program == "reductions":
        reference = _reductions_reference(w, bitwise=device == "cpu")
    else:
        reference = _movement_reference(w)
    for r, res in enumerate(results):
        assert res["differences"] == [], f"rank {r}: compiled differs from eager in {res['differences']}"
        if "premul_falls_back_to_eager" in res:
            assert res["premul_falls_back_to_eager"], f"rank {r}: PREMUL_SUM compiled outside the graph != eager"
            reference[r] = tuple({k: v for k, v in d.items() if k not in PREMUL_KEYS} for d in reference[r])
        _assert_matches(res["compiled"], reference[r], f"{program} rank {r}")
        if program == "movement":
            assert all(res["writes_return_the_buffers"]), "output arguments must be returned themselves"
    if program == "movement" and w == 3:
        expected = _subgroup_reference()
        for r in SUB:
            _assert_matches(results[r]["subgroup"], expected[r], f"subgroup rank {r}")


def test_reductions_compile_without_breaks_like_eager():
    """Every ReduceOp, reduce, broadcast and both reduce-scatters compile as one graph (fullgraph) whose
    values and exact gradients are eager's bits and the float64 reference's."""
    results = run_world(_programs_rank, 2, "reductions", "aot_eager", "cpu", timeout=240)
    _check_programs(results, "reductions", 2)


def test_movement_compiles_without_breaks_like_eager():
    """Every data-movement op (uneven sizes and splits, output arguments, gather/scatter, ring_pass) and a
    subgroup compile as one graph whose values and gradients are eager's bits and the float64 reference's."""
    results = run_world(_programs_rank, 3, "movement", "aot_eager", "cpu", timeout=240)
    _check_programs(results, "movement", 3)


# ---------------------------------------------------------------------------------------------------------
# Shape-learning forms, compiled autograd, Inductor
# ---------------------------------------------------------------------------------------------------------


def _learning_forms(rank: int):
    """Each form with compute before and after it (so a break shows as two graphs), and its fix."""
    def scatter(t):
        u = 2 * t
        return F.scatter([u, 3 * u] if rank == 0 else None, src=0) + u.sum()

    return {
        "all_gather_variable": (lambda t: F.all_gather_variable(2 * t, 0)[0] + 1, "`sizes`"),
        "ring_pass": (lambda t: F.ring_pass(2 * t, 1) + 1, "`recv_shape`"),
        "scatter": (scatter, "placeholder tensors"),
    }


def _learning_rank(rank: int, w: int):
    res = {}
    for name, (fn, hint) in _learning_forms(rank).items():
        x0 = _rand((rank + 1, 2), name, rank)
        if not (name == "scatter" and rank == 0):  # the source has its tensors: it would compile and wait
            try:
                torch.compile(fn, fullgraph=True, backend="eager")(x0.clone().requires_grad_())
                res[f"{name} fullgraph"] = "compiled"
            except Exception as e:  # noqa: BLE001  (the message is what is checked)
                res[f"{name} fullgraph"] = str(e)
        res[f"{name} explain"] = _explain(fn, x0.clone().requires_grad_())[:2]
        runs = []
        for f in (fn, torch.compile(fn, backend="eager")):  # the break is the point, not the backend
            x = x0.clone().requires_grad_()
            y = f(x)
            (y * _weight(rank, name, y.shape)).sum().backward()
            runs.append((y.detach(), x.grad))
        res[f"{name} same as eager"] = all(
            (a is None and b is None) or torch.equal(a, b) for a, b in zip(*runs))  # off the source x is unused
    return res


def test_shape_learning_forms_break_the_graph():
    """all_gather_variable without sizes, ring_pass without recv_shape and scatter without tensors off the
    source run eagerly: under fullgraph a clear error saying what to pass, otherwise one graph break and
    eager's results (a compiled source's scatter makes the eager exchange, so mixed ranks interoperate)."""
    results = run_world(_learning_rank, 2, timeout=240)
    for rank, res in enumerate(results):
        for name, (_, hint) in _learning_forms(rank).items():
            if f"{name} fullgraph" in res:
                msg = res[f"{name} fullgraph"]
                assert "learns" in msg and hint in msg, f"rank {rank} {name}: {msg[:500]}"
            expected = (1, 0) if name == "scatter" and rank == 0 else (2, 1)  # the source compiles its scatter
            assert res[f"{name} explain"] == expected, f"rank {rank} {name}: graphs, breaks = {res[f'{name} explain']}"
            assert res[f"{name} same as eager"], f"rank {rank} {name}: compiled results differ from eager"


def _train_step(x, w):
    y = F.all_reduce(x, R.MAX)
    z = F.reduce_scatter_tensor(y * w, 0, R.AVG)
    r = F.ring_pass(z, 1, recv_shape=z.shape)
    loss = F.all_gather_tensor(r, 1).pow(2).sum()
    loss.backward()
    return loss.detach()


def _compiled_autograd_rank(rank: int, world: int):
    from torch._dynamo.utils import counters

    x0, w = _ties((2 * world, 3), "ca", rank), _rand((2 * world, 3), "ca_w", rank)
    grads = {}
    x = x0.clone().requires_grad_()
    _train_step(x, w)
    grads["eager"] = x.grad
    counters.clear()
    with torch._dynamo.config.patch(compiled_autograd=True):
        x = x0.clone().requires_grad_()
        torch.compile(_train_step, backend="aot_eager")(x, w)  # backward() inside: compiled autograd
        grads["compiled"] = x.grad
        x = x0.clone().requires_grad_()  # eager forward, backward through compiled autograd
        y = F.all_gather_tensor(F.ring_pass(F.reduce_scatter_tensor(F.all_reduce(x, R.MAX) * w, 0, R.AVG), 1), 1)
        torch.compile(lambda t: t.pow(2).sum().backward(), backend="aot_eager")(y)
        grads["eager forward"] = x.grad
    return {"grads": grads, "captures": counters["compiled_autograd"]["captures"]}


def test_compiled_autograd():
    """With compiled_autograd on, a compiled training step (backward inside) and an eager forward give the
    eager gradients, which match the float64 reference."""
    world = 2
    results = run_world(_compiled_autograd_rank, world, timeout=240)
    xs = torch.stack([_ties((2 * world, 3), "ca", r) for r in range(world)]).requires_grad_()
    ws = [_rand((2 * world, 3), "ca_w", r) for r in range(world)]
    y = xs.amax(0)
    zs = [(torch.stack([y * wj for wj in ws]).mean(0)).chunk(world, 0)[r] for r in range(world)]
    received = [zs[(r - 1) % world] for r in range(world)]
    total = sum(torch.cat(received, 1).pow(2).sum() for _ in range(world))
    (expected,) = torch.autograd.grad(total, xs)
    for r, res in enumerate(results):
        assert res["captures"] >= 2, f"rank {r}: compiled autograd did not run ({res['captures']} captures)"
        for mode, g in res["grads"].items():
            torch.testing.assert_close(g, expected[r], **TOL, msg=lambda m: f"rank {r} {mode}: {m}")
            assert torch.equal(g, res["grads"]["eager"]), f"rank {r}: {mode} differs from eager"


def _inductor_program(x: dict, buf: torch.Tensor, bits: torch.Tensor, rank: int, w: int) -> dict[str, torch.Tensor]:
    out = {
        "max": F.all_reduce(x["max"], R.MAX),
        "rst_avg": F.reduce_scatter_tensor(x["rst_avg"], 1, R.AVG),
        "a2a_single": F.all_to_all_single(buf, x["a2a_single"], _a2a_out(rank, w), _a2a_in(rank, w)),
        "ring": F.ring_pass(x["ring"], 1, recv_shape=((rank - 1) % w + 1, 2)),
    }
    total = F.all_reduce(bits)
    if rank == 0:  # unused elsewhere: Inductor must still issue it there
        out["used_on_rank_0"] = total
    return out


def _inductor_inputs(r: int, w: int) -> dict[str, torch.Tensor]:
    return {"max": _ties((4, 3), "i_max", r), "rst_avg": _rand((2, 2 * w), "i_rst", r),
            "a2a_single": _rand((sum(_a2a_in(r, w)), 2), "i_a2a", r), "ring": _rand((r + 1, 2), "i_ring", r)}


def _inductor_rank(rank: int, w: int):
    def run(fn):
        buf = torch.empty(sum(_a2a_out(rank, w)), 2, dtype=torch.float64)
        return _run(lambda x: fn(x, buf, _bits(rank), rank, w), lambda: _inductor_inputs(rank, w), "cpu", rank)


    eager = run(_inductor_program)
    compiled = run(torch.compile(_inductor_program, fullgraph=True))
    return {"eager": _cpu(eager), "compiled": _cpu(compiled)}


def test_inductor_matches_eager_and_reference():
    """The default backend (Inductor, generated C++ kernels around the ops) gives eager's values and grads."""
    w = 2
    results = run_world(_inductor_rank, w, timeout=300)
    leaves = [{k: v.requires_grad_() for k, v in _inductor_inputs(r, w).items()} for r in range(w)]
    outs = [{
        "max": torch.stack([leaves[j]["max"] for j in range(w)]).amax(0),
        "rst_avg": torch.stack([leaves[j]["rst_avg"] for j in range(w)]).mean(0).chunk(w, 1)[r],
        "a2a_single": torch.cat([leaves[i]["a2a_single"].split(_a2a_in(i, w))[r] for i in range(w)]),
        "ring": leaves[(r - 1) % w]["ring"],
    } for r in range(w)]
    outs[0]["used_on_rank_0"] = sum(_bits(r) for r in range(w))
    reference = _with_grads(outs, leaves)
    for r, res in enumerate(results):
        _assert_matches(res["compiled"], res["eager"], f"rank {r} compiled vs eager")
        _assert_matches(res["compiled"], reference[r], f"rank {r} compiled vs reference")


# ---------------------------------------------------------------------------------------------------------
# No process group: a world of one
# ---------------------------------------------------------------------------------------------------------


_DOUBLE = dist._make_nccl_premul_sum(2.0)


def _single(x: dict, double) -> dict[str, torch.Tensor]:
    return {
        "max": F.all_reduce(x["max"], R.MAX),
        "premul": F.all_reduce(x["premul"], double),
        "reduce": F.reduce(x["reduce"], 0, R.PRODUCT),
        "broadcast": F.broadcast(x["broadcast"], 0),
        "rst": F.reduce_scatter_tensor(x["rst"], 1, R.AVG),
        "agt": F.all_gather_tensor(x["agt"], 0),
        "variable": F.all_gather_variable(x["variable"], 1)[0],
        "a2a": F.all_to_all_single(torch.empty_like(x["a2a"]), x["a2a"]),
        "gather": F.gather(x["gather"])[0],
        "scatter": F.scatter([x["scatter"]]),
        "ring": F.ring_pass(x["ring"], 1),
    }


def test_no_process_group_is_the_identity_compiled():
    """Without a process group the compiled ops are the world-of-one identity, as in eager mode."""
    assert not dist.is_initialized()
    names = ["max", "premul", "reduce", "broadcast", "rst", "agt", "variable", "a2a", "gather", "scatter", "ring"]

    def make():
        return {k: _rand((2, 3), "single", k) for k in names}

    eager = _run(lambda x: _single(x, _DOUBLE), make, "cpu", 0)
    fn = torch.compile(_single, fullgraph=True, backend="aot_eager")
    compiled = _run(lambda x: fn(x, _DOUBLE), make, "cpu", 0)
    assert _differences(compiled, eager) == []
    x = make()
    for k in names:
        scale = 2.0 if k == "premul" else 1.0
        torch.testing.assert_close(compiled[0][k], scale * x[k], **TOL)
        torch.testing.assert_close(compiled[1][k], scale * _weight(0, k, (2, 3)), **TOL)
    if hasattr(dist.ReduceOp, "factor"):  # torch >= 2.13: a PREMUL_SUM op from a global or a closure compiles too
        doubled = torch.compile(lambda t: F.all_reduce(t, _DOUBLE), fullgraph=True, backend="eager")(x["premul"])
        torch.testing.assert_close(doubled, 2 * x["premul"], **TOL)


def test_fake_shapes_come_from_the_arguments():
    """Output shapes depend only on an op's arguments (group size, this rank's position), never on the
    process: Inductor reuses a compiled graph wherever its text and inputs match, on any rank or world."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    import distcomm._compile.ops  # noqa: F401  (registers torch.ops.distcomm, else loaded on first compile)

    ops = torch.ops.distcomm
    with FakeTensorMode():  # this process has no group: a world of one, rank 0
        x = torch.empty(6, 4)
        assert ops.all_gather_tensor(x, 1, 3, "").shape == (6, 12)
        assert ops.reduce_scatter_tensor(x, 0, 3, "SUM", "").shape == (2, 4)
        assert len(ops.gather(x, 0, 3, "")) == 3
        assert ops.reduce_scatter_variable(x, 0, [1, 5, 0], 1, "").shape == (5, 4)
        assert ops.all_gather_variable(x, 0, [6, 1, 2], "").shape == (9, 4)
        assert ops.all_to_all_single(x, [1, 2, 4], [2, 2, 2], "").shape == (7, 4)
        assert ops.ring_pass(x, 1, 3, [2, 4], "").shape == (2, 4)


# ---------------------------------------------------------------------------------------------------------
# NCCL
# ---------------------------------------------------------------------------------------------------------


@pytest.mark.gpu2
@pytest.mark.parametrize("program", ["reductions", "movement"])
def test_nccl_programs_compile_with_inductor(program):
    """Both programs on NCCL with CUDA tensors, compiled by Inductor with fullgraph: no break, eager's bits,
    the float64 reference's values."""
    results = run_world(_programs_rank, 2, program, "inductor", "cuda", backend="nccl", timeout=300)
    _check_programs(results, program, 2, "cuda")


def _hand_built_group_rank(rank: int, world: int, path: str):
    store = dist.FileStore(path, world)
    group = dist.ProcessGroup(store, rank, world)  # never registered: group_name == ""
    backend = dist.ProcessGroupGloo(dist.PrefixStore("hand", store), rank, world)
    group._set_default_backend(dist.ProcessGroup.BackendType.GLOO)
    group._register_backend(torch.device("cpu"), dist.ProcessGroup.BackendType.GLOO, backend)
    x = torch.full((2,), float(rank + 1))
    eager = F.all_reduce(x, group=group)
    compiled = torch.compile(lambda t: F.all_reduce(t, group=group), fullgraph=True, backend="eager")
    try:
        compiled(x)
    except Exception as e:  # dynamo's wrapper around the library's ValueError
        return eager.tolist(), str(e)
    return eager.tolist(), None


def test_hand_built_group_is_refused_when_compiled(tmp_path):
    """A ProcessGroup built by hand (no name) works eagerly; compiled, the collectives find groups by name and
    would take the nameless group for no process group (a world of one, silently): refused, naming why."""
    results = run_world(_hand_built_group_rank, 2, str(tmp_path / "store"), timeout=240)
    for eager, error in results:
        assert eager == [3.0, 3.0]
        assert error is not None and "built by hand" in error, error
