"""Context-parallel linear attention, simulated ranks on one GPU: each rank's real kernel and summary work.

For every (kind, layout, tokens per GPU n, ring size W) the script builds the sharded sequence of S = n * W
tokens and runs, for every rank r in turn, exactly what rank r computes in
``distcomm_attention.linear`` (its runs' kernel calls, the fold over all runs' maps, the correction), with
the all-gather replaced by this rank's own maps repeated W times (communication is not run; the bytes it
would move are reported from the plan). The per-rank time is compared with one fla call over the whole
sequence (``--full-limit`` caps its length; beyond it W x one call over n tokens stands in, marked "x").

    efficiency = t(one fla call over S tokens) / (W * max over ranks of t(rank))

Shapes: the gated delta rule with Qwen3.5's GDN heads (16 key heads, 32 value heads, 128 dims) and the scalar
decay with Mamba-2 2.7B's SSD (80 heads of 64, state 128, one group), bf16, batch 1; ``--doc-len`` packs
documents of log-normal lengths (the balanced layout needs them).

Examples:
    python scripts/bench_linear.py --dry-run                     # CPU: arguments, plans, bytes, one tiny step
    python scripts/bench_linear.py --tokens 16k,32k,64k --worlds 4,8,16 --layouts contiguous,zigzag \
        --json bench_linear.json
    python scripts/bench_linear.py --tokens 16k --worlds 8 --doc-len 4096 --layouts contiguous,zigzag,balanced

Bytes per rank per layer: the maps it sends in the forward all-gather (slots x heads x K x (K + V) float32
numbers to W - 1 ranks; the backward's reduce-scatter moves the same), beside what all-gathering the
sequence's q, k, v and gates in bf16 would send.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import _bench_util as U  # noqa: E402
from distcomm_attention.linear import _checks, kernels  # noqa: E402
from distcomm_attention.linear.recurrence import _Call  # noqa: E402
from distcomm_attention.planning import balance  # noqa: E402

SHAPES = {  # kind -> (key heads, value heads, K, V)
    "gdn": (16, 32, 128, 128),
    "ssd": (1, 80, 128, 64),
}
DRY_SHAPES = {"gdn": (2, 4, 16, 16), "ssd": (1, 4, 16, 8)}  # --dry-run's float64 step on CPU


def parse_count(text: str) -> int:
    text = text.strip().lower()
    scale = {"k": 1024, "m": 1024 * 1024}.get(text[-1:], 1)
    return int(float(text[:-1] if scale > 1 else text) * scale)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--kinds", default="gdn,ssd", help="gdn (gated delta rule), ssd (scalar decay)")
    p.add_argument("--layouts", default="contiguous,zigzag", help="contiguous, zigzag, striped, balanced")
    p.add_argument("--tokens", default="16k,32k,64k", help="tokens per GPU (n)")
    p.add_argument("--worlds", default="4,8,16", help="ring sizes W")
    p.add_argument("--doc-len", type=int, default=0, help="mean document length (log-normal); 0: one sequence")
    p.add_argument("--backward", action="store_true", help="time forward + backward (default: forward)")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--full-limit", type=parse_count, default=parse_count("512k"),
                   help="longest whole-sequence fla call to time (beyond: W x one call over n tokens)")
    p.add_argument("--json", type=Path, default=None, help="write the results here")
    p.add_argument("--dry-run", action="store_true",
                   help="CPU, no fla: check the arguments, plans and bytes, run one tiny step per simulated rank")
    p.add_argument("--profile", action="store_true",
                   help="GPU: per kernel, the CUDA time of the busiest rank's step and of one call over n tokens; "
                        "the step's host time (profile_rank_host_ms); both as the GPU ran them, the host ahead "
                        "(profile_*_timeline: every kernel in start order, the span and its idle time)")
    p.add_argument("--gpu-time", action="store_true",
                   help="GPU: also each time with the host kept ahead (a GPU sleep queued before each call): the "
                        "kernels' time without the GPU waiting for Python, as inside a model whose earlier layers "
                        "keep the GPU busy (rank_gpu_ms, efficiency_gpu)")
    p.add_argument("--check", action="store_true",
                   help="GPU: fla's split (simulated ranks, maps gathered) vs a float64 reference, fwd and bwd")
    args = p.parse_args(argv)
    args.kinds = [x for x in args.kinds.split(",") if x]
    args.layouts = [x for x in args.layouts.split(",") if x]
    args.tokens = [parse_count(x) for x in args.tokens.split(",") if x]
    args.worlds = [int(x) for x in args.worlds.split(",") if x]
    for kind in args.kinds:
        if kind not in SHAPES:
            p.error(f"unknown kind {kind!r}; allowed: {', '.join(SHAPES)}")
    if "balanced" in args.layouts and not args.doc_len:
        p.error("layout 'balanced' places documents: pass --doc-len")
    return args


def documents(seq_len: int, mean: int, seed: int = 0) -> tuple[int, ...] | None:
    """Log-normal document lengths (sigma 1) with the given mean, packed to ``seq_len``."""
    if not mean:
        return None
    gen = torch.Generator().manual_seed(seed)
    bounds, pos = [0], 0
    while pos < seq_len:
        length = max(1, int(math.exp(math.log(mean) - 0.5 + torch.randn((), generator=gen).item())))
        pos = min(seq_len, pos + length)
        bounds.append(pos)
    return tuple(bounds)


def plan_of(layout: str, n: int, world: int, docs):
    concrete = balance.resolve(layout, n * world, world, docs)
    return _checks.cached_plan(concrete, n * world, world, docs, False)


def bytes_per_rank(kind: str, plan, n: int, world: int) -> tuple[int, int]:
    """(maps sent by the busiest rank forward, all-gathering its q, k, v and gates in bf16 instead)."""
    h, hv, dk, dv = SHAPES[kind]
    per_map = hv * dk * (dk + dv) if kind == "gdn" else hv * (dk * dv + 1)
    maps = plan.slots * per_map * 4 * (world - 1)
    gates = 2 if kind == "gdn" else 1
    sequence = n * (2 * h * dk + hv * dv + gates * hv) * 2 * (world - 1)
    return maps, sequence


def inputs(kind: str, tokens: int, device, dtype, seed: int = 0, shape=None):
    h, hv, dk, dv = shape or SHAPES[kind]
    gen = torch.Generator(device=device).manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen, device=device, dtype=dtype)  # noqa: E731
    q = r(1, tokens, h, dk)
    k = torch.nn.functional.normalize(r(1, tokens, h, dk).float(), dim=-1).to(dtype)
    v = r(1, tokens, hv, dv)
    gate_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    g = torch.nn.functional.logsigmoid(r(1, tokens, hv).to(gate_dtype)) * 0.1
    beta = torch.rand(1, tokens, hv, generator=gen, device=device).to(dtype) if kind == "gdn" else None
    return [t.requires_grad_() if t is not None else None for t in (q, k, v, g, beta)]


def rank_step(kind, plan, rank, world, tensors, run, backward: bool):
    """Rank ``rank``'s computation, the all-gather replaced by its own maps repeated ``world`` times: a rank's
    work, not the sequence's values (``split_check`` checks those)."""
    comm = SimpleNamespace(size=world, rank=rank, group=None)
    q, k, v, g, beta = tensors
    gather = lambda table: table.unsqueeze(0).expand(world, *table.shape)  # noqa: E731
    call = _Call(plan, comm, run, SHAPES[kind][2] ** -0.5, q, k, v, g, beta, None, gather=gather)
    out, _ = call.forward(False)
    if backward:
        out.float().sum().backward()
    return out


