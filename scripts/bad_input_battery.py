"""Run the bad-input battery: every case of tests/bad_input_cases.py on fresh gloo worlds, classified.

    python scripts/bad_input_battery.py --worlds 2 3 --timeout 20 --json battery.json
    python scripts/bad_input_battery.py --only 'attn\\.cu_' --worlds 2

Each (case, world) runs exactly once, in a fresh world, under the timeout; prints one row per run (case,
world, verdict, first rank's message) and the count of each verdict per world. Exit status 0 when every
run's verdict is good (``clear`` or ``correct``), 1 otherwise.

``--jobs 2`` runs two worlds at once (about 2.5 instead of 3.5 minutes on 2 cores); with two at once, a
case has been seen to end ``nostart`` (connectFullMesh failed) or ``crash`` (a rank exiting with code 255
after raising a clear error) about once per full battery, never with one world at a time.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from concurrent.futures import ThreadPoolExecutor

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from tests.bad_input_cases import CASES, DEFAULT_MODE_ONLY, GOOD, VERDICTS, known_verdict, run_case  # noqa: E402


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 3], help="world sizes (default 2 3)")
    parser.add_argument("--timeout", type=float, default=20.0, help="seconds before a world counts as hung")
    parser.add_argument("--only", default=None, help="run only cases whose name matches this regex")
    parser.add_argument("--jobs", type=int, default=1, help="worlds run at once (default 1)")
    parser.add_argument("--json", default=None, help="write every outcome (per rank) to this file")
    parser.add_argument("--width", type=int, default=110, help="message column width")
    args = parser.parse_args(argv)

    cases = [c for c in CASES if args.only is None or re.search(args.only, c.name)]
    runs = [(c, w) for c in cases for w in args.worlds]
    if not runs:
        print("no case matches", file=sys.stderr)
        return 2
    print(f"{len(cases)} cases x worlds {args.worlds}: {len(runs)} runs, timeout {args.timeout:g}s, {args.jobs} at once")
    with ThreadPoolExecutor(max_workers=args.jobs) as pool:
        outcomes = list(pool.map(lambda cw: run_case(cw[0], cw[1], args.timeout), runs))

    name_w = max(len(c.name) for c in cases)
    print(f"\n{'case':<{name_w}}  world  {'verdict':<8} {'known':<8} first rank's message / reason")
    for (c, w), o in zip(runs, outcomes):
        msg = " ".join(o.first_message().split())
        if o.verdict not in ("clear", "correct") and o.reason not in msg:
            msg = f"[{o.reason}] {msg}"
        known = known_verdict(c, w) or "-"
        print(f"{c.name:<{name_w}}  {w:>5}  {o.verdict:<8} {known:<8} {msg[: args.width]}")

    print("\nverdicts per world (default-mode mismatches that only check mode can see, docs/collectives.md, "
          "counted apart as 'documented'):")
    for w in args.worlds:
        mine = [(c, o) for (c, ww), o in zip(runs, outcomes) if ww == w]
        counts = {v: sum(1 for c, o in mine if o.verdict == v and c.name not in DEFAULT_MODE_ONLY) for v in VERDICTS}
        counts["documented"] = sum(1 for c, _ in mine if c.name in DEFAULT_MODE_ONLY)
        print(f"  world {w}: " + ", ".join(f"{v} {n}" for v, n in counts.items()))
    changed = [
        (c.name, w, known_verdict(c, w) or "good", o.verdict)
        for (c, w), o in zip(runs, outcomes)
        if c.name not in DEFAULT_MODE_ONLY
        and (known_verdict(c, w) or "good") != ("good" if o.verdict in GOOD else o.verdict)
    ]
    if changed:
        print("\nverdicts that differ from the cases' recorded ones (update `known` in tests/bad_input_cases.py):")
        for name, w, was, now in changed:
            print(f"  {name} (world {w}): recorded {was}, now {now}")

    if args.json:
        with open(args.json, "w") as f:
            json.dump([o.__dict__ for o in outcomes], f, indent=1)
    return 0 if all(o.verdict in GOOD for (c, _), o in zip(runs, outcomes) if c.name not in DEFAULT_MODE_ONLY) else 1


if __name__ == "__main__":
    sys.exit(main())
