"""Host time of the per-call verification exchange (Note [Collective verdicts]) on a gloo world.

Every context-parallel call exchanges its verdict and a small metadata vector over the host. This measures
that exchange alone (``verify_across_ring`` with ring_flash_attn's fields) and a whole small
``ring_flash_attn`` call on CPU, median over iterations, per world size.

    python scripts/bench_verification.py --worlds 2 4 8 --iters 200 --json verification.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from distcomm._launch import run_world


def _rank(rank, world, iters):
    import distcomm_attention as da
    from distcomm.ring import RingComm
    from distcomm_attention import _validation

    q = torch.randn(1, 64, 4, 32)
    comm = RingComm()
    fields = {"layout": "contiguous", "causal": True, "softmax_scale": 0.125, "window_left": -1, "window_right": -1,
              "softcap": 0.0, "attention_mask": False, "cu_seqlens": None, "balance_window": -1,
              "requires_grad": False, "strategy": "ring", "ulysses": 0, "ring": 0}

    def timed(fn):
        for _ in range(10):
            fn()
        out = []
        for _ in range(iters):
            t0 = time.perf_counter()
            fn()
            out.append(time.perf_counter() - t0)
        return statistics.median(out)

    verify = timed(lambda: _validation.verify_across_ring("ring_flash_attn", comm, {"q": q, "k": q, "v": q},
                                                          extra=fields))
    call = timed(lambda: da.ring_flash_attn(q, q, q, causal=True))
    return {"verify_us": verify * 1e6, "call_us": call * 1e6}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--iters", type=int, default=200)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    rows = []
    for world in args.worlds:
        got = run_world(_rank, world, args.iters, timeout=600)
        row = {"world": world, "verify_us": max(g["verify_us"] for g in got),
               "call_us": max(g["call_us"] for g in got)}
        rows.append(row)
        print(f"W={world}: verification exchange {row['verify_us']:.0f} us (max over ranks of the median), "
              f"whole ring_flash_attn call (1x64x4x32 per rank, CPU) {row['call_us']:.0f} us")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows, "torch": torch.__version__}, f, indent=1)


if __name__ == "__main__":
    main()
