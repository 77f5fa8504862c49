"""Fit and check the cost model's compute term against measured per-rank times (no GPU needed).

Reads the simulated-rank records of scripts/bench_strategies.py (docs/bench/strategies.json and the
balanced*.json packed mixes: one H100, flash-attn-4 blocks, bf16, d = 128, heads 32/8 or 32/32), rebuilds each
timed rank's plan (ring, all-gather, Ulysses), and compares the measured seconds with

    compute = work / tflops + calls * call_overhead + state / state_gbps [+ pieces * piece_overhead]

where ``work`` is either the visible pairs (the model as shipped) or the pairs of the kernel's 128 x 128
tiles the visible pairs touch, per document piece (``--tiles``). Prints the error of the shipped defaults
and of a least-squares fit (non-negative) of each variant, per strategy and overall.

    python scripts/fit_cost_model.py docs/bench/strategies.json docs/bench/balanced_median_w8.json ...
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import bench_strategies as bs  # noqa: E402

from distcomm_attention.planning import balance, cost  # noqa: E402
from distcomm_attention.planning.plans import gathered_plan, local_plan  # noqa: E402
from distcomm_attention.planning.visibility import LazyPieces, Visibility, ring_plan  # noqa: E402

TILE = 128


def _tile_pairs_of_piece(p) -> int:
    nq, nk = p.q1 - p.q0, p.k1 - p.k0
    d = nk - nq
    total = 0
    for i in range(0, nq, TILE):
        last = min(i + TILE, nq) - 1
        lo = 0 if p.left is None else max(0, i + d - p.left)
        hi = nk if p.right is None else min(nk, last + d + p.right + 1)
        if hi > lo:
            total += (math.ceil(hi / TILE) - lo // TILE) * TILE * min(TILE, nq - i)
    return total


def block_features(block) -> tuple[int, int, int]:
    """(visible pairs, tile pairs, pieces) of one block."""
    nq, nk = block.q.stop - block.q.start, block.kv.stop - block.kv.start
    if block.mode == "full":
        return nq * nk, math.ceil(nq / TILE) * math.ceil(nk / TILE) * TILE * TILE, 1
    if block.mode == "causal":
        t = math.ceil(nq / TILE)
        return nq * (nq + 1) // 2, t * (t + 1) // 2 * TILE * TILE, 1
    pieces = LazyPieces(*block.intervals[:2]).pieces
    return cost._pairs(block), sum(map(_tile_pairs_of_piece, pieces)), len(pieces)


def plan_features(plan, heads: int, kv_heads: int, d: int) -> dict:
    f = {"pairs": 0, "tiles": 0, "pieces": 0, "calls": 0, "state": 0}
    for blocks in plan.blocks:
        for b in blocks:
            pairs, tiles, pieces = block_features(b)
            f["pairs"] += pairs
            f["tiles"] += tiles
            f["pieces"] += pieces
            f["calls"] += 1
            f["state"] += 4 * d * ((b.q.stop - b.q.start) * heads + 2 * (b.kv.stop - b.kv.start) * kv_heads)
    f["flop_per_pair"] = 3.5 * 4 * heads * d
    return f


def samples(paths: list[str]) -> list[dict]:
    out = []
    for path in paths:
        for row in json.loads(Path(path).read_text())["rows"]:
            if "rank_s" not in row or not row.get("causal", True):
                continue
            seq, world, heads, kv_heads = row["seq"], row["world"], row["heads"], row["kv_heads"]
            mix = row.get("documents")
            docs = None if mix in (None, "one") else tuple(bs.documents(mix, seq))
            vis = Visibility(True, cu_seqlens=docs)
            layout = row.get("chosen_layout") or row["layout"]
            concrete = balance.resolve(layout, seq, world, docs)
            n = seq // world
            timed = row.get("timed_ranks") or {s: list(range(world)) for s in row["rank_s"]}
            for strategy, times in row["rank_s"].items():
                if strategy not in ("ring", "allgather", "ulysses"):
                    continue
                for r, t in zip(timed.get(strategy, [0]), times):
                    if strategy == "ring":
                        plan, h, hk = ring_plan(concrete, vis, world, r, n), heads, kv_heads
                    elif strategy == "allgather":
                        plan, h, hk = gathered_plan(concrete, vis, world, r, n), heads, kv_heads
                    else:
                        plan, h, hk = local_plan(vis, seq), heads // world, max(1, kv_heads // world)
                    f = plan_features(plan, h, hk, 128)
                    out.append({"strategy": strategy, "seconds": t, "file": Path(path).name, "seq": seq,
                                "world": world, "mix": mix or "one", **f})
    return out


def predict(s: dict, tflops: float, call: float, state_gbps: float, piece: float, tiles: bool) -> float:
    work = (s["tiles"] if tiles else s["pairs"]) * s["flop_per_pair"]
    return work / (tflops * 1e12) + s["calls"] * call + s["state"] / (state_gbps * 1e9) + s["pieces"] * piece


def fit(rows: list[dict], tiles: bool, pieces: bool) -> tuple[float, float, float, float]:
    """Least squares on relative error (rows weighted by 1 / seconds), coefficients clamped at 0."""
    cols = [[(r["tiles"] if tiles else r["pairs"]) * r["flop_per_pair"] / 1e12, r["calls"], r["state"] / 1e9]
            + ([r["pieces"]] if pieces else []) for r in rows]
    a = torch.tensor(cols, dtype=torch.float64)
    y = torch.tensor([r["seconds"] for r in rows], dtype=torch.float64)
    w = 1 / y
    coef = torch.linalg.lstsq(a * w[:, None], y * w).solution.clamp(min=1e-12)
    c = coef.tolist() + ([0.0] if not pieces else [])
    return 1 / c[0], c[1], 1 / c[2], c[3]


def report(rows, params, tiles, label):
    errs = {}
    for r in rows:
        e = predict(r, *params, tiles=tiles) / r["seconds"] - 1
        errs.setdefault(r["strategy"], []).append(e)
        errs.setdefault("all", []).append(e)
    parts = [f"{k} mean |err| {sum(map(abs, v)) / len(v):.1%} worst {max(v, key=abs):+.0%} (n={len(v)})"
             for k, v in errs.items()]
    print(f"{label}: tflops {params[0]:.0f}, call {params[1] * 1e3:.3f} ms, state {params[2]:.0f} GB/s, "
          f"piece {params[3] * 1e6:.2f} us\n  " + "\n  ".join(parts))
    return errs


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("paths", nargs="+")
    p.add_argument("--out", default=None, help="write the samples and fits here (JSON)")
    a = p.parse_args()
    rows = samples(a.paths)
    hw = cost.Hardware()
    shipped = (hw.tflops, hw.call_overhead_s, hw.state_gbps, 0.0)
    result = {"samples": len(rows), "fits": {}}
    report(rows, shipped, False, "shipped defaults (visible pairs)")
    for tiles in (False, True):
        for pieces in (False, True):
            params = fit(rows, tiles, pieces)
            label = f"fit: {'tile' if tiles else 'visible'} pairs{' + per piece' if pieces else ''}"
            errs = report(rows, params, tiles, label)
            result["fits"][label] = {"params": params, "mean_abs_err": {k: sum(map(abs, v)) / len(v)
                                                                        for k, v in errs.items()}}
    if a.out:
        Path(a.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
