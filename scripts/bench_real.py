"""Real links: every context-parallel strategy on W GPUs over NCCL, beside its emulated and predicted time.

One process per GPU runs the public call, ``context_parallel_attn(strategy=...)`` forward + backward, on its
shard of one sequence (the same random q, k, v on every rank, sharded by ``shard_sequence``):

    efficiency = T_single(S) / (W * T_W)     T_single: one flash-attn-4 fwd+bwd over the whole sequence
                                             on one of the same GPUs (varlen for packed documents), same run
                                             T_W: the slowest rank's mean fwd+bwd (CUDA events, ranks lined up)

Per row and strategy: T_W, per-GPU TFLOP/s, efficiency, peak memory (``max_memory_allocated`` during the
timed loop, this rank's shards included, the whole sequence freed before), the bytes the busiest rank sent
in one fwd+bwd (the strategies' transport counted; the ring's hops counted at ``RingComm.send_recv``; the
cross-rank verification on the host not counted) beside the exchange plan's minimum, the cost model's
prediction (``which_strategy``, default NVLink hardware) and its error, and, with ``--emulated``, the
emulated-link time of scripts/bench_emulated.py for the same row (its "nvlink" link) and its error. Dense
rows also run PyTorch's ``context_parallel`` (ring, SDPA under cuDNN and FlashAttention-2) for time and
peak memory.

    python scripts/bench_real.py --world 2 --seqs 8k,16k,32k,64k --docs one,lognormal,pareto \
        --emulated docs/bench/real_emulated_w2.json --out docs/bench/real_w2.json

``--mesh RxU`` (R * U = W): also the hybrid strategies over a 2-D DeviceMesh of R rings x U-way Ulysses
(``init_device_mesh(device, (R, U), mesh_dim_names=("ring", "ulysses"))``), each on the shards
``shard_sequence(x, layout, group=mesh)`` gives (the layout over the rings, each ring shard cut into U
contiguous pieces). Rows "hybrid", "hybrid_allgather" and "auto_mesh" (``strategy="auto"`` over the mesh:
the cost model's pick among the two hybrids and the 1-D strategies over all the mesh's ranks on its
sharding, ``pick_mesh``); their predictions are ``which_strategy``'s for
the mesh, and ``plan_min_bytes`` (the 1-D exchange plan's minimum) does not apply to them.

    python scripts/bench_real.py --world 4 --mesh 2x2 --seqs 32k,64k,128k --docs lognormal,pareto,one \
        --budget 400 --out real_w4.json

``--device cpu`` runs the same loop on gloo with the PyTorch kernels (a smoke run; no baseline kernel) and
checks every strategy's output and gradients at this rank's positions against the float64 reference of the
whole sequence (``check_error``: the largest absolute error over ranks; the run fails above ``CHECK_TOL``).
With ``--out``, rank 0 rewrites the JSON after every row (``"partial": true`` until the run ends), and
``--budget`` skips the rows that would start after that many seconds, so a run cut short keeps its rows.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import _bench_util as U  # noqa: E402
import bench_strategies as bs  # noqa: E402

from distcomm.ring import RingComm  # noqa: E402
from distcomm_attention import context_parallel_attn, shard_sequence, which_strategy  # noqa: E402
from distcomm_attention import transport  # noqa: E402
from distcomm_attention._reference import attention_reference  # noqa: E402
from distcomm_attention.planning import balance, layouts  # noqa: E402
from distcomm_attention.planning.exchange import exchange_plan  # noqa: E402
from distcomm_attention.planning.visibility import Visibility  # noqa: E402
from distcomm_attention.transport import CountingTransport  # noqa: E402
from distcomm_attention.transport.torch_dist import TorchTransport  # noqa: E402

STRATEGIES = ("ring", "allgather", "ulysses", "auto")
# The strategies run over the 2-D mesh, and the name of each one's row ("auto" over the mesh: "auto_mesh").
MESH_STRATEGIES = {"hybrid": "hybrid", "hybrid_allgather": "hybrid_allgather", "auto": "auto_mesh"}
CHECK_TOL = 2e-3  # largest absolute error of fp32 outputs / gradients against the float64 reference (CPU)
CHECK_TOL_GPU = 0.1  # the same in bf16 on a GPU (--check; inputs of unit scale: a wrong row or head errs by ~1)


class _Wire:
    """Bytes this rank puts on the wire: the transports' (counted) plus the ring's hops (tensors on the data's device:
    on NCCL the verification exchange runs on the host)."""

    def __init__(self):
        self.transports: list[CountingTransport] = []
        self.ring = 0

    def factory(self, group):
        t = CountingTransport(TorchTransport(group))
        self.transports.append(t)
        return t

    @property
    def total(self) -> int:
        return self.ring + sum(t.total for t in self.transports)


def _counting_ring(wire: _Wire, device: torch.device):
    original = RingComm.send_recv

    def send_recv(self, *tensors, shift: int = 1, **kwargs):
        inside = any(self is getattr(t.inner, "_ring", None) for t in wire.transports)  # counted there already
        if shift % self.size and not inside:
            wire.ring += sum(t.numel() * t.element_size() for t in tensors if t.device == device)
        return original(self, *tensors, shift=shift, **kwargs)

    return original, send_recv


def plan_minimum(concrete, vis, world, n, rank, kv_heads, d, itemsize) -> int:
    """The exchange plan's bytes for ``rank``: its rows that others need (k, v in the input dtype) out, and
    the dK, dV of the rows it received back in fp32 (as the ring returns them; the sparse all-gather with
    flash-attn-4 returns them in the input dtype, below this: Note [Sparse gather], "What goes home")."""
    ex = exchange_plan(concrete, vis, world, n)
    sent, received = ex.remote_rows(rank)
    row = 2 * kv_heads * d
    return sent * row * itemsize + received * row * 4


def _flops(seq, heads, d, docs, causal) -> float:
    """Attention fwd+bwd FLOPs over the visible pairs (4 matmuls forward-equivalent x 3.5)."""
    lengths = [seq] if docs is None else [b - a for a, b in zip(docs, docs[1:])]
    pairs = sum(L * (L + 1) / 2 if causal else L * L for L in lengths)
    return 3.5 * 4 * pairs * heads * d


def parse_mesh(text: str | None, world: int, heads: int) -> tuple[int, int] | None:
    """``--mesh RxU`` -> (rings, ulysses degree), checked against the world and the heads; None for no mesh."""
    if text is None or text.lower() == "none":
        return None
    parts = text.lower().split("x")
    if len(parts) != 2 or not all(x.isdigit() and int(x) >= 1 for x in parts):
        raise ValueError(f"--mesh must be RxU (R rings x U-way Ulysses, e.g. 2x2), got {text!r}")
    rings, ulysses = map(int, parts)
    if rings * ulysses != world:
        raise ValueError(f"--mesh {text}: {rings} rings x {ulysses}-way Ulysses is {rings * ulysses} ranks, but "
                         f"--world is {world}")
    if heads % ulysses:
        raise ValueError(f"--mesh {text}: the hybrids split the {heads} query heads over the Ulysses degree "
                         f"{ulysses}, which does not divide them")
    return rings, ulysses


def check_lengths(cases, world: int, packed_layout: str) -> None:
    """Every row's length must split over the ranks: 2 * W for the zigzag rows (the dense causal ones; also the
    hybrids' zigzag over R rings, cut into U pieces), W otherwise."""
    for seq, mix, causal in cases:
        zigzag = (causal if mix == "one" else packed_layout == "zigzag")
        unit = 2 * world if zigzag else world
        if seq % unit:
            raise ValueError(f"S={seq} ({mix}{', zigzag' if zigzag else ''}) over {world} ranks: S must divide "
                             f"by {unit}")


