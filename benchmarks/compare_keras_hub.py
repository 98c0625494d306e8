"""tfllm's train step against keras-hub's GPT2Backbone under model.fit, in one run.

Both train the same 5,322,240-parameter GPT-2 (configs/bench/gpt_5m.yaml) on one device.
Runs are interleaved round by round (tfllm and keras-hub, each with XLA off and on) so
that machine noise hits all four alike; prints each run's JSON, then the medians over
rounds and the ratio tfllm / keras-hub for each jit setting, and writes them to
benchmarks/results/keras_hub_comparison.json.

Usage: python benchmarks/compare_keras_hub.py [--rounds 3] [--steps 20]
"""

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def _last_json(cmd):
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")
    out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    runs = {}
    for round_index in range(args.rounds):
        for jit in ("false", "true"):
            tfllm = _last_json([sys.executable, "-m", "tfllm.cli.main", "bench", "--config",
                                "configs/bench/gpt_5m.yaml", "--steps", str(args.steps),
                                "--set", f"train.jit_compile={jit}"])
            hub = _last_json([sys.executable, os.path.join(HERE, "keras_hub_baseline.py"),
                              "--jit-compile", jit, "--steps", str(args.steps)])
            for name, result in (("tfllm", tfllm), ("keras_hub", hub)):
                runs.setdefault(f"{name}_jit_{jit}", []).append(result["tokens_per_s"])
                print(json.dumps({"round": round_index, "run": name, **result}), flush=True)
    summary = {key: statistics.median(v) for key, v in runs.items()}
    for jit in ("false", "true"):
        summary[f"ratio_jit_{jit}"] = round(summary[f"tfllm_jit_{jit}"] /
                                            summary[f"keras_hub_jit_{jit}"], 3)
    summary["best_ratio"] = round(max(summary["tfllm_jit_false"], summary["tfllm_jit_true"]) /
                                  max(summary["keras_hub_jit_false"],
                                      summary["keras_hub_jit_true"]), 3)
    summary.update(rounds=args.rounds, steps=args.steps, date=time.strftime("%Y-%m-%d"),
                   machine=f"{platform.machine()}, {os.cpu_count()} cores", unit="tokens/s")
    print(json.dumps(summary))
    os.makedirs(os.path.join(HERE, "results"), exist_ok=True)
    with open(os.path.join(HERE, "results", "keras_hub_comparison.json"), "w") as f:
        json.dump({"summary": summary, "runs": runs}, f, indent=1)


if __name__ == "__main__":
    main()
