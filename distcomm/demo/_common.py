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


def loss_gap(single: list[float], distributed: list[float]) -> list[float]:
    """|single - distributed| per step: what "the distributed run equals the single-process run" means."""
    return [abs(a - b) for a, b in zip(single, distributed)]


def plot(path: str, curves: list[tuple[str, list[float], list[float]]], world: int):
    """One row per (title, single-process losses, distributed losses): the two loss curves on top of each
    other, and beside them their absolute difference on a log axis against ``TOL``. Returns the figure;
    skipped (None) without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("  (matplotlib is not installed, so no plot: pip install 'distcomm[demo]')")
        return None
    floor = 1e-18  # where exact zeros are drawn (a log axis has no 0); float64 round-off of a loss ~ 1e-16
    fig, axes = plt.subplots(len(curves), 2, figsize=(11, 3.6 * len(curves)), squeeze=False,
                             gridspec_kw={"width_ratios": [3, 2]})
    for (curve_ax, gap_ax), (title, single, distributed) in zip(axes, curves):
        steps = range(len(single))
        curve_ax.plot(steps, single, lw=4, alpha=0.4, label="single process")
        curve_ax.plot(steps, distributed, "--", lw=1.5, label=f"{world} ranks (distcomm)")
        curve_ax.set(title=title, xlabel="step", ylabel="loss")
        curve_ax.legend()
        gap = loss_gap(single, distributed)
        nonzero = [(s, g) for s, g in zip(steps, gap) if g > 0]
        zero = [s for s, g in zip(steps, gap) if g == 0]
        if nonzero:
            gap_ax.semilogy(*zip(*nonzero), "o", ms=4, color="C1", label="|single − distributed|")
        if zero:
            gap_ax.semilogy(zero, [floor] * len(zero), "v", ms=4, color="C2", label="exactly equal (drawn at 1e-18)")
        gap_ax.axhline(TOL, color="C3", ls=":", label=f"tolerance {TOL:g}")
        gap_ax.set_yscale("log")
        gap_ax.set_ylim(floor / 3, TOL * 1e3)
        gap_ax.set(title=f"difference, max {max(gap, default=0.0):.1e} (float64)", xlabel="step",
                   ylabel="|single − distributed|")
        gap_ax.legend(loc="upper right", fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"  loss curves written to {path}")
    return fig


def parse_args(prog: str, description: str, argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog=prog, description=description)
    parser.add_argument("--world-size", type=int, default=2, help=f"local ranks to start, 1 to {MAX_WORLD} (default 2)")
    parser.add_argument("--steps", type=int, default=40, help="training steps (default 40)")
    parser.add_argument("--plot", default="distcomm_demo.png", help="where to write the loss-curve PNG (default: %(default)s)")
    args = parser.parse_args(argv)
    if not 1 <= args.world_size <= MAX_WORLD:
        parser.error(f"--world-size must be between 1 and {MAX_WORLD}, got {args.world_size}")
    return args


def backend_and_device(world: int) -> tuple[str, str]:
    """NCCL on CUDA when there is a GPU per rank, else gloo on CPU."""
    if torch.cuda.is_available() and torch.cuda.device_count() >= world:
        return "nccl", "cuda"
    return "gloo", "cpu"
