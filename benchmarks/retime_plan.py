"""Re-times stored `tfllm plan --json` results with today's step-time model.

    python benchmarks/retime_plan.py PLAN.json [...] [--suffix _retimed]
    python benchmarks/retime_plan.py PLAN.json --config configs/llama-7b.yaml --devices 8

The step estimate of a plan is arithmetic over what the plan compiled and measured
(`tfllm.plan.timing.step_time` over the roofline, kernel count, clusters and
collectives), so a change of the model alone does not need a new compile. This applies
today's model to each stored plan and writes PLAN<suffix>.json beside it, with the
estimate, MFU and tokens/s replaced and `retimed` naming the date and the source file;
it prints one line per plan (before -> after).

With `--config` (the config the plan was made of, and `--devices`), a mesh plan made
before `tfllm.footprint.layout.gradients` also has its memory re-counted: the float32
gradients the compiled program holds whole, where a mesh device keeps its shards.
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
from tfllm.plan.result import PlanResult  # noqa: E402


def retime(plan: dict) -> dict:
    """The plan with today's step time, roofline lower bound, MFU and tokens/s (its other
    keys, such as a stored plan's `retimed` or `recount`, kept)."""
    result = planner.retime(PlanResult.from_json(plan), get_target(plan["target"]))
    return {**plan, **result.to_json()}


def recount_gradients(plan: dict, config, devices) -> dict:
    """The plan with the mesh device's float32 gradients in place of the compiled
    program's whole set (`tfllm.footprint.layout.gradients`), where the stored plan
    predates it; its fit against the device recomputed."""
    from tfllm.footprint import layout as footprint
    new = copy.deepcopy(plan)
    m = new["memory"]
    if "gradients" in m or new.get("devices", 1) == 1:
        return new  # counted when planned, or one device: nothing to re-count
    plan = footprint.mesh_plan(config, devices)
    g = footprint.gradients(plan, footprint.mesh_plan(plan.local)).as_json()
    m["gradients"] = g
    m["total"] -= g["subtracted"]
    if g["excess"] and not g["subtracted"]:
        m["total_low"] = m["total"] - g["excess"]
    m["margin"] = m["usable"] - m["total"]
    m["fits"] = m["margin"] >= 0
    return new


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("plans", nargs="+")
    parser.add_argument("--suffix", default="_retimed")
    parser.add_argument("--config", help="the plans' config: re-count their gradients")
    parser.add_argument("--devices", type=int, default=None,
                        help="the device count the plans were made for (--devices)")
    parser.add_argument("--set", action="append", default=[], dest="overrides",
                        help="the plans' --set overrides, as tfllm plan took them")
    args = parser.parse_args(argv)
    config = None
    if args.config:
        from tfllm.config import load_config
        config = load_config(args.config, args.overrides)
    today = datetime.date.today().isoformat()
    for path in args.plans:
        with open(path) as f:
            plan = json.load(f)
        new = retime(plan if config is None else recount_gradients(plan, config,
                                                                  args.devices))
        new["retimed"] = {"date": today, "from": os.path.basename(path),
                          "what": "step time, roofline lower bound, tokens/s and MFU recomputed by "
                                  "tfllm.plan.timing; compile and measurements as stored"
                                  + ("; memory: the float32 gradients a mesh device keeps "
                                     "(tfllm.footprint.layout.gradients)" if config else "")}
        root, ext = os.path.splitext(path)
        with open(root + args.suffix + ext, "w") as f:
            json.dump(new, f)
        t = new["step_time"]
        print(f"{os.path.basename(path)}: est. step {plan['estimated_step_s'] * 1e3:.0f} -> "
              f"{t['step_s'] * 1e3:.0f} ms, MFU {plan['estimated_mfu']:.1%} -> "
              f"{new['estimated_mfu']:.1%}, {new['estimated_tokens_per_s']:,.0f} tokens/s; "
              f"dispatch {t['dispatch_s'] * 1e3:.1f} ms, "
              f"{t.get('exposed_dispatch_s', t['dispatch_s']) * 1e3:.2f} exposed; memory "
              f"{plan['memory']['total'] / 2**30:.2f} -> "
              f"{new['memory']['total'] / 2**30:.2f} GiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
