"""Decides `train.jit_compile: auto` on CPU: XLA against plain graphs, same run.

For each config, runs `tfllm bench` with jit_compile false and true, interleaved over
several rounds (so machine noise hits both alike), and reports the median tokens/s of
each and their ratio. Writes benchmarks/results/cpu_jit.json.

Usage: python benchmarks/cpu_jit.py [--rounds 5] [--steps 30]
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
CONFIGS = {"tiny (data=8, 8 logical devices)": ["--config", "configs/tiny.yaml"],
           "gpt_5m (1 device)": ["--config", "configs/bench/gpt_5m.yaml"],
           "gpt_5m (data=2,model=4)": ["--config", "configs/bench/gpt_5m.yaml",
                                       "--set", "mesh.axes=data=2,model=4"]}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=30)
    args = parser.parse_args()
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")
    results = {}
    for name, cfg in CONFIGS.items():
        for _ in range(args.rounds):
            for jit in ("false", "true"):
                cmd = [sys.executable, "-m", "tfllm.cli.main", "bench", *cfg, "--steps",
                       str(args.steps), "--set", f"train.jit_compile={jit}"]
                out = subprocess.run(cmd, cwd=os.path.dirname(HERE), env=env, check=True,
                                     capture_output=True, text=True).stdout
                tps = json.loads(out.strip().splitlines()[-1])["tokens_per_s"]
                results.setdefault(name, {}).setdefault(jit, []).append(tps)
                print(name, "jit", jit, tps, flush=True)
    summary = {name: {"graph_tokens_per_s": statistics.median(r["false"]),
                      "xla_tokens_per_s": statistics.median(r["true"]),
                      "xla_over_graph": round(statistics.median(r["true"]) /
                                              statistics.median(r["false"]), 3)}
               for name, r in results.items()}
    summary["_meta"] = {"rounds": args.rounds, "steps": args.steps,
                        "date": time.strftime("%Y-%m-%d"), "cores": os.cpu_count()}
    print(json.dumps(summary, indent=1))
    os.makedirs(os.path.join(HERE, "results"), exist_ok=True)
    with open(os.path.join(HERE, "results", "cpu_jit.json"), "w") as f:
        json.dump({"summary": summary, "runs": results}, f, indent=1)


if __name__ == "__main__":
    main()
