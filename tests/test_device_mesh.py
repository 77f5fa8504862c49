"""Layer 2: ``group=`` given as a DeviceMesh, on gloo worlds of 2 and 4 CPU ranks.

A 2x2 mesh ("dp", "cp") over 4 ranks has cp groups {0, 1}, {2, 3} and dp groups {0, 2}, {1, 3}. Every rank
feeds values that depend on its global rank, so a collective over the wrong group gives a wrong answer;
expected values are written here in closed form (collectives) or computed in the parent in float64
(attention, losses). Error cases run on one rank only while its peers go on to a valid collective, so an
error raised after communication would hang the world.
"""

import re

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as torch_F

import distcomm
import distcomm.functional as F
import distcomm_attention as da
from distcomm.losses import clip_loss, siglip_loss
from distcomm_attention.planning import layouts
from distcomm_attention._reference import attention_reference
from tests.dist_harness import run_world

FP64 = dict(rtol=1e-10, atol=1e-12)
MESH_DIMS = ("dp", "cp")


def _mesh_2x2():
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (2, 2), mesh_dim_names=MESH_DIMS)


def _members(mesh, dim: str) -> list[int]:
    """Global ranks of this process's group along ``dim``, in group order (read off the mesh tensor)."""
    table = mesh.mesh if dim == "cp" else mesh.mesh.T
    return next(row.tolist() for row in table if dist.get_rank() in row.tolist())


def _value(rank: int) -> torch.Tensor:
    """Rank-dependent data: (2, 3) float64, distinct per rank."""
    return torch.arange(6, dtype=torch.float64).view(2, 3) + 10.0 * (rank + 1)


def _collectives(group, members: list[int]) -> dict:
    """Every collective of distcomm.functional over ``group``: (got, expected) pairs, expected in closed form."""
    me, n = dist.get_rank(), len(members)
    pos = members.index(me)
    x = _value(me)
    pairs = {}

    xg = x.clone().requires_grad_()
    y = F.all_reduce(xg, group=group)
    (y * (me + 1)).sum().backward()  # upstream grad g_r = r + 1 on global rank r
    pairs["all_reduce"] = (y, sum(_value(m) for m in members))
    pairs["all_reduce.grad"] = (xg.grad, torch.full_like(x, float(sum(m + 1 for m in members))))

    pairs["reduce"] = (F.reduce(x, dst=members[1], group=group),
                       sum(_value(m) for m in members) if pos == 1 else torch.zeros_like(x))
    pairs["broadcast"] = (F.broadcast(x, src=members[1], group=group), _value(members[1]))
    pairs["all_gather"] = (torch.stack(F.all_gather(x, group=group)), torch.stack([_value(m) for m in members]))
    base = torch.empty(n * 2, 3, dtype=torch.float64)
    pairs["_all_gather_base"] = (F._all_gather_base(base, x, group=group), torch.cat([_value(m) for m in members]))

    xg = x.clone().requires_grad_()
    cat = F.all_gather_tensor(xg, dim=1, group=group)
    (cat * (me + 1)).sum().backward()
    pairs["all_gather_tensor"] = (cat, torch.cat([_value(m) for m in members], dim=1))
    pairs["all_gather_tensor.grad"] = (xg.grad, torch.full_like(x, float(sum(m + 1 for m in members))))

    var, sizes = F.all_gather_variable(x[: pos + 1], group=group)
    pairs["all_gather_variable"] = (var, torch.cat([_value(m)[: i + 1] for i, m in enumerate(members)]))
    pairs["all_gather_variable.sizes"] = (torch.tensor(sizes), torch.arange(1, n + 1))

    full = torch.cat([x * (i + 1) for i in range(n)])  # block i is meant for group position i
    pairs["reduce_scatter_tensor"] = (F.reduce_scatter_tensor(full, group=group),
                                      sum(_value(m) for m in members) * (pos + 1))
    pairs["reduce_scatter"] = (F.reduce_scatter(torch.empty_like(x), [x * (i + 1) for i in range(n)], group=group),
                               sum(_value(m) for m in members) * (pos + 1))
    pairs["all_to_all"] = (torch.stack(F.all_to_all([torch.empty_like(x) for _ in range(n)],
                                                    [x * (i + 1) for i in range(n)], group=group)),
                           torch.stack([_value(m) * (pos + 1) for m in members]))
    pairs["all_to_all_single"] = (F.all_to_all_single(torch.empty_like(full), full, group=group),
                                  torch.cat([_value(m) * (pos + 1) for m in members]))
    pairs["gather"] = (torch.stack(F.gather(x, dst=members[0], group=group)),
                       torch.stack([_value(m) for m in members]) if pos == 0 else torch.zeros(n, 2, 3, dtype=x.dtype))
    pairs["scatter"] = (F.scatter([x * (i + 1) for i in range(n)] if pos == 0 else None, src=members[0], group=group),
                        _value(members[0]) * (pos + 1))
    pairs["ring_pass"] = (F.ring_pass(x, shift=1, group=group), _value(members[(pos - 1) % n]))

    comm = distcomm.RingComm(group)
    pairs["RingComm.ranks"] = (torch.tensor(comm.ranks), torch.tensor(members))
    return {name: (got.detach(), want) for name, (got, want) in pairs.items()}


