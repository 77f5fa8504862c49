"""Ring attention's training-data features: packed documents, sliding windows, softcap and padding.

    PYTHONPATH=. python scripts/bench_ring_features.py                   # 2 local ranks, NCCL
    PYTHONPATH=. python scripts/bench_ring_features.py --world-size 1    # one GPU (a ring of one)
    PYTHONPATH=. python scripts/bench_ring_features.py --smoke           # CPU / gloo plumbing check, seconds
    torchrun --nproc-per-node 2 scripts/bench_ring_features.py           # also works (one rank per process)

bf16, batch 1, head_dim 128, heads 32/32 and 32/8 (``--heads``), every attention causal. Each case is
``distcomm_attention.ring_flash_attn`` on this rank's (B, S/W, H, D) shard with ``--backend`` (default
"auto"; the backend and kernels it resolves to, ``which_kernels``, are recorded). Forward (under no_grad)
and forward+backward are timed with CUDA events around back-to-back iterations after warm-up; the
iteration count is chosen from one timed call so that a case measures for about ``--case-seconds``
(between ``--min-iters`` and ``--iters``), the same on every rank. Times are the slowest rank's.

Part "docs", packed documents (S = ``--seq``, default 32k; layout ``--layout``, default zigzag): documents of
random lengths uniform in [``--doc-min``, ``--doc-max``] (``--seed``; the last one truncated to fit),
passed as ``cu_seqlens`` (a list: no host sync). Beside it: plain causal attention at the same S, and
PyTorch's ``context_parallel`` (scripts/bench_ring_attention.py's ``bench_cp``) on the same shapes. It has
no document masks, so it runs causal attention over the whole packed sequence: the wrong attention for
packed data, but what a context_parallel user must run. With W > 1 GPUs the same two cases also run on one
GPU alone (``ring_size=1``: each GPU computes the whole sequence, the faster GPU is kept); with W = 1 the
ring of one is itself the single-GPU number.

Part "window", sliding window (S = ``--window-seq``, default 128k; layouts ``--window-layouts``): causal with
``window_size=(w, 0)`` for w in ``--windows`` (default 1k..16k) and without a window. Reported: time, the ring
steps communicated (``len(ring_plan(...).steps)``), time relative to no window beside the FLOP fraction
it would fall to if time were proportional to the visible pairs.

Part "extras" (S = ``--seq``): softcap 50 and a key padding mask (last 10% of the keys padded), relative to
plain causal.

Where "auto" resolves plain causal attention to other kernels than the feature cases (plain: the
FlashAttention-2 backward; features: the Triton backward), plain causal is also timed with the features'
backend (``--kernel-refs``), so the cost of the feature and the cost of the kernel switch are told apart.

FLOPs count the visible (query, key) pairs: fwd = 4 * B * H * D * pairs, fwd+bwd = 3.5 x fwd. Causal:
S^2/2 pairs; packed documents: the sum of L^2/2 over documents; a causal window of w: S*w - w^2/2 (S^2/2
once w >= S); padding (P = unpadded keys): P^2/2 + (S - P)*P. TFLOP/s are PER GPU (FLOPs / W / time).
"per FLOP vs plain" = (T_docs / F_docs) / (T_plain / F_plain) (target <= 1.2). "vs CP" =
T_context_parallel / T (> 1: faster). "eff vs 1 GPU" = T_one_GPU / (W * T). "imbalance" = the busiest
rank's visible pairs / the mean over ranks (the plan's work split; the ring waits for the busiest rank).

Writes ``ring_features.json`` (progressively), ``ring_features.md`` (tables and the command) and
``ring_features.png`` (window panels, needs matplotlib) to ``--out``.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _bench_util as U  # noqa: E402
import bench_ring_attention as R  # noqa: E402  (bench_cp, timing steps, head parsing)

PARTS = ("docs", "window", "extras")
CP_NOTE = "context_parallel: causal over the whole sequence; it cannot mask documents"


# ------------------------------------------------------------------------------------------- the cases
def packed_documents(seq: int, lo: int, hi: int, seed: int) -> list[int]:
    """cu_seqlens (0, ..., seq) of documents of lengths uniform in [lo, hi], the last one truncated to fit."""
    rng = random.Random(seed)
    cu = [0]
    while cu[-1] < seq:
        cu.append(min(seq, cu[-1] + rng.randint(lo, hi)))
    return cu


def visible_pairs(c: dict) -> float:
    """Visible (query, key) pairs of a causal case, with the conventions of the module docstring."""
    s = c["S"]
    if c.get("docs"):
        cu = c["docs"]
        return sum((b - a) ** 2 / 2 for a, b in zip(cu[:-1], cu[1:]))
    if c.get("pad_frac"):
        p = s - _padded(c)
        return p * p / 2 + (s - p) * p
    w = c["window"][0]
    if 0 <= w < s:
        return s * w - w * w / 2
    return s * s / 2


def fwd_flops(c: dict, batch: int) -> float:
    return 4.0 * batch * c["H"] * c["D"] * visible_pairs(c)


def _padded(c: dict) -> int:
    return int(round(c["S"] * c["pad_frac"]))


def _visibility(c: dict):
    from distcomm_attention.planning.visibility import Visibility

    docs = tuple(c["docs"]) if c.get("docs") else None
    return Visibility(True, tuple(c["window"]), docs, bool(c.get("pad_frac")))


def plan_facts(c: dict, ring: int) -> dict:
    """The ring steps communicated and the work split of the ring plan (pure CPU, same on every rank)."""
    from distcomm_attention.planning.visibility import ring_plan

    vis, n = _visibility(c), c["S"] // ring
    work = []
    for r in range(ring):
        pairs = 0
        for blocks in ring_plan(c["layout"], vis, ring, r, n).blocks:
            for b in blocks:
                nq, nk = b.q.stop - b.q.start, b.kv.stop - b.kv.start
                if b.mode == "full":
                    pairs += nq * nk
                elif b.mode == "causal":
                    pairs += nq * (nq + 1) // 2
                else:
                    pairs += int((b.intervals[1] - b.intervals[0]).sum())
        work.append(pairs)
    steps = ring_plan(c["layout"], vis, ring, 0, n).steps
    mean = sum(work) / len(work)
    return {"ring_steps": len(steps), "steps": list(steps), "imbalance": max(work) / mean if mean else None}


def _kernel_choice(c: dict, device, dtype) -> dict:
    from distcomm_attention import which_kernels

    q = torch.empty(1, 16, c["H"], c["D"], device=device, dtype=dtype)
    mask = torch.ones(1, 16, dtype=torch.bool, device=device) if c.get("pad_frac") else None
    choice = which_kernels(q, causal=True, backend=c["backend"], attention_mask=mask,
                           window_size=tuple(c["window"]), softcap=c.get("softcap", 0.0), cu_seqlens=c.get("docs"))
    return choice._asdict()


# ------------------------------------------------------------------------------------------------ timing
def _time_steps(fwd, fwdbwd, cfg: dict, device) -> dict:
    """Warm up, time one fwd+bwd to choose the iteration count (agreed across ranks), then time both."""
    for _ in range(cfg["warmup"]):
        fwdbwd()
    (probe,) = U.all_max([U.time_loop(fwdbwd, iters=1, warmup=0, device=device)], device)
    iters = int(min(cfg["iters"], max(cfg["min_iters"], cfg["case_seconds"] / max(probe, 1e-9))))
    t_fwd = U.time_loop(fwd, iters=iters, warmup=1, device=device)
    U.release_memory(device)
    with U.PeakMemory(device) as pm:
        t_fb = U.time_loop(fwdbwd, iters=iters, warmup=0, device=device)
    return {"fwd_s": t_fwd, "fwdbwd_s": t_fb, "peak": pm.bytes, "iters": iters}


def bench_case(c: dict, cfg: dict, device, dtype, world: int) -> dict:
    """One ``ring_flash_attn`` case on this rank's shard (or on the whole sequence alone: ``c["single"]``)."""
    from distcomm_attention import ring_flash_attn, shard_sequence

    ring = 1 if c.get("single") else world
    b, s, h, hkv, d = cfg["batch"], c["S"], c["H"], c["Hkv"], c["D"]
    n = s // ring
    q, dout = (torch.randn(b, n, h, d, device=device, dtype=dtype) for _ in range(2))
    k, v = (torch.randn(b, n, hkv, d, device=device, dtype=dtype) for _ in range(2))
    q, k, v = R._leaves(q, k, v)
    mask = None
    if c.get("pad_frac"):
        full = torch.ones(b, s, dtype=torch.bool, device=device)
        full[:, s - _padded(c):] = False
        mask = full if ring == 1 else shard_sequence(full, c["layout"], dim=1)
    kwargs = dict(causal=True, layout=c["layout"], backend=c["backend"], attention_mask=mask,
                  window_size=tuple(c["window"]), softcap=c.get("softcap", 0.0), cu_seqlens=c.get("docs"),
                  ring_size=1 if c.get("single") else None)

    def call(q, k, v):
        return ring_flash_attn(q, k, v, **kwargs)

    res = _time_steps(*R._fwd_and_fwdbwd(call, q, k, v, dout), cfg, device)
    res["kernels"] = _kernel_choice(c, device, dtype)
    res.update(plan_facts(c, ring))
    return res


