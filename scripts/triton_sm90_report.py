"""Ahead-of-time sm_90a compile report of our Triton attention kernels and the forward candidates (no GPU).

Our forward is reported as it runs for head_dim 128: the split-2 kernel (Note [Split-2 forward] in
distcomm_attention.kernels.triton_fwd) with TMA q/k/v loads, and the plain ``_ring_fwd_kernel`` it falls back to.

    PYTHONPATH=. python scripts/triton_sm90_report.py                  # ours + candidates, a table
    PYTHONPATH=. python scripts/triton_sm90_report.py --only ours --json report.json

Each kernel is compiled exactly as Triton's JIT would compile it for an H100 (``GPUTarget("cuda", 90,
32)``): the launch arguments are built by our own launchers (``_fwd_last_impl`` / ``_bwd_block_impl``
with CPU tensors, the kernel object swapped for a recorder) and specialised with Triton's
``native_specialize_impl`` (pointer alignment, ints divisible by 16, ints equal to 1 as constants), then
``triton.compile``. Per kernel: registers, spill stores/loads and stack (``ptxas -v`` on the kernel's PTX,
the flags Triton uses), shared memory (Triton's allocation), and from the code: wgmma in the PTX / HGMMA
in the SASS, TMA (``cp.async.bulk.tensor`` / UTMALDG) vs cp.async (LDGSTS) loads, local loads/stores in
the SASS (spill traffic sites), and whether Triton warp-specialised a loop (``ttg.warp_specialize`` in the
TTGIR, ``setmaxnreg`` in the PTX).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parent))

_BIN = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"


def aot_compile(kernel, args, kwargs, *, arch: int = 90):
    """Compile ``kernel[grid](*args, **kwargs)`` for sm_{arch} as the JIT would -> (CompiledKernel, seconds).

    The specialization, options and cache key are those of ``JITFunction.run``, so on a GPU machine the
    result lands in Triton's on-disk cache and a later launch with arguments of the same specialization
    loads it instead of compiling.
    """
    from triton import knobs
    from triton.backends.compiler import GPUTarget
    from triton.compiler.compiler import ASTSource, make_backend
    from triton.runtime.jit import create_function_from_signature

    target = GPUTarget("cuda", arch, 32)
    backend = make_backend(target)
    kwargs = dict(kwargs)
    kwargs["debug"] = kwargs.get("debug", kernel.debug) or knobs.runtime.debug
    kwargs["instrumentation_mode"] = knobs.compilation.instrumentation_mode
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    bound_args, specialization, options = binder(*args, **kwargs)
    options, signature, constexprs, attrs = kernel._pack_args(backend, kwargs, bound_args, specialization, options)
    t0 = time.monotonic()
    compiled = triton.compile(ASTSource(kernel, signature, constexprs, attrs), target=target,
                              options=options.__dict__)
    return compiled, time.monotonic() - t0


def _ptxas_report(ptx: str, arch: int = 90) -> dict:
    """registers / spill bytes / stack from ``ptxas -v`` (the flags Triton's make_cubin uses)."""
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "k.ptx"
        src.write_text(ptx)
        proc = subprocess.run([str(_BIN / "ptxas"), "-lineinfo", "-v", f"--gpu-name=sm_{arch}a", str(src), "-o",
                               str(Path(tmp) / "k.cubin")], capture_output=True, text=True, timeout=300)
    log = proc.stderr + proc.stdout
    num = lambda pat: int(m.group(1)) if (m := re.search(pat, log)) else None  # noqa: E731
    return {"registers": num(r"Used (\d+) registers"), "spill_stores": num(r"(\d+) bytes spill stores"),
            "spill_loads": num(r"(\d+) bytes spill loads"), "stack": num(r"(\d+) bytes stack frame")}


def resources(compiled, arch: int = 90) -> dict:
    """Registers, spills, shared memory and instruction facts of a compiled kernel (see the module doc)."""
    asm = compiled.asm
    ptx, ttgir = asm["ptx"], asm.get("ttgir", "")
    res = _ptxas_report(ptx, arch)
    try:
        sass = asm["sass"]
    except Exception as exc:  # nvdisasm missing: PTX facts only
        sass = ""
        res["sass_error"] = str(exc)[:200]
    count = lambda pat, text: len(re.findall(pat, text))  # noqa: E731
    res.update({
        "shared": compiled.metadata.shared,
        "num_warps": compiled.metadata.num_warps,
        "num_stages": compiled.metadata.num_stages,
        "wgmma": count(r"wgmma\.mma_async", ptx) > 0,
        "wgmma_ptx": count(r"wgmma\.mma_async", ptx),
        "hgmma_sass": count(r"\bHGMMA\.", sass),
        "mma_sync_ptx": count(r"\bmma\.sync", ptx),
        "tma": count(r"cp\.async\.bulk\.tensor", ptx) > 0,
        "utmaldg_sass": count(r"\bUTMALDG", sass),
        "cp_async_ldgsts_sass": count(r"\bLDGSTS", sass),
        "local_ld_st_sass": count(r"\b(?:LDL|STL)\b", sass),
        "warp_specialized": "ttg.warp_specialize" in ttgir,
        "setmaxnreg": count(r"setmaxnreg", ptx),
        "sass_md5": hashlib.md5(sass.encode()).hexdigest()[:12] if sass else None,
    })
    return res


# --------------------------------------------------------------------------------------------------------
# Our kernels, with the arguments our launchers pass
# --------------------------------------------------------------------------------------------------------


class _Recorder:
    """Stands in for a @triton.jit kernel: ``rec[grid](*args, **kwargs)`` records instead of launching."""

    def __init__(self, kernel):
        self.kernel, self.calls = kernel, []

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.calls.append((grid, args, kwargs))


def our_launches(seqlen: int = 8192, heads: int = 32, kv_heads: int = 32, head_dim: int = 128,
                 dtype=torch.bfloat16) -> list[tuple[str, str, object, tuple, dict]]:
    """(name, config, kernel, args, kwargs) of our forward final step and backward, for causal and full
    blocks, as ``_fwd_last_impl`` / ``_bwd_block_impl`` launch them.

    The forward is compiled both ways it runs at head_dim 128 in bf16: its default, the split-2 kernel
    (Note [Split-2 forward]) with TMA loads of q, k and v as on an sm_90 GPU, and the plain
    ``_ring_fwd_kernel`` with the plain config, which launches where TMA does not apply."""
    import distcomm_attention.kernels.triton_bwd as B
    import distcomm_attention.kernels.triton_fwd as F

    q = torch.empty(1, seqlen, heads, head_dim, dtype=dtype)
    k = torch.empty(1, seqlen, kv_heads, head_dim, dtype=dtype)
    v, dout = torch.empty_like(k), torch.empty_like(q)
    lse = torch.empty(1, heads, seqlen, dtype=torch.float32)
    delta = torch.empty_like(lse)
    fcfg = F.default_config(head_dim, dtype, interpret=False)
    plain = F.default_config(head_dim, torch.float32, interpret=False)  # split 1
    fwd_variants = [(f"fwd split={fcfg.split}, TMA q/k/v", fcfg, True)]  # (label, config, TMA available)
    if fcfg.split != 1:
        fwd_variants.append(("fwd split=1, where TMA does not apply", plain, False))
    bcfg = B.default_backward_config(head_dim, dtype, interpret=False)
    launches = []
    saved = (F._ring_fwd_kernel, F._ring_fwd_split_kernel, B._bwd_dkdv_kernel, B._bwd_dq_kernel, F._tma_capable)
    rec_f, rec_s, rec_kv, rec_q = (_Recorder(k_) for k_ in saved[:4])
    try:
        F._ring_fwd_kernel, F._ring_fwd_split_kernel, B._bwd_dkdv_kernel, B._bwd_dq_kernel = rec_f, rec_s, rec_kv, rec_q
        for mode, mask in ((1, "causal"), (0, "full")):
            empty = torch.empty(0, dtype=torch.float32)
            for label, cfg, tma in fwd_variants:
                F._tma_capable = lambda device, tma=tma: tma
                F._fwd_last_impl(q, k, v, empty, empty, empty, None, None, None, mode, head_dim**-0.5, 0.0, False,
                                 *cfg.astuple())
                rec = rec_s if cfg.split == 2 else rec_f
                grid, args, kwargs = rec.calls.pop()
                if cfg.split == 2 and not (kwargs["TMA_Q"] and kwargs["TMA"]):
                    raise RuntimeError(f"{label}: the launcher chose TMA_Q={kwargs['TMA_Q']}, TMA={kwargs['TMA']}")
                name = rec.kernel.fn.__name__
                launches.append((f"{name} ({label}, final step) {mask}",
                                 "(block_m, block_n, warps, stages, split) = " + str(cfg.astuple()), rec.kernel,
                                 args, kwargs))
            dq = torch.empty(q.shape, dtype=torch.float32)
            B._bwd_block_impl(dout, q, k, v, lse, delta, dq, None, None, None, None, None, mode, False,
                              head_dim**-0.5, 0.0, dtype, *bcfg.astuple())
            t = bcfg.astuple()
            for rec, name, cfg in ((rec_kv, "_bwd_dkdv_kernel", t[:4]), (rec_q, "_bwd_dq_kernel", t[4:])):
                grid, args, kwargs = rec.calls.pop()
                launches.append((f"{name} {mask}", "(block_m, block_n, warps, stages) = " + str(cfg), rec.kernel,
                                 args, kwargs))
    finally:
        F._ring_fwd_kernel, F._ring_fwd_split_kernel, B._bwd_dkdv_kernel, B._bwd_dq_kernel, F._tma_capable = saved
    return launches


def report_ours(arch: int = 90) -> dict:
    """{kernel name + mask: resources or error} for our kernels at their head_dim-128 defaults."""
    out = {}
    for name, cfg, kernel, args, kwargs in our_launches():
        try:
            compiled, seconds = aot_compile(kernel, args, kwargs, arch=arch)
            out[name] = {"config": cfg, **resources(compiled, arch), "compile_s": round(seconds, 1)}
        except Exception as exc:
            out[name] = {"config": cfg, "error": f"{type(exc).__name__}: {' '.join(str(exc).split())[:500]}"}
    return out


# --------------------------------------------------------------------------------------------------------
# Report
# --------------------------------------------------------------------------------------------------------


def table(rows: list[tuple[str, str, dict]]) -> str:
    head = ("| kernel | config | regs | spill st/ld B | stack B | smem B | wgmma (PTX/HGMMA) | TMA loads | "
            "cp.async | LDL/STL | warp-spec. |")
    lines = [head, "|" + " --- |" * 11]
    for name, cfg, r in rows:
        if "error" in r:
            lines.append(f"| {name} | {cfg} | ERROR: {r['error'][:200]} |" + " |" * 8)
            continue
        ws = "yes" if r["warp_specialized"] else "no"
        if r["setmaxnreg"]:
            ws += f" (setmaxnreg x{r['setmaxnreg']})"
        lines.append(
            f"| {name} | {cfg} | {r['registers']} | {r['spill_stores']}/{r['spill_loads']} | {r['stack']} | "
            f"{r['shared']} | {'yes' if r['wgmma'] else 'NO'} ({r['wgmma_ptx']}/{r['hgmma_sass']}) | "
            f"{'yes' if r['tma'] else 'no'} ({r['utmaldg_sass']}) | {r['cp_async_ldgsts_sass']} | "
            f"{r['local_ld_st_sass']} | {ws} |")
    return "\n".join(lines)


def ws_notes(raw: dict, T) -> list[str]:
    """For each warp_specialize probe: did it compile, and is its SASS that of the same candidate without
    warp_specialize (i.e. was the flag a no-op)?"""
    from dataclasses import replace

    notes = []
    for probe in T.WS_PROBES:
        if probe.name not in raw:
            continue
        base = replace(probe, name="", warp_spec=False, ws_outer=False, why="")
        twin = next((c for c in T.CANDIDATES if replace(c, name="", why="") == base), None)
        for mask, r in raw[probe.name].items():
            if "error" in r:
                notes.append(f"- {probe.name} {mask}: does not compile ({r['error'][:160]})")
                continue
            ref = raw.get(twin.name, {}).get(mask, {}) if twin else {}
            same = ref.get("sass_md5") is not None and ref.get("sass_md5") == r.get("sass_md5")
            what = f"SASS identical to {twin.name} (flag is a no-op)" if same else (
                f"SASS differs from {twin.name}" if twin and ref else "no twin candidate compiled")
            notes.append(f"- {probe.name} {mask}: warp-specialized={r['warp_specialized']}, "
                         f"setmaxnreg x{r['setmaxnreg']}; {what}")
    return notes


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], epilog=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", default="ours,candidates,ws",
                   help="ours, candidates (the timed ones), ws (the warp_specialize probes), or names")
    p.add_argument("--arch", type=int, default=90)
    p.add_argument("--json", type=Path, default=None, help="also write the raw report here")
    args = p.parse_args(argv)
    only = [x for x in args.only.split(",") if x]
    os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")
    print(f"triton {triton.__version__}, torch {torch.__version__}, target sm_{args.arch}a "
          f"(compiled on the CPU, no GPU needed)", flush=True)
    rows, raw = [], {}
    t0 = time.monotonic()
    if "ours" in only:
        ours = report_ours(args.arch)
        raw["ours"] = ours
        rows += [(name, r["config"], r) for name, r in ours.items()]
        print(f"ours compiled ({time.monotonic() - t0:.0f} s)", flush=True)
    import tune_triton_fwd as T

    picked = [c for c in T.CANDIDATES if "candidates" in only or c.name in only]
    picked += [c for c in T.WS_PROBES if "ws" in only or c.name in only]
    for cand in picked:
        res = T.aot_candidate(cand, arch=args.arch)
        raw[cand.name] = res
        rows += [(f"{cand.name} {mask}", cand.config(), r) for mask, r in res.items()]
        print(f"{cand.name} compiled ({time.monotonic() - t0:.0f} s)", flush=True)
    print()
    print(table(rows))
    notes = ws_notes(raw, T)
    if notes:
        print("\nwarp_specialize on sm_90a (Triton " + triton.__version__ + "):\n" + "\n".join(notes))
    if args.json:
        args.json.write_text(json.dumps(raw, indent=1, default=str) + "\n")
        print(f"\nwrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