def _attention_inputs(seed: int, seq: int):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, seq, 4, 8, generator=g, dtype=torch.float64)
    k = torch.randn(1, seq, 2, 8, generator=g, dtype=torch.float64)
    v = torch.randn(1, seq, 2, 8, generator=g, dtype=torch.float64)
    dout = torch.randn(1, seq, 4, 8, generator=g, dtype=torch.float64)
    return q, k, v, dout


def _attention(group, seed: int, seq: int = 16, layout: str = "zigzag") -> dict:
    """ring_flash_attn over ``group`` on this rank's shards; the sequence is gathered back on the ring."""
    shards = [da.shard_sequence(t, layout, group=group) for t in _attention_inputs(seed, seq)]
    q, k, v = (t.requires_grad_() for t in shards[:3])
    out = da.ring_flash_attn(q, k, v, causal=True, layout=layout, group=group)
    out.backward(shards[3])
    gathered = da.gather_sequence(out.detach(), layout, group=group)
    return {"out": out.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad, "gathered": gathered}


def _expected_attention(seed: int, seq: int = 16) -> dict:
    q, k, v, dout = _attention_inputs(seed, seq)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    out = attention_reference(q, k, v, causal=True)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), dout)
    return {"out": out.detach(), "dq": dq, "dk": dk, "dv": dv}


def _check_attention(got: dict, seed: int, ring_size: int, pos: int, layout: str = "zigzag") -> None:
    want = _expected_attention(seed)
    for name, ref in want.items():
        torch.testing.assert_close(got[name], layouts.shard(ref, layout, ring_size, pos), **FP64)
    torch.testing.assert_close(got["gathered"], want["out"], **FP64)


def _loss_inputs(seed: int = 3, total: int = 5):
    g = torch.Generator().manual_seed(seed)
    x = torch.nn.functional.normalize(torch.randn(total, 6, generator=g, dtype=torch.float64), dim=-1)
    y = torch.nn.functional.normalize(x + 0.5 * torch.randn(total, 6, generator=g, dtype=torch.float64), dim=-1)
    return x, y


LOSS_SIZES = (3, 2)  # per-rank batch of the two dp positions


def _losses(group, pos: int) -> dict:
    x, y = _loss_inputs()
    lo = sum(LOSS_SIZES[:pos])
    own = slice(lo, lo + LOSS_SIZES[pos])
    return {
        "clip": clip_loss(x[own], y[own], 2.0, group=group).detach(),
        "siglip_ring": siglip_loss(x[own], y[own], 2.0, -1.0, impl="ring", group=group).detach(),
        "siglip_gather": siglip_loss(x[own], y[own], 2.0, -1.0, impl="gather", group=group).detach(),
    }


