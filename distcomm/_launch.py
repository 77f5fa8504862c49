"""Run a function on a fresh world of N local processes and collect what each rank returns.

Used by ``python -m distcomm.demo`` and by the test suite. Design (fast and robust on a small machine):
- ranks start from a ``forkserver`` context that preloads torch, so a rank starts in tens of ms;
- the parent owns the rendezvous ``TCPStore`` on a socket it binds to 127.0.0.1, port 0, and passes the
  port: no port races between launches, and nothing beyond this machine can reach the store;
- children run with one thread and ``GLOO_SOCKET_IFNAME=lo``; with ``backend="nccl"`` rank r uses cuda:r;
- tensors come back as plain data (nested lists) and are rebuilt in the parent;
- a child's traceback is re-raised in the parent; a hang ends in a ``TimeoutError`` naming the ranks
  that did not finish, and every child is killed;
- worlds form one at a time on a machine (a file lock from the ranks' start until every rank has joined, or
  until a world that cannot form is torn down). gloo's full-mesh connect keeps trying a refused address until
  its timeout, so the ranks of a world whose peer died can keep connecting to that peer's port, and a world
  forming meanwhile whose listener got the same port would take the stray connection: the likely cause of a
  "connectFullMesh failed: Connection closed by peer" seen once in a test's world under pytest-xdist while
  another pytest session ran worlds too (not reproduced on demand);
- every rank's exit code is checked: a rank that reported its result and then exits with a non-zero code
  or is killed by a signal (e.g. an abort while the interpreter shuts down) fails the run, naming the rank
  and its exit code. Nothing is ever retried: a world that cannot be formed is an error too.

Rank functions must be module-level (picklable): ``fn(rank, world_size, *args) -> result``.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue as queue_mod
import signal
import socket
import tempfile
import time
import traceback
from datetime import timedelta

try:
    import fcntl
except ImportError:  # not POSIX: worlds form without the lock
    fcntl = None

import torch
import torch.distributed as dist

__all__ = ["run_world"]

_CTX = None
_INIT_TIMEOUT_S = 30.0
_PEER_GRACE_S = 5.0  # how long the other ranks may still run once one has failed (they usually block on it)
_EXIT_GRACE_S = 10.0  # how long a rank that reported may take to exit, at least


def _context():
    global _CTX
    if _CTX is None:
        _CTX = mp.get_context("forkserver")
        _CTX.set_forkserver_preload(["torch", "torch.distributed", "distcomm._launch"])
    return _CTX


def _to_plain(obj):
    if isinstance(obj, torch.Tensor):
        t = obj.detach().cpu()
        if t.dtype in (torch.bfloat16, torch.float16):
            return ("__tensor__", str(t.dtype), list(t.shape), t.float().tolist())
        return ("__tensor__", str(t.dtype), list(t.shape), t.tolist())
    if isinstance(obj, dict):
        return {k: _to_plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_plain(v) for v in obj)
    return obj


def _from_plain(obj):
    if isinstance(obj, tuple) and len(obj) == 4 and obj[0] == "__tensor__":
        dtype = getattr(torch, obj[1].replace("torch.", ""))
        return torch.tensor(obj[3], dtype=dtype).reshape(obj[2])
    if isinstance(obj, dict):
        return {k: _from_plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_from_plain(v) for v in obj)
    return obj


def _worker(rank, world_size, port, backend, fn, args, results, timeout_s):
    os.environ.update(OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo", MKL_NUM_THREADS="1")
    torch.set_num_threads(1)
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank % torch.cuda.device_count())
        init_timeout = timedelta(seconds=min(timeout_s, _INIT_TIMEOUT_S))
        store = dist.TCPStore("127.0.0.1", port, world_size, is_master=False, timeout=init_timeout)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=init_timeout)
        # every rank has joined before any runs: a rank whose function returns at once would otherwise tear its
        # side of the group down while a slower peer is still connecting to it ("connection closed by peer")
        store.set(f"joined/{rank}", "1")
        store.wait([f"joined/{r}" for r in range(world_size)], init_timeout)
    except BaseException:
        results.put((rank, "init_error", traceback.format_exc()))
        return
    results.put((rank, "ready", None))
    try:
        try:
            out = fn(rank, world_size, *args)
        finally:
            if backend == "nccl":
                torch.cuda.synchronize()
            dist.destroy_process_group()
        results.put((rank, "ok", _to_plain(out)))
    except BaseException:  # report everything, including KeyboardInterrupt, to the parent
        results.put((rank, "error", traceback.format_exc()))


def _loopback_store(world_size: int) -> dist.TCPStore:
    """The rendezvous store, listening on 127.0.0.1 only (an ephemeral port: ``store.port``).

    TCPStore binds its own server socket to every interface whatever host it is given; handed a socket
    already bound to the loopback (``master_listen_fd``, libuv server), it listens there alone and owns the
    socket from then on.
    """
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.bind(("127.0.0.1", 0))
        sock.listen(max(128, world_size))
        store = dist.TCPStore(
            "127.0.0.1", sock.getsockname()[1], world_size, is_master=True, wait_for_workers=False,
            master_listen_fd=sock.fileno(), use_libuv=True,
        )
    except BaseException:
        sock.close()
        raise
    sock.detach()  # the store closes the descriptor when it is destroyed
    return store


def _exit_status(code: int | None) -> str:
    """A child's exit code in words: ``exit code 3``, ``exit code -6 (killed by signal SIGABRT)``."""
    if code is None:
        return "still running"
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"exit code {code} (killed by signal {name})"
    return f"exit code {code}"


