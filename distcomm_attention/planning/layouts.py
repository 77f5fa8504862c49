"""Sequence layouts: which global tokens each ring position holds, and which blocks the ring computes.

Note [Sequence layouts]
    W = ring size, r = position in the ring, L = global length, n = L / W tokens per rank.
    Example: L = 16, W = 4 (digits are global token positions, one row per rank):

        contiguous  rank r holds [r*n, (r+1)*n)        zigzag  2W chunks of n/2; rank r holds chunks
                                                               r and 2W-1-r, in that order
          r=0:  0  1  2  3                               r=0:  0  1 | 14 15
          r=1:  4  5  6  7                               r=1:  2  3 | 12 13
          r=2:  8  9 10 11                               r=2:  4  5 | 10 11
          r=3: 12 13 14 15                               r=3:  6  7 |  8  9

        striped  token t on rank t mod W, in increasing t
          r=0:  0  4  8 12
          r=1:  1  5  9 13
          r=2:  2  6 10 14
          r=3:  3  7 11 15

    Under a causal mask, contiguous leaves rank W-1 with W blocks of work and rank 0 with one; zigzag and
    striped give every rank the same amount.

Note [Causal blocks]
    At each ring step rank r holds the keys of rank `src`. ``block_plan`` lists the kernel calls that cover
    exactly the visible (query, key) pairs of that pair of shards, each as (q rows, kv rows, causal), where
    causal means the top-left mask j <= i inside the sliced block. Fully masked blocks are not listed.

        contiguous  src < r: full            src == r: causal           src > r: nothing
        zigzag      src < r: all q x first kv half
                    src == r: causal on the whole shard
                    src > r: second q half x all kv
        striped     src <= r: causal (key j visible to query i iff j <= i)
                    src > r: strictly causal (j < i) = causal on (q[1:], k[:-1], v[:-1])

    Without a causal mask every block is one full call.

Everything here is a pure function (no communication); ``distcomm_attention.shard_sequence`` and
``gather_sequence`` (api.py) apply them to this rank's ring position.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import NamedTuple

import torch

from distcomm_attention._device import to_device

__all__ = [
    "LAYOUTS",
    "Block",
    "positions",
    "shard",
    "unshard",
    "check_global_length",
    "check_local_length",
    "block_plan",
    "check_layout",
    "check_position",
    "seq_len_along",
    "unshard_concat",
    "hybrid_positions",
    "Assignment",
    "mesh_assignment",
    "STATIC",
    "DATA_DEPENDENT",
    "split_spec",
    "spec",
    "check_balance_window",
]

STATIC = ("contiguous", "zigzag", "striped")  # positions fixed by (length, ring size, rank)
DATA_DEPENDENT = ("balanced", "auto")  # positions computed from the documents (Note [Balanced layout])
LAYOUTS = STATIC + DATA_DEPENDENT


@dataclass(frozen=True)
class Assignment:
    """A layout computed from the data (``layout="balanced"``, Note [Balanced layout] in balance.py): the
    ranges [start, stop) of global positions each rank holds, increasing and disjoint. Hashable: it keys the
    planner's caches like a layout name."""

    name: str
    ranges: tuple[tuple[tuple[int, int], ...], ...]
    seq_len: int

    @property
    def ring_size(self) -> int:
        return len(self.ranges)

    @property
    def local_len(self) -> int:
        return self.seq_len // self.ring_size

    def positions(self, rank: int) -> torch.Tensor:
        """Global positions of ``rank``'s tokens, increasing: int64 (local_len,), a tensor of the caller's own
        (the table is cached: a view into it, changed in place, would change every later call)."""
        return self.table()[rank].clone()

    @functools.lru_cache(maxsize=64)
    def table(self) -> torch.Tensor:
        """(ring_size, local_len) int64: every rank's positions."""
        rows = [torch.cat([torch.arange(a, b) for a, b in ranks]) if ranks else torch.zeros(0, dtype=torch.int64)
                for ranks in self.ranges]
        return torch.stack(rows)

    def __repr__(self) -> str:
        pieces = sum(len(r) for r in self.ranges)
        return f"Assignment({self.name!r}, {self.ring_size} ranks x {self.local_len} tokens, {pieces} pieces)"


def split_spec(layout) -> tuple[str, int | None]:
    """(name, balance window) of a layout as it travels inside the package: a data-dependent layout made by
    a ``Sharding`` with ``balance_window`` carries it as "name:window" (one string, so it crosses compiled
    custom operators like the plain names)."""
    if isinstance(layout, str) and ":" in layout:
        name, _, window = layout.partition(":")
        return name, int(window) if window.isdigit() else -1
    return layout, None


def spec(name: str, balance_window: int | None) -> str:
    """Inverse of ``split_spec``."""
    return name if balance_window is None or name not in DATA_DEPENDENT else f"{name}:{balance_window}"


