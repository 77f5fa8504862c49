"""Position ids and sharding of non-float inputs, cheapest first.

1. pure functions: ``position_ids`` against the positions ``shard_sequence`` keeps of ``arange``, for every
   layout and ring size; ``shard_sequence`` on int64 position ids, long labels and bool masks (dtype and
   values kept); clear errors;
2. gloo worlds of 2 and 4 CPU ranks: ``position_ids`` from the process group (sub-rings included), and the
   README recipe end to end: a rotary-embedding language model whose inputs, labels and positions are
   sharded, trained with the per-rank loss sum(token losses) / (global token count), against the same model
   run on the whole sequence in one process in float64 (loss, and parameter gradients summed over ranks).
"""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as torch_F
from torch import nn

import distcomm_attention as da
from distcomm_attention import position_ids
from distcomm_attention.planning import layouts
from distcomm_attention._reference import attention_reference
from tests.dist_harness import run_world

FP64 = dict(rtol=1e-10, atol=1e-12)

# ------------------------------------------------------------------------------------------------------
# 1. pure functions
# ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("layout", layouts.STATIC)
@pytest.mark.parametrize("ring_size", [1, 2, 3, 4])
def test_position_ids_are_the_positions_shard_sequence_keeps(layout, ring_size):
    """Rotary embeddings see each token's true global position: position_ids == shard(arange), for every rank."""
    local = 6
    seq = torch.arange(local * ring_size)
    held = []
    for rank in range(ring_size):
        ids = position_ids(local, layout, ring_size=ring_size, rank=rank)
        assert ids.dtype == torch.int64 and ids.shape == (local,)
        torch.testing.assert_close(ids, da.shard_sequence(seq, layout, dim=0, ring_size=ring_size, rank=rank))
        held.append(ids)
    assert sorted(torch.cat(held).tolist()) == seq.tolist()  # every position on exactly one rank


def test_position_ids_documented_example_and_device():
    """The docstring's example (16 tokens on 4 ranks, rank 1) holds; ``device`` places the result."""
    assert position_ids(4, "contiguous", ring_size=4, rank=1).tolist() == [4, 5, 6, 7]
    assert position_ids(4, "zigzag", ring_size=4, rank=1).tolist() == [2, 3, 12, 13]
    assert position_ids(4, "striped", ring_size=4, rank=1, device="meta").device.type == "meta"
    assert position_ids(0, "zigzag", ring_size=2, rank=1).shape == (0,)


def test_position_ids_without_process_group_is_arange():
    """On one process (no process group) every layout is the identity: positions 0..n-1."""
    assert not dist.is_initialized()
    for layout in layouts.STATIC:
        assert position_ids(8, layout).tolist() == list(range(8))


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(local_seq=4, layout="diagonal"), ValueError, r"Invalid layout 'diagonal'. Must be one of: 'contiguous'"),
        (dict(local_seq=-1, layout="zigzag"), ValueError, r"`local_seq` must be an int >= 0 \(tokens on this rank\), got -1"),
        (dict(local_seq=4.0, layout="zigzag"), ValueError, r"`local_seq` must be an int >= 0 .*got 4.0"),
        (dict(local_seq=3, layout="zigzag", ring_size=2, rank=0), ValueError,
         r"layout='zigzag' needs an even `local_seq` .* got 3"),
        (dict(local_seq=4, layout="zigzag", rank=0), ValueError, r"`rank` needs `ring_size`"),
        (dict(local_seq=4, layout="zigzag", ring_size=2, rank=2), ValueError, r"`rank` must be an int in \[0, 2\)"),
        (dict(local_seq=4, layout="zigzag", ring_size=2, rank=0, group=object()), ValueError,
         r"pass either `rank` .* or `group`, not both"),
    ],
)
def test_position_ids_errors(kwargs, error, match):
    """Bad arguments name the argument, the value and what is allowed."""
    local_seq, layout = kwargs.pop("local_seq"), kwargs.pop("layout")
    with pytest.raises(error, match=match):
        position_ids(local_seq, layout, **kwargs)