def bench_context_parallel(c: dict, cfg: dict, device, dtype, iters: int) -> dict:
    """PyTorch's context_parallel, causal over the whole sequence (bench_ring_attention.bench_cp)."""
    cp = {"batch": cfg["batch"], "S": c["S"], "H": c["H"], "Hkv": c["Hkv"], "D": c["D"], "causal": True,
          "iters": iters, "warmup": cfg["warmup"], "cp_rotate": cfg["cp_rotate"]}
    res = R.bench_cp(cp, device, dtype)
    res["iters"] = iters
    res["note"] = f"{CP_NOTE} ({res.get('note', '')})"
    return res


# ------------------------------------------------------------------------------------------------- rows
def _fill(row: dict, res: dict, c: dict, cfg: dict, world: int, device) -> None:
    single = bool(c.get("single"))
    if single:  # every GPU ran it alone: keep the faster one
        t_fwd, t_fb = U.all_min_max(res["fwd_s"], device)[0], U.all_min_max(res["fwdbwd_s"], device)[0]
        gpus = 1
    else:
        t_fwd, t_fb = U.all_max([res["fwd_s"], res["fwdbwd_s"]], device)
        gpus = world
    (peak,) = U.all_max([res["peak"] or 0], device)
    flops = fwd_flops(c, cfg["batch"])
    row.update(fwd_ms=t_fwd * 1e3, fwdbwd_ms=t_fb * 1e3, gpus=gpus, iters=res["iters"], useful_fwd_flops=flops,
               fwd_tflops_per_gpu=flops / gpus / t_fwd / 1e12, fwdbwd_tflops_per_gpu=3.5 * flops / gpus / t_fb / 1e12,
               peak_gib=peak / U.GiB if device.type == "cuda" else None)
    for key in ("kernels", "ring_steps", "steps", "imbalance", "note"):
        if key in res:
            row[key] = res[key]


