"""The emulated link (Note [Emulated links]) and the simulated ranks of tests/test_gpu_emulated.py, on CPU.

1. Pure, milliseconds: ``EmulatedLink`` with CUDA's streams, events, sleep and ``record_stream`` replaced by
   fakes that log what it asks of them: each operation's link time (the Note's bytes over the link's
   bandwidth, plus its latency) and sleep; the order of a post (the side stream waits for the caller's
   stream, sleeps, makes the data, records "done"; the caller's stream is current again; ``wait()`` waits
   on "done"); the data, equal to ``InstantLink``'s.
2. Seconds: the GPU test's simulated ranks through ``InstantLink`` with the exact torch kernels: each case
   takes the path the GPU test's table says; every strategy returns (out, dq, dk, dv) shaped like (q, q, k,
   v) and sends bytes; ring and all-gather agree where the stand-in peers (every peer's keys are this rank's
   own, Note [Emulated links]) make them compute the same attention, and Ulysses agrees with its pipeline.
"""

import pytest
import torch

from distcomm_attention.transport import emulated
from distcomm_attention.transport.emulated import EmulatedLink, InstantLink, Links
from tests import test_gpu_emulated as gpu

CYCLES_PER_US = 1500.0
LINKS = Links(1.0, 2.0, 4.0, 8.0, latency_us=3.0)  # one bandwidth per operation, to tell them apart


class _Stream:
    def __init__(self, name: str, log: list):
        self.name, self._log = name, log

    def wait_event(self, event):
        self._log.append(("wait", self.name, event.name))


class _Event:
    def __init__(self, name: str, log: list):
        self.name, self._log = name, log

    def record(self, stream):
        self._log.append(("record", stream.name, self.name))

    def wait(self, stream):
        self._log.append(("wait", stream.name, self.name))


class _Made(torch.overrides.TorchFunctionMode):
    """Logs the stream current when an operation returns a tensor."""

    def __init__(self, cuda):
        super().__init__()
        self._cuda = cuda

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if isinstance(out, torch.Tensor) or (isinstance(out, tuple) and out and isinstance(out[0], torch.Tensor)):
            self._cuda.log.append(("make", self._cuda.current.name))
        return out


class _FakeCuda:
    """What EmulatedLink takes from torch.cuda, logging into ``log``; the caller's stream is "caller"."""

    def __init__(self, monkeypatch):
        self.log: list = []
        self.current = self.caller = _Stream("caller", self.log)
        streams, events = [], []

        def stream(device=None, **_):
            streams.append(_Stream(f"side{len(streams)}", self.log))
            return streams[-1]

        def event(**_):
            events.append(_Event(f"event{len(events)}", self.log))
            return events[-1]

        def set_stream(s):
            self.log.append(("set", s.name))
            self.current = s

        monkeypatch.setattr(torch.cuda, "Stream", stream)
        monkeypatch.setattr(torch.cuda, "Event", event)
        monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: self.current)
        monkeypatch.setattr(torch.cuda, "set_stream", set_stream)
        monkeypatch.setattr(torch.cuda, "_sleep", lambda cycles: self.log.append(("sleep", self.current.name, cycles)))
        monkeypatch.setattr(torch.Tensor, "record_stream", lambda t, s: self.log.append(("record_stream", s.name)))
        monkeypatch.setattr(emulated, "_cycles_per_us", lambda index: CYCLES_PER_US)


def _fake_link(monkeypatch, size=3, rank=1):
    cuda = _FakeCuda(monkeypatch)
    return cuda, EmulatedLink(size, rank, LINKS, device=torch.device("cuda", 0))


def _x(*shape):
    return torch.arange(torch.Size(shape).numel(), dtype=torch.float32).view(shape)


def _exchange(t):
    """Two pieces out (3 and 1 rows of 4), two in (2 and 5 rows) into slices of one buffer."""
    buffer = torch.zeros(8, 4)
    return t.exchange([(0, _x(3, 4)), (2, _x(1, 4))], [(0, buffer[:2]), (2, buffer[3:8])])


# (name, post(transport), link time in seconds, its stream, tensors it reads on the side stream, tensors that
# arrive)
OPS = [
    ("hop", lambda t: t.send_recv((_x(3, 4), _x(2, 2)), 1), 3e-6 + 64 / 1e9, "side0", 2, 2),
    ("hop, more arrives", lambda t: t.send_recv((_x(3, 4),), 1, [(5, 4)]), 3e-6 + 80 / 1e9, "side0", 1, 1),
    ("all-to-all-v", lambda t: t.all_to_all_v(_x(8, 4), [1, 4, 3], [1, 5, 2]), 3e-6 + 4 * 16 / 2e9, "side1", 1, 1),
    ("exchange", _exchange, 3e-6 + 7 * 16 / 2e9, "side1", 4, 2),  # (the slices it fills kept for the side too)
    ("all-gather", lambda t: t.all_gather(_x(3, 4)), 3e-6 + 2 * 48 / 4e9, "side1", 1, 1),
    ("reduce-scatter", lambda t: t.reduce_scatter(_x(6, 4)), 3e-6 + 2 * 96 / 3 / 8e9, "side1", 1, 1),
]
PARAMS = "name, post, seconds, side, sent, arrive"
IDS = [op[0] for op in OPS]


