"""Demo: train a two-tower (image/text) model with ``distcomm.losses.clip_loss`` on UNEVEN per-rank batches
and check it against a single-process run of the same steps.

Parameter gradients are averaged over ranks, as DDP does; by clip_loss's convention that average is exactly
the gradient of the global-batch loss. Everything runs in float64, so "distributed == single process" holds
to round-off.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as torch_F

from distcomm._launch import run_world
from distcomm.demo import _common

DTYPE = torch.float64
CLIP_SIZES = (7, 5, 3, 6)  # per-rank batch sizes (the first `world` are used)
IMG_DIM, TXT_DIM, EMB = 10, 14, 8
TITLE = "CLIP loss, uneven batches"


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


def clip_data(world: int, step: int):
    g = torch.Generator().manual_seed(10_000 + step)
    n = sum(CLIP_SIZES[:world])
    latent = torch.randn(n, 6, generator=g, dtype=DTYPE)
    images = latent @ torch.randn(6, IMG_DIM, generator=torch.Generator().manual_seed(1), dtype=DTYPE)
    texts = latent @ torch.randn(6, TXT_DIM, generator=torch.Generator().manual_seed(2), dtype=DTYPE)
    images = images + 0.1 * torch.randn(images.shape, generator=g, dtype=DTYPE)
    return images, texts


def _model() -> TwoTower:
    torch.manual_seed(0)
    return TwoTower().to(DTYPE)


def train_rank(rank: int, world: int, device: str, steps: int) -> dict:
    """One rank of the distributed run; returns its loss history and final parameters."""
    from distcomm.losses import clip_loss

    dev = torch.device(device, rank) if device == "cuda" else torch.device("cpu")
    clip = _model().to(dev)
    opt = torch.optim.Adam(clip.parameters(), lr=3e-2)
    lo = sum(CLIP_SIZES[:rank])
    history = []
    for step in range(steps):
        images, texts = clip_data(world, step)
        sl = slice(lo, lo + CLIP_SIZES[rank])
        x, y, scale = clip(images[sl].to(dev), texts[sl].to(dev))
        loss = clip_loss(x, y, scale, local_loss=True)
        opt.zero_grad()
        loss.backward()
        for p in clip.parameters():  # DDP-style averaging of parameter gradients
            dist.all_reduce(p.grad)
            p.grad /= world
        opt.step()
        global_loss = loss.detach() / world  # the mean over ranks of clip_loss is the global-batch loss
        dist.all_reduce(global_loss)
        history.append(global_loss.item())
        if rank == 0 and (step % 10 == 0 or step == steps - 1):
            print(f"    step {step:3d}/{steps}  clip loss {history[-1]:.4f}", flush=True)
    return {"history": history, "params": {k: v.cpu() for k, v in clip.state_dict().items()}}


def train_single(world: int, steps: int) -> dict:
    """The same steps in one process, on the whole batch."""
    clip = _model()
    opt = torch.optim.Adam(clip.parameters(), lr=3e-2)
    history = []
    for step in range(steps):
        images, texts = clip_data(world, step)
        x, y, scale = clip(images, texts)
        logits = scale * x @ y.t()
        labels = torch.arange(len(x))
        loss = 0.5 * (torch_F.cross_entropy(logits, labels) + torch_F.cross_entropy(logits.t(), labels))
        opt.zero_grad()
        loss.backward()
        opt.step()
        history.append(loss.item())
    return {"history": history, "params": clip.state_dict()}


def max_param_diff(a: dict, b: dict) -> float:
    return max((a[k].double() - b[k].double()).abs().max().item() for k in a)


def compare(dist_results: list[dict], single: dict, name: str) -> bool:
    """Print and check: every rank holds the same parameters, equal to the single-process run's, and the
    loss curves agree step by step (within ``_common.TOL``)."""
    hist = dist_results[0]["history"]
    diff = max_param_diff(dist_results[0]["params"], single["params"])
    gap = max(_common.loss_gap(single["history"], hist), default=0.0)
    same = all(max_param_diff(dist_results[0]["params"], r["params"]) == 0 for r in dist_results)
    good = diff <= 1e-8 and gap <= _common.TOL and same
    print(f"  {name}: loss {hist[0]:.3f} -> {hist[-1]:.3f}; max |distributed - single|: loss {gap:.1e}, "
          f"parameters {diff:.1e}  {'ok' if good else 'MISMATCH'}")
    return good


def run(world: int, device: str, backend: str, steps: int) -> tuple[bool, tuple[str, list, list]]:
    """Train distributed and in one process; (parameters match, (title, single losses, distributed losses))."""
    dist_results = run_world(train_rank, world, device, steps, backend=backend, timeout=300)
    single = train_single(world, steps)
    ok = compare(dist_results, single, f"two-tower CLIP, per-rank batches {list(CLIP_SIZES[:world])}")
    return ok, (TITLE, single["history"], dist_results[0]["history"])
