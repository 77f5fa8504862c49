"""Data parallel x context parallel training of a small Llama-style model, torchtitan style.

    torchrun --nproc-per-node 8 examples/dp_cp_training.py --dp 2 --cp 4          # NCCL on 8 GPUs
    torchrun --nproc-per-node 4 examples/dp_cp_training.py --dp 2 --cp 2 --check  # gloo on CPU, checked

The ranks form a 2-D DeviceMesh ("dp", "cp"). Each dp index trains on its own batch; the cp ranks of one
dp index hold the shards of that batch's sequences, and every block's attention runs ``ring_flash_attn``
over the cp dim of the mesh:

    parallelize (once)          apply_context_parallel(model, mesh, layout): each block's `sdpa` module
                                (plain causal attention on the whole sequence) becomes `RingSDPA`
    every step, every rank      its dp batch -> shard_sequence(tokens / labels) + position_ids(...) over cp
                                loss_r = sum of its tokens' losses / number of targets of ALL ranks
                                backward, then all_reduce(SUM) of every grad over the whole mesh

The per-rank losses add up to the global batch's mean loss, so summing the gradients over all ranks gives
its exact gradient (distcomm's convention; with DDP/FSDP, which average over the dp x cp ranks, multiply
loss_r by the number of ranks instead). ``--check`` runs in float64 and compares the parameters after
training with the same steps run on one process on the whole global batch.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from distcomm_attention import position_ids, ring_flash_attn, shard_sequence

VOCAB, DIM, HEADS, KV_HEADS, LAYERS = 64, 32, 4, 2, 2


# ---------------------------------------------------------------------------------------------------------
# The model (knows nothing of parallelism)
# ---------------------------------------------------------------------------------------------------------


def rotary(x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of x (batch, seq, heads, head_dim) at the GLOBAL ``positions`` (seq,)."""
    half = x.shape[-1] // 2
    freqs = 1.0 / (10000 ** (torch.arange(half, dtype=x.dtype, device=x.device) / half))
    angle = positions.to(x.dtype)[:, None] * freqs
    cos, sin = angle.cos()[:, None, :], angle.sin()[:, None, :]
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


class SDPA(nn.Module):
    """Causal attention over the whole sequence; q (B, S, H, D), k/v (B, S, H_kv, D) -> (B, S, H, D)."""

    def forward(self, q, k, v):
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True).transpose(1, 2)


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.head_dim = DIM // HEADS
        self.wq = nn.Linear(DIM, HEADS * self.head_dim, bias=False)
        self.wkv = nn.Linear(DIM, 2 * KV_HEADS * self.head_dim, bias=False)
        self.wo = nn.Linear(HEADS * self.head_dim, DIM, bias=False)
        self.sdpa = SDPA()  # the op context parallelism replaces

    def forward(self, x, positions):
        b, s, _ = x.shape
        q = rotary(self.wq(x).view(b, s, HEADS, self.head_dim), positions)
        k, v = self.wkv(x).view(b, s, 2, KV_HEADS, self.head_dim).unbind(2)
        return self.wo(self.sdpa(q, rotary(k, positions), v).flatten(2))


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.attention_norm, self.ffn_norm = nn.RMSNorm(DIM), nn.RMSNorm(DIM)
        self.attention = Attention()
        self.ffn = nn.Sequential(nn.Linear(DIM, 4 * DIM), nn.SiLU(), nn.Linear(4 * DIM, DIM))

    def forward(self, x, positions):
        x = x + self.attention(self.attention_norm(x), positions)
        return x + self.ffn(self.ffn_norm(x))


class Transformer(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList(Block() for _ in range(LAYERS))
        self.norm = nn.RMSNorm(DIM)
        self.output = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens, positions):
        h = self.embed(tokens)
        for layer in self.layers:
            h = layer(h, positions)
        return self.output(self.norm(h))


# ---------------------------------------------------------------------------------------------------------
# Context parallelism: one function, applied once
# ---------------------------------------------------------------------------------------------------------


class RingSDPA(nn.Module):
    """Drop-in for ``SDPA`` on this rank's shard: ring attention over the mesh's cp dim."""

    def __init__(self, mesh, layout: str):
        super().__init__()
        self.mesh, self.layout = mesh, layout

    def forward(self, q, k, v):
        return ring_flash_attn(q, k, v, causal=True, layout=self.layout, group=(self.mesh, "cp"))


def apply_context_parallel(model: Transformer, mesh, layout: str) -> Transformer:
    for block in model.layers:
        block.attention.sdpa = RingSDPA(mesh, layout)
    return model