def _expected_losses() -> dict:
    x, y = _loss_inputs()
    n = x.shape[0]
    logits = 2.0 * x @ y.T
    target = torch.arange(n)
    clip = 0.5 * (torch_F.cross_entropy(logits, target) + torch_F.cross_entropy(logits.T, target))
    signs = 2 * torch.eye(n, dtype=torch.float64) - 1
    siglip = -torch_F.logsigmoid(signs * (logits - 1.0)).sum() / n
    return {"clip": clip, "siglip_ring": siglip, "siglip_gather": siglip}


def _catch(fn) -> str | None:
    try:
        fn()
    except (ValueError, TypeError) as e:
        return f"{type(e).__name__}: {e}"
    return None


def _mesh_world4_rank(rank, world):
    mesh = _mesh_2x2()
    dp, cp = mesh.get_coordinate()
    out = {"coord": (dp, cp)}
    out["cp_tuple"] = _collectives((mesh, "cp"), _members(mesh, "cp"))
    out["dp_submesh"] = _collectives(mesh["dp"], _members(mesh, "dp"))
    out["cp_index"] = _collectives((mesh, 1), _members(mesh, "cp"))
    out["attention"] = _attention((mesh, "cp"), seed=100 + dp)  # each cp ring holds its own sequence
    out["attention_submesh"] = _attention(mesh["cp"], seed=200 + dp)
    torch.manual_seed(0)
    module = da.RingAttention(16, heads=4, dim_head=4, kv_heads=2, causal=True, layout="striped", group=(mesh, "cp"))
    x_full = torch.randn(2, 8, 16, generator=torch.Generator().manual_seed(7)).double()
    out["module"] = module.double()(da.shard_sequence(x_full, "striped", group=(mesh, "cp"))).detach()
    out["losses"] = _losses((mesh, "dp"), dp)
    # Errors: only rank 0 makes the bad call; everyone then meets in a valid collective.
    if rank == 0:
        x = torch.ones(2)
        out["errors"] = {
            "no_dim": _catch(lambda: F.all_reduce(x, group=mesh)),
            "no_dim_ring": _catch(lambda: da.ring_flash_attn(*_attention_inputs(0, 8)[:3], group=mesh)),
            "unknown_dim": _catch(lambda: F.all_gather_tensor(x, group=(mesh, "tp"))),
            "bad_index": _catch(lambda: F.broadcast(x, src=0, group=(mesh, 2))),
            "bad_dim_type": _catch(lambda: F.all_reduce(x, group=(mesh, 1.0))),
            "not_a_mesh": _catch(lambda: F.all_reduce(x, group=("cp", mesh))),
            "loss": _catch(lambda: clip_loss(x.view(1, 2), x.view(1, 2), 1.0, group=mesh)),
            "shard": _catch(lambda: da.shard_sequence(torch.zeros(1, 8), "zigzag", group=mesh)),
            "module": _catch(lambda: da.RingAttention(8, 2, 4, group=mesh)(torch.zeros(1, 4, 8))),
        }
    out["after_errors"] = F.all_reduce(torch.ones(1), group=(mesh, "cp")).item()
    return out


