"""Linear-attention layers' forwards under context parallelism, from the layers' own weights.

Qwen3-Next's and Qwen3.5's ``GatedDeltaNet`` modules (transformers) run: input projections -> short causal
conv over [q | k | v] -> SiLU -> gated delta rule (q, k L2-normalised, beta = sigmoid(b), g = -exp(A_log)
softplus(a + dt_bias)) -> gated RMS norm with z -> output projection. The Mamba-2 mixers of Bamba, Granite 4.0
(GraniteMoeHybrid) and Nemotron-H run: input projection to [gate | x B C | dt] -> short causal conv over
[x | B | C] -> SiLU -> SSD (dt = clamp(softplus(dt + dt_bias)), state decay exp(A dt) with A = -exp(A_log),
input B (x dt)^T, output C^T S, plus D x) -> gated RMS norm with the gate -> output projection; the SSD is the
scalar-decay recurrence with q = C, k = B, v = x dt, g = A dt (B and C shared by the heads of a group).
Everything but the conv and the recurrence is per token; :func:`gdn_forward` and :func:`mamba2_forward` run
those two across ranks (:func:`causal_conv1d_cp`, :func:`chunk_gated_delta_rule_cp`,
:func:`chunk_simple_gla_cp`) and call the module's own projections, norm and gate for the rest. Nothing here
imports transformers: the module is read by its attributes.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from distcomm_attention.linear.conv import causal_conv1d_cp
from distcomm_attention.linear.recurrence import chunk_gated_delta_rule_cp, chunk_simple_gla_cp

__all__ = ["gdn_forward", "is_gdn_layer", "mamba2_forward", "MAMBA2_MIXERS", "SUPPORTED"]

# the Mamba-2 mixers whose forward is the one mamba2_forward computes (checked against transformers' own
# layers in tests/test_linear_attention.py); others (Falcon-H1's, with its multipliers; Zamba2's) are refused
MAMBA2_MIXERS = ("BambaMixer", "GraniteMoeHybridMambaLayer", "NemotronHMamba2Mixer")
SUPPORTED = ("Qwen3-Next's and Qwen3.5's GatedDeltaNet (in_proj_qkvz + in_proj_ba, or in_proj_qkv/z/b/a), "
             "and the Mamba-2 mixers " + ", ".join(MAMBA2_MIXERS))


def is_gdn_layer(module: torch.nn.Module) -> bool:
    """Whether ``module`` has the attributes :func:`gdn_forward` reads."""
    common = ("conv1d", "A_log", "dt_bias", "norm", "out_proj", "head_k_dim", "head_v_dim", "key_dim", "value_dim")
    if not all(hasattr(module, a) for a in common):
        return False
    return hasattr(module, "in_proj_qkvz") and hasattr(module, "in_proj_ba") or \
        all(hasattr(module, a) for a in ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a"))


def _projections(module, hidden: torch.Tensor):
    """(mixed q|k|v (B, T, C), z (B, T, HV, V), b, a (B, T, HV)) as the module computes them."""
    batch, seq = hidden.shape[:2]
    if hasattr(module, "in_proj_qkvz"):
        q, k, v, z, b, a = module.fix_query_key_value_ordering(module.in_proj_qkvz(hidden), module.in_proj_ba(hidden))
        mixed = torch.cat([x.reshape(batch, seq, -1) for x in (q, k, v)], dim=-1)
        return mixed, z, b, a
    z = module.in_proj_z(hidden).reshape(batch, seq, -1, module.head_v_dim)
    return module.in_proj_qkv(hidden), z, module.in_proj_b(hidden), module.in_proj_a(hidden)


def gdn_forward(module, hidden_states: torch.Tensor, *, sharding, cu_seqlens=None, attention_mask=None,
                kernel: str = "auto") -> torch.Tensor:
    """The layer's output (B, T, hidden) for this rank's T tokens, sharded as ``sharding`` says.

    Args:
        module: a GatedDeltaNet module (:func:`is_gdn_layer`).
        hidden_states: (B, T, hidden) this rank's tokens.
        sharding: the :class:`~distcomm_attention.Sharding` of the tokens (the softmax layers' one).
        cu_seqlens: the global document boundaries (packed documents), or None.
        attention_mask: None or this rank's (B, T) padding mask (padded tokens' inputs are zeroed, as the
            module does).
        kernel: the recurrence's kernel ("auto", "torch", "fla").
    """
    hidden_states = _padding_zeroed(hidden_states, attention_mask)
    batch, seq = hidden_states.shape[:2]
    mixed, z, b, a = _projections(module, hidden_states)
    mixed = causal_conv1d_cp(mixed, module.conv1d.weight, module.conv1d.bias, module.activation,
                             cu_seqlens=cu_seqlens, sharding=sharding)
    q, k, v = torch.split(mixed, [module.key_dim, module.key_dim, module.value_dim], dim=-1)
    q = q.reshape(batch, seq, -1, module.head_k_dim)
    k = k.reshape(batch, seq, -1, module.head_k_dim)
    v = v.reshape(batch, seq, -1, module.head_v_dim)
    beta = b.sigmoid()
    g = -module.A_log.float().exp() * F.softplus(a.float() + module.dt_bias)
    out, _ = chunk_gated_delta_rule_cp(q, k, v, g, beta, use_qk_l2norm_in_kernel=True, cu_seqlens=cu_seqlens,
                                       sharding=sharding, kernel=kernel)
    out = module.norm(out.reshape(-1, module.head_v_dim), z.reshape(-1, module.head_v_dim))
    return module.out_proj(out.reshape(batch, seq, -1))


def _padding_zeroed(x: torch.Tensor, attention_mask) -> torch.Tensor:
    """``x`` with the padded tokens' rows zeroed by a (B, T) mask, as the layers do; as it is without one."""
    if isinstance(attention_mask, torch.Tensor) and attention_mask.dim() == 2:
        return (x * attention_mask[:, :, None]).to(x.dtype)
    return x