def check_balance_window(balance_window) -> None:
    if balance_window is not None and (isinstance(balance_window, bool) or not isinstance(balance_window, int)
                                       or balance_window < 0):
        raise ValueError(
            f"`balance_window` must be None (no window) or an int >= 0 (the attention's window_size[0], keys a "
            f"query sees before itself), got {balance_window!r}"
        )


def check_layout(layout) -> None:
    """Raise ValueError unless ``layout`` names a known layout (or is an ``Assignment``)."""
    if isinstance(layout, Assignment):
        return
    name, window = split_spec(layout)
    if not isinstance(name, str) or name not in LAYOUTS or (window is not None and
                                                            (name not in DATA_DEPENDENT or window < 0)):
        raise ValueError(f"Invalid layout {layout!r}. Must be one of: {', '.join(map(repr, LAYOUTS))}")


def _one_document(layout, seq_len: int, ring_size: int):
    """A data-dependent layout name without documents: its assignment for one document (zigzag's positions)."""
    check_layout(layout)
    if isinstance(layout, str) and split_spec(layout)[0] in DATA_DEPENDENT:
        from distcomm_attention.planning import balance  # (balance builds on this module)

        check_global_length(layout, seq_len, ring_size)
        return balance.resolve(layout, seq_len, ring_size, None)
    return layout


class Block(NamedTuple):
    """One kernel call of a ring step: query rows, key/value rows, and whether the block is causal."""

    q: slice
    kv: slice
    causal: bool


def check_local_length(layout: str, local_len: int, ring_size: int, *, name: str = "local sequence length") -> None:
    """Raise ValueError unless every rank holding ``local_len`` tokens is a valid shard of ``layout``."""
    check_layout(layout)
    if isinstance(layout, Assignment) and (local_len != layout.local_len or ring_size != layout.ring_size):
        raise ValueError(f"{name} {local_len} over {ring_size} ranks does not match the layout's assignment of "
                         f"{layout.local_len} tokens to each of {layout.ring_size} ranks")
    if local_len < 0:
        raise ValueError(f"{name} must be >= 0, got {local_len}")
    if layout == "zigzag" and local_len % 2:
        raise ValueError(
            f"layout='zigzag' needs an even {name} (each rank holds two chunks of equal length: the global "
            f"length must be divisible by 2 * ring_size = {2 * ring_size}), got {local_len}"
        )


def check_global_length(layout: str, seq_len: int, ring_size: int) -> int:
    """Validate a global length for ``layout`` over ``ring_size`` ranks; return the local length."""
    check_layout(layout)
    if isinstance(layout, Assignment):
        if seq_len != layout.seq_len or ring_size != layout.ring_size:
            raise ValueError(f"a sequence of {seq_len} tokens over {ring_size} ranks does not match the layout's "
                             f"assignment of {layout.seq_len} tokens to {layout.ring_size} ranks")
        return layout.local_len
    divisor = 2 * ring_size if layout == "zigzag" else ring_size  # balanced, auto: equal tokens per rank
    if seq_len % divisor:
        raise ValueError(
            f"layout={layout!r} over a ring of {ring_size} needs a global sequence length divisible by "
            f"{divisor}, got {seq_len}"
        )
    return seq_len // ring_size


def check_position(ring_size: int, rank: int) -> None:
    """Raise ValueError unless ``rank`` is a position in a ring of ``ring_size``."""
    if isinstance(ring_size, bool) or not isinstance(ring_size, int) or ring_size < 1:
        raise ValueError(f"`ring_size` must be a positive int, got {ring_size!r}")
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < ring_size:
        raise ValueError(f"`rank` must be an int in [0, {ring_size}) (a position in the ring), got {rank!r}")


def positions(layout: str, seq_len: int, ring_size: int, rank: int) -> torch.Tensor:
    """Global token positions held by ring position ``rank``, in local order (see Note [Sequence layouts]).

    Returns:
        int64 tensor of shape (seq_len // ring_size,).
    """
    check_position(ring_size, rank)
    layout = _one_document(layout, seq_len, ring_size)  # documents known: pass the Assignment (balance.resolve)
    n = check_global_length(layout, seq_len, ring_size)
    if isinstance(layout, Assignment):
        return layout.positions(rank)
    if layout == "contiguous":
        return torch.arange(rank * n, (rank + 1) * n)
    if layout == "zigzag":
        c = n // 2
        last = 2 * ring_size - 1 - rank
        return torch.cat([torch.arange(rank * c, (rank + 1) * c), torch.arange(last * c, (last + 1) * c)])
    return torch.arange(n) * ring_size + rank