def full_call(kind, tensors, run, backward: bool):
    q, k, v, g, beta = tensors
    out, _ = run(q, k, v, g, beta, scale=SHAPES[kind][2] ** -0.5)
    if backward:
        out.float().sum().backward()
    return out


def timed(fn, iters: int, warmup: int, device, ahead_ms: float = 0.0) -> float:
    """Median milliseconds per call (CUDA events on GPU, wall clock on CPU). ``ahead_ms`` > 0 (CUDA): a GPU sleep
    that long is queued before each call and the events bracket the call alone, so the host has queued the
    call's kernels before the GPU reaches them: their time without host gaps (unless the call synchronises)."""
    for _ in range(warmup):
        fn()
    if device.type == "cuda":
        return 1e3 * U.gpu_seconds(fn, iters, 1e-3 * ahead_ms)
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return sorted(times)[len(times) // 2]


def kernel_times(fn, top: int = 14) -> list[tuple[str, float]]:
    """(kernel name, CUDA milliseconds) of one call of ``fn``, the largest first (torch.profiler)."""
    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    totals: dict[str, float] = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            totals[e.name[:70]] = totals.get(e.name[:70], 0.0) + e.time_range.elapsed_us() / 1e3
    ranked = sorted(totals.items(), key=lambda kv: -kv[1])
    return [(name, round(ms, 4)) for name, ms in ranked[:top]] + [("total", round(sum(totals.values()), 4))]


def timeline(fn, ahead_ms: float) -> dict:
    """One call of ``fn`` behind a GPU sleep of ``ahead_ms`` (the host ahead), as the GPU ran it: every kernel
    and copy in start order (ms from the first, ms long, stream), and the time no stream was busy inside the
    call's span (gaps: waits for the host, or for a synchronising call), from torch.profiler's device events."""
    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        U.gpu_sleep(torch.device("cuda"), 1e-3 * ahead_ms)
        fn()
        torch.cuda.synchronize()
    events = sorted((e.start_ns(), e.duration_ns(), e.device_resource_id(), e.name())
                    for e in prof.profiler.kineto_results.events()
                    if e.device_type() == torch.autograd.DeviceType.CUDA and "sleep" not in e.name()
                    and e.duration_ns() > 0)
    if not events:
        return {}
    t0 = events[0][0]
    end, idle = t0, 0.0
    for start, dur, _, _ in events:
        if start > end:
            idle += start - end
        end = max(end, start + dur)
    rows = [(round((s - t0) / 1e6, 4), round(d / 1e6, 4), stream, name[:60]) for s, d, stream, name in events]
    return {"span_ms": round((end - t0) / 1e6, 4), "idle_ms": round(idle / 1e6, 4),
            "kernels_ms": round(sum(d for _, d, _, _ in events) / 1e6, 4), "events": rows}


def host_top(fn, iters: int, device, top: int = 30) -> dict[str, list[tuple[str, float, float, int]]]:
    """cProfile of ``iters`` calls of ``fn``: (function, own ms per call, cumulative ms per call, calls per
    call), the largest own and the largest cumulative times: where a host-bound rank's Python goes."""
    import cProfile
    import pstats

    fn()
    U.synchronize(device)
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(iters):
        fn()
    prof.disable()
    U.synchronize(device)
    stats = pstats.Stats(prof).stats
    rows = [(f"{path.rsplit('/', 2)[-1] if '/' in path else path}:{line}:{name}", tt, ct, nc)
            for (path, line, name), (_, nc, tt, ct, _) in stats.items()]
    def ranked(column):
        return [(name, round(1e3 * tt / iters, 4), round(1e3 * ct / iters, 4), nc // iters)
                for name, tt, ct, nc in sorted(rows, key=lambda r: -r[column])[:top]]
    return {"own": ranked(1), "cumulative": ranked(2)}


def shard_of(tensors, plan, rank):
    index = torch.cat([torch.arange(r.start, r.start + r.length) for r in plan.runs[rank]])
    return [None if t is None else t.detach().index_select(1, index.to(t.device)).requires_grad_() for t in tensors]


def run_case(args, kind, layout, n, world, device, dtype, run) -> dict:
    docs = documents(n * world, args.doc_len)
    plan = plan_of(layout, n, world, docs)
    maps, sequence = bytes_per_rank(kind, plan, n, world)
    row = dict(kind=kind, layout=layout, tokens_per_gpu=n, world=world, docs=0 if docs is None else len(docs) - 1,
               slots=plan.slots, bytes_maps=maps, bytes_allgather_sequence=sequence)
    if args.dry_run:
        return row
    full = inputs(kind, n * world, device, dtype)
    rank_ms = []
    for rank in range(world):
        local = shard_of(full, plan, rank)
        rank_ms.append(timed(lambda: rank_step(kind, plan, rank, world, local, run, args.backward),
                             args.iters, args.warmup, device))
    part = inputs(kind, n, device, dtype)
    local = timed(lambda: full_call(kind, part, run, args.backward), args.iters, args.warmup, device)
    if n * world <= args.full_limit:
        base = timed(lambda: full_call(kind, full, run, args.backward), args.iters, args.warmup, device)
        row["baseline"] = "one call over S"
    else:
        base = world * local
        row["baseline"] = "x: W x one call over n"
    # local_call_ms: one kernel call over a rank's n tokens without context parallelism (what a rank's time
    # is compared with to see the cost of the summaries and corrections apart from the kernel's own scaling)
    row.update(rank_ms=rank_ms, max_rank_ms=max(rank_ms), baseline_ms=base, local_call_ms=local,
               efficiency=base / (world * max(rank_ms)))
    if args.gpu_time:  # the host kept ahead by twice each call's wall time
        rank_gpu = []
        for rank in range(world):
            local_tensors = shard_of(full, plan, rank)
            rank_gpu.append(timed(lambda: rank_step(kind, plan, rank, world, local_tensors, run, args.backward),
                                  args.iters, 1, device, ahead_ms=2 * rank_ms[rank] + 1))
        local_gpu = timed(lambda: full_call(kind, part, run, args.backward), args.iters, 1, device,
                          ahead_ms=2 * local + 1)
        base_gpu = timed(lambda: full_call(kind, full, run, args.backward), args.iters, 1, device,
                         ahead_ms=2 * base + 1) if n * world <= args.full_limit else world * local_gpu
        row.update(rank_gpu_ms=rank_gpu, baseline_gpu_ms=base_gpu, local_call_gpu_ms=local_gpu,
                   efficiency_gpu=base_gpu / (world * max(rank_gpu)))
    if args.profile:
        busiest = max(range(world), key=rank_ms.__getitem__)
        local_tensors = shard_of(full, plan, busiest)
        row["profile_rank"] = busiest
        step = lambda: rank_step(kind, plan, busiest, world, local_tensors, run, args.backward)  # noqa: E731
        row["profile_rank_kernels"] = kernel_times(step)
        row["profile_rank_host_ms"] = 1e3 * U.host_seconds(step, 1e-3 * rank_ms[busiest], args.iters, device)
        row["profile_rank_host_top"] = host_top(step, args.iters, device)
        row["profile_local_call_kernels"] = kernel_times(lambda: full_call(kind, part, run, args.backward))
        row["profile_rank_timeline"] = timeline(step, 2 * rank_ms[busiest] + 1)
        row["profile_local_call_timeline"] = timeline(lambda: full_call(kind, part, run, args.backward), 2 * local + 1)
    del full
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return row


def split_check(kind: str, layout: str, world: int, doc_len: int, run, device, dtype, *, n: int = 16,
                shape=None, backward: bool = True) -> dict:
    """Every simulated rank of a ring of ``world`` with ``run`` as its kernel, the ranks' maps gathered for real,
    forward and backward, against the float64 PyTorch kernel over the whole sequence (and, for another
    kernel, that kernel over the whole sequence beside it): the largest differences of outputs and of the
    gradients of q, k, v, g (and beta), each relative to the reference's largest magnitude; ``backward``
    False: the outputs alone."""
    shape = shape or DRY_SHAPES[kind]
    docs = documents(n * world, doc_len and max(2, n // 3), seed=1)
    plan = plan_of(layout, n, world, docs)
    full = [t.detach().requires_grad_() if t is not None else None
            for t in inputs(kind, n * world, device, torch.float64, shape=shape)]
    scale = shape[2] ** -0.5
    cu = None if docs is None else torch.tensor(docs)
    weight = torch.randn(full[2].shape[:3] + (shape[3],), generator=torch.Generator(device=device).manual_seed(2),
                         device=device, dtype=torch.float64)

    def grads_of(out_full, leaves):
        return torch.autograd.grad((out_full.double() * weight).sum(), [t for t in leaves if t is not None])

    ref, _ = kernels.torch_chunk(*full, scale=scale, cu_seqlens=cu)
    ref_grads = grads_of(ref, full)
    gate_dtype = torch.float64 if dtype == torch.float64 else torch.float32  # fla takes g in float32
    low = [None if t is None else t.detach().to(gate_dtype if i == 3 else dtype).requires_grad_()
           for i, t in enumerate(full)]
    indices = [torch.cat([torch.arange(r.start, r.start + r.length) for r in plan.runs[rank]]).to(device)
               for rank in range(world)]
    shards = [[None if t is None else t.index_select(1, idx) for t in low] for idx in indices]
    # one thread per rank, each rank's call whole (its maps and its outputs from the states they fold to: the
    # delta rule's backward relies on it), the gather a barrier and a stack: its adjoint sums every rank's part.
    # One thread computes at a time (fla's autotuner is not thread-safe): each holds `turn` but at the barrier
    tables, outs, errors = {}, {}, []
    barrier, turn = threading.Barrier(world), threading.Lock()

    def rank_main(rank):
        def gather(table):
            tables[rank] = table
            turn.release()
            try:
                barrier.wait()
            finally:
                turn.acquire()
            return torch.stack([tables[r] for r in range(world)])

        with turn:
            try:
                comm = SimpleNamespace(size=world, rank=rank, group=None)
                outs[rank] = _Call(plan, comm, run, scale, *shards[rank], None, gather=gather).forward(False)[0]
            except BaseException as e:  # noqa: BLE001 (re-raised below)
                errors.append(e)
                barrier.abort()

    threads = [threading.Thread(target=rank_main, args=(rank,)) for rank in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    out_full = torch.zeros_like(ref)
    for rank in range(world):
        out_full = out_full.index_copy(1, indices[rank], outs[rank].double())
    def rel(a, b):
        a, b = a.detach().double(), b.detach()
        return float((a - b).abs().max() / b.abs().max().clamp(min=1e-30))

    names = ["q", "k", "v", "g", "beta"][: 5 if kind == "gdn" else 4]
    result = {"out": rel(out_full, ref)}
    if backward:
        result.update({f"d{name}": rel(g, r) for name, g, r in zip(names, grads_of(out_full, low), ref_grads)})
    if run is not kernels.torch_chunk:  # the same kernel over the whole sequence, for scale
        whole = [None if t is None else t.detach().requires_grad_() for t in low]
        o, _ = run(*whole, scale=scale, cu_seqlens=None if cu is None else cu.to(device))
        result["whole_out"] = rel(o, ref)
        if backward:
            result.update({f"whole_d{name}": rel(g, r) for name, g, r in zip(names, grads_of(o, whole), ref_grads)})
    return result


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.dry_run:
        device, dtype, run = torch.device("cpu"), torch.float64, kernels.torch_chunk
    else:
        if not kernels.fla_available():
            sys.exit("bench_linear.py needs flash-linear-attention: pip install fla-core "
                     "(use --dry-run to check the setup without it)")
        if not torch.cuda.is_available():
            sys.exit("bench_linear.py needs a CUDA GPU (use --dry-run to check the setup on CPU)")
        device, dtype, run = torch.device("cuda"), torch.bfloat16, kernels.fla_chunk
    if args.check:
        rows = []
        for kind in args.kinds:
            for layout in args.layouts:
                for world in args.worlds:
                    for n in args.tokens:  # each row printed as it ends (fla compiles and tunes on first use)
                        problem = kernels.fla_backward_problem(device, delta=kind == "gdn")
                        rows.append(dict(kind=kind, layout=layout, world=world, tokens_per_gpu=n, **split_check(
                            kind, layout, world, args.doc_len, run, device, dtype, n=n, shape=SHAPES[kind],
                            backward=problem is None)))
                        if problem is not None:
                            rows[-1]["backward_not_run"] = problem
                        print(json.dumps(rows[-1]), flush=True)
        if args.json is not None:
            args.json.write_text(json.dumps({"command": " ".join(sys.argv), "rows": rows}, indent=1))
        return 0
    rows = []
    for kind in args.kinds:
        for layout in args.layouts:
            for n in args.tokens:
                for world in args.worlds:
                    try:
                        row = run_case(args, kind, layout, n, world, device, dtype, run)
                    except torch.OutOfMemoryError as e:  # a row too large for this GPU (e.g. the baseline)
                        row = dict(kind=kind, layout=layout, tokens_per_gpu=n, world=world,
                                   error=f"out of memory: {str(e).splitlines()[0]}")
                        torch.cuda.empty_cache()
                    if args.dry_run:
                        errors = split_check(kind, layout, min(world, 4), args.doc_len, run, device, dtype)
                        row["dry_step_max_error"] = max(errors.values())
                    rows.append(row)
                    print(json.dumps(row), flush=True)
                    if args.json is not None:  # each row as it ends: a later failure keeps the earlier ones
                        args.json.write_text(json.dumps({"command": " ".join(sys.argv), "rows": rows}, indent=1))
    if args.dry_run:
        bad = [r for r in rows if r["dry_step_max_error"] > 1e-9]
        if bad:
            print(f"simulated ranks disagree with one call over the sequence: {bad}", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