def test_device_mesh_groups_world4():
    """A 2x2 (dp, cp) mesh: every collective, RingComm, ring attention (+ shard/gather and the module) and
    the losses run over the mesh dim they are given, `(mesh, name)`, `(mesh, index)` or `mesh[name]` alike,
    with clear errors for a mesh without a dim, raised before any communication."""
    results = run_world(_mesh_world4_rank, 4)
    for rank, res in enumerate(results):
        assert res["coord"] == (rank // 2, rank % 2)
        for spec in ("cp_tuple", "dp_submesh", "cp_index"):
            for name, (got, want) in res[spec].items():
                torch.testing.assert_close(got, want.to(got.dtype), rtol=0, atol=0, msg=f"{spec} {name} rank {rank}")
        dp, cp = res["coord"]
        _check_attention(res["attention"], 100 + dp, 2, cp)
        _check_attention(res["attention_submesh"], 200 + dp, 2, cp)
    torch.manual_seed(0)
    module = da.RingAttention(16, heads=4, dim_head=4, kv_heads=2, causal=True, layout="striped").double()
    x_full = torch.randn(2, 8, 16, generator=torch.Generator().manual_seed(7)).double()
    y_full = module(x_full).detach()
    for rank, res in enumerate(results):
        torch.testing.assert_close(res["module"], layouts.shard(y_full, "striped", 2, rank % 2), **FP64)
    want = _expected_losses()
    for cp in range(2):  # the dp ranks of one cp column: sum_r L_r = W * G (W = 2)
        column = [results[cp], results[2 + cp]]
        for name, g in want.items():
            torch.testing.assert_close(sum(r["losses"][name] for r in column) / 2, g, **FP64)
    errors = results[0]["errors"]
    dims = re.escape("('dp', 'cp')")
    for key in ("no_dim", "no_dim_ring", "loss", "shard", "module"):
        assert re.match(rf"ValueError: `group` is a 2-D DeviceMesh with dims {dims}; pick the dim", errors[key]), errors[key]
        assert "group=(mesh, 'cp')" in errors[key] and "group=mesh['cp']" in errors[key]
    assert re.match(rf"ValueError: `group=\(mesh, 'tp'\)`: the DeviceMesh has no dim named 'tp'; its dims are {dims}",
                    errors["unknown_dim"])
    assert re.match(r"ValueError: `group=\(mesh, 2\)`: dim index 2 is out of range for a 2-D DeviceMesh", errors["bad_index"])
    assert re.match(r"TypeError: the dim in `group=\(mesh, dim\)` must be a dim name \(str\) or index \(int\), got float",
                    errors["bad_dim_type"])
    assert re.match(r"TypeError: `group` must be a torch.distributed.ProcessGroup, a 1-D DeviceMesh, a tuple", errors["not_a_mesh"])
    assert all(res["after_errors"] == 2.0 for res in results)


def _mesh_world2_rank(rank, world):
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

    mesh = init_device_mesh("cpu", (2,))
    out = {"collectives": _collectives(mesh, [0, 1]), "attention": _attention(mesh, seed=300)}
    single = DeviceMesh("cpu", [1])  # rank 0 is not part of this mesh
    out["not_member"] = _catch(lambda: F.all_reduce(torch.ones(1), group=single)) if rank == 0 else None
    out["after"] = F.all_reduce(torch.ones(1), group=mesh).item()
    return out


def test_one_dim_mesh_world2():
    """A 1-D mesh is accepted as is; a mesh this process is not part of gets the non-member ValueError."""
    results = run_world(_mesh_world2_rank, 2)
    for rank, res in enumerate(results):
        for name, (got, want) in res["collectives"].items():
            torch.testing.assert_close(got, want.to(got.dtype), rtol=0, atol=0, msg=f"{name} rank {rank}")
        _check_attention(res["attention"], 300, 2, rank)
        assert res["after"] == 2.0
    assert re.match(r"ValueError: this process \(global rank 0\) is not part of the DeviceMesh passed as `group` "
                    r"\(its ranks: \[1\]\)", results[0]["not_member"])


@pytest.mark.parametrize("bad", ["cp", 3, ("cp",)])
def test_non_group_types_rejected_without_process_group(bad):
    """Something that is neither a group nor a mesh is a TypeError naming what is accepted, even on one process."""
    with pytest.raises(TypeError, match=r"`group` must be a torch.distributed.ProcessGroup, a 1-D DeviceMesh"):
        F.all_reduce(torch.ones(1), group=bad)
    with pytest.raises(TypeError, match=r"`group` must be a torch.distributed.ProcessGroup, a 1-D DeviceMesh"):
        distcomm.RingComm(bad)