def _single(q, k, v, causal, docs, device, args):
    """The baseline's mean seconds, or (None, why not)."""
    if device.type != "cuda":
        return None, None
    try:
        step = bs._fa4_single(q, k, v, causal, docs)
    except ImportError as exc:
        return None, U.error_text(exc)
    return U.time_loop(step, iters=args["iters"], warmup=args["warmup"], device=device, barrier=False), None


def _inputs(seq, heads, kv_heads, d, device, dt):
    """The whole sequence's q, k, v, dout, the same on every rank (and on every call)."""
    g = torch.Generator(device=device).manual_seed(0)
    rnd = lambda *shape: torch.randn(*shape, device=device, dtype=dt, generator=g)  # noqa: E731
    return rnd(1, seq, heads, d), rnd(1, seq, kv_heads, d), rnd(1, seq, kv_heads, d), rnd(1, seq, heads, d)


def _shards(seq, layout, cu, device, dt, args, group=None):
    """This rank's shards of q, k, v, dout (``shard_sequence``; ``group``: the 2-D mesh for the hybrids), the
    whole sequence freed."""
    full = _inputs(seq, args["heads"], args["kv_heads"], args["head_dim"], device, dt)
    local = [shard_sequence(x, layout, cu_seqlens=cu, group=group).contiguous() for x in full]
    del full
    U.release_memory(device)
    return local


