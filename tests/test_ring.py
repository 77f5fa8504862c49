"""Layer 2: the ring primitive on gloo worlds of 1..4 ranks against the definition y_r = x_{r-shift}."""

import pytest
import torch

import distcomm
from tests.dist_harness import run_world


def _ring_rank(rank, world, shift, ring_size):
    torch.manual_seed(rank)
    # Shapes differ per rank (rank 1 sends an empty tensor) to exercise the shape exchange.
    n = 0 if rank == 1 else rank + 2
    x = torch.randn(n, 3, dtype=torch.float64).t().requires_grad_()  # non-contiguous
    y = distcomm.ring_pass(x, shift, ring_size=ring_size)
    weight = torch.arange(y.numel(), dtype=torch.float64).reshape(y.shape) + rank
    (y * weight).sum().backward()
    return {"x": x.detach(), "y": y.detach(), "grad": x.grad}


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("shift", [1, -1, 2])
def test_ring_pass_matches_definition(world, shift):
    """Rank r receives x from r - shift and its grad is the weight held by r + shift (within its ring)."""
    ring_size = 2 if world == 4 else None
    res = run_world(_ring_rank, world, shift, ring_size)
    w = ring_size or world
    for rank in range(world):
        base, pos = rank - rank % w, rank % w
        src = base + (pos - shift) % w
        dst = base + (pos + shift) % w
        torch.testing.assert_close(res[rank]["y"], res[src]["x"], rtol=0, atol=0)
        weight = torch.arange(res[rank]["x"].numel(), dtype=torch.float64).reshape(res[rank]["x"].shape) + dst
        torch.testing.assert_close(res[rank]["grad"], weight, rtol=0, atol=0)


def _ringcomm_rank(rank, world):
    comm = distcomm.RingComm()
    a = torch.full((4,), float(rank))
    b = torch.full((2, 2), float(10 * rank))
    seen = []
    for _ in range(comm.size):
        handle = comm.send_recv(a, b)
        a, b = handle.wait()
        seen.append((a[0].item(), b[0, 0].item()))
    return seen


def test_ringcomm_full_rotation():
    """W hops of send_recv visit every rank's blocks in order and return home."""
    world = 3
    res = run_world(_ringcomm_rank, world)
    for rank in range(world):
        expect = [(float((rank - s) % world), float(10 * ((rank - s) % world))) for s in range(1, world + 1)]
        assert res[rank] == expect


def _bad_ring_size(rank, world):
    try:
        distcomm.RingComm(ring_size=3)
    except ValueError as e:
        return str(e)
    return None


def test_ring_size_must_divide():
    msgs = run_world(_bad_ring_size, 4)
    assert all(m and "`ring_size`=3 must divide the group size 4" in m for m in msgs)


def test_single_process_identity():
    """Without a process group the ring is of one rank: ring_pass returns its input."""
    x = torch.randn(3)
    assert distcomm.ring_pass(x) is x
    comm = distcomm.RingComm()
    assert comm.size == 1 and comm.rank == 0


def _independent_rings_rank(rank, world):
    calls = 2 if rank < 2 else 1  # the two rings make different numbers of calls
    x = torch.full((rank + 1,), float(rank))
    for _ in range(calls):
        x = distcomm.ring_pass(x, ring_size=2)
    return x


def test_independent_rings_do_not_wait_for_each_other():
    """The shape exchange of ring_pass involves only the ring's members: rings of 2 in a world of 4 may make
    different numbers of calls without hanging."""
    res = run_world(_independent_rings_rank, 4, timeout=30)
    assert res[0].tolist() == [0.0] and res[1].tolist() == [1.0, 1.0]  # two hops: back home
    assert res[2].tolist() == [3.0] * 4 and res[3].tolist() == [2.0] * 3  # one hop: swapped
