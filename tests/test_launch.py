"""Layer 2: the local launcher (``distcomm._launch.run_world``) that the demo and every multi-process test use.

Every rank's exit is checked: a rank that reports its result and then exits with a non-zero code or is
killed by a signal while the interpreter shuts down fails the run, as does a rank that exits without
reporting; a world that cannot be formed fails at once (nothing is retried).

While a world is up, a rank reads the kernel's socket tables (/proc/net/tcp and tcp6) for the listening
sockets the launching process holds: the rendezvous store must be the only one and must listen on the
loopback address alone, so nothing beyond this machine can reach it.
"""

import gc
import multiprocessing.util
import os
import resource
import signal
import socket
import time

import pytest

from distcomm import _launch
from tests.dist_harness import run_world

pytestmark = pytest.mark.skipif(not os.path.exists("/proc/net/tcp"), reason="needs Linux's /proc/net/tcp")

_LISTEN = "0A"


def _socket_inodes(pid: int) -> set[str]:
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:["):-1])
    return inodes


def _address(hex_addr: str) -> str:
    """/proc/net/tcp{,6} 'ADDR:PORT' (hex, host byte order per 32-bit word) -> 'ip:port'."""
    addr, port = hex_addr.split(":")
    raw = b"".join(bytes.fromhex(addr[i:i + 8])[::-1] for i in range(0, len(addr), 8))
    family = socket.AF_INET if len(raw) == 4 else socket.AF_INET6
    return f"{socket.inet_ntop(family, raw)}:{int(port, 16)}"


def listening_addresses(pid: int) -> list[str]:
    """Local addresses of the TCP sockets process ``pid`` holds in the LISTEN state (IPv4 and IPv6)."""
    inodes = _socket_inodes(pid)
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        if not os.path.exists(table):
            continue
        with open(table) as f:
            for line in f.read().splitlines()[1:]:
                fields = line.split()
                if fields[3] == _LISTEN and fields[9] in inodes:
                    found.append(_address(fields[1]))
    return found


def _listening_rank(rank, world, launcher_pid):
    return listening_addresses(launcher_pid)


def test_rendezvous_store_listens_on_loopback_only():
    """The launcher's store is reachable from this machine only: the process listens on 127.0.0.1 alone (other
    tests of the same worker process may hold stores too: every listening socket must be loopback)."""
    results = run_world(_listening_rank, 2, os.getpid())
    assert results[0] == results[1]
    assert len(results[0]) >= 1, results[0]
    assert all(address.startswith("127.0.0.1:") for address in results[0]), results[0]


def test_address_parser_reads_wildcard_and_loopback():
    """The /proc parser tells a socket bound to every interface from a loopback one (the test above relies on it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as anywhere, \
            socket.socket(socket.AF_INET, socket.SOCK_STREAM) as loopback:
        anywhere.bind(("0.0.0.0", 0))
        anywhere.listen()
        loopback.bind(("127.0.0.1", 0))
        loopback.listen()
        found = set(listening_addresses(os.getpid()))
        assert f"0.0.0.0:{anywhere.getsockname()[1]}" in found
        assert f"127.0.0.1:{loopback.getsockname()[1]}" in found
    if socket.has_ipv6:
        with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as anywhere6:
            anywhere6.bind(("::", 0))
            anywhere6.listen()
            assert f":::{anywhere6.getsockname()[1]}" in listening_addresses(os.getpid())


def test_store_owns_its_socket():
    """The store closes the loopback socket it was handed: no descriptor leaks across the suite's launches."""
    def sockets():
        found = 0
        for fd in os.listdir("/proc/self/fd"):
            try:
                found += os.readlink(f"/proc/self/fd/{fd}").startswith("socket:")
            except OSError:  # closed while listing
                pass
        return found

    gc.collect()
    before = sockets()
    for _ in range(5):
        store = _launch._loopback_store(2)
        assert store.port > 0
        del store
    gc.collect()
    assert sockets() <= before + 1


def _dies_after_reporting_rank(rank, world, how):
    """Returns its rank (reported to the launcher), then dies while its process shuts down, after the report
    has been flushed (a finalizer that runs after the result queue's feeder thread is joined)."""
    if rank == 1:
        if how == "exit 3":
            multiprocessing.util.Finalize(None, os._exit, args=(3,), exitpriority=-10)
        elif how == "SIGABRT":
            resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # no core file from the abort
            multiprocessing.util.Finalize(None, os.kill, args=(os.getpid(), signal.SIGABRT), exitpriority=-10)
    return rank


@pytest.mark.parametrize("how, status", [("exit 3", "exit code 3"),
                                         ("SIGABRT", "exit code -6 (killed by signal SIGABRT)")])
def test_a_rank_that_dies_after_reporting_fails_the_run(how, status):
    """Both ranks report success; rank 1 then exits with code 3 / aborts at exit: the launcher raises, naming
    the rank and its exit code."""
    with pytest.raises(RuntimeError) as info:
        run_world(_dies_after_reporting_rank, 2, how, timeout=30)
    message = str(info.value)
    assert f"rank 1 then exited with {status}" in message, message
    assert "rank 0" not in message, message


def test_ranks_that_exit_cleanly_pass():
    """The same rank function without the fault returns every rank's result (the test above is not vacuous)."""
    assert run_world(_dies_after_reporting_rank, 2, "none", timeout=30) == [0, 1]


def _exits_without_reporting_rank(rank, world):
    if rank == 1:
        os._exit(0)
    return rank


def test_a_rank_that_exits_without_reporting_fails_at_once():
    """A rank whose process ends inside the rank function (even with code 0) fails the run well before the
    timeout, naming the rank and its exit code."""
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=r"rank 1 ---\nprocess exited with exit code 0 without reporting"):
        run_world(_exits_without_reporting_rank, 2, timeout=60)
    assert time.monotonic() - start < 30


