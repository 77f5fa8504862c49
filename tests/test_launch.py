"""Layer 2: the local launcher (``distcomm._launch.run_world``) that the demo and every multi-process test use.

While a world is up, a rank reads the kernel's socket tables (/proc/net/tcp and tcp6) for the listening
sockets the launching process holds: the rendezvous store must be the only one and must listen on the
loopback address alone, so nothing beyond this machine can reach it.
"""

import gc
import os
import socket

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
    """The launcher's store is reachable from this machine only: its one listening socket is 127.0.0.1."""
    results = run_world(_listening_rank, 2, os.getpid())
    assert results[0] == results[1]
    assert len(results[0]) == 1, results[0]
    assert results[0][0].startswith("127.0.0.1:"), results[0]


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