def _reference(seq, causal, docs, device, dt, args):
    """float64 (out, dq, dk, dv) of the whole sequence (the CPU check)."""
    q, k, v, dout = (x.double().requires_grad_(i < 3) for i, x in
                     enumerate(_inputs(seq, args["heads"], args["kv_heads"], args["head_dim"], device, dt)))
    out = attention_reference(q, k, v, causal=causal, cu_seqlens=docs)
    out.backward(dout)
    return tuple(x.detach() for x in (out, q.grad, k.grad, v.grad))


def _measure(call, local, device, args, reference=None, positions=None) -> dict:
    """Time ``call(q, k, v)`` fwd+bwd on this rank's shards, its peak memory, the bytes this rank sends in one
    fwd+bwd, and (``reference``) its largest error at ``positions``; every number the max over ranks."""
    ql, kl, vl = (x.detach().requires_grad_() for x in local[:3])
    dl = local[3]

    def step():
        call(ql, kl, vl).backward(dl)
        ql.grad = kl.grad = vl.grad = None

    U.release_memory(device)
    with U.PeakMemory(device) as pm:
        t = U.time_loop(step, iters=args["iters"], warmup=args["warmup"], device=device)
    wire = _Wire()
    original, counted = _counting_ring(wire, device)
    RingComm.send_recv = counted
    try:
        with transport.using(wire.factory):
            step()
        U.synchronize(device)
    finally:
        RingComm.send_recv = original
    error = 0.0
    if reference is not None:
        out = call(ql, kl, vl)
        out.backward(dl)
        got = (out, ql.grad, kl.grad, vl.grad)
        error = max(float((g.detach().double() - r[:, positions]).abs().max()) for g, r in zip(got, reference))
        ql.grad = kl.grad = vl.grad = None
    t_max, peak, sent, error = U.all_max([t, pm.bytes or 0, wire.total, error], device)
    m = {"max_s": t_max, "peak_bytes": int(peak), "bytes_sent": int(sent)}
    if reference is not None:
        m["check_error"] = error
    return m


def _finish(m: dict, row: dict, world: int, predicted) -> dict:
    """Add throughput, efficiency and the prediction (``None``: the model has none for this strategy)."""
    m["tflops_per_gpu"] = row["flops"] / world / m["max_s"] / 1e12
    if row["single_s"]:
        m["efficiency"] = row["single_s"] / (world * m["max_s"])
    m["predicted_s"] = None if predicted is None else predicted.seconds
    m["prediction_error"] = None if predicted is None else predicted.seconds / m["max_s"] - 1
    return m


def _strategy(call, local, device, args, reference, positions, row, world, predicted) -> dict:
    """One strategy's numbers, or {"error": ...} (agreed across ranks) when it fails: the row's others stay."""
    m, err = U.guarded(lambda: _measure(call, local, device, args, reference, positions), device)
    return {"error": err} if err else _finish(m, row, world, predicted)