def _find(rows: list, **match) -> dict | None:
    for r in rows:
        if all(r.get(k) == v for k, v in match.items()) and r.get("fwdbwd_ms"):
            return r
    return None


def derive(rows: list, world: int) -> None:
    """The relative numbers of every row, from the rows measured so far (idempotent)."""
    for r in rows:
        if not r.get("fwdbwd_ms"):
            continue
        shape = {"S": r["S"], "heads": r["heads"], "kv_heads": r["kv_heads"]}
        per_flop = r["fwdbwd_ms"] / r["useful_fwd_flops"]
        if r["part"] == "docs" and r["case"] in ("docs", "plain") and not r.get("single"):
            plain = _find(rows, part="docs", case="plain", ref=False, single=False, layout=r["layout"], **shape)
            ref = _find(rows, part="docs", case="plain", ref=True, single=False, layout=r["layout"], **shape)
            cp = _find(rows, part="docs", case="context_parallel", **shape)
            one = _find(rows, part="docs", case=r["case"], single=True, **shape)
            if r["case"] == "docs" and plain:
                r["per_flop_vs_plain"] = per_flop / (plain["fwdbwd_ms"] / plain["useful_fwd_flops"])
            if r["case"] == "docs" and ref:
                r["per_flop_vs_plain_same_kernels"] = per_flop / (ref["fwdbwd_ms"] / ref["useful_fwd_flops"])
            if cp and not r.get("ref"):
                r["speedup_vs_cp"] = cp["fwdbwd_ms"] / r["fwdbwd_ms"]
            if one and not r.get("ref"):
                r["eff_vs_1gpu"] = one["fwdbwd_ms"] / (world * r["fwdbwd_ms"])
        elif r["part"] == "window":
            none = _find(rows, part="window", case="no window", ref=False, layout=r["layout"], **shape)
            ref = _find(rows, part="window", case="no window", ref=True, layout=r["layout"], **shape)
            if none:
                r["rel_time"] = r["fwdbwd_ms"] / none["fwdbwd_ms"]
                r["flop_fraction"] = r["useful_fwd_flops"] / none["useful_fwd_flops"]
                r["time_over_flops"] = r["rel_time"] / r["flop_fraction"]
            if ref and r["window"] >= 0:
                r["rel_time_same_kernels"] = r["fwdbwd_ms"] / ref["fwdbwd_ms"]
        elif r["part"] == "extras":
            plain = _find(rows, case="plain", ref=False, single=False, layout=r["layout"], **shape)
            if plain and r is not plain:
                r["rel_time"] = r["fwdbwd_ms"] / plain["fwdbwd_ms"]
                r["per_flop_vs_plain"] = per_flop / (plain["fwdbwd_ms"] / plain["useful_fwd_flops"])


