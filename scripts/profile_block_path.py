"""Where one simulated rank's fwd+bwd goes on a packed mix: host, kernels, and everything around them.

For each strategy, one simulated rank (the busiest by plan; Ulysses: rank 0) runs its whole forward +
backward with an ideal emulated link (no wait: compute and copies only), as in scripts/bench_emulated.py.
Reported per strategy:

- ``gpu_s``: the step's time on the GPU (CUDA events, median of ``--iters`` back-to-back calls);
- ``host_s``: the host's wall time per step when it never waits for the GPU (``torch.cuda._sleep`` queued
  ahead of each step; NaN if a step waited for it anyway): host-bound where host_s >= gpu_s;
- ``kernels``: the CUDA kernels of a few profiled steps (torch.profiler), summed by name per step, split
  into attention kernels (flash-attn-4 / cuDNN / Triton attention) and the rest (copies, index, merge);
- Ulysses only, ``raw_s``: one flash-attn-4 varlen fwd+bwd over the whole pack with H/W query heads and
  Hkv/W kv heads — the same shapes Ulysses' rank computes, without the library around it;
- ``cprofile``: the top host functions of a few steps by cumulative time;
- ``sites`` (``--by-site``): the kernels' time by the library line whose PyTorch operation launched them.

    python scripts/profile_block_path.py --seq 131072 --world 8 --docs lognormal --out prof.json
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import _bench_util as U  # noqa: E402
import bench_emulated as be  # noqa: E402
import bench_strategies as bs  # noqa: E402

from distcomm_attention.kernels import dispatch  # noqa: E402
from distcomm_attention.planning.exchange import sparse_ring  # noqa: E402
from distcomm_attention.planning.visibility import Visibility, ring_plan  # noqa: E402
from distcomm_attention.transport.emulated import EmulatedLink  # noqa: E402

_ATTENTION = ("flash", "fmha", "cudnn", "cutlass", "_attn", "attention", "sm90", "sm100")


def _kernel_table(step, calls: int) -> dict:
    """CUDA kernel time per step by kernel name (torch.profiler), attention kernels apart from the rest."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            step()
        torch.cuda.synchronize()
    by_name: dict[str, list[float]] = {}
    for ev in prof.events():
        if ev.device_type.name != "CUDA":
            continue
        t = by_name.setdefault(ev.name, [0.0, 0])
        t[0] += ev.device_time_total / 1e6 / calls
        t[1] += 1 / calls
    attn = sum(t for name, (t, _) in by_name.items() if any(a in name.lower() for a in _ATTENTION))
    total = sum(t for t, _ in by_name.values())
    top = sorted(by_name.items(), key=lambda kv: -kv[1][0])[:20]
    return {"attention_s": attn, "all_kernels_s": total, "launches": sum(n for _, n in by_name.values()),
            "top": [{"name": name[:120], "s": t, "launches": n} for name, (t, n) in top]}


def _site_of(stack) -> str:
    """The innermost frame of the library (else of a script) in a profiler stack, as "path:line function"."""
    for frame in stack:
        for root in ("distcomm_attention/", "distcomm/", "scripts/"):
            if root in frame:
                return root + frame.split(root, 1)[1]
    return "(no library frame)"


