"""Layer 4 (one GPU, marked ``gpu``): the context-parallel strategies with the block kernels.

Every strategy at world 1 (one process, no process group) with the fa4, cudnn and triton backends, and the
all-gather strategy's gathered plans simulated for 2 and 4 ranks (each rank's queries against the whole key
buffer with the real kernels; dK / dV summed over the ranks in fp32, as the reduce-scatter does). Criterion
(FlashAttention's): the error against the float64 reference is at most twice plain PyTorch's in the same
low precision, plus a small floor. A backend this machine cannot run is skipped with its reason.
"""

import pytest
import torch

from distcomm_attention.api import context_parallel_attn
from distcomm_attention.kernels import dispatch as _kernels
from distcomm_attention.planning import layouts
from distcomm_attention.planning.plans import gathered_plan, natural_order
from distcomm_attention.strategies.allgather import local_backward
from distcomm_attention.strategies.ring import ring_forward
from tests.test_gpu_backends import _inputs, _scaled, _usable, _vis
from tests.test_gpu_ring_features import _assert_criterion, _references

pytestmark = pytest.mark.gpu

LOW = [torch.bfloat16, torch.float16]
CASES = [
    dict(causal=True), dict(causal=False),
    dict(causal=True, window=(300, -1)),
    dict(causal=True, docs=[0, 1, 200, 203, 700, 1024]),
    dict(causal=True, window=(100, -1), docs=[0, 333, 1024], softcap=20.0),
]


@pytest.mark.parametrize("dtype", LOW, ids=str)
@pytest.mark.parametrize("strategy", ["ring", "ulysses", "allgather"])
@pytest.mark.parametrize("backend", ["fa4", "cudnn", "triton"])
@pytest.mark.parametrize("case", CASES, ids=str)
def test_strategy_at_world_one(case, backend, strategy, dtype):
    """context_parallel_attn(strategy=...) on one GPU meets the flash-attn criterion with each kernel."""
    _usable(backend, dtype, case)
    q, k, v, dout = _inputs(dtype, 1024, 4, 1, seed=3)
    qg, kg, vg = (x.clone().requires_grad_() for x in (q, k, v))
    out = context_parallel_attn(qg, kg, vg, strategy=strategy, causal=case["causal"], backend=backend,
                                softcap=case.get("softcap", 0.0), window_size=case.get("window", (-1, -1)),
                                cu_seqlens=case.get("docs"))
    out.backward(dout)
    refs, lows = _references(case, q, k, v, dout, None)
    _assert_criterion(case, (out, qg.grad, kg.grad, vg.grad), refs, lows)


@pytest.mark.parametrize("dtype", [torch.bfloat16], ids=str)
@pytest.mark.parametrize("layout", ["contiguous", "zigzag", "striped"])
@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("backend", ["fa4", "cudnn", "triton"])
@pytest.mark.parametrize("case", CASES, ids=str)
def test_simulated_allgather(case, backend, world, layout, dtype):
    """Each rank's gathered plan (full prefix + causal diagonal, windows, documents) with the real kernels,
    merged over ranks as the strategy does, meets the criterion (GQA 4:1)."""
    _usable(backend, dtype, case)
    seq = 2048
    vis = _vis(case, seq)
    case = _scaled(case, seq)
    softcap = case.get("softcap", 0.0)
    q, k, v, dout = _inputs(dtype, seq, 4, 1, seed=4)
    _name, fwd, bwd = _kernels.select_kernels(backend, q[:, :8], vis, softcap)
    n, scale = seq // world, q.shape[-1] ** -0.5
    order = natural_order(layout, world, n) if layout != "striped" else None
    cat = lambda x: torch.cat([layouts.shard(x, layout, world, r, 1) for r in range(world)], 1)  # noqa: E731
    k_buf, v_buf = cat(k), cat(v)
    if order is not None:
        k_buf, v_buf = k_buf[:, order.cuda()], v_buf[:, order.cuda()]

    class One:
        size, rank = 1, 0

    outs, dqs = [], []
    dk = torch.zeros(k_buf.shape, dtype=torch.float32, device="cuda")
    dv = torch.zeros_like(dk)
    for r in range(world):
        plan = gathered_plan(layout, vis, world, r, n)
        qr, dr = layouts.shard(q, layout, world, r, 1), layouts.shard(dout, layout, world, r, 1)
        out, lse = ring_forward(qr, k_buf, v_buf, None, One(), plan, softcap, scale, fwd)
        dq, dk_r, dv_r = local_backward(dr, qr, k_buf, v_buf, out, lse, None, plan, softcap, scale, bwd)
        outs.append(out)
        dqs.append(dq)
        dk += dk_r
        dv += dv_r
    if order is not None:
        inv = torch.empty_like(dk)
        inv[:, order.cuda()] = dk
        dk = inv
        inv = torch.empty_like(dv)
        inv[:, order.cuda()] = dv
        dv = inv
    unshard = lambda x: layouts.unshard_concat(x, layout, world, 1)  # noqa: E731
    ours = (layouts.unshard(outs, layout, 1), layouts.unshard(dqs, layout, 1), unshard(dk.to(dtype)),
            unshard(dv.to(dtype)))
    refs, lows = _references(case, q, k, v, dout, None)
    _assert_criterion(case, ours, refs, lows)