def _plan(cfg: dict, world: int, device, dtype) -> list[dict]:
    """Every case in measuring order (each part's reference first)."""
    from distcomm_attention import which_kernels

    d, be = cfg["head_dim"], cfg["ring_backend"]
    cases = []

    def ref_backend(**feature) -> str | None:
        """The feature's backend when it differs from plain causal's (then plain runs again with it)."""
        if not cfg["kernel_refs"]:
            return None
        q = torch.empty(1, 16, 1, d, device=device, dtype=dtype)
        try:
            plain = which_kernels(q, causal=True, backend=be).backend
            feat = which_kernels(q, causal=True, backend=be, **feature).backend
        except Exception:
            return None
        return feat if feat != plain else None

    docs_ref = ref_backend(cu_seqlens=[0])
    win_ref = ref_backend(window_size=(min(cfg["windows"] or [1]), 0))
    for h, hkv in cfg["heads"]:
        base = {"H": h, "Hkv": hkv, "D": d, "backend": be, "window": (-1, -1), "ref": False, "single": False}
        if "docs" in cfg["parts"]:
            s, lay = cfg["seq"], cfg["layout"]
            docs = packed_documents(s, cfg["doc_min"], cfg["doc_max"], cfg["seed"])
            p = {**base, "part": "docs", "S": s, "layout": lay}
            cases.append({**p, "case": "plain"})
            if docs_ref:
                cases.append({**p, "case": "plain", "backend": docs_ref, "ref": True})
            cases.append({**p, "case": "docs", "docs": docs})
            cases.append({**p, "case": "context_parallel", "method": "cp"})
            if world > 1 and cfg["single"]:
                cases.append({**p, "case": "plain", "single": True})
                cases.append({**p, "case": "docs", "docs": docs, "single": True})
        if "window" in cfg["parts"]:
            s = cfg["window_seq"]
            layouts = cfg["window_layouts"] if world > 1 else cfg["window_layouts"][:1]
            for lay in layouts:
                p = {**base, "part": "window", "S": s, "layout": lay}
                cases.append({**p, "case": "no window"})
                if win_ref:
                    cases.append({**p, "case": "no window", "backend": win_ref, "ref": True})
                for w in cfg["windows"]:
                    if w < s:
                        cases.append({**p, "case": f"window {U.fmt_count(w)}", "window": (w, 0)})
        if "extras" in cfg["parts"]:
            s, lay = cfg["seq"], cfg["layout"]
            p = {**base, "part": "extras", "S": s, "layout": lay}
            if "docs" not in cfg["parts"]:
                cases.append({**p, "case": "plain"})
            cases.append({**p, "case": f"softcap {cfg['softcap']:g}", "softcap": cfg["softcap"]})
            cases.append({**p, "case": f"padding {cfg['pad_frac']:.0%}", "pad_frac": cfg["pad_frac"]})
    return cases


# ----------------------------------------------------------------------------------------------- one rank
def run_rank(rank: int, world: int, cfg: dict) -> dict:
    U.set_safe_env()
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", category=UserWarning)
    device = U.rank_device(cfg["backend_dist"])
    dtype = getattr(torch, cfg["dtype"])
    torch.manual_seed(rank)
    lead = rank == 0
    budget = U.Budget(cfg["budget_s"], device)
    out_path = Path(cfg["out"]) / cfg["json_name"]
    report = {"benchmark": "ring_features", "command": cfg["command"], "env": U.env_info(cfg["backend_dist"], world),
              "config": cfg, "rows": [], "complete": False}
    rows = report["rows"]

    def save():
        if lead:
            U.write_json(out_path, report)  # progressive: a crash or timeout keeps what was measured

    table = U.Table([("part", -6), ("S", 5), ("heads", 5), ("layout", -10), ("case", -16), ("1 GPU", 5),
                     ("kernels", -7), ("steps", 5), ("fwd ms", 8), ("f+b ms", 8), ("TF/s", 5), ("rel", 5),
                     ("note", -1)], enabled=lead)
    table.header(f"Ring attention features on {world} rank(s) ({cfg['backend_dist']}), {cfg['dtype']}, batch "
                 f"{cfg['batch']}, head_dim {cfg['head_dim']}; f+b TF/s = useful FLOPs per GPU; rel = per useful "
                 f"FLOP vs plain (docs, extras) or time vs no window (window)")
    cases = _plan(cfg, world, device, dtype)
    if lead and "docs" in cfg["parts"] and cases:
        docs = next((c["docs"] for c in cases if c.get("docs")), [])
        lens = [b - a for a, b in zip(docs[:-1], docs[1:])]
        report["documents"] = {"cu_seqlens": docs, "count": len(lens), "min": min(lens), "max": max(lens)}
        table.note(f"packed documents: {len(lens)} in S={U.fmt_count(cfg['seq'])}, lengths {min(lens)}..{max(lens)} "
                   f"(seed {cfg['seed']})")
    cp_unsupported = None
    for c in cases:
        row = {k: v for k, v in c.items() if k not in ("docs", "H", "Hkv", "D")}
        row.update(heads=c["H"], kv_heads=c["Hkv"], head_dim=c["D"], window=c["window"][0],
                   num_docs=len(c["docs"]) - 1 if c.get("docs") else None)
        t_case = time.monotonic()
        if budget.exhausted():
            row["error"] = "skipped: time budget spent"
        elif c.get("method") == "cp" and cp_unsupported:
            row["error"] = f"skipped: unsupported here ({cp_unsupported})"
        else:
            if c.get("method") == "cp":
                plain = _find(rows, part=c["part"], case="plain", ref=False, single=False, S=c["S"], heads=c["H"],
                              kv_heads=c["Hkv"])
                iters = plain["iters"] if plain else cfg["min_iters"]
                fn = lambda: bench_context_parallel(c, cfg, device, dtype, iters)  # noqa: E731
            else:
                fn = lambda: bench_case(c, cfg, device, dtype, world)  # noqa: E731
            res, err = U.guarded(fn, device)
            U.release_memory(device)
            if err is None:
                _fill(row, res, c, cfg, world, device)
            else:
                row["error"] = err
                if c.get("method") == "cp":
                    (missing,) = U.all_max([err.startswith("NotImplementedError")], device)
                    if missing:
                        cp_unsupported = err.split(":")[0]
        row["wall_s"] = time.monotonic() - t_case  # warm-up (kernel compiles) included
        rows.append(row)
        derive(rows, world)
        _print_row(table, row)
        save()
    report["summary"] = summarize(report)
    report["elapsed_s"] = budget.elapsed()
    report["complete"] = True
    save()
    return report if lead else {}


