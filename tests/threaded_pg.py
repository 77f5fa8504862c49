"""Ranks as threads of one process: ``run_threads(fn, world_size, *args)`` runs ``fn(rank, world_size, *args)`` in
``world_size`` threads, each inside a default process group of PyTorch's threaded backend
(``torch.testing._internal.distributed.multi_threaded_pg``), and returns the results by rank.

That backend's collectives (all-to-all, all-gather, reduce-scatter, all-reduce, broadcast) move tensors between
threads, CUDA tensors included, so the public API runs unchanged at any world size on one GPU. It has no
point-to-point; ``install`` gives its group a ``send``/``recv`` pair over a mailbox: a send clones each tensor into
the queue of (source, destination, tag); a recv completes, in posting order, with the next message of its
queue (copied into the receive buffer by whichever thread makes the pair meet), and its work's ``wait`` waits for
that. Every thread issues its kernels on the device's default stream, so a copy is ordered after the producer's
kernels and before the consumer's by issue order.

flash-attn-4's entry points are not thread safe while they JIT-compile: ``install`` wraps ``_flash_attn_fwd``
and ``_flash_attn_bwd`` (when flash-attn-4 is importable) under one lock.

An exception in one thread wakes the others (``ProcessLocalGroup.exception_handle``), and ``run_threads``
re-raises the first one, naming its rank; a thread still alive after ``timeout`` seconds is an error too.
"""

from __future__ import annotations

import collections
import functools
import importlib
import threading

import torch
import torch.distributed as dist
from torch.testing._internal.distributed import multi_threaded_pg as mtpg

__all__ = ["install", "run_threads"]

_lock = threading.Lock()
_installed = False


class _Mailbox:
    """Messages by (source, destination, tag), FIFO, and the receives waiting for them."""

    def __init__(self):
        self.cond = threading.Lock()
        self.messages: dict[tuple, collections.deque] = collections.defaultdict(collections.deque)
        self.waiting: dict[tuple, collections.deque] = collections.defaultdict(collections.deque)

    def put(self, key, tensor):
        with self.cond:
            if self.waiting[key]:
                buf, fut = self.waiting[key].popleft()
            else:
                self.messages[key].append(tensor)
                return
        buf.copy_(tensor)
        fut.set_result([buf])

    def take(self, key, buf, fut):
        with self.cond:
            if not self.messages[key]:
                self.waiting[key].append((buf, fut))
                return
            tensor = self.messages[key].popleft()
        buf.copy_(tensor)
        fut.set_result([buf])


_mailboxes: dict[str, _Mailbox] = {}


def _box(pg) -> _Mailbox:
    with _lock:
        return _mailboxes.setdefault(pg.pg_name, _Mailbox())


def _done(tensors):
    fut = torch.futures.Future()
    fut.set_result(tensors)
    return torch._C._distributed_c10d._create_work_from_future(fut)


def _send(self, tensors, dst, tag=0):
    box = _box(self)
    for t in tensors:
        box.put((self._rank, dst, tag), t.detach().clone())
    return _done(tensors)


def _recv(self, tensors, src, tag=0):
    (buf,) = tensors
    fut = torch.futures.Future()
    _box(self).take((src, self._rank, tag), buf, fut)
    return torch._C._distributed_c10d._create_work_from_future(fut)


def _serialised(fn):
    @functools.wraps(fn)
    def call(*args, **kwargs):
        with _fa4_lock:
            return fn(*args, **kwargs)

    call._threaded_pg_lock = True
    return call


_fa4_lock = threading.RLock()


def install() -> None:
    """Point-to-point for the threaded group, and flash-attn-4's entry points under one lock (idempotent)."""
    global _installed
    with _lock:
        if _installed:
            return
        mtpg.ProcessLocalGroup.send = _send
        mtpg.ProcessLocalGroup.recv = _recv
        if not hasattr(mtpg.ThreadLocalWorld, "comms"):  # torch < 2.12: destroy_process_group reads world.comms
            mtpg.ThreadLocalWorld.comms = property(lambda self: getattr(self._get_world(), "comms", []))
        try:
            interface = importlib.import_module("flash_attn.cute.interface")
        except ImportError:
            interface = None
        if interface is not None:
            for name in ("_flash_attn_fwd", "_flash_attn_bwd"):
                fn = getattr(interface, name)
                if not getattr(fn, "_threaded_pg_lock", False):
                    setattr(interface, name, _serialised(fn))
        _installed = True


def run_threads(fn, world_size: int, *args, timeout: float = 300.0) -> list:
    """``[fn(rank, world_size, *args) for rank in range(world_size)]``, each rank a thread in a threaded default
    process group; the first exception is re-raised (as RuntimeError naming the rank, from the original)."""
    install()
    world = mtpg._install_threaded_pg()
    store = dist.HashStore()
    results: list = [None] * world_size
    errors: list = []

    def worker(rank):
        dist.init_process_group(backend="threaded", rank=rank, world_size=world_size, store=store)
        try:
            if torch.cuda.is_available():
                torch.cuda.set_device(0)
            results[rank] = fn(rank, world_size, *args)
        except BaseException as ex:  # noqa: BLE001 - handed to the caller below
            errors.append((rank, ex))
            mtpg.ProcessLocalGroup.exception_handle(ex)
        finally:
            if world == dist.distributed_c10d._world:
                dist.destroy_process_group()

    torch._C._distributed_c10d._set_thread_isolation_mode(True)
    try:
        threads = [threading.Thread(target=worker, args=(r,), daemon=True) for r in range(world_size)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout)
        alive = [r for r, t in enumerate(threads) if t.is_alive()]
    finally:
        mtpg.ProcessLocalGroup.reset()
        mtpg._uninstall_threaded_pg()
        torch._C._distributed_c10d._set_thread_isolation_mode(False)
        with _lock:
            _mailboxes.clear()
    real = [(r, e) for r, e in errors if not isinstance(e, SystemExit)] or errors
    if real:
        rank, ex = real[0]
        raise RuntimeError(f"rank {rank} of {world_size} failed: {type(ex).__name__}: {ex}") from ex
    if alive:
        raise RuntimeError(f"ranks {alive} of {world_size} still running after {timeout} s")
    return results
