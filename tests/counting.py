"""Strategies' traffic in tests: every transport made inside ``counted()`` counts the bytes it sends."""

import contextlib

from distcomm_attention import transport
from distcomm_attention.transport import CountingTransport, TorchTransport

__all__ = ["counted", "counted_attention"]


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


def counted_attention(rank, world, n, layout, causal, window, docs, masked, seed, call):
    """One rank's counted fwd+bwd of ``call(q, k, v, **kwargs)`` on its shards of random float64 inputs (batch 2,
    heads 4 / kv heads 2, head_dim 8, ``n`` tokens a rank), against the float64 reference over the whole
    sequence: {"errors": max abs error of out, dq, dk, dv; "sent": bytes this rank's transports sent;
    "transports": how many were made}."""
    import torch

    from distcomm_attention._reference import attention_reference
    from distcomm_attention.planning import balance, layouts

    seq_len = world * n
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(2, seq_len, h, 8, dtype=torch.float64, generator=g) for h in (4, 2, 2))
    dout = torch.randn(2, seq_len, 4, 8, dtype=torch.float64, generator=g)
    mask = torch.rand(2, seq_len, generator=g) > 0.2 if masked else None
    concrete = balance.resolve(layout, seq_len, world, docs) if layout == "balanced" else layout
    pos = layouts.positions(concrete, seq_len, world, rank)
    local = [t[:, pos].clone().requires_grad_() for t in (q, k, v)]
    kwargs = dict(causal=causal, window_size=window, cu_seqlens=docs, layout=layout,
                  attention_mask=None if mask is None else mask[:, pos])
    with counted() as made:
        out = call(*local, **kwargs)
        out.backward(dout[:, pos])
    errors = reference_errors(q, k, v, dout, pos, out, local, causal=causal, window=window, docs=docs, mask=mask)
    return {"errors": errors, "sent": sum(c.total for c in made), "transports": len(made)}


def max_diff(a, b) -> float:
    """The largest |a - b|, and inf where either holds a NaN (``max`` over a list of errors passes over a NaN:
    every comparison with it is False)."""
    diff = (a - b).abs().max()
    return float("inf") if bool(diff.isnan()) else float(diff)


def reference_errors(q, k, v, dout, pos, out, local, *, causal, window, docs, mask) -> list[float]:
    """Largest differences of a rank's out, dq, dk, dv (``local``: its leaves, at global positions ``pos``)
    from the float64 single-process reference over the whole sequence."""
    from distcomm_attention._reference import attention_reference

    ref_in = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = attention_reference(*ref_in, causal=causal, window_size=window, cu_seqlens=docs, attention_mask=mask)
    ref.backward(dout)
    return [max_diff(a.detach(), b[:, pos]) for a, b in
            zip([out] + [t.grad for t in local], [ref.detach()] + [t.grad for t in ref_in])]
