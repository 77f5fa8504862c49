"""Where the time of one ring-attention forward+backward goes, from a torch.profiler trace of each rank.

    PYTHONPATH=. python scripts/profile_ring_attention.py                  # 2 local ranks, NCCL, S = 8k
    PYTHONPATH=. python scripts/profile_ring_attention.py --seqs 8k,32k --heads 32/32,32/8
    PYTHONPATH=. python scripts/profile_ring_attention.py --smoke          # CPU / gloo plumbing check

For each case the script profiles a few back-to-back forward+backward iterations of ``ring_flash_attn`` on
every rank, and of single-GPU SDPA flash on the whole sequence, then splits each rank's wall time into:

- ``attention``: the attention kernels (Triton forward, flash backward; for SDPA its own kernels);
- ``other compute``: every other non-NCCL kernel (fp32 accumulation, casts, copies, zero fills);
- ``comm exposed``: time when an NCCL kernel runs and no compute kernel does;
- ``idle``: time when no kernel runs at all (host work: Python, launches, waits).

The ideal per-GPU time is T_sdpa(S) / W. The attention kernels of the ring against the SDPA kernels / W say
how much the block decomposition costs the kernels themselves; the other rows say what the ring adds.
Writes ``ring_profile.json`` and ``ring_profile.md`` to ``--out`` and, with ``--trace``, rank 0's Chrome
trace of the first case (``ring_profile_trace.json.gz``).
"""

from __future__ import annotations

import argparse
import gzip
import json
import shutil
import sys
import tempfile
import warnings
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _bench_util as U  # noqa: E402
from bench_ring_attention import _flash_ctx, _sdpa_call, _sdpa_gqa_mode, attn_flops  # noqa: E402

CATEGORIES = ("attention", "other compute", "comm exposed", "idle")


def _is_attention(name: str) -> bool:
    low = name.lower()
    return any(key in low for key in ("flash", "fmha", "attn", "_fwd_kernel", "_bwd_kernel", "attention"))