def _site_table(step, calls: int, top: int = 25) -> list[dict]:
    """CUDA kernel time per step by the library line whose PyTorch operation launched it (torch.profiler with
    Python stacks): each row a (site, operation) with its kernels' seconds and launches per step. Kernels that
    no PyTorch operation launched (Triton's, flash-attn-4's, the emulated link's copies) are listed by kernel
    name under "(not a PyTorch operation)"."""
    from torch._C._profiler import _ExperimentalConfig
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], with_stack=True,
                 experimental_config=_ExperimentalConfig(verbose=True)) as prof:
        for _ in range(calls):
            step()
        torch.cuda.synchronize()
    rows: dict[tuple[str, str], list[float]] = {}
    by_kernel: dict[str, float] = {}
    for ev in prof.events():
        if ev.device_type.name == "CUDA":
            by_kernel[ev.name] = by_kernel.get(ev.name, 0.0) + ev.device_time_total / 1e6 / calls
        elif ev.kernels:
            t = rows.setdefault((_site_of(ev.stack), ev.name), [0.0, 0])
            for kernel in ev.kernels:
                t[0] += kernel.duration / 1e6 / calls
                t[1] += 1 / calls
                by_kernel[kernel.name] = by_kernel.get(kernel.name, 0.0) - kernel.duration / 1e6 / calls
    for name, t in by_kernel.items():
        if t > 1e-7 and not any(a in name.lower() for a in _ATTENTION):
            rows[("(not a PyTorch operation)", name[:100])] = [t, 0]
    ordered = sorted(rows.items(), key=lambda kv: -kv[1][0])[:top]
    return [{"site": site, "op": op, "s": t, "launches": n} for (site, op), (t, n) in ordered]


def cprofile_text(step, calls: int, top: int, sort: str = "cumulative", dump: str | None = None) -> str:
    """cProfile of ``calls`` calls of ``step`` (the GPU drained before and after): the ``top`` functions by
    ``sort`` ("cumulative" or "tottime", own time); with ``dump``, the statistics also written to that file."""
    torch.cuda.synchronize()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        step()
    torch.cuda.synchronize()
    prof.disable()
    if dump is not None:
        prof.dump_stats(dump)
    s = io.StringIO()
    pstats.Stats(prof, stream=s).sort_stats(sort).print_stats(top)
    return s.getvalue()


