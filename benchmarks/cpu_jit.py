"""Decides `train.jit_compile: auto` on CPU: XLA against plain graphs, same run.

XLA here is real: on a mesh tfllm clusters each device's program (tfllm/compiler/jit.py),
and every XLA run's own report (clusters, share of ops compiled) is checked and stored.

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
CONFIGS = {"tiny (data=2)": ["--config", "configs/tiny.yaml", "--set", "mesh.axes=data=2"],
           "gpt_5m (1 device)": ["--config", "configs/bench/gpt_5m.yaml"],
           "gpt_5m (1 device, bf16)": ["--config", "configs/bench/gpt_5m.yaml",
                                       "--set", "precision.policy=bfloat16"],
           "gpt_5m (data=2,model=4)": ["--config", "configs/bench/gpt_5m.yaml",
                                       "--set", "mesh.axes=data=2,model=4"]}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=30)
    args = parser.parse_args()
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")
    results, first, xla_reports = {}, {}, {}
    for name, cfg in CONFIGS.items():
        for _ in range(args.rounds):
            for jit in ("false", "true"):
                cmd = [sys.executable, "-m", "tfllm.cli.main", "bench", *cfg, "--steps",
                       str(args.steps), "--set", f"train.jit_compile={jit}"]
                out = subprocess.run(cmd, cwd=os.path.dirname(HERE), env=env, check=True,
                                     capture_output=True, text=True).stdout
                record = json.loads(out.strip().splitlines()[-1])
                if jit == "true":  # XLA really compiled the step: its report says so
                    assert record["xla"] and record["xla"]["clusters"] > 0, record
                    xla_reports[name] = record["xla"]
                tps = record["tokens_per_s"]
                results.setdefault(name, {}).setdefault(jit, []).append(tps)
                first.setdefault(name, {}).setdefault(jit, []).append(record["first_step_s"])
                print(name, "jit", jit, tps, record["first_step_s"], flush=True)
    summary = {name: {"graph_tokens_per_s": statistics.median(r["false"]),
                      "xla_tokens_per_s": statistics.median(r["true"]),
                      "xla_over_graph": round(statistics.median(r["true"]) /
                                              statistics.median(r["false"]), 3),
                        "graph_first_step_s": statistics.median(first[name]["false"]),
                        "xla_first_step_s": statistics.median(first[name]["true"]),
                        "xla_report": xla_reports[name]}
               for name, r in results.items()}
    summary["_meta"] = {"rounds": args.rounds, "steps": args.steps,
                        "date": time.strftime("%Y-%m-%d"), "cores": os.cpu_count()}
    print(json.dumps(summary, indent=1))
    os.makedirs(os.path.join(HERE, "results"), exist_ok=True)
    with open(os.path.join(HERE, "results", "cpu_jit.json"), "w") as f:
        json.dump({"summary": summary, "runs": results}, f, indent=1)


if __name__ == "__main__":
    main()