def bench_case(seq, mix, causal, world, rank, device, args, mesh=None) -> dict:
    heads, kv_heads, d = args["heads"], args["kv_heads"], args["head_dim"]
    dt = torch.bfloat16 if device.type == "cuda" else torch.float32
    docs = None if mix == "one" else bs.documents(mix, seq)
    layout = ("zigzag" if causal else "contiguous") if docs is None else args["layout"]
    q, k, v, _ = _inputs(seq, heads, kv_heads, d, device, dt)
    single, single_note = _single(q, k, v, causal, docs, device, args)
    del q, k, v
    U.release_memory(device)
    reference = _reference(seq, causal, docs, device, dt, args) if args["check"] else None
    cu = docs  # the boundaries on the host, as the docs advise (a CUDA tensor is read back on every call)
    local = _shards(seq, layout, cu, device, dt, args)
    n = seq // world
    vis = Visibility(causal, cu_seqlens=None if docs is None else tuple(docs))
    concrete = balance.resolve(layout, seq, world, None if docs is None else tuple(docs))
    choice = which_strategy(local[0], local[1], layout=layout, causal=causal, cu_seqlens=cu)
    row = {"seq": seq, "world": world, "documents": mix, "causal": causal, "layout": bs.layout_name(concrete),
           "single_s": single, "flops": _flops(seq, heads, d, docs, causal), "pick": choice.strategy,
           "plan_min_bytes": max(plan_minimum(concrete, vis, world, n, r, kv_heads, d, local[1].element_size())
                                 for r in range(world)),
           "strategies": {}}
    if single_note:
        row["single_note"] = single_note
    positions = layouts.positions(concrete, seq, world, rank)
    for strategy in args["strategies"]:
        if strategy == "ulysses" and heads % world:
            continue

        def call(q, k, v, strategy=strategy):
            return context_parallel_attn(q, k, v, strategy=strategy, causal=causal, layout=layout, cu_seqlens=cu)

        predicted = choice.predictions.get(choice.strategy if strategy == "auto" else strategy)
        row["strategies"][strategy] = _strategy(call, local, device, args, reference, positions, row, world,
                                                predicted)
    del local
    if mesh is not None and args["mesh_strategies"]:
        _, err = U.guarded(lambda: _bench_mesh(row, seq, layout, docs, cu, causal, world, device, dt, args, mesh,
                                               reference), device)
        if err:
            row["mesh"] = {**row.get("mesh", {}), "error": err}
    if docs is None and device.type == "cuda" and args["context_parallel"]:
        row["context_parallel"] = _torch_cp(seq, causal, world, device, args)
    return row


def _bench_mesh(row, seq, layout, docs, cu, causal, world, device, dt, args, mesh, reference) -> None:
    """The hybrid strategies over the 2-D mesh, on the mesh's shards, into ``row["strategies"]``."""
    rings, ulysses = mesh.size(mesh.mesh_dim_names.index("ring")), mesh.size(mesh.mesh_dim_names.index("ulysses"))
    local = _shards(seq, layout, cu, device, dt, args, group=mesh)
    concrete = balance.resolve(layout, seq, rings, None if docs is None else tuple(docs))
    positions = layouts.hybrid_positions(concrete, seq, rings, mesh.get_local_rank("ring"), ulysses,
                                         mesh.get_local_rank("ulysses"))
    choice = which_strategy(local[0], local[1], group=mesh, layout=layout, causal=causal, cu_seqlens=cu)
    row["mesh"] = {"shape": f"{rings}x{ulysses}", "ring": rings, "ulysses": ulysses,
                   "layout": bs.layout_name(concrete)}
    row["pick_mesh"] = choice.strategy
    for strategy in args["mesh_strategies"]:

        def call(q, k, v, strategy=strategy):
            return context_parallel_attn(q, k, v, strategy=strategy, causal=causal, layout=layout, group=mesh,
                                         cu_seqlens=cu)

        predicted = choice.predictions.get(choice.strategy if strategy == "auto" else strategy)
        m = _strategy(call, local, device, args, reference, positions, row, world, predicted)
        row["strategies"][MESH_STRATEGIES[strategy]] = {"mesh": row["mesh"]["shape"], **m}


def _torch_cp(seq, causal, world, device, args) -> dict:
    import bench_ring_attention as bra

    out = {}
    for backend in ("cudnn", "flash"):
        c = {"batch": 1, "S": seq, "H": args["heads"], "Hkv": args["kv_heads"], "D": args["head_dim"],
             "causal": causal, "sdpa_backend": backend, "iters": args["iters"], "warmup": args["warmup"]}
        res, err = U.guarded(lambda: bra.bench_cp(c, device, torch.bfloat16), device)
        if err:
            out[backend] = {"error": err}
            continue
        t, peak = U.all_max([res["fwdbwd_s"], res["peak"] or 0], device)
        out[backend] = {"max_s": t, "peak_bytes": int(peak), "note": res.get("note", "")}
    return out