def _raw_ulysses(seq, heads, kv_heads, world, d, docs, iters, warmup) -> float:
    g = torch.Generator(device="cuda").manual_seed(1)
    rnd = lambda *shape: torch.randn(*shape, device="cuda", dtype=torch.bfloat16, generator=g)  # noqa: E731
    return bs._timed(bs._fa4_single(rnd(1, seq, heads // world, d), rnd(1, seq, max(1, kv_heads // world), d),
                                    rnd(1, seq, max(1, kv_heads // world), d), True, docs), iters, warmup)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=131072)
    parser.add_argument("--world", type=int, default=8)
    parser.add_argument("--docs", default="lognormal", help=f"one of {', '.join(bs.MIXES)}")
    parser.add_argument("--layout", default="auto")
    parser.add_argument("--strategies", default="ring,allgather,ulysses")
    parser.add_argument("--heads", default="32/8")
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--iters", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--profile-calls", type=int, default=3)
    parser.add_argument("--top", type=int, default=30, help="host functions listed per strategy")
    parser.add_argument("--backend", default="fa4", help="the strategies' block kernels (the baselines are "
                                                            "flash-attn-4 calls whatever this says)")
    parser.add_argument("--sync-debug", action="store_true",
                        help="run one step per strategy under torch.cuda.set_sync_debug_mode('error') and print "
                             "where it synchronises with the host (nothing else is measured)")
    parser.add_argument("--by-site", action="store_true",
                        help="also the kernels' time by the library line that launched them (slower profile)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    heads, kv_heads = (int(x) for x in args.heads.split("/"))
    seq, world, d = args.seq, args.world, args.head_dim
    dev, dt, scale = torch.device("cuda"), torch.bfloat16, args.head_dim ** -0.5
    docs = None if args.docs == "one" else bs.documents(args.docs, seq)
    vis = Visibility(True, cu_seqlens=None if docs is None else tuple(docs))
    n = seq // world
    concrete = bs.plan_layout(args.layout, seq, world, docs, True)["concrete"]
    g = torch.Generator(device=dev).manual_seed(0)
    rnd = lambda *shape: torch.randn(*shape, device=dev, dtype=dt, generator=g)  # noqa: E731
    _, fwd, bwd = dispatch.select_kernels(args.backend, rnd(1, 128, heads, d), vis, 0.0)
    q, k, v, dout = rnd(1, n, heads, d), rnd(1, n, kv_heads, d), rnd(1, n, kv_heads, d), rnd(1, n, heads, d)
    single = bs._timed(bs._fa4_single(rnd(1, seq, heads, d), rnd(1, seq, kv_heads, d), rnd(1, seq, kv_heads, d),
                                      True, docs), args.iters, args.warmup)
    report = {"seq": seq, "world": world, "heads": heads, "kv_heads": kv_heads, "documents": args.docs,
              "n_documents": None if docs is None else len(docs) - 1, "layout": bs.layout_name(concrete),
              "single_s": single, "device": torch.cuda.get_device_name(), "strategies": {}}
    print(f"single fa4 call {single * 1e3:.2f} ms; W x fa4 share {single / world * 1e3:.2f} ms", flush=True)
    for strategy in args.strategies.split(","):
        if strategy == "ulysses":
            rank = 0
        else:
            work = bs.planned_rank_s(strategy, concrete, vis, world, n, heads, kv_heads, d)
            rank = bs.pick_ranks(work, 1)[-1] if max(work) > work[0] else 0
        t = be._Sent(EmulatedLink(world, rank, be.LINKS["ideal"]))
        sp = sparse_ring(concrete, vis, world, rank, n)
        if strategy == "ring" and sp is not None:
            step = be._sparse_ring_step(t, q, k, v, dout, sp, fwd, bwd, scale)
        elif strategy == "ring":
            step = be._ring_step(t, q, k, v, dout, ring_plan(concrete, vis, world, rank, n), fwd, bwd, scale)
        elif strategy == "allgather":
            step, _ = be._allgather_step(t, q, k, v, dout, concrete, vis, world, rank, fwd, bwd, scale)
        else:
            step = be._ulysses_step(t, q, k, v, dout, concrete, vis, world, fwd, bwd, scale, pipelined=False)
        if args.sync_debug:
            step()
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error")
            try:
                step()
                print(f"{strategy:10s} rank {rank}: no host synchronisation", flush=True)
            except RuntimeError:
                import traceback

                print(f"{strategy:10s} rank {rank}: synchronises:\n{traceback.format_exc()}", flush=True)
            finally:
                torch.cuda.set_sync_debug_mode(0)
                torch.cuda.synchronize()
            continue
        gpu = bs._timed(step, args.iters, args.warmup)
        host = U.host_seconds(step, 0.05, args.iters, torch.device("cuda"))  # behind ~100 ms of GPU sleep
        kernels = _kernel_table(step, args.profile_calls)
        row = {"rank": rank, "gpu_s": gpu, "host_s": host, "efficiency": single / (world * gpu),
               "kernels": kernels, "cprofile": cprofile_text(step, args.profile_calls, args.top)}
        if args.by_site:
            row["sites"] = _site_table(step, args.profile_calls)
            for site in row["sites"]:
                print(f"    {site['s'] * 1e3:7.3f} ms  x{site['launches']:<5.1f} {site['op']:28s} {site['site']}")
        if strategy == "ulysses":
            row["raw_s"] = _raw_ulysses(seq, heads, kv_heads, world, d, docs, args.iters, args.warmup)
        report["strategies"][strategy] = row
        print(f"{strategy:10s} rank {rank}: gpu {gpu * 1e3:7.2f} ms  host {host * 1e3:7.2f} ms  "
              f"attention kernels {kernels['attention_s'] * 1e3:7.2f} ms  all kernels "
              f"{kernels['all_kernels_s'] * 1e3:7.2f} ms ({kernels['launches']:.0f} launches)"
              + (f"  raw varlen {row['raw_s'] * 1e3:.2f} ms" if "raw_s" in row else ""), flush=True)
        for kr in kernels["top"][:12]:
            print(f"    {kr['s'] * 1e3:7.3f} ms  x{kr['launches']:<5.0f} {kr['name']}")
        print(row["cprofile"][:6000], flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
