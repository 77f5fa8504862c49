"""distcomm_attention: context-parallel flash attention over a sequence sharded across ranks.

Public API: :func:`context_parallel_attn` (ring, Ulysses, all-gather KV, hybrids, or the cost model's pick),
:func:`which_strategy` (and :class:`Hardware`, what its cost model predicts with), :func:`ring_flash_attn`,
:func:`which_kernels`, :func:`cu_seqlens_from_position_ids`, :func:`shard_sequence`, :func:`gather_sequence`,
:func:`position_ids`, :class:`Sharding` (layout, group and ring size in one handle), :class:`RingAttention`, and the accepted names ``LAYOUTS`` and ``BACKENDS``.
Importing needs neither triton nor flash_attn: kernels are imported when a backend is first used.
Linear attention and the short conv of hybrid models (GDN, Mamba-2) on the same sharding:
:mod:`distcomm_attention.linear` (docs/hybrid.md).
"""

from distcomm import __version__  # one distribution ships both packages
from distcomm_attention.api import context_parallel_attn, ring_flash_attn, which_kernels, which_strategy
from distcomm_attention.kernels.dispatch import BACKENDS, KernelChoice
from distcomm_attention.modules import RingAttention
from distcomm_attention.planning.cost import Hardware
from distcomm_attention.planning.layouts import LAYOUTS
from distcomm_attention.planning.visibility import cu_seqlens_from_position_ids
from distcomm_attention.strategies.dispatch import STRATEGIES
from distcomm_attention.sharding import Sharding, gather_sequence, position_ids, shard_sequence

__all__ = [
    "ring_flash_attn",
    "context_parallel_attn",
    "which_strategy",
    "Hardware",
    "STRATEGIES",
    "which_kernels",
    "KernelChoice",
    "cu_seqlens_from_position_ids",
    "shard_sequence",
    "gather_sequence",
    "position_ids",
    "Sharding",
    "RingAttention",
    "LAYOUTS",
    "BACKENDS",
]
