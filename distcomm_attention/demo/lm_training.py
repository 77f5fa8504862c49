"""Demo: train a long-context causal language model whose attention is ``RingAttention`` over a
zigzag-sharded sequence, and check it against a single-process run of the same steps.

The task: at every position, name the sequence's FIRST token. Only the first rank holds it, so every other
rank's queries must find it through the ring. Each rank gets its shard of the tokens and targets and the
global positions of its tokens (``position_ids``); its loss is the sum of its tokens' losses over the global
token count, so the per-rank losses add up to the global mean and parameter gradients are summed over
ranks. Everything runs in float64, so "distributed == single process" holds to round-off.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as torch_F

from distcomm._launch import run_world
from distcomm.demo.clip_training import compare
from distcomm_attention import RingAttention, position_ids, shard_sequence

DTYPE = torch.float64
VOCAB, SEQ, BATCH = 12, 48, 8  # SEQ: divisible by 2W for W = 1..4 (zigzag)
LAYOUT = "zigzag"
TITLE = "ring-attention LM loss"


class TinyLM(nn.Module):
    """Embedding + learned positions + one ring-attention block + head."""

    def __init__(self, **ring_kwargs):
        super().__init__()
        self.tok = nn.Embedding(VOCAB, 32)
        self.pos = nn.Embedding(SEQ, 32)
        self.attn = RingAttention(32, heads=4, dim_head=8, kv_heads=2, causal=True, **ring_kwargs)
        self.head = nn.Linear(32, VOCAB)

    def forward(self, tokens, positions):
        """tokens (batch, local_seq), positions (local_seq,) global -> logits (batch, local_seq, VOCAB)."""
        h = self.tok(tokens) + self.pos(positions)
        return self.head(h + self.attn(h))


def lm_data(step: int):
    """Tokens and targets of the whole sequence (batch, SEQ)."""
    g = torch.Generator().manual_seed(20_000 + step)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    return tokens, tokens[:, :1].expand(BATCH, SEQ).clone()


def _model() -> TinyLM:
    torch.manual_seed(1)
    return TinyLM(layout=LAYOUT).to(DTYPE)


def train_rank(rank: int, world: int, device: str, steps: int) -> dict:
    """One rank of the distributed run; returns its loss history and final parameters."""
    dev = torch.device(device, rank) if device == "cuda" else torch.device("cpu")
    lm = _model().to(dev)
    opt = torch.optim.Adam(lm.parameters(), lr=1e-2)
    positions = position_ids(SEQ // world, LAYOUT, device=dev)
    history = []
    for step in range(steps):
        tokens, targets = lm_data(step)
        n_targets = targets.numel()  # the GLOBAL count
        logits = lm(shard_sequence(tokens, LAYOUT).to(dev), positions)
        local_targets = shard_sequence(targets, LAYOUT).to(dev)
        loss = torch_F.cross_entropy(logits.flatten(0, 1), local_targets.flatten(), reduction="sum") / n_targets
        opt.zero_grad()
        loss.backward()
        for p in lm.parameters():  # per-rank losses add up to the global loss: sum the gradients
            dist.all_reduce(p.grad)
        opt.step()
        total = loss.detach().clone()
        dist.all_reduce(total)
        history.append(total.item())
        if rank == 0 and (step % 10 == 0 or step == steps - 1):
            print(f"    step {step:3d}/{steps}  ring-attention LM loss {history[-1]:.4f}", flush=True)
    return {"history": history, "params": {k: v.cpu() for k, v in lm.state_dict().items()}}


def train_single(steps: int) -> dict:
    """The same steps in one process, on the whole sequence."""
    lm = _model()
    opt = torch.optim.Adam(lm.parameters(), lr=1e-2)
    positions = torch.arange(SEQ)
    history = []
    for step in range(steps):
        tokens, targets = lm_data(step)
        loss = torch_F.cross_entropy(lm(tokens, positions).flatten(0, 1), targets.flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
        history.append(loss.item())
    return {"history": history, "params": lm.state_dict()}


def run(world: int, device: str, backend: str, steps: int) -> tuple[bool, tuple[str, list, list]]:
    """Train distributed and in one process; (parameters match, (title, single losses, distributed losses))."""
    dist_results = run_world(train_rank, world, device, steps, backend=backend, timeout=300)
    single = train_single(steps)
    ok = compare(dist_results, single, f"ring-attention LM ({LAYOUT}, seq {SEQ})")
    return ok, (TITLE, single["history"], dist_results[0]["history"])
