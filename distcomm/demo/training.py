"""Demo part 3: train two tiny models over the local ranks and check them against a single-process run.

- A two-tower (image/text) model with ``distcomm.losses.clip_loss`` on UNEVEN per-rank batches. Parameter
  gradients are averaged over ranks, as DDP does; by clip_loss's convention that average is exactly the
  gradient of the global-batch loss.
- A long-context causal model (recall the first token) whose attention is ``distcomm_attention.RingAttention`` over a zigzag-sharded
  sequence. Each rank's loss is the sum of its tokens' losses over the global token count, so the per-rank
  losses add up to the global mean and parameter gradients are summed over ranks.

Both run in float64 so "distributed == single process" holds to round-off.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as torch_F

DTYPE = torch.float64
CLIP_SIZES = (7, 5, 3, 6)  # per-rank batch sizes (the first `world` are used)
IMG_DIM, TXT_DIM, EMB = 10, 14, 8
VOCAB, SEQ, BATCH = 12, 48, 8  # SEQ: divisible by 2W for W = 1..4 (zigzag)
LAYOUT = "zigzag"


class TwoTower(nn.Module):
    def __init__(self):
        super().__init__()
        self.image = nn.Sequential(nn.Linear(IMG_DIM, 16), nn.Tanh(), nn.Linear(16, EMB))
        self.text = nn.Sequential(nn.Linear(TXT_DIM, 16), nn.Tanh(), nn.Linear(16, EMB))
        self.log_scale = nn.Parameter(torch.tensor(1.0))

    def forward(self, images, texts):
        x = torch_F.normalize(self.image(images), dim=-1)
        y = torch_F.normalize(self.text(texts), dim=-1)
        return x, y, self.log_scale.exp()


class TinyLM(nn.Module):
    """Embedding + learned positions + one ring-attention block + head.

    The task: at every position, name the sequence's FIRST token. Only rank 0 holds it, so every other
    rank's queries must find it through the ring."""

    def __init__(self, **ring_kwargs):
        from distcomm_attention import RingAttention

        super().__init__()
        self.tok = nn.Embedding(VOCAB, 32)
        self.pos = nn.Embedding(SEQ, 32)
        self.attn = RingAttention(32, heads=4, dim_head=8, kv_heads=2, causal=True, **ring_kwargs)
        self.head = nn.Linear(32, VOCAB)

    def forward(self, tokens, positions):
        h = self.tok(tokens) + self.pos(positions)
        return self.head(h + self.attn(h))


def clip_data(world: int, step: int):
    g = torch.Generator().manual_seed(10_000 + step)
    n = sum(CLIP_SIZES[:world])
    latent = torch.randn(n, 6, generator=g, dtype=DTYPE)
    images = latent @ torch.randn(6, IMG_DIM, generator=torch.Generator().manual_seed(1), dtype=DTYPE)
    texts = latent @ torch.randn(6, TXT_DIM, generator=torch.Generator().manual_seed(2), dtype=DTYPE)
    images = images + 0.1 * torch.randn(images.shape, generator=g, dtype=DTYPE)
    return images, texts


def lm_data(step: int):
    g = torch.Generator().manual_seed(20_000 + step)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    return tokens, tokens[:, :1].expand(BATCH, SEQ).clone()


def _models():
    torch.manual_seed(0)
    clip = TwoTower().to(DTYPE)
    torch.manual_seed(1)
    lm = TinyLM(layout=LAYOUT).to(DTYPE)
    return clip, lm


def train_rank(rank: int, world: int, device: str, steps: int) -> dict:
    """One rank of the distributed run; returns its loss history and final parameters."""
    from distcomm.losses import clip_loss
    from distcomm_attention import shard_sequence

    dev = torch.device(device, rank) if device == "cuda" else torch.device("cpu")
    clip, lm = (m.to(dev) for m in _models())
    opt_clip = torch.optim.Adam(clip.parameters(), lr=3e-2)
    opt_lm = torch.optim.Adam(lm.parameters(), lr=1e-2)
    lo = sum(CLIP_SIZES[:rank])
    positions = shard_sequence(torch.arange(SEQ).expand(BATCH, SEQ), LAYOUT).to(dev)
    n_targets = None
    history = {"clip": [], "lm": []}
    for step in range(steps):
        images, texts = clip_data(world, step)
        sl = slice(lo, lo + CLIP_SIZES[rank])
        x, y, scale = clip(images[sl].to(dev), texts[sl].to(dev))
        loss = clip_loss(x, y, scale, local_loss=True)
        opt_clip.zero_grad()
        loss.backward()
        for p in clip.parameters():  # DDP-style averaging of parameter gradients
            dist.all_reduce(p.grad)
            p.grad /= world
        opt_clip.step()
        global_loss = loss.detach() / world  # the mean over ranks of clip_loss is the global-batch loss
        dist.all_reduce(global_loss)
        history["clip"].append(global_loss.item())

        tokens, targets = lm_data(step)
        n_targets = targets.numel()
        logits = lm(shard_sequence(tokens, LAYOUT).to(dev), positions)
        local_targets = shard_sequence(targets, LAYOUT).to(dev)
        loss = torch_F.cross_entropy(logits.flatten(0, 1), local_targets.flatten(), reduction="sum") / n_targets
        opt_lm.zero_grad()
        loss.backward()
        for p in lm.parameters():  # per-rank losses add up to the global loss: sum the gradients
            dist.all_reduce(p.grad)
        opt_lm.step()
        total = loss.detach().clone()
        dist.all_reduce(total)
        history["lm"].append(total.item())
        if rank == 0 and (step % 10 == 0 or step == steps - 1):
            print(f"    step {step:3d}/{steps}  clip loss {history['clip'][-1]:.4f}"
                  f"  ring-attention LM loss {history['lm'][-1]:.4f}", flush=True)
    return {
        "history": history,
        "clip": {k: v.cpu() for k, v in clip.state_dict().items()},
        "lm": {k: v.cpu() for k, v in lm.state_dict().items()},
    }


def train_single(world: int, steps: int) -> dict:
    """The same steps in one process, on the whole batch and the whole sequence."""
    clip, lm = _models()
    opt_clip = torch.optim.Adam(clip.parameters(), lr=3e-2)
    opt_lm = torch.optim.Adam(lm.parameters(), lr=1e-2)
    positions = torch.arange(SEQ).expand(BATCH, SEQ)
    history = {"clip": [], "lm": []}
    for step in range(steps):
        images, texts = clip_data(world, step)
        x, y, scale = clip(images, texts)
        logits = scale * x @ y.t()
        labels = torch.arange(len(x))
        loss = 0.5 * (torch_F.cross_entropy(logits, labels) + torch_F.cross_entropy(logits.t(), labels))
        opt_clip.zero_grad()
        loss.backward()
        opt_clip.step()
        history["clip"].append(loss.item())

        tokens, targets = lm_data(step)
        loss = torch_F.cross_entropy(lm(tokens, positions).flatten(0, 1), targets.flatten())
        opt_lm.zero_grad()
        loss.backward()
        opt_lm.step()
        history["lm"].append(loss.item())
    return {"history": history, "clip": clip.state_dict(), "lm": lm.state_dict()}


def max_param_diff(a: dict, b: dict) -> float:
    return max((a[k].double() - b[k].double()).abs().max().item() for k in a)