def _union_length(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


def _subtract_length(base: list[tuple[float, float]], cover: list[tuple[float, float]]) -> float:
    """Length of union(base) minus union(base) ∩ union(cover)."""
    both = []
    cover = sorted(cover)
    for a, b in base:
        for c, d in cover:
            if d <= a:
                continue
            if c >= b:
                break
            both.append((max(a, c), min(b, d)))
    return _union_length(base) - _union_length(both)


def breakdown(trace: dict) -> dict:
    """Per-iteration split of the steady iterations' GPU time (µs); see the module docstring.

    The window runs from the first kernel of the second profiled iteration to the last kernel of the last
    one (the iterations are marked with ``record_function``), so the profiler's start-up stays out.
    """
    events = trace.get("traceEvents", [])
    spans: dict[int, list[float]] = {}  # iteration -> [first start, last end] over its marks (one per stream)
    for e in events:
        if e.get("cat") == "gpu_user_annotation" and e.get("name", "").startswith("profiled_iter"):
            span = spans.setdefault(int(e["name"][len("profiled_iter"):]), [e["ts"], e["ts"] + e["dur"]])
            span[0], span[1] = min(span[0], e["ts"]), max(span[1], e["ts"] + e["dur"])
    if len(spans) < 2:
        return {"kernels": 0}
    lo, hi = min(a for i, (a, _) in spans.items() if i >= 1), max(b for i, (_, b) in spans.items() if i >= 1)
    iters = len(spans) - 1

    def clip(e):
        return max(e["ts"], lo), min(e["ts"] + e["dur"], hi)

    kernels = [e for e in events if e.get("cat") == "kernel" and e.get("dur", 0) > 0
               and e["ts"] < hi and e["ts"] + e["dur"] > lo]
    is_comm = {id(e): "nccl" in e["name"].lower() for e in kernels}
    comm = [clip(e) for e in kernels if is_comm[id(e)]]
    attn = [clip(e) for e in kernels if not is_comm[id(e)] and _is_attention(e["name"])]
    other = [clip(e) for e in kernels if not is_comm[id(e)] and not _is_attention(e["name"])]
    compute = attn + other
    wall = hi - lo
    by_name: dict[str, list[float]] = {}
    for e in kernels:
        a, b = clip(e)
        by_name.setdefault(e["name"], []).append(b - a)
    top = sorted(((sum(d), len(d), name) for name, d in by_name.items()), reverse=True)[:12]
    res = {
        "wall_us": wall,
        "attention": _union_length(attn),
        "other compute": _union_length(compute) - _union_length(attn),
        "comm exposed": _subtract_length(comm, compute),
        "comm total": _union_length(comm),
        "idle": max(0.0, wall - _union_length(compute + comm)),
    }
    res = {key: value / iters for key, value in res.items()}
    res["top_kernels"] = [{"name": name[:90], "total_us": tot / iters, "count": cnt / iters}
                          for tot, cnt, name in top]
    res["iters"] = iters
    return res


def profile_window(step, *, iters: int, warmup: int, device, trace_path: Path | None = None) -> dict:
    """Profile ``iters`` + 1 calls of ``step`` after ``warmup``; returns the per-iteration breakdown (µs)."""
    from torch.profiler import ProfilerActivity, profile, record_function

    for _ in range(warmup):
        step()
    U.synchronize(device)
    U.all_max([0.0], device)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "trace.json"
        with profile(activities=activities) as prof:
            for i in range(iters + 1):
                with record_function(f"profiled_iter{i}"):
                    step()
            U.synchronize(device)
        prof.export_chrome_trace(str(path))
        trace = json.loads(path.read_text())
        if trace_path is not None:
            with path.open("rb") as src, gzip.open(trace_path, "wb") as dst:
                shutil.copyfileobj(src, dst)
    return breakdown(trace)


def run_rank(rank: int, world: int, cfg: dict) -> dict:
    U.set_safe_env()
    warnings.filterwarnings("ignore")
    from distcomm_attention import ring_flash_attn

    device = U.rank_device(cfg["backend_dist"])
    dtype = getattr(torch, cfg["dtype"])
    out = Path(cfg["out"])
    rows = []
    for s in cfg["seqs"]:
        for h, hkv in cfg["heads"]:
            for causal in cfg["causal"]:
                layout = "zigzag" if causal else "contiguous"
                n, d, b = s // world, cfg["head_dim"], 1
                row = {"S": s, "H": h, "Hkv": hkv, "causal": causal, "layout": layout}
                q, dout = (torch.randn(b, n, h, d, device=device, dtype=dtype) for _ in range(2))
                k, v = (torch.randn(b, n, hkv, d, device=device, dtype=dtype) for _ in range(2))
                for t in (q, k, v):
                    t.requires_grad_()

                def ring_step():
                    o = ring_flash_attn(q, k, v, causal=causal, layout=layout, backend=cfg["backend"])
                    o.backward(dout)
                    q.grad = k.grad = v.grad = None

                trace = out / "ring_profile_trace.json.gz" if cfg["trace"] and rank == 0 and not rows else None
                row["ring"] = profile_window(ring_step, iters=cfg["iters"], warmup=cfg["warmup"], device=device,
                                             trace_path=trace)
                del q, k, v, dout
                U.release_memory(device)
                if device.type == "cuda":
                    qs, douts = (torch.randn(b, h, s, d, device=device, dtype=dtype) for _ in range(2))
                    ks, vs = (torch.randn(b, hkv, s, d, device=device, dtype=dtype) for _ in range(2))
                    for t in (qs, ks, vs):
                        t.requires_grad_()
                    gqa = _sdpa_gqa_mode(h, hkv, d, causal, device, dtype)

                    def sdpa_step():
                        with _flash_ctx():
                            o = _sdpa_call(qs, ks, vs, causal, gqa)
                        o.backward(douts)
                        qs.grad = ks.grad = vs.grad = None

                    row["sdpa"] = profile_window(sdpa_step, iters=cfg["iters"], warmup=cfg["warmup"],
                                                 device=device)
                    del qs, ks, vs, douts
                    U.release_memory(device)
                row["flops_fwdbwd"] = 3.5 * attn_flops(s, h, d, causal)
                (row["ring_wall_max_us"],) = U.all_max([row["ring"].get("wall_us", 0.0)], device)
                rows.append(row)
                if rank == 0:
                    _print_case(row, world)
    return {"rows": rows, "env": U.env_info(cfg["backend_dist"], world), "command": cfg["command"]}


def _k(s: int) -> str:
    return f"{s // 1024}k" if s % 1024 == 0 else str(s)


def _fmt_breakdown(res: dict) -> str:
    return " ".join(f"{k}={res.get(k, 0) / 1e3:.3f}" for k in ("wall_us",) + CATEGORIES)


def _print_case(row: dict, world: int) -> None:
    print(f"\nS={_k(row['S'])} {row['H']}/{row['Hkv']} {'causal' if row['causal'] else 'full'} {row['layout']}",
          flush=True)
    comm_total = row["ring"].get("comm total", 0) / 1e3
    print(f"  ring (ms/iter, rank 0): {_fmt_breakdown(row['ring'])}  comm total={comm_total:.3f}")
    if "sdpa" in row:
        print(f"  sdpa (ms/iter, whole S): {_fmt_breakdown(row['sdpa'])}  -> ideal per GPU "
              f"{row['sdpa'].get('wall_us', 0) / world / 1e3:.3f}")
    for k in row["ring"].get("top_kernels", [])[:8]:
        print(f"    {k['total_us'] / 1e3:8.3f} ms x{k['count']:5.1f}  {k['name']}")


def write_markdown(report: dict, path: Path, world: int) -> None:
    env = report["env"]
    lines = [f"## Ring attention profile (forward+backward, per iteration, rank 0)\n",
             f"Measured {env.get('time_utc', '')} on {world} x {env.get('gpu', env.get('device', '?'))}, "
             f"torch {env.get('torch')}, commit {env.get('git_commit')}, with\n",
             f"```bash\n{report['command']}\n```\n",
             "Times in ms per forward+backward. ideal = SDPA(S) / W; eff = ideal / slowest rank's wall. Categories "
             "as in the script's docstring (kernels from the profiler trace).\n"]
    headers = ["S", "heads", "mask", "layout", "wall", "eff", "ideal", "attention", "SDPA attention / W",
               "other compute", "comm exposed", "comm total", "idle"]
    table = []
    for r in report["rows"]:
        ring, sdpa = r["ring"], r.get("sdpa", {})
        ideal = sdpa.get("wall_us", 0) / world
        table.append([_k(r['S']), f"{r['H']}/{r['Hkv']}", "causal" if r["causal"] else "full", r["layout"],
                      f"{ring.get('wall_us', 0) / 1e3:.3f}",
                      f"{ideal / r['ring_wall_max_us']:.2f}" if ideal and r["ring_wall_max_us"] else "-",
                      f"{ideal / 1e3:.3f}", f"{ring.get('attention', 0) / 1e3:.3f}",
                      f"{sdpa.get('attention', 0) / world / 1e3:.3f}", f"{ring.get('other compute', 0) / 1e3:.3f}",
                      f"{ring.get('comm exposed', 0) / 1e3:.3f}", f"{ring.get('comm total', 0) / 1e3:.3f}",
                      f"{ring.get('idle', 0) / 1e3:.3f}"])
    lines.append(U.markdown_table(headers, table, "rrllrrrrrrrrr"))
    lines.append("\nLargest kernels of the ring (ms per iteration, rank 0):\n")
    for r in report["rows"]:
        lines.append(f"- S={_k(r['S'])} {r['H']}/{r['Hkv']} {'causal' if r['causal'] else 'full'}: "
                     + "; ".join(f"`{k['name'][:60]}` {k['total_us'] / 1e3:.3f} (x{k['count']:.0f})"
                                 for k in r["ring"].get("top_kernels", [])[:5]))
    path.write_text("\n".join(lines) + "\n")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seqs", type=lambda s: U.parse_list(s, U.parse_count), default=[8192])
    p.add_argument("--heads", default="32/32,32/8")
    p.add_argument("--causal", choices=["both", "yes", "no"], default="both")
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--backend", default="auto", help="ring_flash_attn backend")
    p.add_argument("--trace", action="store_true", help="also write rank 0's Chrome trace of the first case")
    p.add_argument("--out", default=None, help="output directory (default docs/bench; with --smoke a new temporary folder)")
    p.add_argument("--nccl-priority", choices=["high", "default"], default="high",
                   help="NCCL stream priority (default high: TORCH_NCCL_HIGH_PRIORITY=1)")
    p.add_argument("--smoke", action="store_true", help="CPU/gloo, tiny shapes, torch backend")
    args = p.parse_args(argv)
    args.out = U.out_dir(args.out, args.smoke)
    U.set_nccl_priority(args.nccl_priority)
    heads = [tuple(int(x) for x in part.split("/")) for part in args.heads.split(",")]
    cfg = dict(seqs=args.seqs, heads=heads, causal={"both": [True, False], "yes": [True], "no": [False]}[args.causal],
               iters=args.iters, warmup=args.warmup, backend=args.backend, trace=args.trace, out=args.out,
               dtype="bfloat16", head_dim=128, command=U.command_line(),
               backend_dist="gloo" if args.smoke or not torch.cuda.is_available() else "nccl")
    if args.smoke:
        cfg.update(seqs=[256], heads=[(4, 2)], dtype="float32", head_dim=32, backend="torch", iters=2, warmup=1)
    Path(cfg["out"]).mkdir(parents=True, exist_ok=True)
    results = U.launch(run_rank, args.world_size, cfg, backend=cfg["backend_dist"], timeout=600)
    if not results:
        return 0
    report = results[0]
    U.write_json(Path(cfg["out"]) / "ring_profile.json", report)
    write_markdown(report, Path(cfg["out"]) / "ring_profile.md", args.world_size)
    print(f"\nwrote {cfg['out']}/ring_profile.json, ring_profile.md", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
