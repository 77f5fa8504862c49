"""Layer 2: the Ulysses and all-gather strategies inside ``torch.compile(fullgraph=True)`` on CPU (one
process and gloo worlds of 2), see Note [Compiled strategies].

The compiled call must equal eager (the same kernels; eager is checked against the float64 reference in
test_strategies.py) with no graph break, features included, and the hybrids must refuse clearly.
"""

import pytest
import torch

from distcomm_attention.api import context_parallel_attn
from distcomm_attention.planning import layouts
from tests.dist_harness import run_world
from tests.counting import max_diff

STRATS = ("ulysses", "allgather")
OPTIONS = dict(causal=True, window_size=(5, 0), softcap=3.0, cu_seqlens=[0, 7, 9, 32])


def _inputs(seed=0, seq=32):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(2, seq, 4, 16, generator=g, dtype=torch.float64)
    k = torch.randn(2, seq, 2, 16, generator=g, dtype=torch.float64)
    v = torch.randn(2, seq, 2, 16, generator=g, dtype=torch.float64)
    mask = torch.ones(2, seq, dtype=torch.bool)
    mask[1, 20:] = False
    return q, k, v, mask


def _values_and_grads(fn, q, k, v, mask):
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out = fn(q, k, v, mask)
    grads = torch.autograd.grad((out * out).sum(), (q, k, v))
    return [out.detach(), *grads]


def _attend_with(strategy, layout):
    def attend(q, k, v, mask):
        return context_parallel_attn(q, k, v, strategy=strategy, layout=layout, attention_mask=mask, **OPTIONS)

    return attend


def _compare(strategy, layout, q, k, v, mask):
    attend = _attend_with(strategy, layout)
    eager = _values_and_grads(attend, q, k, v, mask)
    compiled = _values_and_grads(torch.compile(attend, fullgraph=True, backend="aot_eager"), q, k, v, mask)
    return [max_diff(a, b) for a, b in zip(eager, compiled)]


@pytest.mark.parametrize("strategy", ["ulysses", "allgather", "auto"])
def test_compiled_single_process_equals_eager(strategy):
    """Without a process group the compiled strategy (fullgraph) equals eager exactly, with no graph break."""
    q, k, v, mask = _inputs()
    assert _compare(strategy, "contiguous", q, k, v, mask) == [0.0] * 4
    torch._dynamo.reset()


def _world_rank(rank, world):
    q, k, v, mask = _inputs(seed=1)
    diffs = {}
    for strategy in STRATS:
        for layout in ("contiguous", "zigzag"):
            local = [layouts.shard(t, layout, world, rank, 1) for t in (q, k, v, mask)]
            diffs[f"{strategy}-{layout}"] = _compare(strategy, layout, *local)
    return diffs


def test_compiled_world_of_two_equals_eager():
    """On gloo, compiled Ulysses and all-gather (every layout) equal eager, values and gradients."""
    for rank_diffs in run_world(_world_rank, 2, timeout=240):
        for name, diffs in rank_diffs.items():
            assert diffs == [0.0] * 4, (name, diffs)


def test_compiled_hybrid_refuses():
    """A 2-D mesh cannot travel in a compiled graph: the hybrids say so instead of breaking the graph."""
    q, k, v, mask = _inputs()
    attend = torch.compile(_attend_with("hybrid", "contiguous"), fullgraph=True, backend="aot_eager")
    with pytest.raises(Exception, match="2-D DeviceMesh"):
        attend(q, k, v, mask)
    torch._dynamo.reset()
