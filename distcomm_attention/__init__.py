"""distcomm_attention: ring flash attention over a sequence sharded across ranks.

Public API: :func:`ring_flash_attn`, :func:`shard_sequence`, :func:`gather_sequence`, :class:`RingAttention`,
and the accepted names ``LAYOUTS`` and ``BACKENDS``. Importing needs neither triton nor flash_attn: kernels
are imported when a backend is first used.
"""

from distcomm_attention._kernels import BACKENDS
from distcomm_attention.api import gather_sequence, ring_flash_attn, shard_sequence
from distcomm_attention.layouts import LAYOUTS
from distcomm_attention.modules import RingAttention

__all__ = ["ring_flash_attn", "shard_sequence", "gather_sequence", "RingAttention", "LAYOUTS", "BACKENDS"]