def _rel(row: dict) -> float | None:
    return row.get("per_flop_vs_plain", row.get("rel_time"))


def _print_row(table: U.Table, row: dict) -> None:
    note = row.get("error") or row.get("note") or ""
    if row.get("ref"):
        note = "same kernels as the features " + note
    table.row([row["part"], U.fmt_count(row["S"]), f"{row['heads']}/{row['kv_heads']}", row["layout"], row["case"],
               "yes" if row.get("single") else "", (row.get("kernels") or {}).get("backend", "-"),
               row.get("ring_steps", "-"), U.fmt(row.get("fwd_ms"), ".2f"), U.fmt(row.get("fwdbwd_ms"), ".2f"),
               R._tf(row.get("fwdbwd_tflops_per_gpu")), U.fmt(_rel(row), ".2f"), note])


# ------------------------------------------------------------------------------------------------ summary
def summarize(report: dict) -> dict:
    """The issue's targets: packed documents within 1.2x of plain causal per useful FLOP and faster than
    context_parallel; a 4k window's time about proportional to the window (<= 1.5x its FLOP fraction)."""
    derive(report["rows"], report["env"].get("world_size", 1))
    checks = []
    for r in report["rows"]:
        shape = f"S={U.fmt_count(r['S'])} {r['heads']}/{r['kv_heads']} {r['layout']}"
        if r["part"] == "docs" and r["case"] == "docs" and not r.get("single"):
            if r.get("per_flop_vs_plain") is not None:
                checks.append({"check": f"packed docs {shape}: time per useful FLOP vs plain causal <= 1.2",
                               "value": r["per_flop_vs_plain"], "ok": r["per_flop_vs_plain"] <= 1.2})
            if r.get("speedup_vs_cp") is not None:
                checks.append({"check": f"packed docs {shape}: faster than context_parallel (causal over the whole "
                                        "sequence)", "value": r["speedup_vs_cp"], "ok": r["speedup_vs_cp"] > 1.0})
        if r["part"] == "window" and r["window"] == 4096 and r.get("time_over_flops") is not None:
            checks.append({"check": f"window 4k {shape}: time vs no window <= 1.5 x its FLOP fraction "
                                    f"({r['flop_fraction']:.3f})", "value": r["time_over_flops"],
                           "ok": r["time_over_flops"] <= 1.5})
    errors = sorted({f"{r['case']}: {r['error']}" for r in report["rows"] if r.get("error")})
    return {"checks": checks, "passed": sum(c["ok"] for c in checks), "failed": sum(not c["ok"] for c in checks),
            "errors": errors}


def print_summary(summary: dict) -> None:
    print(f"\nTargets: {summary['passed']} met, {summary['failed']} missed", flush=True)
    for c in summary["checks"]:
        print(f"  {'PASS' if c['ok'] else 'MISS'}  {c['check']}: {U.fmt(c['value'], '.3f')}", flush=True)
    for e in summary["errors"]:
        print(f"  error  {e}", flush=True)
    print(f"  note   {CP_NOTE}", flush=True)


