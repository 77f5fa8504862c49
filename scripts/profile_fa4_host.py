"""Host time per call of flash-attn-4 alone and of two simulated ranks' forward + backward on a packed mix.

Each case is timed behind a GPU sleep (``_bench_util.host_seconds``: the host never waits for the GPU) and
profiled with cProfile by own time, so that the host cost of the kernel's own Python interface can be read
beside the library's around it (the cProfile runs back to back, without a sleep ahead: its own times include
the host's waits, which show as ``_cuda_synchronize``):

- one raw flash-attn-4 varlen forward + backward over a 128k log-normal pack with Ulysses' per-rank heads at
  W = 8 (4 query heads, 1 kv head), and one dense causal call over 16k tokens with 32/8 heads;
- rank 1 of 8 of the ring and the all-gather strategies on that pack (balanced layout), as
  scripts/bench_emulated.py runs them, over an ideal emulated link (no wait).

    python scripts/profile_fa4_host.py > host_profile.txt
"""

from __future__ import annotations

import sys
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


def profile(name: str, step, calls: int = 5, top: int = 28) -> None:
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    host = U.host_seconds(step, 0.05, 5, torch.device("cuda"))
    text = cprofile_text(step, calls, top, sort="tottime")
    print(f"===== {name}: host {host * 1e3:.2f} ms per call", flush=True)
    print("\n".join(line[:160] for line in text.splitlines()[:top + 12]), flush=True)


def main():
    dev, dt, d = torch.device("cuda"), torch.bfloat16, 128
    g = torch.Generator(device=dev).manual_seed(0)
    rnd = lambda *shape: torch.randn(*shape, device=dev, dtype=dt, generator=g)  # noqa: E731
    seq, world = 131072, 8
    docs = bs.documents("lognormal", seq)
    profile(f"raw fa4 varlen 128k 4/1 heads ({len(docs) - 1} docs)",
            bs._fa4_single(rnd(1, seq, 4, d), rnd(1, seq, 1, d), rnd(1, seq, 1, d), True, docs))
    profile("raw fa4 dense 16k 32/8",
            bs._fa4_single(rnd(1, 16384, 32, d), rnd(1, 16384, 8, d), rnd(1, 16384, 8, d), True))
    probe = torch.empty(1, 1, 32, d, device=dev, dtype=dt)
    _, fwd, bwd = dispatch.select_kernels("fa4", probe, Visibility(True), 0.0)
    _, vis, concrete = be.plan_case(seq, world, "lognormal", "auto")
    n = seq // world
    q, k, v, dout = rnd(1, n, 32, d), rnd(1, n, 8, d), rnd(1, n, 8, d), rnd(1, n, 32, d)
    for strategy in ("ring", "allgather"):
        link = be._Sent(be.EmulatedLink(world, 1, be.LINKS["ideal"]))
        path, step = be.rank_step(strategy, link, q, k, v, dout, concrete, vis, world, 1, fwd, bwd, d ** -0.5)
        profile(f"{path} rank 1 lognormal W{world}", step)


if __name__ == "__main__":
    main()
