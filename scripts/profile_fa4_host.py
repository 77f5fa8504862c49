"""Host time per call of flash-attn-4 alone and of two simulated ranks' forward + backward on a packed mix.

Each case is timed behind a GPU sleep (``_bench_util.host_seconds``: the host never waits for the GPU) and
profiled with cProfile by own time, so that the host cost of the kernel's own Python interface can be read
beside the library's around it (the cProfile runs back to back, without a sleep ahead: its own times include
the host's waits, which show as ``_cuda_synchronize``):

- one raw flash-attn-4 varlen forward + backward over a 128k log-normal pack with Ulysses' per-rank heads at
  W = 8 (4 query heads, 1 kv head), and one dense causal call over 16k tokens with 32/8 heads;
- rank 1 of 8 of the ring and the all-gather strategies on that pack (balanced layout), as
  scripts/bench_emulated.py runs them, over an ideal emulated link (no wait); for each, first its host time
  per call split into flash-attn-4's own interface (and, for the sparse all-gather, its forward and
  backward, each inclusive) with the CUDA launches per call (torch.profiler), then the cProfile.

    python scripts/profile_fa4_host.py > host_profile.txt
    python scripts/profile_fa4_host.py --docs short --world 4 --rank 0 --strategies allgather,ring,ulysses \
        --no-raw --dump prof/     # another mix, world and rank; each strategy's cProfile statistics kept
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import _bench_util as U  # noqa: E402
import bench_emulated as be  # noqa: E402
import bench_strategies as bs  # noqa: E402
from profile_block_path import cprofile_text  # noqa: E402

from distcomm_attention.kernels import dispatch  # noqa: E402
from distcomm_attention.planning.visibility import Visibility  # noqa: E402


def profile(name: str, step, calls: int = 5, top: int = 28, dump: str | None = None) -> None:
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    host = U.host_seconds(step, 0.05, 5, torch.device("cuda"))
    text = cprofile_text(step, calls, top, sort="tottime", dump=dump)
    print(f"===== {name}: host {host * 1e3:.2f} ms per call", flush=True)
    print("\n".join(line[:160] for line in text.splitlines()[:top + 12]), flush=True)


class _Timed:
    """A callable's host seconds and calls, accumulated while ``on``."""

    def __init__(self, fn):
        self.fn, self.seconds, self.calls, self.on = fn, 0.0, 0, False

    def __call__(self, *args, **kwargs):
        if not self.on:
            return self.fn(*args, **kwargs)
        t0 = time.perf_counter()
        try:
            return self.fn(*args, **kwargs)
        finally:
            self.seconds += time.perf_counter() - t0
            self.calls += 1


def _method(timed: _Timed):
    """``timed`` as a method (a plain function, so that it binds to the instance)."""
    return lambda self, *args, **kwargs: timed(self, *args, **kwargs)


_LAUNCHES = ("cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx", "cudaLaunchKernelExC", "cudaMemcpyAsync",
             "cudaMemsetAsync")


def launches(step, calls: int = 3) -> float:
    """CUDA launches (kernels, async copies and memsets) the host issues per call of ``step``."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(calls):
            step()
        torch.cuda.synchronize()
    return sum(e.count for e in prof.key_averages() if e.key in _LAUNCHES) / calls


def split(name: str, step, timed: list[_Timed], iters: int = 7, phases: dict | None = None) -> None:
    """Host time of one call, and the part of it inside the flash-attn-4 interface (``timed``) and in each of
    ``phases`` (name -> _Timed)."""
    phases = phases or {}
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    for t in timed + list(phases.values()):
        t.seconds, t.calls, t.on = 0.0, 0, True
    host = U.host_seconds(step, 0.05, iters, torch.device("cuda"))
    for t in timed + list(phases.values()):
        t.on = False
    fa4 = sum(t.seconds for t in timed) / iters
    calls = sum(t.calls for t in timed) / iters
    parts = "".join(f", {p} {t.seconds / iters * 1e3:.2f} ms" for p, t in phases.items())
    print(f"##### {name}: host {host * 1e3:.2f} ms per call, of which flash-attn-4's interface {fa4 * 1e3:.2f} ms "
          f"({calls:.0f} kernel calls){parts}, launches {launches(step):.0f} per call", flush=True)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--docs", default="lognormal", help="document mix of scripts/bench_strategies.py")
    p.add_argument("--world", type=int, default=8)
    p.add_argument("--rank", type=int, default=1)
    p.add_argument("--strategies", default="ring,allgather", help="comma list of ring, allgather, ulysses")
    p.add_argument("--layout", default="auto")
    p.add_argument("--no-raw", action="store_true", help="skip the raw flash-attn-4 calls")
    p.add_argument("--no-cprofile", action="store_true", help="only the host split and the launch counts")
    p.add_argument("--dump", default=None, help="also write each strategy's cProfile statistics to DIR/<path>.prof")
    args = p.parse_args()
    dev, dt, d = torch.device("cuda"), torch.bfloat16, 128
    g = torch.Generator(device=dev).manual_seed(0)
    rnd = lambda *shape: torch.randn(*shape, device=dev, dtype=dt, generator=g)  # noqa: E731
    seq, world = 131072, args.world
    docs = bs.documents(args.docs, seq)
    if not args.no_raw:
        profile(f"raw fa4 varlen 128k 4/1 heads ({len(docs) - 1} docs)",
                bs._fa4_single(rnd(1, seq, 4, d), rnd(1, seq, 1, d), rnd(1, seq, 1, d), True, docs))
        profile("raw fa4 dense 16k 32/8",
                bs._fa4_single(rnd(1, 16384, 32, d), rnd(1, 16384, 8, d), rnd(1, 16384, 8, d), True))
    probe = torch.empty(1, 1, 32, d, device=dev, dtype=dt)
    _, fwd, bwd = dispatch.select_kernels("fa4", probe, Visibility(True), 0.0)
    timed = [_Timed(fwd._fwd), _Timed(bwd._bwd)]
    fwd._fwd, bwd._bwd = timed
    _, vis, concrete = be.plan_case(seq, world, args.docs, args.layout)
    n = seq // world
    q, k, v, dout = rnd(1, n, 32, d), rnd(1, n, 8, d), rnd(1, n, 8, d), rnd(1, n, 32, d)
    for strategy in args.strategies.split(","):
        link = be._Sent(be.EmulatedLink(world, 1, be.LINKS["ideal"]))
        path, step = be.rank_step(strategy, link, q, k, v, dout, concrete, vis, world, args.rank, fwd, bwd, d ** -0.5)
        name = f"{path} rank {args.rank} {args.docs} W{world}"
        phases = {}
        if path == "sparse_allgather":  # the all-gather's forward and backward, each inclusive
            for phase in ("forward", "backward"):
                phases[phase] = _Timed(getattr(be.AllGatherKV, phase))
                setattr(be.AllGatherKV, phase, _method(phases[phase]))
        split(name, step, timed, phases=phases)
        for phase, t in phases.items():
            setattr(be.AllGatherKV, phase, t.fn)
        if not args.no_cprofile:
            dump = None if args.dump is None else str(Path(args.dump) / f"{path}_{args.docs}_w{world}.prof")
            profile(name, step, dump=dump)


if __name__ == "__main__":
    main()
