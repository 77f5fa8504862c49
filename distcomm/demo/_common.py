"""Command line, backend choice, printing and plotting shared by the demos (``python -m distcomm.demo`` and
``python -m distcomm_attention.demo``)."""

from __future__ import annotations

import argparse

import torch

MAX_WORLD = 4  # the CLIP demo has per-rank batch sizes for up to 4 ranks
TOL = 1e-9  # every check runs in float64


def table(rows: list[tuple[str, float, float]], title: str) -> bool:
    """Print (name, forward error, backward error) rows; True if every error is within ``TOL``."""
    print(f"\n{title}")
    print(f"  {'operation':<44} {'forward err':>12} {'backward err':>13}  ok")
    ok = True
    for name, fwd, bwd in rows:
        good = fwd <= TOL and bwd <= TOL
        ok &= good
        print(f"  {name:<44} {fwd:12.1e} {bwd:13.1e}  {'yes' if good else 'NO'}")
    return ok


def plot(path: str, curves: list[tuple[str, list[float], list[float]]], world: int) -> None:
    """One panel per (title, single-process losses, distributed losses); skipped without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("  (matplotlib is not installed, so no plot: pip install 'distcomm[demo]')")
        return
    fig, axes = plt.subplots(1, len(curves), figsize=(5 * len(curves), 3.8), squeeze=False)
    for ax, (title, single, distributed) in zip(axes[0], curves):
        ax.plot(single, label="single process", lw=3, alpha=0.5)
        ax.plot(distributed, "--", label=f"{world} ranks (distcomm)")
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"  loss curves written to {path}")


def parse_args(prog: str, description: str, argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog=prog, description=description)
    parser.add_argument("--world-size", type=int, default=2, help=f"local ranks to start, 1 to {MAX_WORLD} (default 2)")
    parser.add_argument("--steps", type=int, default=40, help="training steps (default 40)")
    parser.add_argument("--plot", default="distcomm_demo.png", help="where to write the loss-curve PNG")
    args = parser.parse_args(argv)
    if not 1 <= args.world_size <= MAX_WORLD:
        parser.error(f"--world-size must be between 1 and {MAX_WORLD}, got {args.world_size}")
    return args


def backend_and_device(world: int) -> tuple[str, str]:
    """NCCL on CUDA when there is a GPU per rank, else gloo on CPU."""
    if torch.cuda.is_available() and torch.cuda.device_count() >= world:
        return "nccl", "cuda"
    return "gloo", "cpu"