# ---------------------------------------------------------------------------------------------------------
# Training
# ---------------------------------------------------------------------------------------------------------


def global_batch(step: int, dp: int, batch: int, seq: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens and next-token labels of every dp index's batch, (dp * batch, seq); -100 = no target."""
    g = torch.Generator().manual_seed(1000 + step)
    tokens = torch.randint(0, VOCAB, (dp * batch, seq), generator=g)
    labels = torch.full_like(tokens, -100)
    labels[:, :-1] = tokens[:, 1:]
    labels[::3, : seq // 4] = -100  # some prompts are not trained on: uneven target counts
    return tokens, labels


def make_model(dtype: torch.dtype, device: torch.device) -> Transformer:
    torch.manual_seed(0)
    return Transformer().to(device=device, dtype=dtype)


def train(args: argparse.Namespace, device: torch.device) -> tuple[list[float], dict]:
    """Run on every rank of an initialised world of dp * cp ranks; returns (losses, final parameters)."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(device.type, (args.dp, args.cp), mesh_dim_names=("dp", "cp"))
    dp_rank = mesh.get_local_rank("dp")
    dtype = torch.float64 if args.check else torch.float32
    model = apply_context_parallel(make_model(dtype, device), mesh, args.layout)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    positions = position_ids(args.seq // args.cp, args.layout, group=(mesh, "cp"), device=device)
    losses = []
    for step in range(args.steps):
        tokens, labels = global_batch(step, args.dp, args.batch, args.seq)
        rows = slice(dp_rank * args.batch, (dp_rank + 1) * args.batch)  # this dp index's batch
        tokens, labels = (shard_sequence(t[rows], args.layout, group=(mesh, "cp")).to(device) for t in (tokens, labels))
        n_targets = (labels != -100).sum()
        dist.all_reduce(n_targets)  # targets of ALL ranks
        logits = model(tokens, positions)
        loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100, reduction="sum")
        loss = loss / n_targets
        opt.zero_grad()
        loss.backward()
        for p in model.parameters():  # the per-rank losses add up to the global loss: sum the gradients
            dist.all_reduce(p.grad)
        opt.step()
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(total.item())
        if dist.get_rank() == 0:
            print(f"step {step}: loss {losses[-1]:.4f}", flush=True)
    return losses, {k: v.detach().cpu() for k, v in model.state_dict().items()}


def train_single(args: argparse.Namespace) -> tuple[list[float], dict]:
    """The same steps on one process on the whole global batch (float64)."""
    model = make_model(torch.float64, torch.device("cpu"))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for step in range(args.steps):
        tokens, labels = global_batch(step, args.dp, args.batch, args.seq)
        logits = model(tokens, torch.arange(args.seq))
        loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, model.state_dict()


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dp", type=int, default=2, help="data-parallel size (default 2)")
    parser.add_argument("--cp", type=int, default=2, help="context-parallel (ring) size (default 2)")
    parser.add_argument("--layout", default="zigzag", help="sequence layout over the cp ranks (default zigzag)")
    parser.add_argument("--steps", type=int, default=5, help="training steps (default 5)")
    parser.add_argument("--batch", type=int, default=2, help="sequences per dp index (default 2)")
    parser.add_argument("--seq", type=int, default=32, help="tokens per sequence (default 32)")
    parser.add_argument("--check", action="store_true", help="float64, compared with a one-process run")
    return parser.parse_args(argv)


def run(args: argparse.Namespace, device: torch.device) -> bool:
    """Train on this rank (process group initialised); with --check, compare with one process on rank 0."""
    world = dist.get_world_size()
    if args.dp * args.cp != world:
        raise ValueError(f"--dp {args.dp} x --cp {args.cp} must equal the number of ranks, {world}")
    losses, params = train(args, device)
    if not args.check:
        return True
    mismatch = torch.zeros(1, device=device)
    if dist.get_rank() == 0:
        single_losses, single_params = train_single(args)
        diff = max((params[k].double() - single_params[k]).abs().max().item() for k in params)
        loss_diff = max(abs(a - b) for a, b in zip(losses, single_losses))
        mismatch += not (diff < 1e-9 and loss_diff < 1e-9)
        print(f"check: max |param - single-process param| = {diff:.1e}, max loss difference = {loss_diff:.1e}: "
              f"{'MISMATCH' if mismatch.item() else 'ok'}", flush=True)
    dist.broadcast(mismatch, src=0)  # every rank exits with rank 0's verdict (parameters are replicated)
    return not mismatch.item()


def main(argv=None) -> int:
    args = parse_args(argv)
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl")
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    try:
        return 0 if run(args, device) else 1
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
