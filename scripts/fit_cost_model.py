"""Fit and check the cost model's compute term against measured per-rank times (no GPU needed).

Reads the simulated-rank records of scripts/bench_strategies.py (docs/bench/strategies.json and the
balanced*.json packed mixes: one H100, flash-attn-4 blocks, bf16, d = 128, heads 32/8 or 32/32), rebuilds each
timed rank's plan (ring, all-gather, Ulysses), and compares the measured seconds with

    compute = work / tflops + calls * call_overhead + state / state_gbps [+ query tiles * query_tile_s]
              (the shipped defaults also + key tiles * key_tile_s; the fits here leave key tiles out)

where ``work`` is either the visible pairs or the pairs of the kernel's 128 x 128 tiles that hold a visible
pair, per piece the kernel runs (the model as shipped, with a cost per 128-row query tile and head: Note [Cost
model]). Prints the error of the shipped defaults and of a least-squares fit (non-negative) of each variant,
per strategy and overall. These records time blocks alone (no link, no exchange copies), so the fits here
describe the compute term only; the shipped defaults were chosen against the emulated-link rows
(scripts/check_cost_model.py).

    python scripts/fit_cost_model.py docs/bench/strategies.json docs/bench/balanced_median_w8.json ...
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import bench_strategies as bs  # noqa: E402

from distcomm_attention.planning import balance, cost  # noqa: E402
from distcomm_attention.planning.plans import gathered_plan, local_plan  # noqa: E402
from distcomm_attention.planning.visibility import Visibility, ring_plan  # noqa: E402

TILE = 128


def block_features(block) -> tuple[int, int, int, int]:
    """(visible pairs, tile pairs, query tiles, key tiles) of one block: the kernel's 128 x 128 tiles that hold
    a visible pair, times their pairs, its 128-row query tiles that see a key and its 128-key tiles a query sees
    (``cost._tiles``, the model's count)."""
    tiles, q_tiles, k_tiles = cost._tiles(block)
    return cost._pairs(block), tiles * TILE * TILE, q_tiles, k_tiles


def plan_features(plan, heads: int, kv_heads: int, d: int) -> dict:
    f = {"pairs": 0, "tiles": 0, "q_tiles": 0, "k_tiles": 0, "calls": 0, "state": 0}
    for blocks in plan.blocks:
        for b in blocks:
            pairs, tiles, q_tiles, k_tiles = block_features(b)
            f["pairs"] += pairs
            f["tiles"] += tiles
            f["q_tiles"] += q_tiles * heads * d / 128  # per head, scaled with head_dim as the model does
            f["k_tiles"] += k_tiles * heads * d / 128
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


def predict(s: dict, tflops: float, call: float, state_gbps: float, q_tile: float, tiles: bool,
            k_tile: float = 0.0) -> float:
    work = (s["tiles"] if tiles else s["pairs"]) * s["flop_per_pair"]
    return (work / (tflops * 1e12) + s["calls"] * call + s["state"] / (state_gbps * 1e9) + s["q_tiles"] * q_tile
            + s["k_tiles"] * k_tile)


def fit(rows: list[dict], tiles: bool, q_tiles: bool) -> tuple[float, float, float, float]:
    """Least squares on relative error (rows weighted by 1 / seconds), coefficients clamped at 0."""
    cols = [[(r["tiles"] if tiles else r["pairs"]) * r["flop_per_pair"] / 1e12, r["calls"], r["state"] / 1e9]
            + ([r["q_tiles"]] if q_tiles else []) for r in rows]
    a = torch.tensor(cols, dtype=torch.float64)
    y = torch.tensor([r["seconds"] for r in rows], dtype=torch.float64)
    w = 1 / y
    coef = torch.linalg.lstsq(a * w[:, None], y * w).solution.clamp(min=1e-12)
    c = coef.tolist() + ([0.0] if not q_tiles else [])
    return 1 / c[0], c[1], 1 / c[2], c[3]


def report(rows, params, tiles, label, k_tile: float = 0.0):
    errs = {}
    for r in rows:
        e = predict(r, *params, tiles=tiles, k_tile=k_tile) / r["seconds"] - 1
        errs.setdefault(r["strategy"], []).append(e)
        errs.setdefault("all", []).append(e)
    parts = [f"{k} mean |err| {sum(map(abs, v)) / len(v):.1%} worst {max(v, key=abs):+.0%} (n={len(v)})"
             for k, v in errs.items()]
    print(f"{label}: tflops {params[0]:.0f}, call {params[1] * 1e3:.3f} ms, state {params[2]:.0f} GB/s, "
          f"query tile {params[3] * 1e6:.3f} us, key tile {k_tile * 1e6:.3f} us\n  " + "\n  ".join(parts))
    return errs


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("paths", nargs="+")
    p.add_argument("--out", default=None, help="write the samples and fits here (JSON)")
    a = p.parse_args()
    rows = samples(a.paths)
    hw = cost.Hardware()
    shipped = (hw.tflops, hw.call_overhead_s, hw.state_gbps, hw.query_tile_s)
    result = {"samples": len(rows), "fits": {}}
    report(rows, shipped, True, "shipped defaults (tile pairs + per query tile + per key tile)", hw.key_tile_s)
    for tiles in (False, True):
        for q_tiles in (False, True):
            params = fit(rows, tiles, q_tiles)
            label = f"fit: {'tile' if tiles else 'visible'} pairs{' + per query tile' if q_tiles else ''}"
            errs = report(rows, params, tiles, label)
            result["fits"][label] = {"params": params, "mean_abs_err": {k: sum(map(abs, v)) / len(v)
                                                                        for k, v in errs.items()}}
    if a.out:
        Path(a.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
