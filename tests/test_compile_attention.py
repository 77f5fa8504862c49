"""Layer 2: ring attention inside ``torch.compile(fullgraph=True)`` on CPU (one process and gloo worlds of 2).

The compiled ring (see Note [Compiled ring attention]) must give eager's values and gradients bit for bit
(both run the same kernels; eager itself is checked against the float64 reference elsewhere), with no graph
break, features included, for the function and for the ``RingAttention`` module, and under compiled
autograd.
"""

import pytest
import torch

import distcomm_attention as da
from distcomm_attention._reference import attention_reference
from tests.dist_harness import run_world
from tests.counting import max_diff

OPTIONS = dict(causal=True, window_size=(5, 0), softcap=3.0, cu_seqlens=[0, 7, 9, 16])


def _inputs(seed=0, n=16):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(2, n, 4, 16, generator=g, dtype=torch.float64)
    k = torch.randn(2, n, 2, 16, generator=g, dtype=torch.float64)
    v = torch.randn(2, n, 2, 16, generator=g, dtype=torch.float64)
    mask = torch.ones(2, n, dtype=torch.bool)
    mask[1, 12:] = False
    return q, k, v, mask


def _attend(q, k, v, mask, layout="contiguous"):
    return da.ring_flash_attn(q, k, v, layout=layout, attention_mask=mask, **OPTIONS)


def _values_and_grads(fn, q, k, v, mask, layout):
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out = fn(q, k, v, mask, layout)
    grads = torch.autograd.grad((out * out).sum(), (q, k, v))
    return [out.detach(), *grads]


def test_compiled_single_process_equals_eager_and_reference():
    """Without a process group the compiled call (fullgraph, no graph break) equals eager and the reference."""
    q, k, v, mask = _inputs()
    eager = _values_and_grads(_attend, q, k, v, mask, "contiguous")
    compiled = _values_and_grads(torch.compile(_attend, fullgraph=True, backend="aot_eager"), q, k, v, mask,
                                 "contiguous")
    for a, b in zip(eager, compiled):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    ref = attention_reference(q, k, v, attention_mask=mask, **OPTIONS)
    torch.testing.assert_close(eager[0], ref, rtol=1e-10, atol=1e-12)
    assert torch._dynamo.explain(_attend)(q, k, v, mask).graph_break_count == 0


def test_compiled_with_inductor():
    """Inductor compiles the graph around the ring's custom op and gives eager's results."""
    q, k, v, mask = _inputs(seed=1)

    def block(q, k, v, mask, layout):
        return torch.tanh(_attend(q * 1.5, k, v, mask, layout)) * 2

    eager = _values_and_grads(block, q, k, v, mask, "contiguous")
    compiled = _values_and_grads(torch.compile(block, fullgraph=True), q, k, v, mask, "contiguous")
    for a, b in zip(eager, compiled):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def _world_rank(rank, world):
    q, k, v, mask = _inputs(seed=2)
    results = {}
    for layout in ("zigzag", "striped"):
        shards = [da.shard_sequence(t, layout) for t in (q, k, v, mask)]
        eager = _values_and_grads(_attend, *shards, layout)
        compiled = _values_and_grads(torch.compile(_attend, fullgraph=True, backend="aot_eager"), *shards, layout)
        results[layout] = max(max_diff(a, b) for a, b in zip(eager, compiled))

    torch.manual_seed(0)
    layer = da.RingAttention(32, heads=4, dim_head=8, kv_heads=2, causal=True, layout="zigzag",
                             window_size=(6, 0)).double()
    x = da.shard_sequence(torch.randn(2, 16, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(3)),
                          "zigzag")
    local_mask = da.shard_sequence(mask, "zigzag")

    def loss_fn(module, x):
        return module(x, attention_mask=local_mask, cu_seqlens=[0, 9, 16]).square().sum()

    eager_loss = loss_fn(layer, x)
    eager_grads = torch.autograd.grad(eager_loss, list(layer.parameters()))
    compiled_layer = torch.compile(layer, fullgraph=True, backend="aot_eager")
    compiled_loss = loss_fn(compiled_layer, x)
    compiled_grads = torch.autograd.grad(compiled_loss, list(layer.parameters()))
    results["module"] = max([max_diff(eager_loss.detach(), compiled_loss.detach())] +
                            [max_diff(a, b) for a, b in zip(eager_grads, compiled_grads)])

    # compiled autograd: the backward graph, with the ring's backward op in it, is captured and compiled
    from torch._dynamo.utils import counters

    shards = [da.shard_sequence(t, "zigzag") for t in (q, k, v, mask)]
    q_l, k_l, v_l = (t.clone().requires_grad_() for t in shards[:3])
    forward = torch.compile(lambda q, k, v: _attend(q, k, v, shards[3], "zigzag").square().sum(), fullgraph=True,
                            backend="aot_eager")

    def step(q, k, v):
        loss = forward(q, k, v)
        loss.backward()
        return loss.detach()

    before = counters["compiled_autograd"]["captures"]
    torch._dynamo.config.compiled_autograd = True
    try:
        torch.compile(step, backend="aot_eager")(q_l, k_l, v_l)
    finally:
        torch._dynamo.config.compiled_autograd = False
    captured = counters["compiled_autograd"]["captures"] - before
    want = _values_and_grads(_attend, *shards, "zigzag")[1:]
    results["compiled_autograd"] = max(max_diff(t.grad, w) for t, w in zip((q_l, k_l, v_l), want))
    results["captures"] = captured
    return results


def test_compiled_ring_of_two_equals_eager():
    """A 2-rank ring compiled with fullgraph (function, module, compiled autograd) gives eager's results."""
    for rank_results in run_world(_world_rank, 2, timeout=240):
        assert rank_results.pop("captures") >= 1, "compiled autograd did not capture the backward"
        assert all(err == 0.0 for err in rank_results.values()), rank_results


def test_compiled_bad_input_raises_the_eager_error():
    """Bad options are still reported by name when the call is being compiled (fullgraph: inside dynamo's
    error, which wraps every exception raised while tracing)."""
    q, k, v, mask = _inputs()

    def bad(q, k, v):
        return da.ring_flash_attn(q, k, v, window_size=(-3, 0))

    with pytest.raises(ValueError, match=r"`window_size` must be a pair"):
        torch.compile(bad, backend="eager")(q, k, v)
    with pytest.raises(Exception, match=r"`window_size` must be a pair.*got \(-3, 0\)"):
        torch.compile(bad, fullgraph=True, backend="eager")(q, k, v)