def plot(report: dict, path: Path) -> Path | None:
    """Time relative to no window against the window, one panel per head shape, beside the FLOP fraction."""
    rows = [r for r in report["rows"] if r["part"] == "window" and r.get("rel_time") is not None and r["window"] >= 0]
    if not rows:
        return None
    env = report.get("env", {})
    palette = {"contiguous": "tab:blue", "zigzag": "tab:red", "striped": "tab:green"}
    panels = []
    for h, hkv, s in dict.fromkeys((r["heads"], r["kv_heads"], r["S"]) for r in rows):
        mine = [r for r in rows if (r["heads"], r["kv_heads"], r["S"]) == (h, hkv, s)]
        windows = sorted({r["window"] for r in mine})
        series = []
        for lay in dict.fromkeys(r["layout"] for r in mine):
            pts = sorted((r["window"], r["rel_time"]) for r in mine if r["layout"] == lay)
            series.append({"label": f"{lay}", "x": [p[0] for p in pts], "y": [p[1] for p in pts],
                           "color": palette.get(lay)})
        frac = sorted({(r["window"], r["flop_fraction"]) for r in mine})
        series.append({"label": "FLOP fraction (proportional)", "x": [f[0] for f in frac], "y": [f[1] for f in frac],
                       "style": "--", "color": "black"})
        panels.append({"title": f"S={U.fmt_count(s)}, {h}/{hkv} heads, causal", "xlabel": "window (left)",
                       "ylabel": "fwd+bwd time / no window", "xscale": "log", "yscale": "log",
                       "xticks": [(w, U.fmt_count(w)) for w in windows], "series": series})
    return U.plot_panels(path, panels, title=f"Sliding-window ring attention, {env.get('world_size')} x "
                                              f"{env.get('gpu', 'CPU')}, {report['config']['dtype']}")


def write_markdown(report: dict, path: Path) -> Path:
    cfg = report["config"]
    world = report["env"].get("world_size", 1)
    rows = report["rows"]
    text = U.markdown_header("Ring attention: packed documents, sliding windows, softcap, padding", report)
    text += (f"\n{cfg['dtype']}, batch {cfg['batch']}, head_dim {cfg['head_dim']}, causal, {world} GPU(s), backend "
             f"`{cfg['ring_backend']}` (kernels: the backend `which_kernels` resolved). Forward+backward, CUDA events "
             f"after warm-up, slowest rank. TFLOP/s per GPU of USEFUL FLOPs (4·b·h·d·visible pairs, x3.5 for "
             f"fwd+bwd). steps = ring steps communicated; imbalance = busiest rank's visible pairs / mean.\n")

    def kern(r):
        return (r.get("kernels") or {}).get("backend", "")

    def err(r):
        return (r.get("error") or "")[:90]

    part = [r for r in rows if r["part"] == "docs"]
    if part:
        d = report.get("documents", {})
        text += (f"\n### Packed documents\n\n{d.get('count')} documents of lengths {d.get('min')}..{d.get('max')} "
                 f"(uniform in [{cfg['doc_min']}, {cfg['doc_max']}], seed {cfg['seed']}) in S = "
                 f"{U.fmt_count(cfg['seq'])}. per FLOP vs plain = (T/F_useful) / (T_plain/F_plain) (target <= 1.2); "
                 f"vs CP = T_context_parallel / T. **{CP_NOTE}** (its TFLOP/s count the causal FLOPs it computes). "
                 + (f"GPUs = 1: `ring_size=1`, the whole sequence on each GPU alone (the faster kept); eff vs 1 GPU "
                    f"= T_one_GPU / ({world} T)." if world > 1 else "On one GPU the ring of one is the single-GPU "
                    "number.") + "\n\n")
        text += U.markdown_table(
            ["heads", "case", "GPUs", "kernels", "steps", "imbalance", "fwd ms", "f+b ms", "f+b TF/s",
             "per FLOP vs plain", "vs CP", "eff vs 1 GPU", "peak GiB", "error"],
            [[f"{r['heads']}/{r['kv_heads']}", r["case"] + (" (same kernels as docs)" if r.get("ref") else ""),
              r.get("gpus", ""), kern(r), r.get("ring_steps", ""), U.fmt(r.get("imbalance"), ".2f"),
              U.fmt(r.get("fwd_ms"), ".1f"), U.fmt(r.get("fwdbwd_ms"), ".1f"), R._tf(r.get("fwdbwd_tflops_per_gpu")),
              U.fmt(r.get("per_flop_vs_plain"), ".2f")
              + (f" ({r['per_flop_vs_plain_same_kernels']:.2f} same kernels)"
                 if r.get("per_flop_vs_plain_same_kernels") is not None else ""),
              U.fmt(r.get("speedup_vs_cp"), ".2f"), U.fmt(r.get("eff_vs_1gpu"), ".2f"), U.fmt(r.get("peak_gib"), ".1f"),
              err(r)] for r in part], align="llrlrrrrrrrrrl") + "\n"
    part = [r for r in rows if r["part"] == "window"]
    if part:
        text += (f"\n### Sliding window\n\nS = {U.fmt_count(cfg['window_seq'])}, causal with window_size=(w, 0). rel = "
                 f"T / T_no_window; FLOP fraction = visible pairs / causal pairs (what rel would be if time were "
                 f"proportional to the window); rel (same kernels) divides by no window run with the window's "
                 f"kernels.\n\n")
        text += U.markdown_table(
            ["heads", "layout", "case", "kernels", "steps", "imbalance", "fwd ms", "f+b ms", "f+b TF/s", "rel",
             "FLOP fraction", "rel (same kernels)", "error"],
            [[f"{r['heads']}/{r['kv_heads']}", r["layout"], r["case"] + (" (window kernels)" if r.get("ref") else ""),
              kern(r), r.get("ring_steps", ""), U.fmt(r.get("imbalance"), ".2f"), U.fmt(r.get("fwd_ms"), ".1f"),
              U.fmt(r.get("fwdbwd_ms"), ".1f"), R._tf(r.get("fwdbwd_tflops_per_gpu")), U.fmt(r.get("rel_time"), ".3f"),
              U.fmt(r.get("flop_fraction"), ".3f"), U.fmt(r.get("rel_time_same_kernels"), ".3f"), err(r)]
             for r in part], align="llllrrrrrrrrl") + "\n"
    part = [r for r in rows if r["part"] == "extras" or (r["part"] == "docs" and r["case"] == "plain"
                                                          and not r.get("ref") and not r.get("single")
                                                          and any(x["part"] == "extras" for x in rows))]
    if part:
        text += (f"\n### Softcap and padding\n\nS = {U.fmt_count(cfg['seq'])}, layout {cfg['layout']}; rel = T / "
                 f"T_plain_causal; padding: the last {cfg['pad_frac']:.0%} of the keys masked (useful FLOPs count "
                 f"only visible keys).\n\n")
        text += U.markdown_table(
            ["heads", "case", "kernels", "fwd ms", "f+b ms", "f+b TF/s", "rel", "per FLOP vs plain", "error"],
            [[f"{r['heads']}/{r['kv_heads']}", r["case"], kern(r), U.fmt(r.get("fwd_ms"), ".1f"),
              U.fmt(r.get("fwdbwd_ms"), ".1f"), R._tf(r.get("fwdbwd_tflops_per_gpu")), U.fmt(r.get("rel_time"), ".2f"),
              U.fmt(r.get("per_flop_vs_plain"), ".2f") if r["part"] == "extras" else "", err(r)] for r in part],
            align="lllrrrrrl") + "\n"
    summary = report.get("summary", {})
    if summary.get("checks"):
        text += f"\nTargets: {summary['passed']} met, {summary['failed']} missed.\n\n"
        text += "\n".join(f"- {'PASS' if c['ok'] else 'MISS'} {c['check']}: {U.fmt(c['value'], '.3f')}"
                           for c in summary["checks"]) + "\n"
    if report.get("failure"):
        text += f"\nThe run ended early: {report['failure']}\n"
    path.write_text(text)
    return path


