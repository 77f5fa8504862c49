"""Which indexing operations make the host wait for the GPU: each runs once queued behind a GPU sleep of about
two seconds, with an index made before the sleep ("old") and one copied to the GPU from pinned memory just
before the operation ("fresh"); a row (name, fresh, waited, host seconds) with waited True returned only after
the sleep ended. One GPU: ``PYTHONPATH=. python scripts/probe_index_waits.py``."""
import time

import torch

from distcomm_attention._device import to_device
dev = torch.device("cuda", 0)
S, H, D = 65536, 4, 128
x4 = torch.randn(1, S, H, D, device=dev)
x2 = torch.randn(S, H * D, device=dev)
perm = torch.randperm(S)
old = to_device(perm, dev); torch.cuda.synchronize()

def case(name, fn, fresh=True):
    torch.cuda.synchronize()
    torch.cuda._sleep(int(4e9))
    ev = torch.cuda.Event(); ev.record()
    t0 = time.perf_counter()
    idx = to_device(torch.randperm(S), dev) if fresh else old
    fn(idx)
    t1 = time.perf_counter()
    waited = ev.query()
    torch.cuda.synchronize()
    return name, fresh, waited, round(t1 - t0, 4)

def put_dim1(idx):
    out = torch.empty_like(x4); out[:, idx] = x4
def put_dim0(idx):
    out = torch.empty_like(x2); out[idx] = x2
def index_copy0(idx):
    out = torch.empty_like(x2); out.index_copy_(0, idx, x2)
def index_copy1(idx):
    out = torch.empty_like(x4); out.index_copy_(1, idx, x4)
def select1(idx):
    x4.index_select(1, idx)
def index_add0(idx):
    out = torch.zeros_like(x2); out.index_add_(0, idx, x2)
def put_dim0_bool(idx):
    m = torch.zeros(S, dtype=torch.bool, device=dev); m[idx[:10]] = True
def put_dim0_sub(idx):
    out = torch.empty_like(x2); out[idx[: S // 2]] = x2[: S // 2]

rows = []
for fresh in (False, True):
    for name, fn in [("put_dim1", put_dim1), ("put_dim0", put_dim0), ("index_copy0", index_copy0),
                     ("index_copy1", index_copy1), ("select1", select1), ("index_add0", index_add0),
                     ("put_dim0_bool", put_dim0_bool), ("put_dim0_sub", put_dim0_sub)]:
        fn(old); torch.cuda.synchronize()  # warm
        rows.append(case(name, fn, fresh))
for r in rows:
    print(r)
print(torch.__version__)
