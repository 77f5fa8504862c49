"""``python -m distcomm.demo [--world-size 2] [--steps 40] [--plot distcomm_demo.png]``

Starts its own local ranks (gloo on CPU; NCCL when enough GPUs are present; no torchrun needed) and:
1. runs every collective forward and backward and checks values and gradients against a single-process
   float64 simulation;
2. runs ring flash attention in every layout and checks it against single-process attention;
3. trains a two-tower CLIP model on uneven per-rank batches and a ring-attention language model, checks
   that the distributed run matches a single-process run of the same steps, and plots the loss curves.
Exits with status 1 if any check fails.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

from distcomm._launch import run_world
from distcomm.demo import attention, collectives, training

TOL = 1e-9  # everything runs in float64


def _table(rows, title):
    print(f"\n{title}")
    print(f"  {'operation':<44} {'forward err':>12} {'backward err':>13}  ok")
    ok = True
    for name, fwd, bwd in rows:
        good = fwd <= TOL and bwd <= TOL
        ok &= good
        print(f"  {name:<44} {fwd:12.1e} {bwd:13.1e}  {'yes' if good else 'NO'}")
    return ok


def _plot(path, dist_hist, single_hist, world):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("  (matplotlib is not installed, so no plot: pip install 'distcomm[demo]')")
        return
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    for ax, key, title in zip(axes, ("clip", "lm"), ("CLIP loss, uneven batches", "ring-attention LM loss")):
        ax.plot(single_hist[key], label="single process", lw=3, alpha=0.5)
        ax.plot(dist_hist[key], "--", label=f"{world} ranks (distcomm)")
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"  loss curves written to {path}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m distcomm.demo", description=__doc__.split("\n")[0])
    parser.add_argument("--world-size", type=int, default=2, help="local ranks to start, 1 to 4 (default 2)")
    parser.add_argument("--steps", type=int, default=40, help="training steps (default 40)")
    parser.add_argument("--plot", default="distcomm_demo.png", help="where to write the loss-curve PNG")
    args = parser.parse_args(argv)
    world = args.world_size
    if not 1 <= world <= len(training.CLIP_SIZES):
        parser.error(f"--world-size must be between 1 and {len(training.CLIP_SIZES)}, got {world}")
    use_cuda = torch.cuda.is_available() and torch.cuda.device_count() >= world
    backend, device = ("nccl", "cuda") if use_cuda else ("gloo", "cpu")
    print(f"distcomm demo: {world} local ranks, backend {backend}, device {device}")
    start = time.time()

    results = run_world(collectives.run_rank, world, device, backend=backend, timeout=120)
    ok = _table(collectives.check(results, world), "1. collectives vs single-process float64 simulation")

    rows = []
    for layout in ("contiguous", "zigzag", "striped"):
        res = run_world(attention.run_rank, world, device, layout, "float64", backend=backend, timeout=120)
        rows += attention.check(res, world, layout)
    ok &= _table(rows, "2. ring attention vs single-process attention on the whole sequence")

    print(f"\n3. training {args.steps} steps on {world} ranks")
    dist_results = run_world(training.train_rank, world, device, args.steps, backend=backend, timeout=300)
    single = training.train_single(world, args.steps)
    hist = dist_results[0]["history"]
    for key, name in (("clip", "two-tower CLIP, per-rank batches " + str(training.CLIP_SIZES[:world])),
                      ("lm", f"ring-attention LM ({training.LAYOUT}, seq {training.SEQ})")):
        diff = training.max_param_diff(dist_results[0][key], single[key])
        same = all(training.max_param_diff(dist_results[0][key], r[key]) == 0 for r in dist_results)
        good = diff <= 1e-8 and same
        ok &= good
        print(f"  {name}: loss {hist[key][0]:.3f} -> {hist[key][-1]:.3f}; "
              f"max |param(distributed) - param(single)| = {diff:.1e}  {'ok' if good else 'MISMATCH'}")
    _plot(args.plot, hist, single["history"], world)
    print(f"\n{'all checks passed' if ok else 'SOME CHECKS FAILED'} in {time.time() - start:.1f}s")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