# --------------------------------------------------------------------------------------------------- main
def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--parts", type=U.parse_list, help=f"subset of {','.join(PARTS)} (default all)")
    p.add_argument("--seq", type=U.parse_count, help="total S of the docs and extras parts (default 32k)")
    p.add_argument("--window-seq", type=U.parse_count, help="total S of the window part (default 128k)")
    p.add_argument("--windows", type=lambda s: U.parse_list(s, U.parse_count),
                   help="left window sizes (default 1k,2k,4k,8k,16k)")
    p.add_argument("--doc-min", type=U.parse_count, help="shortest document (default 512)")
    p.add_argument("--doc-max", type=U.parse_count, help="longest document (default 8k)")
    p.add_argument("--seed", type=int, default=0, help="seed of the document lengths (default 0)")
    p.add_argument("--heads", type=R._heads, help="query/kv heads, e.g. 32/32,32/8 (default)")
    p.add_argument("--head-dim", type=int)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--layout", choices=["contiguous", "zigzag", "striped"],
                   help="layout of the docs and extras parts (default zigzag)")
    p.add_argument("--window-layouts", type=U.parse_list, help="layouts of the window part (default contiguous,zigzag)")
    p.add_argument("--backend", dest="ring_backend", help="ring_flash_attn backend (default auto; --smoke torch)")
    p.add_argument("--kernel-refs", action=argparse.BooleanOptionalAction, default=True,
                   help="also time plain causal with the features' backend where auto picks other kernels for it")
    p.add_argument("--single", action=argparse.BooleanOptionalAction, default=True,
                   help="with W > 1: also run the docs part's cases on one GPU alone (ring_size=1)")
    p.add_argument("--softcap", type=float, default=50.0)
    p.add_argument("--pad-frac", type=float, default=0.1, help="fraction of keys padded at the end (default 0.1)")
    p.add_argument("--dtype", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--cp-rotate", choices=["allgather", "alltoall"],
                   help="context_parallel KV rotation (default: torch's default)")
    p.add_argument("--iters", type=int, help="most timed iterations per case (default 20)")
    p.add_argument("--min-iters", type=int, help="fewest timed iterations per case (default 3)")
    p.add_argument("--warmup", type=int, help="warm-up iterations (default 2)")
    p.add_argument("--case-seconds", type=float, help="aimed measuring time per case (default 1.0)")
    p.add_argument("--world-size", type=int, default=2, help="local ranks to start (not under torchrun)")
    p.add_argument("--budget", type=float, default=300.0,
                   help="seconds of measuring after which remaining cases are skipped (default 300)")
    p.add_argument("--out", default=None, help="output directory (default docs/bench; with --smoke a new temporary folder)")
    p.add_argument("--nccl-priority", choices=["high", "default"], default="high",
                   help="NCCL stream priority (default high: TORCH_NCCL_HIGH_PRIORITY=1)")
    p.add_argument("--smoke", action="store_true", help="CPU/gloo, tiny shapes, torch backend: plumbing only")
    args = p.parse_args(argv)
    args.out = U.out_dir(args.out, args.smoke)
    return args


