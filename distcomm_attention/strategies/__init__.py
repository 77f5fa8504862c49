"""Who talks to whom: the context-parallel strategies, generic over the block-kernel contract.

- ``prepare``: one call's per-rank checks, cross-rank verification, plan and kernel choice (shared by every
  strategy and by the compiled path).
- ``ring``: ring attention (Note [Ring attention loop]) and the ring all-gather / reduce-scatter.
"""