def run_world(fn, world_size: int, *args, backend: str = "gloo", timeout: float = 60.0):
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` processes; return the per-rank results.

    Raises ``RuntimeError`` when a rank cannot join the process group, when ``fn`` raises on any rank, when a
    rank exits without reporting, or when a rank that reported its result exits with a non-zero code or is
    killed by a signal; ``TimeoutError`` when the ranks do not join or finish in time. Nothing is retried.
    """
    if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
        raise ValueError(f"run_world: world_size must be an int >= 1, got {world_size!r}")
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
        raise ValueError(f"run_world: timeout must be a number of seconds > 0, got {timeout!r}")
    return _run_once(fn, world_size, args, backend, timeout)


def _rank_errors(errors: dict[int, str]) -> str:
    return "".join(f"\n--- rank {r} ---\n{e}" for r, e in sorted(errors.items()))


class _FormationLock:
    """A machine-wide lock held while one world forms (the module's docstring): taken when made, released once."""

    PATH = os.path.join(tempfile.gettempdir(), "distcomm_world_formation.lock")

    def __init__(self):
        self._file = None
        if fcntl is not None:
            self._file = open(self.PATH, "a")  # noqa: SIM115 (held while the world forms)
            fcntl.flock(self._file, fcntl.LOCK_EX)

    def release(self):
        if self._file is not None:
            fcntl.flock(self._file, fcntl.LOCK_UN)
            self._file.close()
            self._file = None


def _run_once(fn, world_size: int, args, backend: str, timeout: float):
    ctx = _context()
    store = _loopback_store(world_size)
    results = ctx.Queue()
    procs = [
        ctx.Process(target=_worker, args=(r, world_size, store.port, backend, fn, args, results, timeout), daemon=True)
        for r in range(world_size)
    ]
    forming = _FormationLock()
    try:
        for p in procs:
            p.start()
    except BaseException:
        forming.release()
        raise
    out: dict[int, object] = {}
    errors: dict[int, str] = {}
    ready: set[int] = set()
    start_deadline = time.monotonic() + _INIT_TIMEOUT_S + 10.0
    deadline = time.monotonic() + timeout
    try:
        while len(out) + len(errors) < world_size:
            if len(ready) < world_size and time.monotonic() > start_deadline:
                missing = sorted(set(range(world_size)) - ready - set(errors))
                raise TimeoutError(
                    f"ranks {missing} of {world_size} did not join the process group within "
                    f"{_INIT_TIMEOUT_S + 10.0:.0f}s" + _rank_errors(errors)
                )
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                missing = sorted(set(range(world_size)) - set(out) - set(errors))
                within = (f"within {timeout:.0f}s" if not errors else
                          f"within {_PEER_GRACE_S:.0f}s of rank(s) {sorted(errors)} failing")
                raise TimeoutError(f"ranks {missing} did not finish {within}" + _rank_errors(errors))
            try:
                rank, status, payload = results.get(timeout=min(remaining, 0.5))
            except queue_mod.Empty:
                dead = [r for r, p in enumerate(procs) if not p.is_alive() and r not in out and r not in errors]
                if dead:
                    time.sleep(0.2)  # an exiting child may still be flushing its report
                    if results.empty():
                        for r in dead:
                            errors[r] = f"process exited with {_exit_status(procs[r].exitcode)} without reporting"
                        deadline = min(deadline, time.monotonic() + _PEER_GRACE_S)
                continue
            if status == "ready":
                ready.add(rank)
                if len(ready) == world_size:  # every rank connected: the next world may form
                    forming.release()
            elif status == "init_error":
                errors[rank] = f"rank {rank} of {world_size} could not join the process group:\n{payload}"
                deadline = min(deadline, time.monotonic() + _PEER_GRACE_S)
            elif status == "ok":
                out[rank] = _from_plain(payload)
            else:
                errors[rank] = payload
                # Peers of a failed rank usually block in a collective: give them a moment, then stop.
                deadline = min(deadline, time.monotonic() + _PEER_GRACE_S)
        if errors:
            raise RuntimeError("rank(s) failed:" + _rank_errors(errors))
        exit_wait = max(deadline - time.monotonic(), _EXIT_GRACE_S)
        exit_deadline = time.monotonic() + exit_wait
        for p in procs:
            p.join(timeout=max(0.0, exit_deadline - time.monotonic()))
        bad = {r: p.exitcode for r, p in enumerate(procs) if p.exitcode != 0}
        if bad:
            raise RuntimeError(
                "every rank reported its result, but "
                + "; ".join(
                    f"rank {r} did not exit within {exit_wait:.0f}s of reporting" if code is None
                    else f"rank {r} then exited with {_exit_status(code)}"
                    for r, code in sorted(bad.items())
                )
                + " (a rank must exit with code 0)"
            )
        return [out[r] for r in range(world_size)]
    finally:
        for p in procs:
            p.join(timeout=2.0)
            if p.is_alive():
                p.kill()
                p.join()
        forming.release()  # after a world that could not form is gone: its ranks connect no more

