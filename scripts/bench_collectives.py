"""Forward+backward time of every distcomm collective against the same collectives issued by hand.

    PYTHONPATH=. python scripts/bench_collectives.py            # 2 local ranks, NCCL, 1 MB .. 1 GB
    PYTHONPATH=. python scripts/bench_collectives.py --quick    # 4 sizes, fewer iterations
    PYTHONPATH=. python scripts/bench_collectives.py --smoke    # CPU / gloo plumbing check, seconds
    PYTHONPATH=. python scripts/bench_collectives.py --quick --compiled   # + torch.compile'd rows
    torchrun --nproc-per-node 2 scripts/bench_collectives.py    # also works (one rank per process)

What is measured (one row per op and message size; sizes are PER-RANK INPUT bytes, float32 by default):
- "distcomm": ``y = F.op(x)`` then ``y.backward(g)`` through ``distcomm.functional`` (autograd included).
- "raw": the same forward collective plus its adjoint collective issued by hand with torch.distributed,
  with the same out-of-place semantics (inputs and incoming grads are never modified, so where
  torch.distributed only works in place the raw path copies first, exactly as distcomm must). For
  MAX/MIN/PRODUCT raw is the forward all_reduce(op) plus ONE all_reduce(SUM) of the grad (torch's
  gradient, not the exact one): the ratio is the price of the exact gradient, and the collectives each
  side issued (counted with the profiler) show the extra collectives it needs.
- "x8 in one graph" rows: eight collectives whose outputs share ONE ``backward()`` call, as in a training
  step, against eight forward and eight adjoint collectives by hand: the autograd engine's fixed cost per
  ``backward()`` call (thread hand-off, graph walk) is shared, what remains is distcomm's cost per op.
  "no autograd" and "torch.nn" rows: distcomm under ``torch.no_grad`` (the ops alone) and
  ``torch.distributed.nn.functional`` (the same autograd path through torch's module).
- all_gather_variable is compared with a fixed-size all_gather_into_tensor + reduce_scatter_tensor of the
  same bytes (uneven sizes: the same total bytes, evenly split).
- "compiled" rows (``--compiled``): the same step with each distcomm function wrapped in
  ``torch.compile(fullgraph=True, dynamic=False, backend=--compile-backend)``, compiled afresh for every
  size (compilation happens in the warm-up), so forward and backward run as compiled graphs; target 1.10x
  of raw at >= 16 MB. The forms that learn shapes at run time (a graph break) and torch's module get no
  compiled row.
Time: CUDA events around back-to-back iterations after warm-up, the best of ``--repeats`` alternating
repeats, the slowest rank. Bus bandwidth follows nccl-tests (all_reduce 2(W-1)/W, all_gather and
reduce_scatter and all_to_all (W-1)/W of their large side, broadcast/reduce/ring pass 1x) summed over the
forward and the adjoint collective, divided by the fwd+bwd time. Targets (PASS/MISS at >= 16 MB):
SUM/AVG and data-movement ops within 1.03x of raw; all_gather_variable with sizes given within 1.15x of
the fixed-size gather. Writes ``collectives.json``, ``collectives.png`` and ``collectives.md`` (the table, with the
command that made it) to ``--out``.
"""

from __future__ import annotations

import argparse
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _bench_util as U  # noqa: E402

COLS = 256  # inputs are (rows, COLS); gathers and splits act on dim 0
MIN_TARGET_BYTES = 16 * U.MiB
MOVE_TARGET, VARIABLE_TARGET, COMPILED_TARGET = 1.03, 1.15, 1.10

# torch 2.13 renamed the *_into_tensor / *_tensor collectives to *_single (old names warn).
_AG = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_RS = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


@dataclass
class Ctx:
    """What a case builder needs: this rank, the world, and the message."""

    rank: int
    world: int
    device: torch.device
    dtype: torch.dtype
    rows: int  # rows of the per-rank (rows, COLS) input
    nccl: bool
    seed: int
    compile_backend: str = "inductor"

    def rand(self, rows: int | None = None) -> torch.Tensor:
        self.seed += 1
        torch.manual_seed(self.seed * 1000 + self.rank)
        return torch.randn(self.rows if rows is None else rows, COLS, device=self.device, dtype=self.dtype)


@dataclass
class Case:
    name: str
    group: str  # "move" (1.03 target), "variable" (1.15 target), "compiled" (1.10 target), "info" (no target)
    bus: object  # (per-rank input bytes, world) -> bus bytes of the forward + adjoint collectives
    build: object  # (Ctx, distcomm.functional) -> dict(dist=step, raw=step, compare=bool); a step runs
    #                forward + backward once and returns the forward output
    raw: str  # what the raw baseline issues
    compiles: bool = True  # whether a compiled row makes sense (no graph break, distcomm's own functions)

    @property
    def target(self) -> float | None:
        return {"move": MOVE_TARGET, "variable": VARIABLE_TARGET, "compiled": COMPILED_TARGET}.get(self.group)