def _fails_while_peer_blocks_rank(rank, world):
    if rank == 0:
        raise ValueError("rank 0 fails at once")
    time.sleep(60)  # a peer that would block on the failed rank
    return rank


def test_a_peer_left_blocked_by_a_failed_rank_is_named_with_the_failure():
    """Once a rank fails, the others get a short grace, and the error names them as not finishing within that
    grace after the failure (not within the run's whole timeout, which did not elapse), with the failure's
    traceback."""
    start = time.monotonic()
    with pytest.raises(TimeoutError, match=r"ranks \[1\] did not finish within 5s of rank\(s\) \[0\] failing(.|\n)*"
                                           r"rank 0 fails at once"):
        run_world(_fails_while_peer_blocks_rank, 2, timeout=120)
    assert time.monotonic() - start < 60


def _never_runs_rank(rank, world):
    raise AssertionError("the world was never formed, the rank function must not run")


def test_a_world_that_cannot_form_fails_once_without_retry(monkeypatch):
    """Ranks that cannot join the process group (here: a backend that does not exist) fail the run with every
    rank's own error; the launcher forms one world only (one rendezvous store), never a second attempt."""
    stores, real_store = [], _launch._loopback_store

    def counted(world_size):
        stores.append(real_store(world_size))
        return stores[-1]

    monkeypatch.setattr(_launch, "_loopback_store", counted)
    with pytest.raises(RuntimeError) as info:
        run_world(_never_runs_rank, 2, backend="no-such-backend", timeout=30)
    message = str(info.value)
    for rank in (0, 1):
        assert f"rank {rank} of 2 could not join the process group" in message, message
    assert "no-such-backend" in message and "must not run" not in message, message
    assert len(stores) == 1


def _rank_of(rank, world, marker):
    with open(f"{marker}.{rank}", "w"):
        pass
    return rank


def test_worlds_form_one_at_a_time(tmp_path):
    """While the machine-wide formation lock is held (another world forming), a launch starts no rank; once it is
    released the world forms and runs. A world whose peer died would otherwise keep connecting to that peer's
    port and reach the listener of a world forming meanwhile (docs in distcomm/_launch.py)."""
    import threading

    held = _launch._FormationLock()
    marker = str(tmp_path / "started")
    result = {}
    thread = threading.Thread(target=lambda: result.update(out=run_world(_rank_of, 2, marker, timeout=60)))
    try:
        thread.start()
        time.sleep(1.5)
        assert thread.is_alive() and not list(tmp_path.iterdir()), "a rank started while another world formed"
    finally:
        held.release()
    thread.join(timeout=60)
    assert result.get("out") == [0, 1] and len(list(tmp_path.iterdir())) == 2


def test_the_formation_lock_is_released_after_every_world(monkeypatch):
    """Released once the ranks have joined, and after a world that cannot form has been torn down."""
    events = []

    class Recorded(_launch._FormationLock):
        def __init__(self):
            events.append("taken")
            super().__init__()

        def release(self):
            if self._file is not None:
                events.append("released")
            super().release()

    monkeypatch.setattr(_launch, "_FormationLock", Recorded)
    assert run_world(_dies_after_reporting_rank, 2, "none", timeout=30) == [0, 1]
    with pytest.raises(RuntimeError, match="could not join the process group"):
        run_world(_never_runs_rank, 2, backend="no-such-backend", timeout=30)
    assert events == ["taken", "released", "taken", "released"]


@pytest.mark.parametrize("kwargs, message", [
    (dict(world_size=0), "world_size must be an int >= 1, got 0"),
    (dict(world_size=2.0), "world_size must be an int >= 1, got 2.0"),
    (dict(world_size=2, timeout=0), "timeout must be a number of seconds > 0, got 0"),
])
def test_bad_arguments_are_refused_before_any_launch(kwargs, message):
    world_size = kwargs.pop("world_size")
    with pytest.raises(ValueError, match=message):
        run_world(_never_runs_rank, world_size, **kwargs)
