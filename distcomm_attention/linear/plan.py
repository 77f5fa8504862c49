"""Runs, segments and exchange slots of a sharded sequence: pure functions, no communication, no kernels.

Note [Runs and segments]
    A rank's shard is a list of *runs*: maximal pieces of the global sequence that it holds contiguously, in
    local order (contiguous: one run; zigzag: two; balanced: one per placed range; striped: one per token).
    Document starts (``cu_seqlens``; position 0 always) cut a run into *segments*. The state entering a
    segment is the previous segment's end state, unless the segment starts a document: then it is that
    document's initial state (or zeros). Only a run's first segment can depend on another rank, and only when
    the run does not begin at a document start: that segment is *open*, every other one is *closed*.

        global   |--- doc 0 -----------|--- doc 1 -----------------------------|- doc 2 --|
        rank 0   [run a ........]                       [run d ......]
        rank 1                   [run b .......]  [run c]              [run e ............]

        run b: open segment (doc 0 part, state from run a), then a closed segment (doc 1 from its start)
        run c: one open segment;  run e: open (doc 1 part), then closed (doc 2)

    Every rank computes every rank's runs (the layout is known to all), so all ranks agree on the global
    order of runs and on the slots of the exchange: rank r sends ``slots`` affine maps, its runs' end maps
    first, then (for ``output_final_state``) the maps to each document end in its runs, padded with zeros to
    the largest count of any rank.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

import torch

from distcomm_attention.planning import layouts

__all__ = ["Segment", "Run", "Plan", "make_plan", "rank_positions"]


@dataclass(frozen=True)
class Segment:
    """Tokens [local, local + length) of this rank, global [start, start + length), all in document ``doc``;
    ``opens``: it starts document ``doc`` (closed), else it continues the state of the previous run (open);
    ``ends``: document ``doc`` ends with it."""

    local: int
    start: int
    length: int
    doc: int
    opens: bool
    ends: bool


@dataclass(frozen=True)
class Run:
    """A contiguous piece of the global sequence held by one rank: ``order`` is its index among all runs of
    all ranks sorted by global start; ``segments`` cut it at document starts (Note [Runs and segments])."""

    rank: int
    order: int
    local: int
    start: int
    length: int
    segments: tuple[Segment, ...]

    @property
    def is_open(self) -> bool:
        return not self.segments[0].opens


@dataclass(frozen=True)
class Plan:
    """Every rank's runs (``runs[r]``, in local order), the exchange slots and where each document ends.

    ``slots``: maps per rank in the exchange; ``end_slot[(rank, i)]`` the slot of rank's i-th run's end map;
    ``doc_end[d]``: (rank, slot, run order) of the map to document d's final state (with ``finals``)."""

    seq_len: int
    world: int
    docs: tuple[int, ...]
    runs: tuple[tuple[Run, ...], ...]
    slots: int
    doc_end: tuple[tuple[int, int, int], ...]

    @property
    def num_docs(self) -> int:
        return len(self.docs) - 1

    def ordered(self) -> list[Run]:
        """All runs of all ranks by global start."""
        return sorted((run for rank in self.runs for run in rank), key=lambda run: run.start)


def rank_positions(concrete, seq_len: int, world: int) -> list[torch.Tensor]:
    """The global positions of every rank's tokens under a resolved layout (``balance.resolve``)."""
    return [layouts.positions(concrete, seq_len, world, r) for r in range(world)]


def _runs_of(pos: torch.Tensor) -> list[tuple[int, int, int]]:
    """(local start, global start, length) of the maximal increasing-by-one pieces of ``pos``."""
    if pos.numel() == 0:
        return []
    breaks = ((pos[1:] - pos[:-1]) != 1).nonzero().flatten().add(1).tolist()
    edges = [0] + breaks + [pos.numel()]
    return [(a, int(pos[a]), b - a) for a, b in zip(edges[:-1], edges[1:])]


def _segments(local: int, start: int, length: int, docs: tuple[int, ...]) -> tuple[Segment, ...]:
    """The run [start, start + length) cut at the document starts inside it."""
    out, pos = [], start
    stop = start + length
    while pos < stop:
        doc = bisect.bisect_right(docs, pos) - 1
        end = min(docs[doc + 1], stop)
        out.append(Segment(local + pos - start, pos, end - pos, doc, pos == docs[doc], end == docs[doc + 1]))
        pos = end
    return tuple(out)


def make_plan(positions: list[torch.Tensor], seq_len: int, docs: tuple[int, ...] | None, finals: bool) -> Plan:
    """The plan of Note [Runs and segments] from every rank's global positions (``rank_positions``).

    Args:
        positions: rank r's positions, int64 (local_len,).
        seq_len: the global length.
        docs: ``cu_seqlens`` as a tuple (None: one document).
        finals: whether the exchange carries the maps to every document's end (``output_final_state``).
    """
    docs = tuple(docs) if docs is not None else (0, seq_len)
    pieces = [_runs_of(p) for p in positions]
    starts = sorted(g for rank in pieces for _, g, _ in rank)
    order = {g: i for i, g in enumerate(starts)}
    runs = tuple(
        tuple(Run(r, order[g], a, g, n, _segments(a, g, n, docs)) for a, g, n in rank)
        for r, rank in enumerate(pieces)
    )
    doc_end: list[tuple[int, int, int] | None] = [None] * (len(docs) - 1)
    counts = []
    for r, rank in enumerate(runs):
        slot = len(rank)
        if finals:
            for run in rank:
                for seg in run.segments:
                    if seg.ends:
                        doc_end[seg.doc] = (r, slot, run.order)
                        slot += 1
        counts.append(slot)
    return Plan(seq_len, len(positions), docs, runs, max(counts, default=0),
                tuple(d for d in doc_end if d is not None) if finals else ())
