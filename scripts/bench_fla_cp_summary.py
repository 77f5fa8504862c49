"""What a state-only summary of a run costs beside fla's whole chunked gated-delta-rule forward (one GPU).

Context parallelism for the gated delta rule needs, for a run that does not start a document, its affine map
(A, B): the end state as A S_in + B. distcomm_attention.linear computes it today with one kernel call that is
``V + K`` wide (values [v | 0] from the state [0 | I]); fla-core's ``fla/ops/cp`` computes ``[B | A]`` with a
state-only kernel (``chunk_cp_fwd_h``) over the WY representation that its forward builds anyway, then runs
the forward from the incoming state. This script times, over T tokens with Qwen3.5's GDN heads (16 key heads,
32 value heads, 128 dims, bf16), per forward:

    call        fla's chunk_gated_delta_rule forward (public API)
    wide        the same with values [v | 0] from the state [0 | I] (the library's open-run call)
    intra       fla's cumulative gate + intra-chunk WY step (w, u): shared by the forward and the summary
    summary     fla's state-only [B | A] kernel on top of intra's outputs
    h, o        fla's state pass and output pass from an incoming state (the rest of a forward)

so that ``intra + summary + h + o`` (a two-pass open run) can be set beside ``wide + correction``. Uses fla's
private functions (fla-core 0.6.0); prints one JSON line.

    python scripts/bench_fla_cp_summary.py --tokens 16k
"""

from __future__ import annotations

import argparse
import json

import torch


def timed(fn, iters: int = 20, warmup: int = 5) -> float:
    for _ in range(warmup):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(iters):
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", default="16k")
    args = p.parse_args()
    t = int(float(args.tokens.rstrip("k")) * 1024) if args.tokens.endswith("k") else int(args.tokens)
    from fla.ops.common.chunk_delta_h import chunk_gated_delta_rule_fwd_h
    from fla.ops.common.chunk_o import chunk_fwd_o
    from fla.ops.cp.chunk_fwd import chunk_cp_fwd_h
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    from fla.ops.gated_delta_rule.chunk_fwd import chunk_gated_delta_rule_fwd_intra
    from fla.ops.utils.constant import RCP_LN2
    from fla.ops.utils.cumsum import chunk_local_cumsum

    h, hv, dk, dv = 16, 32, 128, 128
    gen = torch.Generator(device="cuda").manual_seed(0)
    r = lambda *s: torch.randn(*s, generator=gen, device="cuda", dtype=torch.bfloat16)  # noqa: E731
    q = r(1, t, h, dk)
    k = torch.nn.functional.normalize(r(1, t, h, dk).float(), dim=-1).bfloat16()
    v = r(1, t, hv, dv)
    g = torch.nn.functional.logsigmoid(r(1, t, hv).float()) * 0.1
    beta = torch.rand(1, t, hv, generator=gen, device="cuda").bfloat16()
    scale = dk ** -0.5
    s_in = torch.randn(1, hv, dk, dv, generator=gen, device="cuda") * 0.1
    eye = torch.eye(dk, device="cuda").expand(1, hv, dk, dk)
    wide_h0 = torch.cat([torch.zeros(1, hv, dk, dv, device="cuda"), eye], dim=-1)
    out = {"tokens": t, "device": torch.cuda.get_device_name(), "heads": f"{h}/{hv}x{dk}"}
    with torch.no_grad():
        out["call_ms"] = timed(lambda: chunk_gated_delta_rule(q, k, v, g, beta, scale=scale, initial_state=s_in,
                                                              output_final_state=True))
        out["wide_ms"] = timed(lambda: chunk_gated_delta_rule(
            q, k, torch.cat([v, v.new_zeros(1, t, hv, dk)], dim=-1), g, beta, scale=scale, initial_state=wide_h0,
            output_final_state=True))

        def intra():
            gc = chunk_local_cumsum(g, chunk_size=64, scale=RCP_LN2)
            w, u, _ = chunk_gated_delta_rule_fwd_intra(k=k, v=v, g=gc, beta=beta)
            return gc, w, u

        out["intra_ms"] = timed(intra)
        gc, w, u = intra()
        hm = torch.zeros(1, hv, dk, dv + dk, device="cuda")
        out["summary_ms"] = timed(lambda: chunk_cp_fwd_h(k=k, w=w, u=u, hm=hm, g=gc))
        out["h_ms"] = timed(lambda: chunk_gated_delta_rule_fwd_h(k=k, w=w, u=u, g=gc, initial_state=s_in,
                                                                 output_final_state=True))
        hs, v_new, _ = chunk_gated_delta_rule_fwd_h(k=k, w=w, u=u, g=gc, initial_state=s_in, output_final_state=True)
        out["o_ms"] = timed(lambda: chunk_fwd_o(q=q, k=k, v=v_new, h=hs, g=gc, scale=scale))
        out["two_pass_ms"] = out["intra_ms"] + out["summary_ms"] + out["h_ms"] + out["o_ms"]
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
