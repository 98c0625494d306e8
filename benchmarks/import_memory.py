"""Peak host memory of `tfllm import` for a llama-1b-sized Hugging Face checkpoint.

Writes a Llama 3.2 1B-shaped folder (config.json, bf16 model.safetensors with random
weights; tokenizer from --tokenizer-source, since a real one cannot be downloaded
here), then runs `tfllm import` in a child process per mesh and reports the child's peak
resident memory (ru_maxrss) against the model's float32 bytes. On a CPU the "devices"
are host memory, so the model itself (one float32 copy, sharded or not) counts in the
peak; the import should add at most a tensor plus the checkpoint writer's buffers.

    python benchmarks/import_memory.py --out benchmarks/results/import_memory.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import shutil
import subprocess
import sys
import tempfile
import time

import numpy as np

# Llama 3.2 1B (configs/llama-1b.yaml)
SHAPE = dict(vocab=128256, hidden=2048, layers=16, heads=32, kv_heads=8, mlp=8192)


def write_checkpoint(path: str, tokenizer_source: str) -> int:
    """A Llama 3.2 1B-shaped HF folder with bf16 random weights; returns the parameters."""
    import ml_dtypes
    from safetensors.numpy import save_file
    s = SHAPE
    head = s["hidden"] // s["heads"]
    os.makedirs(path, exist_ok=True)
    config = {"model_type": "llama", "architectures": ["LlamaForCausalLM"],
              "vocab_size": s["vocab"], "hidden_size": s["hidden"],
              "num_hidden_layers": s["layers"], "num_attention_heads": s["heads"],
              "num_key_value_heads": s["kv_heads"], "intermediate_size": s["mlp"],
              "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "tie_word_embeddings": True,
              "max_position_embeddings": 131072, "torch_dtype": "bfloat16",
              "rope_scaling": {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                               "high_freq_factor": 4.0,
                               "original_max_position_embeddings": 8192}}
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    rng = np.random.default_rng(0)
    shapes = {"model.embed_tokens.weight": (s["vocab"], s["hidden"]),
              "model.norm.weight": (s["hidden"],)}
    for i in range(s["layers"]):
        p = f"model.layers.{i}."
        shapes.update({p + "input_layernorm.weight": (s["hidden"],),
                       p + "post_attention_layernorm.weight": (s["hidden"],),
                       p + "self_attn.q_proj.weight": (s["heads"] * head, s["hidden"]),
                       p + "self_attn.k_proj.weight": (s["kv_heads"] * head, s["hidden"]),
                       p + "self_attn.v_proj.weight": (s["kv_heads"] * head, s["hidden"]),
                       p + "self_attn.o_proj.weight": (s["hidden"], s["heads"] * head),
                       p + "mlp.gate_proj.weight": (s["mlp"], s["hidden"]),
                       p + "mlp.up_proj.weight": (s["mlp"], s["hidden"]),
                       p + "mlp.down_proj.weight": (s["hidden"], s["mlp"])})
    tensors = {k: (rng.standard_normal(v, dtype=np.float32) * 0.02).astype(ml_dtypes.bfloat16)
               for k, v in shapes.items()}
    save_file(tensors, os.path.join(path, "model.safetensors"))
    return sum(int(np.prod(v)) for v in shapes.values())


def run_import(preset: str, workdir: str, tokenizer: str, axes: str) -> dict:
    # ru_maxrss counts the safetensors file's mmapped (file-backed, reclaimable) pages
    # too; a sampler of RssAnon every 20 ms gives the memory the process really holds.
    code = ("import resource, sys, threading, time\n"
            "peak = [0]\n"
            "def sample():\n"
            "    while True:\n"
            "        for line in open('/proc/self/status'):\n"
            "            if line.startswith('RssAnon:'):\n"
            "                peak[0] = max(peak[0], int(line.split()[1]))\n"
            "        time.sleep(0.02)\n"
            "threading.Thread(target=sample, daemon=True).start()\n"
            "from tfllm.cli.main import main\n"
            "rc = main(sys.argv[1:])\n"
            "print('PEAK', resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, peak[0])\n"
            "sys.exit(rc)\n")
    start = time.perf_counter()
    r = subprocess.run([sys.executable, "-c", code, "import", "--preset", preset,
                        "--workdir", workdir, "--tokenizer", tokenizer,
                        "--set", f"mesh.axes={axes}", "--set", "data.sequence_length=128"],
                       capture_output=True, text=True, timeout=3600,
                       env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"})
    if r.returncode != 0:
        raise SystemExit(f"import failed:\n{r.stderr[-3000:]}")
    peak = [l for l in r.stdout.splitlines() if l.startswith("PEAK")][-1].split()
    summary = json.loads([l for l in r.stdout.splitlines() if l.startswith("{")][-1])
    return {"mesh": axes, "peak_rss_gib": int(peak[1]) / 2**20,
            "peak_anonymous_gib": int(peak[2]) / 2**20,
            "seconds": time.perf_counter() - start,
            "largest_read_gib": summary["largest_read"] / 2**30,
            "bytes_read_gib": summary["bytes_read"] / 2**30}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="benchmarks/results/import_memory.json")
    parser.add_argument("--meshes", default="data=1;fsdp=8",
                        help="';'-separated mesh.axes values to import onto.")
    parser.add_argument("--tokenizer", required=True,
                        help="A keras-hub tokenizer preset directory or .model file.")
    args = parser.parse_args()
    tmp = tempfile.mkdtemp(prefix="tfllm-import-memory-")
    try:
        params = write_checkpoint(os.path.join(tmp, "hf"), args.tokenizer)
        rows = []
        for axes in args.meshes.split(";"):
            workdir = os.path.join(tmp, f"run-{len(rows)}")
            rows.append(run_import(os.path.join(tmp, "hf"), workdir, args.tokenizer, axes))
            shutil.rmtree(workdir)
            print(json.dumps(rows[-1]), flush=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    import tensorflow as tf
    import keras_hub
    result = {"date": time.strftime("%Y-%m-%d"), "host": platform.node(),
              "versions": {"tensorflow": tf.__version__, "keras_hub": keras_hub.__version__},
              "params": params, "model_fp32_gib": params * 4 / 2**30,
              "source_bf16_gib": params * 2 / 2**30, "rows": rows}
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
