"""Demo: train a long-context causal language model whose attention is ``RingAttention`` over a
zigzag-sharded sequence of PACKED DOCUMENTS with a padding mask, and check it against a single-process run
of the same steps with plain dense-mask attention.

The task is next-token prediction on a small synthetic language. Each document opens with one of
``TOPICS`` topic tokens; its other tokens are content tokens drawn one after the other, each from the
topic's few allowed tokens, weighted by a fixed bigram table on the previous token::

    document:  [topic] c1 c2 c3 ...      c1 ~ allowed[topic],  c(i+1) ~ allowed[topic] * bigram[c(i)]

The previous token is at hand at every position, but the topic only at the document's first position,
often on another rank: a model without attention can reach at best ~1.23 nats per target
(``BEST_WITHOUT_ATTENTION``), one whose queries find their document's first token through the ring ~0.81
(both measured on these tables), and attending across a document boundary or to padding would mislead it.
Documents have uneven random lengths (two tokens to a third of the sequence, spanning ranks); some rows are
padded at the tail. Position ids restart at 0 for each document (they feed the position embedding and give
``cu_seqlens``). Each rank gets its shard of the tokens, targets, position ids and padding mask; its loss is
the sum of its real targets' losses over the global count of real targets, so the per-rank losses add up
to the global mean and parameter gradients are summed over ranks. Everything runs in float64, so
"distributed == single process" holds to round-off.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as torch_F

from distcomm._launch import run_world
from distcomm.demo.clip_training import compare
from distcomm_attention import RingAttention, cu_seqlens_from_position_ids, shard_sequence

DTYPE = torch.float64
TOPICS, CONTENT = 4, 12  # tokens 0..3 open a document and name its topic; 4..15 are content tokens
VOCAB = TOPICS + CONTENT
ALLOWED = 5  # content tokens each topic allows
SEQ, BATCH = 48, 8  # SEQ: divisible by 2W for W = 1..4 (zigzag)
LR = 4e-3  # Adam: the loss keeps falling over the default 40 steps (at 1e-2 it is flat from step ~25)
LAYOUT = "zigzag"
TITLE = "ring-attention LM (packed documents, padding)"
IGNORE = -100  # target of padded positions and of each document's last token
# Loss (nats per target) of the best model that sees only the previous token, measured on these tables: a
# trained TinyLM going below it has learnt to find its document's topic through the ring.
BEST_WITHOUT_ATTENTION = 1.23


def _language() -> tuple[torch.Tensor, torch.Tensor]:
    """The fixed language: which content tokens each topic allows (TOPICS, CONTENT) bool, and the bigram
    weights of a content token given the previous one (CONTENT, CONTENT), rows summing to 1."""
    g = torch.Generator().manual_seed(7)
    allowed = torch.zeros(TOPICS, CONTENT, dtype=torch.bool)
    for topic in range(TOPICS):
        allowed[topic, torch.randperm(CONTENT, generator=g)[:ALLOWED]] = True
    bigram = torch.softmax(2.0 * torch.randn(CONTENT, CONTENT, generator=g, dtype=torch.float64), dim=-1)
    return allowed, bigram


class TinyLM(nn.Module):
    """Embedding + position-in-document embedding + one ring-attention block + head."""

    def __init__(self, **ring_kwargs):
        super().__init__()
        self.tok = nn.Embedding(VOCAB, 32)
        self.pos = nn.Embedding(SEQ, 32)
        self.attn = RingAttention(32, heads=4, dim_head=8, kv_heads=2, causal=True, **ring_kwargs)
        self.head = nn.Linear(32, VOCAB)

    def forward(self, tokens, positions, attention_mask, cu_seqlens):
        """tokens (batch, local_seq), positions (local_seq,) within documents, attention_mask (batch,
        local_seq) True = real token -> logits (batch, local_seq, VOCAB)."""
        h = self.tok(tokens) + self.pos(positions)
        return self.head(h + self.attn(h, attention_mask=attention_mask, cu_seqlens=cu_seqlens))

    def forward_dense(self, tokens, positions, visible):
        """The same model on the whole sequence with plain softmax attention under a dense (batch, SEQ, SEQ)
        visibility, written independently of the ring (the single-process reference)."""
        h = self.tok(tokens) + self.pos(positions)
        a = self.attn
        b, s, _ = h.shape
        q, k, v = a.to_qkv(h).split([a.heads * a.dim_head, a.kv_heads * a.dim_head, a.kv_heads * a.dim_head], -1)
        q = q.view(b, s, a.heads, a.dim_head).transpose(1, 2)
        k, v = (t.view(b, s, a.kv_heads, a.dim_head).transpose(1, 2).repeat_interleave(a.heads // a.kv_heads, 1)
                for t in (k, v))
        scores = (q @ k.transpose(-1, -2)) * a.dim_head**-0.5
        empty = ~visible.any(-1, keepdim=True)[:, None]  # queries with no visible key attend to nothing
        scores = scores.masked_fill(~(visible[:, None] | empty), float("-inf"))
        probs = torch.softmax(scores, dim=-1).masked_fill(empty, 0.0)
        out = (probs @ v).transpose(1, 2).reshape(b, s, a.heads * a.dim_head)
        return self.head(h + a.to_out(out))


def lm_data(step: int):
    """One step's batch over the whole sequence: tokens (BATCH, SEQ), targets (the next token of the same
    document; IGNORE at a document's last token and where padded), position ids restarting per document
    (SEQ,), padding mask (BATCH, SEQ) True = real token. Document boundaries are shared by the rows."""
    g = torch.Generator().manual_seed(20_000 + step)
    allowed, bigram = _language()
    lengths = []
    while sum(lengths) < SEQ:
        lengths.append(min(int(torch.randint(2, SEQ // 3 + 1, (1,), generator=g)), SEQ - sum(lengths)))
    starts = torch.repeat_interleave(torch.tensor([sum(lengths[:i]) for i in range(len(lengths))]),
                                     torch.tensor(lengths))
    positions = torch.arange(SEQ) - starts
    tokens = torch.empty(BATCH, SEQ, dtype=torch.long)
    for i in range(SEQ):  # all rows at once, one position at a time
        if positions[i] == 0:
            topic = torch.randint(0, TOPICS, (BATCH,), generator=g)
            tokens[:, i] = topic
            continue
        weights = allowed[topic].double()
        if positions[i] > 1:  # after the first content token, the bigram table weighs the choice
            weights = weights * bigram[tokens[:, i - 1] - TOPICS]
        tokens[:, i] = TOPICS + torch.multinomial(weights, 1, generator=g)[:, 0]
    pad = torch.randint(0, SEQ // 4, (BATCH,), generator=g) * (torch.arange(BATCH) % 2)  # odd rows padded
    mask = torch.arange(SEQ)[None, :] < (SEQ - pad)[:, None]
    targets = torch.full((BATCH, SEQ), IGNORE)
    has_next = mask[:, 1:] & (positions[1:] != 0)  # the next position is real and in the same document
    targets[:, :-1] = torch.where(has_next, tokens[:, 1:], IGNORE)
    return tokens, targets, positions, mask


def _model() -> TinyLM:
    torch.manual_seed(1)
    return TinyLM(layout=LAYOUT).to(DTYPE)


def train_rank(rank: int, world: int, device: str, steps: int) -> dict:
    """One rank of the distributed run; returns its loss history and final parameters."""
    dev = torch.device(device, rank) if device == "cuda" else torch.device("cpu")
    lm = _model().to(dev)
    opt = torch.optim.Adam(lm.parameters(), lr=LR)
    history = []
    for step in range(steps):
        tokens, targets, positions, mask = lm_data(step)
        n_targets = int((targets != IGNORE).sum())  # the GLOBAL count of real targets
        cu_seqlens = cu_seqlens_from_position_ids(positions)  # CPU: no host sync inside the ring
        local = [shard_sequence(t, LAYOUT).to(dev) for t in (tokens, targets, mask)]
        local_positions = shard_sequence(positions, LAYOUT, dim=0).to(dev)
        logits = lm(local[0], local_positions, local[2], cu_seqlens)
        loss = torch_F.cross_entropy(logits.flatten(0, 1), local[1].flatten(), reduction="sum",
                                     ignore_index=IGNORE) / n_targets
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
    """The same steps in one process, on the whole sequence, with dense-mask attention."""
    lm = _model()
    opt = torch.optim.Adam(lm.parameters(), lr=LR)
    history = []
    i = torch.arange(SEQ)
    for step in range(steps):
        tokens, targets, positions, mask = lm_data(step)
        doc = torch.cumsum(positions == 0, 0)
        visible = (i[None, :] <= i[:, None]) & (doc[None, :] == doc[:, None])  # causal, same document
        visible = visible[None] & mask[:, None, :]  # keys that are real tokens
        logits = lm.forward_dense(tokens, positions, visible)
        loss = torch_F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=IGNORE)
        opt.zero_grad()
        loss.backward()
        opt.step()
        history.append(loss.item())
    return {"history": history, "params": lm.state_dict()}


def run(world: int, device: str, backend: str, steps: int) -> tuple[bool, tuple[str, list, list]]:
    """Train distributed and in one process; (parameters match, (title, single losses, distributed losses))."""
    dist_results = run_world(train_rank, world, device, steps, backend=backend, timeout=300)
    single = train_single(steps)
    ok = compare(dist_results, single, f"ring-attention LM ({LAYOUT}, seq {SEQ}, packed documents, padding)")
    return ok, (TITLE, single["history"], dist_results[0]["history"])