@pytest.mark.parametrize(PARAMS, OPS, ids=IDS)
def test_link_time_and_sleep_per_operation(monkeypatch, name, post, seconds, side, sent, arrive):
    """Each operation takes latency + bytes / bandwidth (bytes as Note [Emulated links] counts them: a hop the
    larger of what leaves and arrives, an all-to-all-v the larger of the rows to and from other ranks, an
    exchange the larger of its pieces out and in, an all-gather (n - 1) x its input, a reduce-scatter (n - 1) /
    n x), slept on its kind's stream."""
    cuda, link = _fake_link(monkeypatch)
    post(link)
    assert link.seconds == pytest.approx(seconds, rel=1e-12)
    (sleep,) = [e for e in cuda.log if e[0] == "sleep"]
    assert sleep[1] == side
    assert abs(sleep[2] - seconds * CYCLES_PER_US * 1e6) <= 1


@pytest.mark.parametrize(PARAMS, OPS, ids=IDS)
def test_post_order_and_wait(monkeypatch, name, post, seconds, side, sent, arrive):
    """A post: the side stream waits for what the caller's stream has queued, the inputs are kept for the side
    stream, the data is made on the side stream after the sleep and before "done" is recorded there, the
    caller's stream is current again and keeps the outputs; wait() makes the caller's stream wait on "done"."""
    cuda, link = _fake_link(monkeypatch)
    with _Made(cuda):
        handle = post(link)
    log = [e for e in cuda.log if e[0] != "make"]
    ready, sleep, done = log[0][2], log[3 + sent], log[4 + sent][2]
    assert log == [("record", "caller", ready), ("wait", side, ready), *[("record_stream", side)] * sent,
                   ("set", side), ("sleep", side, sleep[2]), ("record", side, done), ("set", "caller"),
                   *[("record_stream", "caller")] * arrive]
    start = cuda.log.index(log[0])  # (the inputs are made before, on the caller's stream)
    made = [i for i, e in enumerate(cuda.log) if e[0] == "make" and i > start]
    assert made and all(cuda.log[i] == ("make", side) for i in made)
    assert cuda.log.index(sleep) < made[0] and made[-1] < cuda.log.index(("record", side, done))
    assert cuda.current is cuda.caller
    cuda.log.clear()
    assert len(handle.wait()) == arrive
    assert cuda.log == [("wait", "caller", done)]


def test_ready_event_is_the_links_and_done_is_new_per_post(monkeypatch):
    """Every post records the link's one "ready" event again (a wait binds to the record before it) and a new
    "done" event (several transfers may be in flight; each wait() waits for its own)."""
    cuda, link = _fake_link(monkeypatch)
    a = link.all_gather(_x(3, 4))
    b = link.send_recv((_x(3, 4),), 1)
    readies = [e[2] for e in cuda.log if e[:2] == ("record", "caller")]
    dones = [e[2] for e in cuda.log if e[0] == "record" and e[1] != "caller"]
    assert len(readies) == 2 and len(set(readies)) == 1
    assert len(dones) == 2 and len(set(dones) | set(readies)) == 3
    cuda.log.clear()
    b.wait()
    a.wait()
    assert cuda.log == [("wait", "caller", dones[1]), ("wait", "caller", dones[0])]


@pytest.mark.parametrize(PARAMS, OPS, ids=IDS)
def test_data_is_the_instant_links(monkeypatch, name, post, seconds, side, sent, arrive):
    """The emulated link delivers exactly InstantLink's data: new tensors, contiguous."""
    _, link = _fake_link(monkeypatch)
    got = post(link).wait()
    want = post(InstantLink(3, 1)).wait()
    assert len(got) == len(want) > 0
    for a, b in zip(got, want):
        assert torch.equal(a, b) and a.is_contiguous()


