"""``python -m distcomm_attention.demo [--world-size 2] [--steps 40] [--plot distcomm_demo.png]``

Starts its own local ranks (gloo on CPU; NCCL when enough GPUs are present; no torchrun needed) and:
1. runs every collective forward and backward and checks values and gradients against a single-process
   float64 simulation (the first part of ``python -m distcomm.demo``);
2. runs ring flash attention in every layout and checks it against single-process attention;
3. trains a two-tower CLIP model on uneven per-rank batches and a ring-attention language model, checks
   that each distributed run matches a single-process run of the same steps, and plots the loss curves.
Exits with status 1 if any check fails.
"""

from __future__ import annotations

import sys
import time

from distcomm.demo import _common, clip_training, collectives
from distcomm_attention.demo import attention, lm_training


def main(argv=None) -> int:
    args = _common.parse_args("python -m distcomm_attention.demo", __doc__.split("\n")[0], argv)
    world = args.world_size
    backend, device = _common.backend_and_device(world)
    print(f"distcomm demo: {world} local ranks, backend {backend}, device {device}")
    start = time.time()
    ok = collectives.run(world, device, backend, number=1)
    ok &= attention.run(world, device, backend, number=2)
    print(f"\n3. training {args.steps} steps on {world} ranks")
    good_clip, clip_curve = clip_training.run(world, device, backend, args.steps)
    good_lm, lm_curve = lm_training.run(world, device, backend, args.steps)
    ok &= good_clip and good_lm
    _common.plot(args.plot, [clip_curve, lm_curve], world)
    print(f"\n{'all checks passed' if ok else 'SOME CHECKS FAILED'} in {time.time() - start:.1f}s")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