def seq_len_along(x: torch.Tensor, dim: int) -> tuple[int, int]:
    """(length of ``x`` along ``dim``, ``dim`` made non-negative), with clear errors for a bad ``dim``."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"expected a torch.Tensor, got {type(x).__name__}")
    if x.dim() == 0 or not -x.dim() <= dim < x.dim():
        raise ValueError(f"`dim`={dim} is out of range for a tensor of shape {tuple(x.shape)}")
    dim = dim % x.dim()
    return x.shape[dim], dim


def shard(x: torch.Tensor, layout: str, ring_size: int, rank: int, dim: int = 1) -> torch.Tensor:
    """Ring position ``rank``'s shard of the full sequence ``x`` (sequence along ``dim``).

    Differentiable (the grad lands on the shard's positions, zero elsewhere). Contiguous shards are views.
    """
    seq_len, dim = seq_len_along(x, dim)
    idx = positions(layout, seq_len, ring_size, rank)
    if layout == "contiguous":
        n = idx.numel()
        return x.narrow(dim, rank * n, n)
    return x.index_select(dim, to_device(idx, x.device))


def unshard(shards: list[torch.Tensor] | tuple[torch.Tensor, ...], layout: str, dim: int = 1) -> torch.Tensor:
    """Inverse of :func:`shard`: the full sequence from every ring position's shard (in ring order)."""
    if not isinstance(shards, (list, tuple)) or not shards:
        raise ValueError("`shards` must be a non-empty list of tensors, one per ring position")
    ring_size = len(shards)
    _, dim = seq_len_along(shards[0], dim)
    if any(s.shape != shards[0].shape for s in shards):
        raise ValueError(f"every shard must have the same shape, got {[tuple(s.shape) for s in shards]}")
    return unshard_concat(torch.cat(list(shards), dim), layout, ring_size, dim)


def unshard_concat(cat: torch.Tensor, layout: str, ring_size: int, dim: int) -> torch.Tensor:
    """The full sequence from the concatenation, in ring order, of every rank's shard."""
    if layout == "contiguous":
        return cat
    seq_len = cat.shape[dim]
    order = torch.cat([positions(layout, seq_len, ring_size, r) for r in range(ring_size)])
    return cat.index_select(dim, to_device(torch.argsort(order), cat.device))


def block_plan(layout: str, causal: bool, ring_size: int, rank: int, src: int, local_len: int) -> tuple[Block, ...]:
    """Kernel calls covering the visible pairs of rank's queries and src's keys (see Note [Causal blocks])."""
    everything = slice(None)
    if not local_len:
        return ()
    if not causal:
        return (Block(everything, everything, False),)
    if src == rank:  # the diagonal block of every layout: local order follows global order
        return (Block(everything, everything, True),)
    if layout == "contiguous":
        return (Block(everything, everything, False),) if src < rank else ()
    if layout == "zigzag":
        half = local_len // 2
        if src < rank:
            return (Block(everything, slice(0, half), False),)
        return (Block(slice(half, None), everything, False),)
    if src < rank:
        return (Block(everything, everything, True),)
    return (Block(slice(1, None), slice(0, local_len - 1), True),) if local_len > 1 else ()


@functools.lru_cache(maxsize=32)
def mesh_assignment(layout, seq_len: int, grid: tuple[tuple[int, ...], ...]) -> Assignment:
    """The hybrids' sharding as one layout over every rank of their mesh: rank ``grid[r][u]`` (of the group the
    mesh spans) holds ``hybrid_positions`` of coordinate (r, u), for ``layout`` over the ``len(grid)`` ring
    positions. What a 1-D strategy runs on over the whole mesh (``strategy="auto"`` on a 2-D mesh). Cached:
    every call of a model's layers asks for the same one."""
    rings, ulysses = len(grid), len(grid[0])
    ranges: list = [None] * (rings * ulysses)
    for r, row in enumerate(grid):
        for u, rank in enumerate(row):
            pos = hybrid_positions(layout, seq_len, rings, r, ulysses, u)
            cut = ((pos[1:] - pos[:-1]) != 1).nonzero().flatten() + 1
            starts = torch.cat([pos[:1], pos[cut]]).tolist()
            stops = torch.cat([pos[cut - 1] + 1, pos[-1:] + 1]).tolist()
            ranges[rank] = tuple(zip(starts, stops))
    name = layout.name if isinstance(layout, Assignment) else str(layout)
    return Assignment(f"{name} on a {rings} x {ulysses} mesh", tuple(ranges), seq_len)


def hybrid_positions(layout: str, seq_len: int, ring_size: int, ring_rank: int, ulysses_size: int,
                     ulysses_rank: int) -> torch.Tensor:
    """Global positions held by mesh coordinate (ring_rank, ulysses_rank) of the hybrid strategies: the
    layout's shard of ring position ``ring_rank`` (over ``ring_size``), cut into ``ulysses_size`` equal
    contiguous pieces, piece ``ulysses_rank``."""
    shard = positions(layout, seq_len, ring_size, ring_rank)
    n = shard.numel() // ulysses_size
    return shard[ulysses_rank * n:(ulysses_rank + 1) * n]
