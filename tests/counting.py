"""Strategies' traffic in tests: every transport made inside ``counted()`` counts the bytes it sends."""

import contextlib

from distcomm_attention import transport
from distcomm_attention.transport import CountingTransport, TorchTransport

__all__ = ["counted"]


@contextlib.contextmanager
def counted():
    """Within the block, the strategies' transports are counting ones over torch.distributed; yields the list
    of those made (``sum(c.total for c in made)``: the bytes this rank sent)."""
    made: list[CountingTransport] = []

    def factory(group):
        made.append(CountingTransport(TorchTransport(group)))
        return made[-1]

    with transport.using(factory):
        yield made
