"""Driver for scripts/profile_triton_kernels.sh: one launch each of our Triton forward/backward and cuDNN's,
under Nsight Compute; and the summary of the resulting report.

    python scripts/_profile_driver.py --seq 8192 --no-profile       # warm-up only (fills Triton's cache)
    ncu --profile-from-start off ... python scripts/_profile_driver.py --seq 8192
    python scripts/_profile_driver.py --summarize OUT_DIR           # raw.csv (+ raw_nvtx.csv) -> summary

Profiled run: every case runs twice un-profiled (compile, warm-up), then ``cudaProfilerStart``, and per
case one call inside an NVTX range named after it, followed by a marker kernel (``torch.cuda._sleep``,
ATen's ``spin_kernel``) so that the summary can assign kernels to cases even without NVTX renaming, then
``cudaProfilerStop``. Cases, in this order, for each mask (causal, full): ours_fwd (``TritonForward``
final step), ours_bwd (``TritonBackward`` dK/dV + dQ kernels, dK/dV in the input dtype), cudnn_fwd,
cudnn_bwd (``aten._scaled_dot_product_cudnn_attention`` and its backward, (B, H, S, D) views as in
bench_block_kernels.py). bf16, B = 1, 32 heads, head_dim 128.
"""

from __future__ import annotations

import argparse
import csv
import json
import re
import sys
from pathlib import Path


def cases(seq: int, heads: int, head_dim: int):
    """[(name, fn)] in launch order."""
    import torch

    from distcomm_attention.kernels.triton_bwd import TritonBackward
    from distcomm_attention.kernels.triton_fwd import TritonForward
    from distcomm_attention.planning.visibility import CAUSAL, FULL

    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, dout = (torch.randn(1, seq, heads, head_dim, generator=gen, device="cuda", dtype=torch.bfloat16)
                     for _ in range(4))
    scale = head_dim**-0.5
    out_list = []
    for causal in (True, False):
        mask = "causal" if causal else "full"
        block = CAUSAL if causal else FULL
        fwd, bwd = TritonForward(), TritonBackward()
        st = fwd.init_state(q)
        fwd.step(st, q, k, v, mask=block, scale=scale, final=True)
        out, lse = fwd.finalize(st, q.dtype)
        delta = (dout.float() * out.float()).sum(-1).transpose(1, 2).contiguous()

        def ours_fwd(block=block, fwd=fwd):
            s = fwd.init_state(q)
            fwd.step(s, q, k, v, mask=block, scale=scale, final=True)

        def ours_bwd(block=block, lse=lse, delta=delta, bwd=bwd):
            bwd.step(dout, q, k, v, None, lse, delta, mask=block, scale=scale, dkv_dtype=q.dtype)

        qt, kt, vt, dot = (x.transpose(1, 2) for x in (q, k, v, dout))
        op = torch.ops.aten._scaled_dot_product_cudnn_attention
        res = op(qt, kt, vt, None, True, 0.0, causal, False, scale=scale)
        c_out, c_lse, cum_q, cum_k, max_q, max_k, seed, offset = res[:8]

        def cudnn_fwd(causal=causal):
            op(qt, kt, vt, None, True, 0.0, causal, False, scale=scale)

        def cudnn_bwd(causal=causal, c_out=c_out, c_lse=c_lse, cum_q=cum_q, cum_k=cum_k, max_q=max_q,
                      max_k=max_k, seed=seed, offset=offset):
            torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
                dot, qt, kt, vt, c_out, c_lse, seed, offset, None, cum_q, cum_k, max_q, max_k, 0.0, causal,
                scale=scale)

        out_list += [(f"{mask}:ours_fwd", ours_fwd), (f"{mask}:ours_bwd", ours_bwd),
                     (f"{mask}:cudnn_fwd", cudnn_fwd), (f"{mask}:cudnn_bwd", cudnn_bwd)]
    return out_list


def run(args) -> None:
    import torch

    todo = cases(args.seq, args.heads, args.head_dim)
    for name, fn in todo:
        try:
            for _ in range(args.warmup):
                fn()
            torch.cuda.synchronize()
        except Exception as exc:  # a case that cannot run is reported and left out
            print(f"{name}: FAILED in warm-up: {type(exc).__name__}: {exc}", flush=True)
            todo = [(n, f) for n, f in todo if n != name]
    print("cases: " + ", ".join(n for n, _ in todo), flush=True)
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "cases.json").write_text(json.dumps([n for n, _ in todo]))
    if args.no_profile:
        return
    torch.cuda.profiler.start()
    for name, fn in todo:
        torch.cuda.nvtx.range_push(name)
        fn()
        torch.cuda.nvtx.range_pop()
        torch.cuda._sleep(1000)  # marker kernel between cases (spin_kernel)
        torch.cuda.synchronize()
    torch.cuda.profiler.stop()
    print("profiled", flush=True)