def mamba2_forward(module, hidden_states: torch.Tensor, *, sharding, cu_seqlens=None, attention_mask=None,
                   kernel: str = "auto") -> torch.Tensor:
    """A Mamba-2 mixer's output (B, T, hidden) for this rank's T tokens (one of :data:`MAMBA2_MIXERS`).

    Arguments as :func:`gdn_forward`. The recurrence runs in the inputs' dtype (float64 in, float64 out), with
    the decay, the ``D`` skip and the gated norm in float32 for 16/32-bit inputs, as the mixer does; padded
    tokens' inputs are zeroed before the projection and after the conv, as the mixer does. The mixer's
    accelerate hooks (weights offloaded by accelerate) are not applied.
    """
    batch, seq = hidden_states.shape[:2]
    heads, head_dim, groups, state = module.num_heads, module.head_dim, module.n_groups, module.ssm_state_size
    projected = module.in_proj(_padding_zeroed(hidden_states, attention_mask))
    gate, xbc, dt = projected.split([module.intermediate_size, module.conv_dim, heads], dim=-1)
    xbc = causal_conv1d_cp(xbc, module.conv1d.weight, module.conv1d.bias, module.activation,
                           cu_seqlens=cu_seqlens, sharding=sharding)
    x, b, c = _padding_zeroed(xbc, attention_mask).split([module.intermediate_size, groups * state, groups * state],
                                                         dim=-1)
    low, high = module.time_step_limit
    dt = F.softplus(dt + module.dt_bias.to(dt.dtype)).clamp(min=low, max=high)
    x = x.reshape(batch, seq, heads, head_dim)
    decay_dtype = torch.float64 if x.dtype == torch.float64 else torch.float32
    g = -module.A_log.to(decay_dtype).exp() * dt.to(decay_dtype)
    y, _ = chunk_simple_gla_cp(c.reshape(batch, seq, groups, state), b.reshape(batch, seq, groups, state),
                               (x * dt[..., None]).to(x.dtype), g, scale=1.0, cu_seqlens=cu_seqlens,
                               sharding=sharding, kernel=kernel)
    # the skip, the norm's input and the norm in float32 (float64 for float64 inputs), as the mixer runs them
    y = y.to(decay_dtype) + module.D.to(decay_dtype)[:, None] * x.to(decay_dtype)
    return module.out_proj(module.norm(y.reshape(batch, seq, -1), gate).to(hidden_states.dtype))
