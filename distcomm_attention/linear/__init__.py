"""Context-parallel linear attention for hybrid models, on the same sharding as softmax attention.

Public API: :func:`chunk_gated_delta_rule_cp` (gated delta rule: GDN, Qwen3-Next), :func:`chunk_simple_gla_cp`
(scalar decay: simple GLA, Mamba-2 SSD) and :func:`causal_conv1d_cp` (the short causal convolution before
them, with its halo across ranks). Each rank passes its shard in the layout ``shard_sequence`` gave it.

Modules: ``plan`` (runs, segments, exchange slots: pure), ``kernels`` (the per-run kernels: PyTorch, fla),
``exchange`` (the differentiable all-gather over the transport), ``recurrence`` (the two recurrences across
ranks: Note [Linear attention across ranks]), ``conv`` (the halo convolution), ``_checks`` (argument checks).
fla is imported only when its kernel is used; docs/hybrid.md is the user's page.
"""

from distcomm_attention.linear.conv import causal_conv1d_cp
from distcomm_attention.linear.kernels import KERNELS
from distcomm_attention.linear.recurrence import chunk_gated_delta_rule_cp, chunk_simple_gla_cp

__all__ = ["chunk_gated_delta_rule_cp", "chunk_simple_gla_cp", "causal_conv1d_cp", "KERNELS"]