# ------------------------------------------------------------------------------------------- raw helpers
def _raw_all_reduce(t: torch.Tensor, op: str, c: Ctx) -> None:
    if op == "AVG" and not c.nccl:  # gloo has no AVG
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
        t.div_(c.world)
    else:
        dist.all_reduce(t, op=getattr(dist.ReduceOp, op))


def _p2p(send: torch.Tensor, recv: torch.Tensor, dst: int, src: int) -> None:
    ops = [dist.P2POp(dist.isend, send, dst), dist.P2POp(dist.irecv, recv, src)]
    for work in dist.batch_isend_irecv(ops):
        work.wait()


# ------------------------------------------------------------------------------------------------- cases
def _all_reduce_case(op: str) -> Case:
    adjoint = {"SUM": "SUM", "AVG": "AVG"}.get(op, "SUM")

    def build(c: Ctx, F):
        x, g = c.rand(), c.rand()
        xl = x.clone().requires_grad_()
        red = getattr(dist.ReduceOp, op)

        def step_dist():
            y = F.all_reduce(xl, red)
            y.backward(g)
            xl.grad = None
            return y

        def step_raw():
            y = x.clone()
            _raw_all_reduce(y, op, c)
            gx = g.clone()
            _raw_all_reduce(gx, adjoint, c)
            return y

        return {"dist": step_dist, "raw": step_raw, "compare": True}

    group = "move" if op in ("SUM", "AVG") else "info"
    return Case(f"all_reduce({op})", group, lambda m, w: 4 * m * (w - 1) / w, build,
                f"clone + all_reduce({op}); clone grad + all_reduce({adjoint})")


def _broadcast_build(c: Ctx, F):
    x, g = c.rand(), c.rand()
    xl = x.clone().requires_grad_()

    def step_dist():
        y = F.broadcast(xl, 0)
        y.backward(g)
        xl.grad = None
        return y

    def step_raw():
        y = x.clone() if c.rank == 0 else torch.empty_like(x)
        dist.broadcast(y, 0)
        if c.rank == 0:
            gx = g.clone()
            dist.reduce(gx, 0, op=dist.ReduceOp.SUM)
        else:  # NCCL leaves a non-root reduce input untouched; gloo may use it as scratch
            dist.reduce(g if c.nccl else g.clone(), 0, op=dist.ReduceOp.SUM)
            gx = torch.zeros_like(x)
        return y

    return {"dist": step_dist, "raw": step_raw, "compare": True}


def _reduce_build(c: Ctx, F):
    x, g = c.rand(), c.rand()
    xl = x.clone().requires_grad_()

    def step_dist():
        y = F.reduce(xl, 0, dist.ReduceOp.SUM)
        y.backward(g)
        xl.grad = None
        return y

    def step_raw():
        y = x.clone()
        dist.reduce(y, 0, op=dist.ReduceOp.SUM)
        gx = g.clone() if c.rank == 0 else torch.empty_like(g)
        dist.broadcast(gx, 0)
        return y

    return {"dist": step_dist, "raw": step_raw, "compare": c.rank == 0}  # off dst the value is documented


def _gather_raw(c: Ctx, x: torch.Tensor, gy: torch.Tensor):
    def step_raw():
        y = torch.empty(c.world * x.shape[0], COLS, device=c.device, dtype=c.dtype)
        _AG(y, x)
        gx = torch.empty_like(x)
        _RS(gx, gy)
        return y

    return step_raw


def _all_gather_tensor_build(c: Ctx, F):
    x, gy = c.rand(), c.rand(c.world * c.rows)
    xl = x.clone().requires_grad_()

    def step_dist():
        y = F.all_gather_tensor(xl, 0)
        y.backward(gy)
        xl.grad = None
        return y

    return {"dist": step_dist, "raw": _gather_raw(c, x, gy), "compare": True}