def _device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def run_rank(rank: int, world: int, cfg: dict) -> list:
    device = U.rank_device(cfg["backend_dist"])
    mesh, mesh_error = None, None
    if cfg["mesh"] is not None:
        from torch.distributed.device_mesh import init_device_mesh

        mesh, mesh_error = U.guarded(
            lambda: init_device_mesh(device.type, tuple(cfg["mesh"]), mesh_dim_names=("ring", "ulysses")), device)
        if mesh_error and rank == 0:
            print(f"the {cfg['mesh'][0]}x{cfg['mesh'][1]} mesh could not be made: {mesh_error}", flush=True)
    budget = U.Budget(cfg["budget"], device) if cfg["budget"] else None
    rows = []
    for seq, mix, causal in cfg["cases"]:
        if budget is not None and budget.exhausted():
            row = {"seq": seq, "world": world, "documents": mix, "causal": causal,
                   "error": f"skipped: the {cfg['budget']:g} s budget was spent"}
        else:
            row, err = U.guarded(lambda: bench_case(seq, mix, causal, world, rank, device, cfg, mesh), device)
            if err:
                row = {"seq": seq, "world": world, "documents": mix, "causal": causal, "error": err}
        if mesh_error and "error" not in row:
            row["mesh"] = {"error": mesh_error}
        rows.append(row)
        if rank == 0:
            print(_line(row), flush=True)
            if cfg["out"]:
                U.write_json(Path(cfg["out"]), {**cfg["report"], "device": _device_name(device), "rows": rows,
                                                "partial": True})
    return rows


def _ms(x) -> str:
    return "-" if x is None else f"{x * 1e3:.2f}"


def _pct(x) -> str:
    return "-" if x is None else f"{x:+.0%}"


def _line(row) -> str:
    head = f"S={row['seq']} {row['documents']} {'causal' if row['causal'] else 'full'}"
    if "error" in row:
        return f"{head}: {row['error']}"
    m = row.get("mesh", {})
    mesh = (f", mesh {m['shape']} layout {m['layout']} pick {row['pick_mesh']}" if "pick_mesh" in row else "")
    mesh += f", mesh error: {m['error']}" if "error" in m else ""
    parts = [f"{head} {row['layout']}: single {_ms(row['single_s'])} ms, pick {row['pick']}, "
             f"plan min {row['plan_min_bytes'] / 2**20:.1f} MiB{mesh}"]
    for s, m in row["strategies"].items():
        if "error" in m:
            parts.append(f"  {s:16s} {m['error']}")
            continue
        parts.append(f"  {s:16s} {_ms(m['max_s'])} ms  eff {m.get('efficiency', float('nan')):.3f}  "
                     f"{m['tflops_per_gpu']:.0f} TF/GPU  peak {m['peak_bytes'] / 2**30:.2f} GiB  "
                     f"sent {m['bytes_sent'] / 2**20:.1f} MiB  pred {_pct(m.get('prediction_error'))}"
                     + (f"  emul {m['emulated_error']:+.0%}" if "emulated_error" in m else "")
                     + (f"  check {m['check_error']:.1e}" if "check_error" in m else ""))
    for b, m in row.get("context_parallel", {}).items():
        parts.append(f"  torch_cp/{b} " + (m["error"] if "error" in m else
                                           f"{_ms(m['max_s'])} ms  peak {m['peak_bytes'] / 2**30:.2f} GiB"))
    return "\n".join(parts)


def _join_emulated(rows, path):
    """Add each strategy's emulated-link (NVLink-class) time and the real time's error against it."""
    emulated = json.loads(Path(path).read_text())["rows"]
    for row in rows:
        for e in emulated:
            if (e["seq"], e["world"], e["documents"]) != (row.get("seq"), row.get("world"), row.get("documents")):
                continue
            if not row.get("causal"):
                continue
            for s, m in row.get("strategies", {}).items():
                em = e["links"].get("nvlink", {}).get(s)
                if em and "max_s" in m:
                    m["emulated_s"] = em["max_s"]
                    m["emulated_error"] = em["max_s"] / m["max_s"] - 1


