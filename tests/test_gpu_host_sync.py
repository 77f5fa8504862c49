"""No host synchronisation on the hot path: after a call has planned and cached its device tensors, a
repeated context_parallel_attn forward + backward over NCCL runs under ``torch.cuda.set_sync_debug_mode
("warn")``, which reports every operation that makes the host wait for the GPU (a blocking host-to-device
copy, ``.item()``, ``.tolist()``, ``torch.cuda.synchronize``); and, queued behind a GPU sleep of about a
second, it returns while the sleep still runs, which also catches what the debug mode does not see (a
host-to-device copy from pageable memory, which the driver may start only once the stream has drained: the
index tensors of 32k tokens are 256 KiB). Marked ``gpu2``: run on the GPU machine."""

import contextlib
import os
import traceback
import warnings

import pytest
import torch

from tests.dist_harness import run_world

for _name in ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST", "NVSHMEM_DISABLE_NVLS"):
    os.environ.setdefault(_name, "0" if _name == "NCCL_NVLS_ENABLE" else "1")  # no NVLink multicast

STRATEGIES = ("ring", "allgather", "ulysses", "auto")
SEQ = 32768
CASES = [  # (name, layout, documents over the whole sequence, kv heads)
    ("dense causal zigzag", "zigzag", None, 2),
    ("packed balanced", "balanced", [0, 1600, 14400, 16000, 27200, SEQ], 2),
    ("kv heads replicated", "zigzag", None, 1),
]


def _rank(rank: int, world: int):
    from distcomm_attention import context_parallel_attn, shard_sequence

    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    failures = []
    for name, layout, docs, kv_heads in CASES:
        g = torch.Generator(device=device).manual_seed(0)
        full = [torch.randn(1, SEQ, h, 64, device=device, dtype=torch.bfloat16, generator=g)
                for h in (4, kv_heads, kv_heads, 4)]
        cu = docs  # on the host, as the docs advise: a CUDA cu_seqlens is read back once per call
        q, k, v, dout = (shard_sequence(x, layout, cu_seqlens=cu).contiguous() for x in full)
        q, k, v = (x.requires_grad_() for x in (q, k, v))
        for strategy in STRATEGIES:
            def step():
                out = context_parallel_attn(q, k, v, strategy=strategy, causal=True, layout=layout, cu_seqlens=cu)
                out.backward(dout)

            step()  # plans, caches, kernel compilation
            torch.cuda.synchronize()
            with _synchronizing_calls() as found:
                step()
            failures += [f"{name}, {strategy}: a synchronizing call at {where}" for where in dict.fromkeys(found)]
            torch.cuda.synchronize()
            torch.cuda._sleep(int(2e9))  # about a second
            slept = torch.cuda.Event()
            slept.record()
            step()
            if slept.query():  # the host reached here only after the sleep ended
                failures.append(f"{name}, {strategy}: the call returned after a queued GPU sleep ended (it waited "
                                f"for the GPU)")
            torch.cuda.synchronize()
    return failures


@pytest.mark.gpu2
def test_repeated_calls_never_wait_for_the_gpu():
    per_rank = run_world(_rank, 2, backend="nccl", timeout=600)
    failures = [f"rank {r}: {f}" for r, fs in enumerate(per_rank) for f in fs]
    assert not failures, "\n".join(failures)


@contextlib.contextmanager
def _synchronizing_calls():
    """Collect every operation that makes the host wait for the GPU inside the block (``set_sync_debug_mode
    ("warn")``), each as the innermost frames of the library that made it; a list, filled on exit."""
    found = []

    def show(message, category, filename, lineno, file=None, line=None):
        if "synchroniz" in str(message):
            frames = [f for f in traceback.extract_stack() if "distcomm" in f.filename][-4:]
            found.append(" <- ".join(f"{os.path.basename(f.filename)}:{f.lineno} {f.name}" for f in reversed(frames)))

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = show
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield found
        finally:
            torch.cuda.set_sync_debug_mode("default")


def _documents(rng: "torch.Generator", count: int) -> list[int]:
    """Boundaries of ``count`` documents of random lengths over SEQ tokens (host ints)."""
    cuts = torch.randperm(SEQ - 1, generator=rng)[:count - 1] + 1
    return [0, *sorted(int(c) for c in cuts), SEQ]


def _new_documents_rank(rank: int, world: int):
    """Every call has documents it has not seen (a new plan: masks, indices and sharding built and copied to
    the GPU on that call), and still returns while a queued GPU sleep runs."""
    from distcomm_attention import context_parallel_attn, shard_sequence

    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    rng = torch.Generator().manual_seed(1)  # the same documents on every rank
    failures = []
    for layout in ("balanced", "zigzag"):
        for strategy in STRATEGIES:
            calls = []
            for count in (7, 9, 13, 9, 11):  # warm-up (planning code, kernel compilation), then the timed call
                cu = _documents(rng, count)
                g = torch.Generator(device=device).manual_seed(count)
                full = [torch.randn(1, SEQ, h, 64, device=device, dtype=torch.bfloat16, generator=g)
                        for h in (4, 2, 2, 4)]
                q, k, v, dout = (shard_sequence(x, layout, cu_seqlens=cu).contiguous() for x in full)
                calls.append((cu, q.requires_grad_(), k.requires_grad_(), v.requires_grad_(), dout))

            def step(cu, q, k, v, dout):
                out = context_parallel_attn(q, k, v, strategy=strategy, causal=True, layout=layout, cu_seqlens=cu)
                out.backward(dout)

            for call in calls[:-1]:
                step(*call)
            torch.cuda.synchronize()
            torch.cuda._sleep(int(4e9))  # about two seconds: the new plan is built on the host meanwhile
            slept = torch.cuda.Event()
            slept.record()
            with _synchronizing_calls() as found:
                step(*calls[-1])
            failures += [f"{layout}, {strategy}: a synchronizing call at {where}" for where in dict.fromkeys(found)]
            if slept.query():
                failures.append(f"{layout}, {strategy}: a call with new documents returned after a queued GPU "
                                f"sleep ended (it waited for the GPU)")
            torch.cuda.synchronize()
    return failures


@pytest.mark.gpu2
def test_calls_with_new_documents_never_wait_for_the_gpu():
    per_rank = run_world(_new_documents_rank, 2, backend="nccl", timeout=600)
    failures = [f"rank {r}: {f}" for r, fs in enumerate(per_rank) for f in fs]
    assert not failures, "\n".join(failures)
