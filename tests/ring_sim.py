"""The ring's schedule in one process: every rank's block calls, from the same plan and the same kernels as
``ring_flash_attn``, without communication. Lets one GPU (or the CPU interpreter) check the kernels on the
blocks a ring of any size issues; the gloo tests check the communication.
"""

import torch

from distcomm_attention.planning import layouts
from distcomm_attention.planning.visibility import ring_plan
from distcomm_attention.strategies.ring import packed


def simulate_ring(q, k, v, dout, key_mask, *, layout, ring_size, vis, scale, softcap, fwd, bwd):
    """Ring attention of the global (B, S, H, D) q and (B, S, Hkv, D) k, v over ``ring_size`` simulated ranks.

    Returns the global out (q's dtype) and dq, dk, dv (fp32 sums of the block gradients, then q's dtype).
    """
    w = ring_size
    shard = lambda x: [layouts.shard(x, layout, w, r, 1).contiguous() for r in range(w)]  # noqa: E731
    qs, ks, vs, dos = shard(q), shard(k), shard(v), shard(dout)
    kms = shard(key_mask) if key_mask is not None else [None] * w
    n = qs[0].shape[1]
    plans = [ring_plan(layout, vis, w, r, n) for r in range(w)]
    outs, lses = [], []
    for r in range(w):
        state = fwd.init_state(qs[r])
        for i, t in enumerate(plans[r].steps):
            src = (r - t) % w
            calls = packed(plans[r], i, fwd, kms[src], q.device, backward=False)
            if calls is not None:  # the step's pieces in few varlen calls, as the ring runs them
                fwd.packed_step(state, qs[r], ks[src], vs[src], calls, scale=scale, softcap=softcap)
                continue
            for j, block in enumerate(plans[r].blocks[i]):
                fwd.step(
                    state, qs[r], ks[src][:, block.kv], vs[src][:, block.kv],
                    mask=plans[r].mask(i, j, q.device), scale=scale, softcap=softcap,
                    key_mask=None if kms[src] is None else kms[src][:, block.kv], q_slice=block.q,
                )
        out, lse = fwd.finalize(state, q.dtype)
        outs.append(out)
        lses.append(lse)
    dqs = [torch.zeros(x.shape, dtype=torch.float32, device=q.device) for x in qs]
    dks = [torch.zeros(x.shape, dtype=torch.float32, device=q.device) for x in ks]
    dvs = [torch.zeros(x.shape, dtype=torch.float32, device=q.device) for x in vs]
    for r in range(w):
        delta = (dos[r].float() * outs[r].float()).sum(-1).transpose(1, 2).contiguous()
        for i, t in enumerate(plans[r].steps):
            src = (r - t) % w
            calls = packed(plans[r], i, bwd, kms[src], q.device, backward=True)
            if calls is not None:
                for kv, dk, dv in bwd.packed_step(dos[r], qs[r], ks[src], vs[src], outs[r], lses[r], calls,
                                                  scale=scale, softcap=softcap, dq_acc=dqs[r]):
                    dks[src][:, kv] += dk
                    dvs[src][:, kv] += dv
                continue
            for j, block in enumerate(plans[r].blocks[i]):
                rows = block.q
                _, dk, dv = bwd.step(
                    dos[r][:, rows], qs[r][:, rows], ks[src][:, block.kv], vs[src][:, block.kv],
                    outs[r][:, rows], lses[r][:, :, rows], delta[:, :, rows],
                    mask=plans[r].mask(i, j, q.device), scale=scale, softcap=softcap,
                    key_mask=None if kms[src] is None else kms[src][:, block.kv],
                    dq_acc=dqs[r][:, rows], dkv_dtype=torch.float32,
                )
                dks[src][:, block.kv] += dk
                dvs[src][:, block.kv] += dv
    unshard = lambda xs: layouts.unshard([x.to(q.dtype) for x in xs], layout, 1)  # noqa: E731
    return unshard(outs), unshard(dqs), unshard(dks), unshard(dvs)