def check_failures(rows, tol: float = CHECK_TOL) -> list[str]:
    """The strategy rows whose check exceeded ``tol``."""
    return [f"S={r['seq']} {r['documents']} {'causal' if r['causal'] else 'full'} {s}: {m['check_error']:.2e}"
            for r in rows for s, m in r.get("strategies", {}).items() if m.get("check_error", 0.0) > tol]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--seqs", default="8k,16k,32k,64k", help="total tokens of the dense rows")
    p.add_argument("--packed-seq", default="128k", help="total tokens of the packed rows")
    p.add_argument("--docs", default="one,lognormal,pareto", help=f"mixes ({', '.join(bs.MIXES)}); one: dense")
    p.add_argument("--full", action="store_true", help="dense rows also without the causal mask")
    p.add_argument("--layout", default="auto", help="layout of the packed rows")
    p.add_argument("--strategies", default=",".join(STRATEGIES))
    p.add_argument("--mesh", default=None,
                   help="RxU: also the hybrids over a 2-D mesh of R rings x U-way Ulysses (R * U = --world)")
    p.add_argument("--mesh-strategies", default=",".join(MESH_STRATEGIES),
                   help="strategies run over --mesh (auto: its row is auto_mesh)")
    p.add_argument("--heads", default="32/8")
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--budget", type=float, default=None,
                   help="seconds: the rows that would start later are skipped (recorded as skipped)")
    p.add_argument("--no-context-parallel", action="store_true")
    p.add_argument("--no-check", action="store_true", help="CPU: skip the check against the float64 reference")
    p.add_argument("--check", action="store_true",
                   help=f"GPU: check too (bf16 within {CHECK_TOL_GPU:g}; the float64 reference of the whole "
                        f"sequence on the GPU: short rows only)")
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--emulated", default=None, help="scripts/bench_emulated.py JSON(s) of the same rows, comma-separated")
    p.add_argument("--from-json", default=None, help="join --emulated into this earlier run's JSON (nothing runs)")
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    if a.from_json:
        report = json.loads(Path(a.from_json).read_text())
        for path in a.emulated.split(","):
            _join_emulated(report["rows"], path)
        print("\n".join(map(_line, report["rows"])))
        U.write_json(Path(a.out or a.from_json), report)
        return
    heads, kv_heads = map(int, a.heads.split("/"))
    strategies, mesh_strategies = U.parse_list(a.strategies), U.parse_list(a.mesh_strategies)
    for s in strategies:
        if s not in STRATEGIES:
            p.error(f"--strategies: unknown strategy {s!r}; one of {', '.join(STRATEGIES)}")
    for s in mesh_strategies:
        if s not in MESH_STRATEGIES:
            p.error(f"--mesh-strategies: unknown strategy {s!r}; one of {', '.join(MESH_STRATEGIES)}")
    cases = []
    for mix in a.docs.split(","):
        if mix == "one":
            for seq in a.seqs.split(","):
                cases += [(U.parse_count(seq), "one", True)] + ([(U.parse_count(seq), "one", False)] if a.full else [])
        elif mix in bs.MIXES:
            cases.append((U.parse_count(a.packed_seq), mix, True))
        else:
            p.error(f"--docs: unknown mix {mix!r}; one of {', '.join(bs.MIXES)}")
    try:
        mesh = parse_mesh(a.mesh, a.world, heads)
        check_lengths(cases, a.world, a.layout)
    except ValueError as exc:
        p.error(str(exc))
    if a.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device here (use --device cpu for the gloo smoke run)")
    if a.device == "cuda" and torch.cuda.device_count() < a.world:
        p.error(f"--world {a.world}: only {torch.cuda.device_count()} CUDA devices here")
    report = {"command": U.command_line(), "commit": U.git_commit(), "world": a.world, "mesh": a.mesh}
    cfg = {"cases": cases, "heads": heads, "kv_heads": kv_heads, "head_dim": a.head_dim, "iters": a.iters,
           "warmup": a.warmup, "strategies": strategies, "layout": a.layout, "mesh": mesh,
           "mesh_strategies": mesh_strategies if mesh else [], "budget": a.budget,
           "context_parallel": not a.no_context_parallel, "check": (a.device == "cpu" and not a.no_check) or a.check,
           "backend_dist": "nccl" if a.device == "cuda" else "gloo", "out": a.out, "report": report}
    results = U.launch(run_rank, a.world, cfg, backend=cfg["backend_dist"], timeout=900)
    if not results:
        return
    rows = results[0]
    if a.emulated:
        for path in a.emulated.split(","):
            _join_emulated(rows, path)
        print("with the emulated times:\n" + "\n".join(map(_line, rows)))
    report.update(rows=rows, device=torch.cuda.get_device_name() if a.device == "cuda" else "cpu")
    if a.out:
        U.write_json(Path(a.out), report)
    tol = CHECK_TOL if a.device == "cpu" else CHECK_TOL_GPU
    failed = check_failures(rows, tol)
    if failed:
        raise SystemExit(f"check against the float64 reference above {tol:g}:\n  " + "\n  ".join(failed))


if __name__ == "__main__":
    main()
