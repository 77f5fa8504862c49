"""How the strategies communicate: one transport interface, its implementations side by side
(Note [Transport] in transport/base.py)."""

from distcomm_attention.transport.base import Done, Handle, Transport, for_group, using
from distcomm_attention.transport.counting import CountingTransport
from distcomm_attention.transport.torch_dist import TorchTransport

__all__ = ["Done", "Handle", "Transport", "for_group", "using", "CountingTransport", "TorchTransport"]