@pytest.mark.parametrize("layout", layouts.STATIC)
def test_shard_sequence_keeps_integer_and_bool_inputs(layout):
    """Position ids (int64), labels (long, -100 included) and padding masks (bool) shard like activations:
    same dtype, and each rank's entries are those at its global positions."""
    ring_size, batch, seq = 2, 3, 8
    g = torch.Generator().manual_seed(0)
    inputs = {
        "position_ids": torch.arange(seq).expand(batch, seq),
        "labels": torch.where(torch.rand(batch, seq, generator=g) < 0.3, -100, torch.randint(0, 50, (batch, seq), generator=g)),
        "mask": torch.rand(batch, seq, generator=g) < 0.7,
    }
    for rank in range(ring_size):
        where = position_ids(seq // ring_size, layout, ring_size=ring_size, rank=rank)
        for name, full in inputs.items():
            part = da.shard_sequence(full, layout, ring_size=ring_size, rank=rank)
            assert part.dtype == full.dtype, name
            assert torch.equal(part, full[:, where]), name
        shards = [da.shard_sequence(inputs["mask"], layout, ring_size=ring_size, rank=r) for r in range(ring_size)]
        assert torch.equal(layouts.unshard(shards, layout), inputs["mask"])


# ------------------------------------------------------------------------------------------------------
# 2. gloo worlds
# ------------------------------------------------------------------------------------------------------


def _positions_rank(rank, world, ring_size):
    seq = torch.arange(8 * (ring_size or world))
    out = {}
    for layout in layouts.STATIC:
        ids = position_ids(8, layout, ring_size=ring_size)
        out[layout] = (ids, da.shard_sequence(seq, layout, dim=0, ring_size=ring_size))
        # gathering the position ids back over the ring gives the whole sequence, in order
        out[layout + ".gathered"] = da.gather_sequence(ids, layout, dim=0, ring_size=ring_size)
    return out


@pytest.mark.parametrize("world, ring_size", [(2, None), (4, 2)])
def test_position_ids_from_process_group(world, ring_size):
    """From the process group (rings smaller than the world included), position_ids match this rank's shard."""
    results = run_world(_positions_rank, world, ring_size)
    w = ring_size or world
    for rank, res in enumerate(results):
        for layout in layouts.STATIC:
            ids, kept = res[layout]
            assert torch.equal(ids, kept)
            assert torch.equal(ids, layouts.positions(layout, 8 * w, w, rank % w))
            assert res[layout + ".gathered"].tolist() == list(range(8 * w))


VOCAB, DIM, HEADS, KV_HEADS, HEAD_DIM = 32, 16, 4, 2, 8
BATCH, SEQ = 2, 16


def rotary(x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Rotary embedding (rotate-half form) of x (batch, seq, heads, head_dim) at ``positions`` (seq,)."""
    half = x.shape[-1] // 2
    freqs = 1.0 / (10000 ** (torch.arange(half, dtype=x.dtype) / half))
    angle = positions.to(x.dtype)[:, None] * freqs  # (seq, half)
    cos, sin = angle.cos()[:, None, :], angle.sin()[:, None, :]
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


class RotaryLM(nn.Module):
    """Embedding, one rotary GQA attention block (the attention function is passed in), head."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.q = nn.Linear(DIM, HEADS * HEAD_DIM)
        self.kv = nn.Linear(DIM, 2 * KV_HEADS * HEAD_DIM)
        self.out = nn.Linear(HEADS * HEAD_DIM, DIM)
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, tokens, positions, attend):
        b, n = tokens.shape
        h = self.embed(tokens)
        q = rotary(self.q(h).view(b, n, HEADS, HEAD_DIM), positions)
        k, v = self.kv(h).view(b, n, 2, KV_HEADS, HEAD_DIM).unbind(2)
        k = rotary(k, positions)
        return self.head(h + self.out(attend(q, k, v).flatten(2)))


def _batch():
    """Tokens and next-token labels of the FULL sequence (shifted before sharding; -100 = no target)."""
    g = torch.Generator().manual_seed(5)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    labels = torch.full_like(tokens, -100)
    labels[:, :-1] = tokens[:, 1:]
    labels[0, :3] = -100  # e.g. a prompt that is not trained on
    return tokens, labels


def _model():
    torch.manual_seed(0)
    return RotaryLM().double()


def _recipe_rank(rank, world, layout):
    model = _model()
    tokens, labels = _batch()
    n_targets = int((labels != -100).sum())  # GLOBAL count, from the full batch
    local_tokens = da.shard_sequence(tokens, layout)
    local_labels = da.shard_sequence(labels, layout)
    positions = position_ids(local_tokens.shape[1], layout)

    def attend(q, k, v):
        return da.ring_flash_attn(q, k, v, causal=True, layout=layout)

    logits = model(local_tokens, positions, attend)
    loss = torch_F.cross_entropy(logits.flatten(0, 1), local_labels.flatten(), reduction="sum") / n_targets
    loss.backward()
    return {"loss": loss.detach(), "logits": logits.detach(), "grads": {n: p.grad for n, p in model.named_parameters()}}


@pytest.mark.parametrize("layout", ["zigzag", "striped"])
def test_recipe_sharded_inputs_labels_positions(layout):
    """The README recipe: the per-rank losses add up to the single-process mean loss, logits match the full
    model's at each rank's positions, and parameter gradients summed over ranks equal the full model's."""
    world = 2
    results = run_world(_recipe_rank, world, layout)
    model = _model()
    tokens, labels = _batch()
    logits = model(tokens, torch.arange(SEQ), lambda q, k, v: attention_reference(q, k, v, causal=True))
    loss = torch_F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)
    loss.backward()
    torch.testing.assert_close(sum(r["loss"] for r in results), loss.detach(), **FP64)
    for rank, res in enumerate(results):
        torch.testing.assert_close(res["logits"], layouts.shard(logits.detach(), layout, world, rank), **FP64)
    for name, p in model.named_parameters():
        torch.testing.assert_close(sum(r["grads"][name] for r in results), p.grad, **FP64, msg=name)
