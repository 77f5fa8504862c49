"""Ulysses pipelined by head groups (Note [Ulysses pipeline]).

1. pure functions: how many groups a rank's heads are cut into, forward and backward (every kv head in
   one backward group);
2. gloo worlds of 2 and 4 ranks: context_parallel_attn(strategy="ulysses") with MHA, GQA (kv heads split,
   replicated or expanded), documents and padding against the float64 reference, with the number of
   all-to-alls the pipeline posts counted (so a silently unpipelined path fails).
"""

import pytest
import torch

from distcomm_attention.strategies.ulysses import head_groups, kv_head_index
from tests.dist_harness import run_world
from tests.counting import max_diff


@pytest.mark.parametrize("heads, kv_heads, forward, backward", [
    (4, 4, 4, 4),    # MHA: one head per group both ways
    (4, 1, 4, 1),    # 4 query heads on one kv head: the backward keeps them together
    (8, 2, 4, 2),    # 2 kv heads: forward groups of 2 query heads, backward one kv head per group
    (6, 3, 3, 3),
    (2, 2, 2, 2),
    (1, 1, 1, 1),
    (3, 1, 3, 1),
])
def test_head_groups(heads, kv_heads, forward, backward):
    """Forward groups may split the query heads of one kv head; backward groups never do (a kv head's gradient
    is one kernel's); never more than MAX_GROUPS."""
    assert head_groups(heads, kv_heads, backward=False) == forward
    assert head_groups(heads, kv_heads, backward=True) == backward


def _ulysses_rank(rank, world, heads, kv_heads, docs, masked, pipelined):
    import distcomm_attention as da
    from distcomm_attention.strategies import ulysses as strategy

    strategy.ulysses.__kwdefaults__["pipelined"] = pipelined  # the option the strategy's callers leave out
    from distcomm_attention._reference import attention_reference
    from distcomm_attention.planning import layouts
    from tests.counting import counted

    n = 6
    seq = world * n
    g = torch.Generator().manual_seed(3)
    q = torch.randn(2, seq, heads, 8, dtype=torch.float64, generator=g)
    k, v = (torch.randn(2, seq, kv_heads, 8, dtype=torch.float64, generator=g) for _ in range(2))
    dout = torch.randn(2, seq, heads, 8, dtype=torch.float64, generator=g)
    mask = (torch.rand(2, seq, generator=g) > 0.25) if masked else None
    pos = layouts.positions("zigzag", seq, world, rank)
    local = [t[:, pos].clone().requires_grad_() for t in (q, k, v)]
    with counted() as made:
        out = da.context_parallel_attn(*local, strategy="ulysses", causal=True, layout="zigzag", cu_seqlens=docs,
                                       attention_mask=None if mask is None else mask[:, pos])
        posted_fwd = sum(c.calls["all_to_all_v"] for c in made)
        out.backward(dout[:, pos])
    posted = sum(c.calls["all_to_all_v"] for c in made)
    ref_in = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = attention_reference(*ref_in, causal=True, cu_seqlens=docs, attention_mask=mask)
    ref.backward(dout)
    errors = [max_diff(a.detach(), b[:, pos].detach()) for a, b in
              zip([out] + [t.grad for t in local], [ref] + [t.grad for t in ref_in])]
    return {"errors": errors, "forward": posted_fwd, "backward": posted - posted_fwd}


@pytest.mark.parametrize("world, heads, kv_heads, docs, masked", [
    (2, 8, 8, None, False),             # MHA: 4 heads per rank, 4 groups both ways
    (2, 8, 2, (0, 5, 12), True),        # GQA, kv heads split: 4 query heads on 1 kv head per rank
    (4, 8, 2, None, False),             # kv heads replicated (2 per 4 ranks): 2 query heads per rank
    (2, 6, 3, (0, 7, 12), False),       # 3 heads per rank
    (4, 4, 4, None, True),              # one head per rank: nothing to pipeline
])
@pytest.mark.parametrize("pipelined", [True, False])
def test_pipelined_ulysses_is_exact(world, heads, kv_heads, docs, masked, pipelined):
    """out, dQ, dK, dV equal the float64 reference, pipelined or not (the default), and the pipeline posts one
    all-to-all per head group for q and out (forward) and for dout and dq (backward), plus k, v and dk, dv
    once each (one group each way without it)."""
    got = run_world(_ulysses_rank, world, heads, kv_heads, docs, masked, pipelined, timeout=90)
    h = heads // world
    index = kv_head_index(heads, kv_heads, world)  # kv heads sent: split, replicated or expanded
    hk = kv_heads // world if index is None else len(index) // world
    forward, backward = head_groups(h, hk, backward=False), head_groups(h, hk, backward=True)
    if not pipelined:
        forward = backward = 1
    for g in got:
        assert max(g["errors"]) < 1e-10, g["errors"]
        assert g["forward"] == 2 * forward + 2, g
        assert g["backward"] == 2 * backward + 2, g