def test_instant_link_data():
    """What simulated peers send (Note [Emulated links]): a hop this rank's tensors as copies (cut or repeated
    to the shapes asked for), an all-gather W copies of the input, an all-to-all-v the input's rows repeated
    to the rows that arrive, an exchange its sends' elements written into the slices given, a reduce-scatter the
    first rows."""
    t = InstantLink(3, 1)
    x, y = _x(3, 4), _x(4, 6)[:, :2]
    got = t.send_recv((x, y), 1).wait()
    assert torch.equal(got[0], x) and torch.equal(got[1], y) and got[1].is_contiguous()
    assert got[0].data_ptr() != x.data_ptr()
    (cut,) = t.send_recv((x,), 1, [(2, 5)]).wait()
    assert torch.equal(cut, x.reshape(-1)[:10].view(2, 5))
    (grown,) = t.send_recv((x,), 1, [(5, 4)]).wait()
    assert torch.equal(grown, torch.cat([x, x])[:5])
    assert torch.equal(t.all_gather(x).wait()[0], torch.cat([x, x, x]))
    assert torch.equal(t.all_to_all_v(x, [1, 1, 1], [2, 2, 3]).wait()[0], torch.cat([x, x, x])[:7])
    assert t.all_to_all_v(x[:0], [0, 0, 0], [1, 0, 1]).wait()[0].eq(0).all()
    assert torch.equal(t.reduce_scatter(_x(6, 4)).wait()[0], _x(6, 4)[:2])
    # an exchange: the receives, in order, hold the sends' elements in order, repeated or cut
    buffer = torch.full((9, 2), -1.0)
    a, b = t.exchange([(0, x), (2, y[:1])], [(0, buffer[:1]), (2, buffer[2:9])]).wait()
    assert a.data_ptr() == buffer.data_ptr() and b.data_ptr() == buffer[2:].data_ptr()
    flat = torch.cat([x.reshape(-1), y[:1].reshape(-1)])  # 14 elements; 16 arrive
    assert torch.equal(buffer[:1].reshape(-1), flat[:2]) and torch.equal(buffer[1], torch.tensor([-1.0, -1.0]))
    assert torch.equal(buffer[2:].reshape(-1), torch.cat([flat, flat])[2:16])
    (nothing,) = t.exchange([], [(0, buffer[:1])]).wait()
    assert nothing.eq(0).all()


# --- the GPU test's simulated ranks, on CPU ----------------------------------------------------------------

CPU = dict(device=torch.device("cpu"), backend="torch")


@pytest.mark.parametrize("case", gpu.CASES)
def test_cases_take_the_paths_of_the_gpu_table(case):
    """The GPU test's cases cover every path bench_emulated.py drives (dense and sparse ring, dense and sparse
    all-gather, Ulysses and its pipeline), and each strategy's rank returns (out, dq, dk, dv) shaped like
    (q, q, k, v) after sending bytes."""
    mix, layout = gpu.CASES[case]
    for strategy, expected in zip(gpu.STRATEGIES, gpu.PATHS[case]):
        path, grads, sent = gpu.simulated_rank(strategy, InstantLink, mix, layout, head_dim=16, dtype=torch.float32,
                                               **CPU)
        assert path == expected, strategy
        n = gpu.SEQ // gpu.WORLD
        assert [tuple(x.shape) for x in grads] == [(1, n, h, 16) for h in (gpu.HEADS,) * 2 + (gpu.KV_HEADS,) * 2]
        assert all(torch.isfinite(x).all() for x in grads) and all(s.total > 0 for s in sent), strategy
    assert {p for paths in gpu.PATHS.values() for p in paths} == {
        "ring", "sparse_ring", "allgather", "sparse_allgather", "ulysses", "ulysses_halves", "ulysses_pipelined",
        "hybrid", "hybrid_sparse", "hybrid_allgather", "hybrid_sparse_allgather"}


def test_simulated_strategies_agree_where_they_compute_the_same():
    """With a contiguous layout every stand-in peer's keys are this rank's own at that peer's positions, both
    for the ring's hops and the all-gather's buffer: the two give the same out and dq (their dk, dv sum
    stand-in contributions differently), and so do the two hybrids. Ulysses gives the same with and without its pipeline (in halves its
    stand-in peers send other rows: what it computes is checked in tests/test_ulysses_halves.py)."""
    runs = {s: gpu.simulated_rank(s, InstantLink, "one", "contiguous", seq=1024, head_dim=32, dtype=torch.float64,
                                  **CPU)
            for s in gpu.STRATEGIES}
    assert [runs[s][0] for s in gpu.STRATEGIES] == ["ring", "allgather", "ulysses", "ulysses_halves",
                                                    "ulysses_pipelined", "hybrid", "hybrid_allgather"]
    for ring, gathered in (("ring", "allgather"), ("hybrid", "hybrid_allgather")):  # the hybrids: their ring dimension
        for a, b in zip(runs[ring][1][:2], runs[gathered][1][:2]):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-12)
    for a, b in zip(runs["ulysses"][1], runs["ulysses_pipelined"][1]):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)
