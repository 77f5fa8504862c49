"""Who may attend whom, and which blocks each rank computes: pure functions, no communication, no kernels.

- ``visibility``: the one visibility rule (causal, window, documents, key padding) and the ring's block plan.
- ``layouts``: which global tokens each rank holds (contiguous, zigzag, striped) and shard / unshard.
"""
