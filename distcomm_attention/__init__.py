"""distcomm_attention: ring flash attention over a sequence sharded across ranks.

Public API: :func:`ring_flash_attn`, :func:`which_kernels`, :func:`cu_seqlens_from_position_ids`,
:func:`shard_sequence`, :func:`gather_sequence`, :func:`position_ids`, :class:`RingAttention`,
and the accepted names ``LAYOUTS`` and ``BACKENDS``. Importing needs neither triton nor flash_attn: kernels
are imported when a backend is first used.
"""

from distcomm_attention._kernels import BACKENDS
from distcomm_attention._kernels import KernelChoice
from distcomm_attention._positions import position_ids
from distcomm_attention._visibility import cu_seqlens_from_position_ids
from distcomm_attention.api import gather_sequence, ring_flash_attn, shard_sequence, which_kernels
from distcomm_attention.layouts import LAYOUTS
from distcomm_attention.modules import RingAttention

__all__ = [
    "ring_flash_attn",
    "which_kernels",
    "KernelChoice",
    "cu_seqlens_from_position_ids",
    "shard_sequence",
    "gather_sequence",
    "position_ids",
    "RingAttention",
    "LAYOUTS",
    "BACKENDS",
]