# -------------------------------------------------------------------------------------------- summary
COLUMNS = [  # (short name, metric column) in the raw page; missing columns are left out
    ("dur_us", "gpu__time_duration.sum"),
    ("sm_thru_%", "sm__throughput.avg.pct_of_peak_sustained_elapsed"),
    ("gmma_pipe_%", "sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_active"),
    ("hmma_pipe_%", "sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active"),
    ("gmma_inst", "sm__inst_executed_pipe_tensor_op_gmma.sum"),
    ("issue_active_%", "sm__inst_issued.avg.pct_of_peak_sustained_active"),
    ("dram_%", "dram__throughput.avg.pct_of_peak_sustained_elapsed"),
    ("regs", "launch__registers_per_thread"),
    ("threads", "launch__block_size"),
    ("grid", "launch__grid_size"),
    ("smem_dyn_B", "launch__shared_mem_per_block_dynamic"),
    ("occ_theor_%", "sm__maximum_warps_per_active_cycle_pct"),
    ("occ_achieved_%", "sm__warps_active.avg.pct_of_peak_sustained_active"),
    ("local_ld_B", "l1tex__t_bytes_pipe_lsu_mem_local_op_ld.sum"),
    ("local_st_B", "l1tex__t_bytes_pipe_lsu_mem_local_op_st.sum"),
]
_STALL = re.compile(r"^smsp__average_warps?_(?:latency_)?issue_stalled_(\w+?)(?:_per_issue_active)?\.ratio$")
_TIME_UNITS = {"ns": 1e-3, "usecond": 1.0, "us": 1.0, "nsecond": 1e-3, "ms": 1e3, "msecond": 1e3, "s": 1e6,
               "second": 1e6}


def _num(text: str) -> float | None:
    try:
        return float(text.replace(",", ""))
    except (ValueError, AttributeError):
        return None


def _read_raw(path: Path) -> tuple[list[str], list[str], list[list[str]]]:
    """ncu --page raw --csv: a header row, a units row, then one row per kernel."""
    lines = [ln for ln in path.read_text(errors="replace").splitlines() if ln.startswith('"')]
    rows = list(csv.reader(lines))
    if len(rows) < 2:
        return [], [], []
    return rows[0], rows[1], rows[2:]


def summarize(out_dir: Path) -> None:
    header, units, rows = _read_raw(out_dir / "raw.csv")
    if not rows:
        raise SystemExit(f"no kernels in {out_dir / 'raw.csv'} (see ncu.log)")
    col = {name: i for i, name in enumerate(header)}
    nvtx_names = {}
    nvtx = out_dir / "raw_nvtx.csv"
    if nvtx.exists():
        h2, _, r2 = _read_raw(nvtx)
        if "ID" in h2 and "Kernel Name" in h2:
            nvtx_names = {r[h2.index("ID")]: r[h2.index("Kernel Name")] for r in r2}
    case_order = json.loads((out_dir / "cases.json").read_text()) if (out_dir / "cases.json").exists() else []
    table, case_i = [], 0
    for r in rows:
        name = r[col["Kernel Name"]]
        if "spin_kernel" in name:  # marker between cases
            case_i += 1
            continue
        case = case_order[case_i] if case_i < len(case_order) else f"case{case_i}"
        renamed = nvtx_names.get(r[col["ID"]], "")
        if renamed and renamed != name and ":" in renamed:
            case = renamed.split("/")[-1]
        entry = {"case": case, "kernel": re.sub(r"\(.*", "", name)[:60]}
        for short, metric in COLUMNS:
            if metric in col:
                v = _num(r[col[metric]])
                if short == "dur_us" and v is not None:
                    v *= _TIME_UNITS.get(units[col[metric]].strip(), 1.0)
                entry[short] = v
        stalls = []
        for metric, i in col.items():
            m = _STALL.match(metric)
            if m and not metric.endswith("_not_issued.ratio"):
                v = _num(r[i])
                if v is not None:
                    stalls.append((v, m.group(1)))
        stalls.sort(reverse=True)
        entry["top_stalls"] = "; ".join(f"{n} {v:.2f}" for v, n in stalls[:4])
        table.append(entry)
    keys = ["case", "kernel"] + [s for s, _ in COLUMNS if any(s in e for e in table)] + ["top_stalls"]
    with open(out_dir / "summary.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys, extrasaction="ignore")
        w.writeheader()
        w.writerows(table)
    fmt = lambda v: "-" if v is None else (f"{v:.1f}" if isinstance(v, float) else str(v))  # noqa: E731
    cells = [[fmt(e.get(k)) for k in keys] for e in table]
    widths = [max(len(k), *(len(c[i]) for c in cells)) for i, k in enumerate(keys)]
    text = "\n".join(["  ".join(k.ljust(w) for k, w in zip(keys, widths))]
                     + ["  ".join(c.ljust(w) for c, w in zip(row, widths)) for row in cells])
    (out_dir / "summary.txt").write_text(text + "\n")
    print(text)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], epilog=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seq", type=int, default=8192)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--out", default=None, help="where to write cases.json")
    p.add_argument("--no-profile", action="store_true", help="warm-up only (no profiler start/stop)")
    p.add_argument("--summarize", type=Path, default=None, help="summarize raw.csv in this folder and exit")
    args = p.parse_args(argv)
    if args.summarize:
        summarize(args.summarize)
        return 0
    run(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