def make_config(args: argparse.Namespace) -> dict:
    if args.smoke:
        d = dict(parts=list(PARTS), seq=256, window_seq=512, windows=[32, 128], doc_min=16, doc_max=96,
                 heads=[(2, 2), (2, 1)], head_dim=16, layout="zigzag", window_layouts=["contiguous", "zigzag"],
                 ring_backend="torch", dtype="float32", iters=1, min_iters=1, warmup=1, case_seconds=0.0)
    else:
        d = dict(parts=list(PARTS), seq=32768, window_seq=131072, windows=[1024, 2048, 4096, 8192, 16384],
                 doc_min=512, doc_max=8192, heads=[(32, 32), (32, 8)], head_dim=128, layout="zigzag",
                 window_layouts=["contiguous", "zigzag"], ring_backend="auto", dtype="bfloat16", iters=20,
                 min_iters=3, warmup=2, case_seconds=1.0)
    cfg = {k: (getattr(args, k) if getattr(args, k, None) is not None else v) for k, v in d.items()}
    world = args.world_size
    if U.under_torchrun():
        world = int(os.environ["WORLD_SIZE"])
    for part in cfg["parts"]:
        if part not in PARTS:
            raise SystemExit(f"unknown part {part!r}; choose from {', '.join(PARTS)}")
    for lay in cfg["window_layouts"]:
        if lay not in R.LAYOUTS:
            raise SystemExit(f"unknown layout {lay!r} in --window-layouts; choose from {', '.join(R.LAYOUTS)}")
    for name in ("seq", "window_seq"):
        if cfg[name] % (2 * world):
            raise SystemExit(f"--{name.replace('_', '-')}={cfg[name]} must be divisible by 2 x world size = "
                             f"{2 * world} (zigzag layout)")
    if not 1 <= cfg["doc_min"] <= cfg["doc_max"]:
        raise SystemExit(f"need 1 <= --doc-min <= --doc-max, got {cfg['doc_min']} and {cfg['doc_max']}")
    if any(w < 0 for w in cfg["windows"]):
        raise SystemExit(f"--windows must be >= 0, got {cfg['windows']}")
    if not 0 < args.pad_frac < 1:
        raise SystemExit(f"--pad-frac must be in (0, 1), got {args.pad_frac}")
    backend_dist = "gloo" if args.smoke or not torch.cuda.is_available() else "nccl"
    name = "ring_features_smoke" if args.smoke else "ring_features"
    cfg.update(batch=args.batch, seed=args.seed, kernel_refs=args.kernel_refs, single=args.single,
               softcap=args.softcap, pad_frac=args.pad_frac, cp_rotate=args.cp_rotate, backend_dist=backend_dist,
               out=args.out, budget_s=args.budget, json_name=f"{name}.json", md_name=f"{name}.md",
               png_name=f"{name}.png", command=U.command_line(), smoke=args.smoke)
    return cfg


def main(argv=None) -> int:
    args = parse_args(argv)
    U.set_nccl_priority(args.nccl_priority)
    cfg = make_config(args)
    world = args.world_size
    if cfg["backend_dist"] == "nccl" and not U.under_torchrun() and torch.cuda.device_count() < world:
        print(f"need {world} GPUs for NCCL, found {torch.cuda.device_count()} (use --smoke for a CPU run)")
        return 2
    out = Path(cfg["out"])
    t0 = time.monotonic()
    report, failure = U.run_report(run_rank, world, cfg, backend=cfg["backend_dist"],
                                   timeout=cfg["budget_s"] + 180, summarize=summarize)
    if report is None:
        return 1 if failure else 0
    print_summary(report["summary"])
    png = plot(report, out / cfg["png_name"])
    md = write_markdown(report, out / cfg["md_name"])
    print(f"\nwrote {out / cfg['json_name']}, {md}" + (f", {png}" if png else "")
          + f" in {time.monotonic() - t0:.0f} s", flush=True)
    return 1 if failure else 0


if __name__ == "__main__":
    sys.exit(main())
