"""Host time of one context_parallel_attn fwd+bwd per strategy on W ranks: where short steps lose time.

Per strategy: the GPU time per call (CUDA events over back-to-back calls), the host time per call (the median
wall time of one call with ``torch.cuda._sleep`` of twice its GPU time queued ahead, so the host does not wait
for the GPU unless the call synchronises: a call that does shows about the sleep's length), and on rank 0 a
cProfile of a few calls (top functions by cumulative time).

    python scripts/profile_host.py --world 2 --seq 8k --strategies ring,ulysses,allgather,auto --out prof.txt
    python scripts/profile_host.py --world 4 --seq 128k --docs lognormal --layout balanced   # a packed mix
"""

from __future__ import annotations

import argparse
import cProfile
import functools
import importlib
import inspect
import io
import pstats
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import _bench_util as U  # noqa: E402
import bench_strategies as bs  # noqa: E402

from distcomm_attention import context_parallel_attn, shard_sequence  # noqa: E402


def resolve_section(spec: str):
    """(the module or class holding it, its name) of a section ``module:Attr.attr``; ValueError naming the spec
    where it is not a callable there."""
    module, sep, path = spec.partition(":")
    try:
        if not sep or not module or not path:
            raise ValueError("not of the form module:Attr.attr")
        *parents, name = path.split(".")
        parent = importlib.import_module(module)
        for p in parents:
            parent = getattr(parent, p)
        if not callable(getattr(parent, name)):
            raise ValueError(f"{name!r} is not callable")
    except (ImportError, AttributeError, ValueError) as e:
        raise ValueError(f"--sections: {spec!r} is not a function or method (module:Attr.attr): {e}") from None
    return parent, name


class _Sections:
    """Inclusive host seconds of named functions (``module:Attr.attr``), counted while ``on``: each replaced
    on its module or class by a timed wrapper (where a module imported a function by name, name that module; a
    function that calls itself is counted at every level)."""

    def __init__(self, specs):
        self.on, self.seconds = False, {spec: 0.0 for spec in specs}
        for spec in specs:
            parent, name = resolve_section(spec)
            raw = inspect.getattr_static(parent, name)
            if isinstance(raw, (staticmethod, classmethod)):  # wrapped inside, the descriptor kept
                setattr(parent, name, type(raw)(self._wrap(spec, raw.__func__)))
            else:
                setattr(parent, name, self._wrap(spec, getattr(parent, name)))

    def _wrap(self, spec, fn):
        def timed(*args, **kwargs):
            if not self.on:
                return fn(*args, **kwargs)
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[spec] += time.perf_counter() - t0

        return functools.wraps(fn)(timed)


def run_rank(rank: int, world: int, cfg: dict) -> dict:
    device = U.rank_device(cfg["backend"])
    dt = torch.bfloat16 if device.type == "cuda" else torch.float32
    heads, kv_heads, d, seq = cfg["heads"], cfg["kv_heads"], cfg["head_dim"], cfg["seq"]
    g = torch.Generator(device=device).manual_seed(0)
    full = [torch.randn(1, seq, h, d, device=device, dtype=dt, generator=g) for h in (heads, kv_heads, kv_heads, heads)]
    layout, docs = cfg["layout"], None if cfg["docs"] == "one" else bs.documents(cfg["docs"], seq)
    q, k, v, dout = (shard_sequence(x, layout, cu_seqlens=docs).contiguous() for x in full)
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    out = {}
    sections = _Sections(cfg["sections"])
    for strategy in cfg["strategies"]:
        def step():
            o = context_parallel_attn(q, k, v, strategy=strategy, causal=True, layout=layout, cu_seqlens=docs)
            o.backward(dout)
            q.grad = k.grad = v.grad = None

        gpu = U.time_loop(step, iters=cfg["iters"], warmup=3, device=device)
        # each call timed alone behind its own GPU sleep (twice the call's GPU time): the host never waits for
        # the GPU unless the call synchronises, and the queue holds one call's launches only (a loop behind
        # one long sleep fills CUDA's bounded queue of pending launches and then waits for the sleep)
        # the same on every rank: twice the slowest rank's call (none on CPU)
        sleep_s = 2 * max(U.all_max([gpu], device)[0], 1e-3) if device.type == "cuda" else 0.0
        hosts = []
        sections.on = True
        sections.seconds = dict.fromkeys(sections.seconds, 0.0)
        for _ in range(cfg["iters"]):
            U.synchronize(device)
            U.all_max([0.0], device)  # the ranks line up: their collectives meet inside the call
            U.gpu_sleep(device, sleep_s)
            t0 = time.perf_counter()
            step()
            hosts.append(time.perf_counter() - t0)
        sections.on = False
        parts = {spec: t / cfg["iters"] for spec, t in sections.seconds.items()}
        host = sorted(hosts)[len(hosts) // 2]
        U.synchronize(device)
        U.all_max([0.0], device)
        text = ""
        if rank == 0:
            prof = cProfile.Profile()
            prof.enable()
            for _ in range(5):
                step()
            U.synchronize(device)
            prof.disable()
            s = io.StringIO()
            if cfg["dump"]:
                prof.dump_stats(f"{cfg['dump']}/{strategy}_{cfg['docs']}_w{world}.prof")
            pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(cfg["top"])
            text = s.getvalue()
        else:
            for _ in range(5):
                step()
            U.synchronize(device)
        gpu_max, host_max = U.all_max([gpu, host], device)
        out[strategy] = {"gpu_s": gpu_max, "host_s": host_max, "sleep_s": sleep_s, "profile": text, "sections": parts}
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--seq", default="8k")
    p.add_argument("--strategies", default="ring,ulysses,allgather,auto")
    p.add_argument("--docs", default="one", help=f"document mix ({', '.join(bs.MIXES)}); one: a single sequence")
    p.add_argument("--layout", default="zigzag")
    p.add_argument("--heads", default="32/8")
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--top", type=int, default=30)
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--out", default=None)
    p.add_argument("--sections", default="", help="comma list of module:Attr.attr whose host time per call (mean, "
                   "inclusive, rank 0) is reported beside the whole call's")
    p.add_argument("--dump", default=None, help="also write rank 0's cProfile statistics to DIR/<strategy>_...prof")
    a = p.parse_args()
    for spec in filter(None, a.sections.split(",")):  # before any rank starts
        try:
            resolve_section(spec)
        except ValueError as e:
            p.error(str(e))
    heads, kv_heads = map(int, a.heads.split("/"))
    cfg = {"seq": U.parse_count(a.seq), "strategies": a.strategies.split(","), "heads": heads, "kv_heads": kv_heads,
           "head_dim": a.head_dim, "iters": a.iters, "top": a.top, "docs": a.docs, "layout": a.layout,
           "backend": "nccl" if a.device == "cuda" else "gloo", "dump": a.dump,
           "sections": [x for x in a.sections.split(",") if x]}
    res = U.launch(run_rank, a.world, cfg, backend=cfg["backend"], timeout=600)
    if not res:
        return
    lines = []
    for s, m in res[0].items():
        lines.append(f"== {s}: GPU {m['gpu_s'] * 1e3:.2f} ms/call, host {m['host_s'] * 1e3:.2f} ms/call (each call "
                     f"behind {m['sleep_s'] * 1e3:.1f} ms of GPU sleep)")
        lines += [f"   {seconds * 1e3:7.3f} ms  {spec}" for spec, seconds in m["sections"].items()]
        lines.append(m["profile"])
    text = "\n".join(lines)
    print(text)
    if a.out:
        Path(a.out).write_text(text)


if __name__ == "__main__":
    main()
