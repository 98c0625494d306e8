"""Re-times stored `tfllm plan --json` results with today's step-time model.

    python benchmarks/retime_plan.py PLAN.json [...] [--suffix _retimed]

The step estimate of a plan is arithmetic over what the plan compiled and measured
(`tfllm.plan.timing.step_time` over the roofline, kernel count, clusters and
collectives), so a change of the model alone does not need a new compile. This applies
today's model to each stored plan and writes PLAN<suffix>.json beside it, with the
estimate, MFU and tokens/s replaced and `retimed` naming the date and the source file;
it prints one line per plan (before -> after).
"""

import argparse
import copy
import datetime
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tfllm.compiler.targets import get_target  # noqa: E402
from tfllm.plan import planner  # noqa: E402


def retime(plan: dict) -> dict:
    """The plan with today's step time, roofline lower bound, MFU and tokens/s."""
    return planner.estimate_time(copy.deepcopy(plan), get_target(plan["target"]))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("plans", nargs="+")
    parser.add_argument("--suffix", default="_retimed")
    args = parser.parse_args(argv)
    today = datetime.date.today().isoformat()
    for path in args.plans:
        with open(path) as f:
            plan = json.load(f)
        new = retime(plan)
        new["retimed"] = {"date": today, "from": os.path.basename(path),
                          "what": "step time, roofline lower bound, tokens/s and MFU recomputed by "
                                  "tfllm.plan.timing; compile and measurements as stored"}
        root, ext = os.path.splitext(path)
        with open(root + args.suffix + ext, "w") as f:
            json.dump(new, f)
        t = new["step_time"]
        print(f"{os.path.basename(path)}: est. step {plan['estimated_step_s'] * 1e3:.0f} -> "
              f"{t['step_s'] * 1e3:.0f} ms, MFU {plan['estimated_mfu']:.1%} -> "
              f"{new['estimated_mfu']:.1%}, {new['estimated_tokens_per_s']:,.0f} tokens/s; "
              f"dispatch {t['dispatch_s'] * 1e3:.1f} ms, "
              f"{t.get('exposed_dispatch_s', t['dispatch_s']) * 1e3:.2f} exposed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