def _reduce_scatter_tensor_build(c: Ctx, F):
    x, g = c.rand(), c.rand(c.rows // c.world)
    xl = x.clone().requires_grad_()

    def step_dist():
        y = F.reduce_scatter_tensor(xl, 0)
        y.backward(g)
        xl.grad = None
        return y

    def step_raw():
        y = torch.empty(c.rows // c.world, COLS, device=c.device, dtype=c.dtype)
        _RS(y, x)
        gx = torch.empty_like(x)
        _AG(gx, g)
        return y

    return {"dist": step_dist, "raw": step_raw, "compare": True}


def _all_to_all_build(c: Ctx, F):
    x, g = c.rand(), c.rand()
    xl = x.clone().requires_grad_()

    def step_dist():
        y = F.all_to_all_single(torch.empty_like(x), xl)
        y.backward(g)
        xl.grad = None
        return y

    def step_raw():
        y = torch.empty_like(x)
        dist.all_to_all_single(y, x)
        gx = torch.empty_like(g)
        dist.all_to_all_single(gx, g)
        return y

    return {"dist": step_dist, "raw": step_raw, "compare": True}


def _ring_pass_build(known_shape: bool):
    def build(c: Ctx, F):
        x, g = c.rand(), c.rand()
        xl = x.clone().requires_grad_()
        right, left = (c.rank + 1) % c.world, (c.rank - 1) % c.world
        kwargs = {"recv_shape": tuple(x.shape)} if known_shape else {}

        def step_dist():
            y = F.ring_pass(xl, **kwargs)
            y.backward(g)
            xl.grad = None
            return y

        def step_raw():
            y = torch.empty_like(x)
            _p2p(x, y, right, left)
            gx = torch.empty_like(g)
            _p2p(g, gx, left, right)
            return y

        return {"dist": step_dist, "raw": step_raw, "compare": True}

    return build


def _variable_build(mode: str):
    def build(c: Ctx, F):
        if mode == "uneven":  # same total rows, split unevenly: rank r holds rows * (1 + (W-1-2r)/(2W))
            sizes = [c.rows + (c.world - 1 - 2 * r) * c.rows // (2 * c.world) for r in range(c.world)]
        else:
            sizes = [c.rows] * c.world
        x_even, gy = c.rand(), c.rand(c.world * c.rows)
        xl = c.rand(sizes[c.rank]).requires_grad_()
        given = None if mode == "none" else sizes

        def step_dist():
            y, _ = F.all_gather_variable(xl, 0, sizes=given)
            y.backward(gy)
            xl.grad = None
            return y

        if mode != "uneven":
            xl.data.copy_(x_even)
        return {"dist": step_dist, "raw": _gather_raw(c, x_even, gy), "compare": mode != "uneven"}

    return build


def _torch_nn_case(case: Case) -> Case:
    """The same case through torch.distributed.nn.functional: how much autograd alone costs there."""
    import torch.distributed.nn.functional as torch_nn

    return Case(f"torch.nn {case.name}", "info", case.bus, lambda c, F: case.build(c, torch_nn),
                case.raw + " (dist column: torch.distributed.nn.functional)", compiles=False)


def _no_grad_all_reduce_build(c: Ctx, F):
    """distcomm's all_reduce on x and on the grad, outside autograd: the ops minus the autograd engine."""
    x, g = c.rand(), c.rand()

    def step_dist():
        with torch.no_grad():
            y = F.all_reduce(x)
            F.all_reduce(g)
        return y

    def step_raw():
        y = x.clone()
        _raw_all_reduce(y, "SUM", c)
        gx = g.clone()
        _raw_all_reduce(gx, "SUM", c)
        return y

    return {"dist": step_dist, "raw": step_raw, "compare": True}


IN_GRAPH = 8  # collectives per backward() in the "in one graph" rows


def _in_graph_build(kind: str):
    """IN_GRAPH independent collectives whose outputs go through ONE backward() call, as in a training step:
    the autograd engine's fixed cost per backward() call is shared, what remains is distcomm's per-op cost.
    Raw: the same IN_GRAPH forward collectives, then their IN_GRAPH adjoints, by hand."""

    def build(c: Ctx, F):
        xs = [c.rand() for _ in range(IN_GRAPH)]
        g = c.rand()
        leaves = [x.clone().requires_grad_() for x in xs]

        def forward(t):
            return F.all_reduce(t) if kind == "all_reduce" else F.broadcast(t, 0)

        def step_dist():
            ys = [forward(leaf) for leaf in leaves]
            torch.autograd.backward(ys, [g] * IN_GRAPH)
            for leaf in leaves:
                leaf.grad = None
            return ys[0]

        def step_raw():
            ys = []
            for x in xs:
                y = x.clone() if kind == "all_reduce" or c.rank == 0 else torch.empty_like(x)
                if kind == "all_reduce":
                    dist.all_reduce(y)
                else:
                    dist.broadcast(y, 0)
                ys.append(y)
            for _ in xs:
                gx = g.clone()
                if kind == "all_reduce":
                    dist.all_reduce(gx)
                else:
                    dist.reduce(gx, 0, op=dist.ReduceOp.SUM)
                    if c.rank != 0:
                        gx.zero_()
            return ys[0]

        return {"dist": step_dist, "raw": step_raw, "compare": True}

    return build


_GATHER_PAIR = lambda m, w: 2 * m * (w - 1)  # noqa: E731  all_gather (W*m out) + reduce_scatter (W*m in)
_SCATTER_PAIR = lambda m, w: 2 * m * (w - 1) / w  # noqa: E731
CASES = [
    _all_reduce_case("SUM"),
    _all_reduce_case("AVG"),
    Case("broadcast(src=0)", "move", lambda m, w: 2 * m, _broadcast_build,
         "clone + broadcast; clone grad + reduce(SUM) to src, zeros elsewhere"),
    Case("reduce(dst=0,SUM)", "move", lambda m, w: 2 * m, _reduce_build, "clone + reduce; broadcast of dst's grad"),
    Case("all_gather_tensor", "move", _GATHER_PAIR, _all_gather_tensor_build,
         "all_gather_into_tensor; reduce_scatter_tensor(SUM)"),
    Case("reduce_scatter_tensor", "move", _SCATTER_PAIR, _reduce_scatter_tensor_build,
         "reduce_scatter_tensor(SUM); all_gather_into_tensor"),
    Case("all_to_all_single", "move", _SCATTER_PAIR, _all_to_all_build, "all_to_all_single; all_to_all_single"),
    Case("ring_pass(recv_shape)", "move", lambda m, w: 2 * m, _ring_pass_build(True),
         "batch_isend_irecv right/left; batch_isend_irecv left/right"),
    # Learning the incoming shape is an extra exchange (and a host sync) that raw does not make: reported
    # beside the target, like all_gather_variable(None).
    Case("ring_pass", "info", lambda m, w: 2 * m, _ring_pass_build(False),
         "batch_isend_irecv right/left; batch_isend_irecv left/right (distcomm also learns the shape)",
         compiles=False),
    Case("all_gather_variable(sizes)", "variable", _GATHER_PAIR, _variable_build("given"),
         "fixed-size all_gather_into_tensor; reduce_scatter_tensor(SUM)"),
    Case("all_gather_variable(None)", "info", _GATHER_PAIR, _variable_build("none"),
         "fixed-size all_gather_into_tensor; reduce_scatter_tensor(SUM)", compiles=False),
    Case("all_gather_variable(uneven)", "info", _GATHER_PAIR, _variable_build("uneven"),
         "fixed-size all_gather_into_tensor; reduce_scatter_tensor(SUM) of the same total bytes"),
    _all_reduce_case("MAX"),
    _all_reduce_case("MIN"),
    _all_reduce_case("PRODUCT"),
    Case("all_reduce(SUM) no autograd", "info", lambda m, w: 4 * m * (w - 1) / w, _no_grad_all_reduce_build,
         "clone + all_reduce(SUM), twice (dist column: distcomm under torch.no_grad)"),
]
CASES += [
    Case(f"all_reduce(SUM) x{IN_GRAPH} in one graph", "info", lambda m, w: IN_GRAPH * 4 * m * (w - 1) / w,
         _in_graph_build("all_reduce"), f"{IN_GRAPH} x (clone + all_reduce(SUM)), then {IN_GRAPH} x (clone grad + "
         "all_reduce(SUM)); dist column: one backward() for all"),
    Case(f"broadcast(src=0) x{IN_GRAPH} in one graph", "info", lambda m, w: IN_GRAPH * 2 * m,
         _in_graph_build("broadcast"), f"{IN_GRAPH} x (clone + broadcast), then {IN_GRAPH} x (clone grad + reduce); "
         "dist column: one backward() for all"),
]
CASES += [_torch_nn_case(c) for c in CASES if c.name in ("all_reduce(SUM)", "broadcast(src=0)")]


class _Compiled:
    """``distcomm.functional`` with each function compiled on first use (fullgraph, static shapes).

    Made afresh for every (op, size) after ``torch._dynamo.reset()``: sizes never pile up recompilations
    (past dynamo's recompile limit a function would silently run eagerly)."""

    def __init__(self, F, backend: str):
        torch._dynamo.reset()
        self._F, self._backend, self._fns = F, backend, {}

    def __getattr__(self, name: str):
        if name not in self._fns:
            self._fns[name] = torch.compile(getattr(self._F, name), fullgraph=True, dynamic=False,
                                            backend=self._backend)
        return self._fns[name]


def _compiled_case(case: Case) -> Case:
    """The same step through compiled distcomm functions, measured against the same raw baseline."""
    return Case(f"{case.name} compiled", "compiled" if case.group == "move" else "info", case.bus,
                lambda c, F: case.build(c, _Compiled(F, c.compile_backend)),
                case.raw + " (dist column: distcomm under torch.compile)", compiles=False)


# ----------------------------------------------------------------------------------------------- one rank
def _iters_for(nbytes: int, cfg: dict) -> int:
    return max(cfg["min_iters"], min(cfg["iters"], int(cfg["iters"] * 64 * U.MiB / nbytes)))


def _verdict(case: Case, nbytes: int, ratio: float | None) -> str:
    if case.target is None or nbytes < MIN_TARGET_BYTES:
        return ""
    if ratio is None:
        return "MISS"
    return "PASS" if ratio <= case.target else "MISS"


def _all_cases(cfg: dict) -> list[Case]:
    """CASES, each followed by its compiled row when ``--compiled`` is given."""
    if not cfg.get("compiled"):
        return list(CASES)
    return [row for c in CASES for row in ([c, _compiled_case(c)] if c.compiles else [c])]


def _selected(cfg: dict) -> list[Case]:
    wanted = cfg["ops"]
    cases = _all_cases(cfg)
    if not wanted:
        return cases
    return [c for c in cases if any(c.name == w or c.name.startswith(w) for w in wanted)]


def run_rank(rank: int, world: int, cfg: dict) -> dict:
    U.set_safe_env()
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", category=UserWarning, message=".*barrier.*")
    import distcomm.functional as F

    device = U.rank_device(cfg["backend"])
    dtype = getattr(torch, cfg["dtype"])
    elem = torch.tensor([], dtype=dtype).element_size()
    out_path = Path(cfg["out"]) / cfg["json_name"]
    budget = U.Budget(cfg["budget_s"], device)
    lead = rank == 0
    table = U.Table([("op", -42), ("bytes", 6), ("iters", 5), ("distcomm us", 11), ("raw us", 10), ("ratio", 6),
                     ("busbw GB/s", 10), ("raw GB/s", 8), ("MiB dc/raw", 13), ("target", 6), ("", 4),
                     ("note", -1)], enabled=lead)
    table.header(f"{world} ranks, {cfg['backend']}, {cfg['dtype']}; bytes = per-rank input; time = forward+backward")
    report = {"benchmark": "collectives", "command": cfg["command"], "env": U.env_info(cfg["backend"], world),
              "config": cfg, "baselines": {c.name: c.raw for c in _all_cases(cfg)}, "rows": [], "complete": False}
    rows = report["rows"]
    probed_ops: set[str] = set()
    for case in _selected(cfg):
        for nbytes in cfg["sizes"]:
            row = {"op": case.name, "bytes": nbytes, "dtype": cfg["dtype"], "group": case.group,
                   "target": case.target}
            if budget.exhausted():
                row["error"] = "skipped: time budget spent"
            else:
                ctx = Ctx(rank, world, device, dtype, nbytes // elem // COLS, cfg["backend"] == "nccl",
                          seed=len(rows), compile_backend=cfg["compile_backend"])
                _measure_case(row, case, ctx, F, cfg, probe=case.name not in probed_ops)
                if "collectives" in row:
                    probed_ops.add(case.name)
            row["verdict"] = _verdict(case, nbytes, row.get("ratio"))  # a failed row with a target is a MISS
            rows.append(row)
            _print_row(table, row, case)
            if lead:
                U.write_json(out_path, report)  # progressive: a crash or timeout keeps what was measured
    report["summary"] = summarize(rows)
    report["elapsed_s"] = budget.elapsed()
    report["complete"] = True
    if lead:
        U.write_json(out_path, report)
    return report if lead else {}


def _measure_case(row: dict, case: Case, c: Ctx, F, cfg: dict, *, probe: bool) -> None:
    """Fill ``row`` with the times of one op at one size (or its error); every rank takes the same path."""
    device = c.device
    iters = _iters_for(row["bytes"], cfg)
    row["iters"] = iters
    steps, err = U.guarded(lambda: case.build(c, F), device)
    if err is None and probe:
        # once per op: forward values agree with raw, and which collectives each side issues
        def check():
            y_dist = steps["dist"]().detach()
            y_raw = steps["raw"]()
            U.synchronize(device)
            tol = 1e-5 if c.dtype == torch.float32 else 3e-2
            same = (not steps["compare"]) or (
                y_dist.shape == y_raw.shape and torch.allclose(y_dist, y_raw, rtol=tol, atol=tol))
            return same, U.count_collectives(steps["dist"]), U.count_collectives(steps["raw"])

        probed, err = U.guarded(check, device)
        if err is None:
            same, c_dist, c_raw = probed
            (bad,) = U.all_max([0.0 if same else 1.0], device)
            row["forward_matches_raw"] = not bad
            row["collectives"] = {"distcomm": c_dist, "raw": c_raw,
                                  "extra": sum(c_dist.values()) - sum(c_raw.values())}
    if err is None:
        def measure():
            best = {"dist": float("inf"), "raw": float("inf")}
            peak = {"dist": 0, "raw": 0}
            for _ in range(cfg["repeats"]):  # alternate the sides so drifts hit both alike
                for side in ("raw", "dist"):
                    with U.PeakMemory(device) as pm:
                        t = U.time_loop(steps[side], iters=iters, warmup=cfg["warmup"], device=device)
                    best[side] = min(best[side], t)
                    peak[side] = max(peak[side], pm.bytes or 0)
            return best, peak

        measured, err = U.guarded(measure, device)
    del steps
    U.release_memory(device)
    if err is not None:
        row["error"] = err
        return
    best, peak = measured
    t_dist, t_raw, m_dist, m_raw = U.all_max([best["dist"], best["raw"], peak["dist"], peak["raw"]], device)
    bus = case.bus(row["bytes"], c.world)
    cuda = device.type == "cuda"
    row.update(distcomm_us=t_dist * 1e6, raw_us=t_raw * 1e6, ratio=t_dist / t_raw,
               distcomm_busbw_GBps=bus / t_dist / 1e9, raw_busbw_GBps=bus / t_raw / 1e9,
               distcomm_peak_MiB=m_dist / U.MiB if cuda else None, raw_peak_MiB=m_raw / U.MiB if cuda else None)


def _print_row(table: U.Table, row: dict, case: Case) -> None:
    note = row.get("error", "")
    if row.get("forward_matches_raw") is False:
        note = "FORWARD DIFFERS FROM RAW " + note
    if "collectives" in row:
        cd, cr = row["collectives"]["distcomm"], row["collectives"]["raw"]
        note = (note + f" comms dc={sum(cd.values())} raw={sum(cr.values())}").strip()
    mem = (f"{row['distcomm_peak_MiB']:.0f}/{row['raw_peak_MiB']:.0f}"
           if row.get("distcomm_peak_MiB") is not None else "-")
    table.row([case.name, U.fmt_bytes(row["bytes"]), row.get("iters", "-"), U.fmt(row.get("distcomm_us"), ".1f"),
               U.fmt(row.get("raw_us"), ".1f"), U.fmt(row.get("ratio"), ".3f"),
               U.fmt(row.get("distcomm_busbw_GBps"), ".1f"), U.fmt(row.get("raw_busbw_GBps"), ".1f"), mem,
               U.fmt(case.target, ".2f", ""), row["verdict"], note])


# ------------------------------------------------------------------------------------------------ summary
def summarize(rows: list[dict]) -> dict:
    """Per op: worst and mean ratio at >= 16 MB, the verdict, and the collectives each side issues."""
    summary = {}
    for name in dict.fromkeys(r["op"] for r in rows):
        mine = [r for r in rows if r["op"] == name]
        big = [r for r in mine if r["bytes"] >= MIN_TARGET_BYTES]
        ratios = [r["ratio"] for r in big if r.get("ratio") is not None]
        coll = next((r["collectives"] for r in mine if "collectives" in r), None)
        target = mine[0].get("target")
        verdicts = [r.get("verdict") for r in big if r.get("verdict")]
        summary[name] = {
            "target": target,
            "worst_ratio_ge_16MB": max(ratios) if ratios else None,
            "mean_ratio_ge_16MB": sum(ratios) / len(ratios) if ratios else None,
            "verdict": ("PASS" if verdicts and all(v == "PASS" for v in verdicts) else "MISS") if target and big
            else "",
            "errors": sorted({r["error"] for r in mine if r.get("error")}),
            "collectives": coll,
        }
    return summary


def print_summary(summary: dict) -> None:
    table = U.Table([("op", -42), ("target", 6), ("worst>=16MB", 11), ("mean>=16MB", 10), ("", 4),
                     ("collectives distcomm", -48), ("raw", -46), ("extra", 5)])
    table.header("Summary (ratio = distcomm time / raw time, forward+backward)")
    for name, s in summary.items():
        coll = s.get("collectives") or {}
        fmt_c = lambda d: ", ".join(f"{k} x{v}" for k, v in d.items()) if d else "-"  # noqa: E731
        table.row([name, U.fmt(s["target"], ".2f", ""), U.fmt(s["worst_ratio_ge_16MB"], ".3f"),
                   U.fmt(s["mean_ratio_ge_16MB"], ".3f"), s["verdict"], fmt_c(coll.get("distcomm")),
                   fmt_c(coll.get("raw")), coll.get("extra", "-")])
        for e in s["errors"]:
            print(f"    error: {e}", flush=True)


def plot(report: dict, path: Path) -> Path | None:
    rows = [r for r in report["rows"] if r.get("ratio") is not None]
    names = list(dict.fromkeys(r["op"] for r in report["rows"]))
    try:
        import matplotlib

        cmap = matplotlib.colormaps["tab20"]
    except Exception:
        cmap = None
    color = {n: (cmap(i % 20) if cmap else None) for i, n in enumerate(names)}
    sizes = sorted({r["bytes"] for r in report["rows"]})
    ticks = [(s, U.fmt_bytes(s)) for s in sizes]
    panels = []
    for title, group_names, target in (
        ("SUM/AVG and data movement (target 1.03x)", [n for n in names if _group_of(n) == "move"], MOVE_TARGET),
        ("compiled (target 1.10x)", [n for n in names if _group_of(n) == "compiled"], COMPILED_TARGET),
        ("exact MAX/MIN/PRODUCT, all_gather_variable", [n for n in names if _group_of(n) not in ("move", "compiled")],
         VARIABLE_TARGET),
    ):
        if not group_names:
            continue
        bw, ratio = [], []
        for n in group_names:
            mine = sorted((r for r in rows if r["op"] == n), key=lambda r: r["bytes"])
            xs = [r["bytes"] for r in mine]
            bw.append({"label": f"{n}", "x": xs, "y": [r["distcomm_busbw_GBps"] for r in mine], "style": "o-",
                       "color": color[n]})
            bw.append({"label": "_raw", "x": xs, "y": [r["raw_busbw_GBps"] for r in mine], "style": "x--",
                       "color": color[n]})
            ratio.append({"label": n, "x": xs, "y": [r["ratio"] for r in mine], "style": "o-", "color": color[n]})
        hl = [(1.0, ""), (target, f"{target:.2f}")]
        panels.append({"title": f"bus bandwidth, {title}\n(solid distcomm, dashed raw)", "xlabel": "per-rank input",
                       "ylabel": "GB/s (fwd+bwd)", "xscale": "log", "xticks": ticks, "series": bw})
        panels.append({"title": f"distcomm / raw time, {title}", "xlabel": "per-rank input", "ylabel": "ratio",
                       "xscale": "log", "xticks": ticks, "series": ratio, "hlines": hl})
    env = report.get("env", {})
    title = (f"distcomm collectives vs raw torch.distributed: {env.get('world_size')} x {env.get('gpu', 'CPU')}, "
             f"{env.get('backend')}, {report['config']['dtype']}")
    return U.plot_panels(path, panels, title=title)


def write_markdown(report: dict, path: Path) -> Path:
    """The measured table in Markdown (ratio and distcomm bus bandwidth at a few sizes, per op)."""
    rows = report["rows"]
    sizes = sorted({r["bytes"] for r in rows})
    shown = [s for s in sizes if s in (U.MiB, 16 * U.MiB, 256 * U.MiB, U.GiB)] or sizes[:4]
    by = {(r["op"], r["bytes"]): r for r in rows}
    table = []
    for name, s in report["summary"].items():
        cells = []
        for size in shown:
            r = by.get((name, size), {})
            cells.append(f"{r['ratio']:.3f} ({r['distcomm_busbw_GBps']:.0f})" if r.get("ratio") else "-")
        coll = s.get("collectives") or {}
        extra = coll.get("extra")
        table.append([f"`{name}`", *cells, U.fmt(s["worst_ratio_ge_16MB"], ".3f"), U.fmt(s["target"], ".2f", ""),
                      s["verdict"], "-" if extra is None else f"{extra:+d}"])
    cfg = report["config"]
    text = U.markdown_header("distcomm collectives vs raw torch.distributed (forward + backward)", report)
    text += (f"\nCells: time ratio distcomm / raw (distcomm bus bandwidth, GB/s); message = per-rank input bytes, "
             f"{cfg['dtype']}. Raw = the same forward collective plus its adjoint issued by hand "
             f"(MAX/MIN/PRODUCT: plus one all_reduce(SUM) of the grad; all_gather_variable: a fixed-size "
             f"all_gather_into_tensor + reduce_scatter_tensor of the same bytes). Extra = collectives distcomm "
             f"issues beyond raw per forward+backward. Verdict at >= 16 MB.\n\n")
    text += U.markdown_table(["op", *[U.fmt_bytes(s) for s in shown], "worst >= 16MB", "target", "verdict", "extra"],
                             table) + "\n"
    path.write_text(text)
    return path


def _group_of(name: str) -> str:
    return next((c.group for c in _all_cases({"compiled": True}) if c.name == name), "info")


# --------------------------------------------------------------------------------------------------- main
def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--sizes", type=lambda s: U.parse_list(s, U.parse_bytes),
                   help="per-rank input sizes (default 1MB,2MB,...,1GB; --quick 1MB,16MB,128MB,1GB)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--ops", type=U.parse_list, default=[],
                   help="ops to run (names or prefixes, e.g. all_reduce,ring_pass); default all: "
                        + ", ".join(c.name for c in CASES))
    p.add_argument("--iters", type=int, help="timed iterations up to 64 MB (scaled down above; default 40)")
    p.add_argument("--min-iters", type=int, help="fewest timed iterations at large sizes (default 8)")
    p.add_argument("--warmup", type=int, help="warm-up iterations before each timed loop (default 3)")
    p.add_argument("--repeats", type=int, help="alternating raw/distcomm repeats, best kept (default 3)")
    p.add_argument("--world-size", type=int, default=2, help="local ranks to start (not under torchrun)")
    p.add_argument("--budget", type=float, default=300.0,
                   help="seconds of measuring after which remaining cases are skipped (default 300)")
    p.add_argument("--out", default=None, help="output directory (default docs/bench; with --smoke a new temporary folder)")
    p.add_argument("--quick", action="store_true", help="4 sizes, fewer iterations (about a minute)")
    p.add_argument("--smoke", action="store_true", help="CPU/gloo, tiny sizes, 1-3 iterations: plumbing only")
    p.add_argument("--compiled", action="store_true",
                   help="add a torch.compile'd row after each op (target 1.10x of raw at >= 16 MB)")
    p.add_argument("--compile-backend", help="torch.compile backend of the compiled rows (default inductor; "
                                             "aot_eager under --smoke, which skips code generation)")
    args = p.parse_args(argv)
    args.out = U.out_dir(args.out, args.smoke)
    return args


def make_config(args: argparse.Namespace) -> dict:
    if args.smoke:
        defaults = dict(sizes=[64 << 10, 256 << 10], iters=3, min_iters=2, warmup=1, repeats=1)
    elif args.quick:
        defaults = dict(sizes=[U.MiB, 16 * U.MiB, 128 * U.MiB, U.GiB], iters=20, min_iters=5, warmup=2, repeats=2)
    else:
        defaults = dict(sizes=[U.MiB << i for i in range(11)], iters=40, min_iters=8, warmup=3, repeats=3)
    cfg = {k: (getattr(args, k) if getattr(args, k, None) is not None else v) for k, v in defaults.items()}
    backend = "gloo" if args.smoke or not torch.cuda.is_available() else "nccl"
    if backend == "gloo" and args.dtype != "float32":
        print("note: gloo on CPU: using float32", flush=True)
        args.dtype = "float32"
    name = "collectives_smoke" if args.smoke else "collectives"
    cfg.update(dtype=args.dtype, ops=args.ops, backend=backend, out=args.out, budget_s=args.budget,
               json_name=f"{name}.json", png_name=f"{name}.png", md_name=f"{name}.md", command=U.command_line(),
               smoke=args.smoke, quick=args.quick, compiled=args.compiled,
               compile_backend=args.compile_backend or ("aot_eager" if args.smoke else "inductor"))
    return cfg


def main(argv=None) -> int:
    args = parse_args(argv)
    cfg = make_config(args)
    world = args.world_size
    if cfg["backend"] == "nccl" and not U.under_torchrun() and torch.cuda.device_count() < world:
        print(f"need {world} GPUs for NCCL, found {torch.cuda.device_count()} (use --smoke for a CPU run)")
        return 2
    out = Path(cfg["out"])
    t0 = time.monotonic()
    report, failure = U.run_report(run_rank, world, cfg, backend=cfg["backend"],
                                   timeout=cfg["budget_s"] + 120, summarize=lambda r: summarize(r["rows"]))
    if report is None:
        return 1 if failure else 0
    print_summary(report["summary"])
    png = plot(report, out / cfg["png_name"])
    md = write_markdown(report, out / cfg["md_name"])
    print(f"\nwrote {out / cfg['json_name']}, {md}" + (f" and {png}" if png else "")
          + f" in {time.monotonic() - t0:.0f} s", flush=True)
    return 1 if failure else 0


if __name__ == "__main__":
    sys.exit(main())
