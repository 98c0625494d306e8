"""The `tfllm` command: its surface, and each subcommand end to end."""

import json

import pytest

from tfllm.cli.main import build_parser
from tests.harness import metrics_records, run_tfllm


def test_cli_surface_is_frozen():
    # A new subcommand or flag is a deliberate change: update this list with it.
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    surface = {name: sorted(o for a in p._actions for o in a.option_strings
                            if o != "--debug")  # every command's, checked below
               for name, p in sub.choices.items()}
    assert sorted(o for a in parser._actions for o in a.option_strings) == [
        "--debug", "--help", "-h"]
    assert [name for name, p in sub.choices.items()
            if "--debug" not in p._option_string_actions] == ["launch"]
    assert surface == {
        "train": ["--config", "--help", "--set", "--workdir", "-h"],
        "layouts": ["--config", "--help", "--num-devices", "--plot", "--set", "-h"],
        "bench": ["--config", "--help", "--repeats", "--set", "--steps", "--warmup", "-h"],
        "export-step": ["--check", "--config", "--help", "--out", "--set", "-h"],
        "plan": ["--collectives", "--config", "--devices", "--help", "--json", "--layers",
                 "--set", "--target", "-h"],
        "generate": ["--chat", "--help", "--max-new-tokens", "--prompt", "--seed", "--set",
                     "--temperature", "--top-k", "--top-p", "--workdir", "-h"],
        "eval": ["--add-bos-token", "--apply-chat-template", "--batch-size", "--help",
                 "--include-path", "--limit", "--log-samples", "--num-fewshot", "--set",
                 "--steps", "--tasks", "--workdir", "-h"],
        "export": ["--dtype", "--format", "--help", "--max-shard-size", "--merge-lora",
                   "--out", "--set", "--skip-vllm-checks", "--workdir", "-h"],
        "import": ["--adapter", "--config", "--help", "--preset", "--set", "--tokenizer",
                   "--workdir", "-h"],
        "doctor": ["--config", "--help", "--ports", "--rank", "--report-dir", "--set",
                   "--wait-s", "--world-size", "-h"],
        "launch": [],  # its own options: tests/launch/test_arguments.py freezes them
    }


@pytest.mark.slow
def test_train_tiny_on_a_mesh_writes_metrics_and_config(tmp_path):
    workdir = tmp_path / "run"
    r = run_tfllm("train", "--config", "configs/tiny.yaml", "--workdir", str(workdir),
                  "--set", "train.steps=12", "--set", "train.log_every=5", "--set", "data.source=synthetic",
                  "--set", "mesh.axes=data=2,fsdp=2,model=2")
    assert r.returncode == 0, r.stderr
    records = metrics_records(workdir)
    lines = [r for r in records if "loss" in r]
    assert [l["step"] for l in lines] == [1, 5, 10, 12]
    for line in lines:
        # no "mfu" on CPU (tfllm.train.metrics.NO_CPU_PEAK)
        assert set(line) == {"step", "loss", "grad_norm", "learning_rate", "tokens_per_s",
                             "skipped_steps"}
    assert "eval_loss" in records[-1] and records[-1]["step"] == 12
    assert lines[-1]["loss"] < lines[0]["loss"]
    assert lines[-1]["tokens_per_s"] > 0
    assert "mesh.axes" not in (workdir / "config.yaml").read_text()
    assert "axes: data=2,fsdp=2,model=2" in (workdir / "config.yaml").read_text()
    assert "mesh [data=2, fsdp=2, model=2]" in r.stdout
    # Every device computes distinct tokens: rows over data, sequence over fsdp.
    assert "batch rows over 'data', sequence over 'fsdp'" in r.stdout
    assert "repeat the same activations" not in r.stdout


@pytest.mark.slow
def test_layouts_for_llama_70b_without_allocating():
    r = run_tfllm("layouts", "--config", "configs/llama-70b.yaml")
    assert r.returncode == 0, r.stderr
    assert "parameters: 70,553,706,496" in r.stdout
    assert "llama/block_79/mlp/down/kernel" in r.stdout
    assert "optimizer state per device" in r.stdout


@pytest.mark.slow
@pytest.mark.parametrize("args, message", [
    (["train", "--set", "model.hiden_dim=3"], "Did you mean 'model.hidden_dim'"),
    (["layouts", "--config", "configs/tiny.yaml", "--set", "mesh.axes=data=3"],
     "the mesh has 3 devices but 8 are available"),
    (["layouts", "--config", "configs/tiny.yaml", "--set", "mesh.axes=model=3",
      "--num-devices", "3"], "is not divisible by mesh axis 'model' (size 3)"),
    (["train", "--config", "configs/nope.yaml"], "no such file"),
    # The batch's own message, naming the setting, not the generic sharding error.
    (["train", "--config", "configs/tiny.yaml", "--set", "mesh.axes=data=8", "--set",
      "train.global_batch_size=12"], "12 sequences per micro-batch do not divide over "
     "mesh axis 'data' (size 8)"),
    (["train", "--config", "configs/tiny.yaml", "--set", "mesh.axes=data=2,fsdp=4", "--set",
      "data.sequence_length=30"], "data.sequence_length (30) does not divide over mesh axis "
     "'fsdp' (size 4)"),
])
def test_bad_input_exits_2_with_a_message(args, message, tmp_path):
    if args[0] == "layouts" and "--num-devices" not in args:
        args = args + ["--num-devices", "8"]
    r = run_tfllm(*args, "--workdir", str(tmp_path)) if args[0] == "train" else run_tfllm(*args)
    assert r.returncode == 2
    assert message in r.stderr


@pytest.mark.slow
@pytest.mark.parametrize("command", [["generate", "--prompt", "a"], ["eval"],
                                     ["export", "--out", "out"]], ids=lambda c: c[0])
def test_a_folder_that_is_no_run_is_refused_before_tensorflow_is_imported(command, tmp_path):
    import subprocess
    import sys
    code = ("import sys; from tfllm.cli.main import main; "
            f"rc = main({command + ['--workdir', str(tmp_path / 'nothing')]!r}); "
            "print(rc, 'tensorflow' in sys.modules)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=120)
    assert r.stdout.split() == ["2", "False"], r.stderr
    assert "nothing/config.yaml does not exist" in r.stderr


def test_every_input_error_class_is_where_the_cli_looks_for_it():
    # The CLI classifies an error by the classes of modules already imported; a class
    # that moved would be a traceback instead of exit 2.
    import importlib

    from tfllm.cli import main as cli
    for module, name in cli.INPUT_ERROR_CLASSES:
        assert issubclass(getattr(importlib.import_module(module), name), Exception)


@pytest.mark.slow
def test_bench_prints_one_json_line():
    r = run_tfllm("bench", "--config", "configs/bench/gpt_5m.yaml", "--steps", "2",
                  "--warmup", "1")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["params"] == 5_322_240
    # 3 x (2 x 5,242,880 matmul weights (4 layers x 786,432 + the 8192 x 256 head) +
    # causal attention 4 layers x 2 x 256 x 256 (T^2/2 pairs x 4 FLOPs x 256 / T)).
    assert out["flops_per_token"] == 33_030_144
    # No MFU on CPU, and the reason in its place.
    assert out["mfu"] is None and out["peak_source"].startswith("none: no MFU on CPU")
    assert out["tokens_per_s"] > 0


def test_export_offers_the_formats_the_library_dispatches():
    from tfllm.cli.main import build_parser
    from tfllm.pretrained.formats import FORMATS, export_run
    sub = next(a for a in build_parser()._actions if a.dest == "command")
    offered = next(a for a in sub.choices["export"]._actions if a.dest == "format").choices
    assert tuple(offered) == tuple(FORMATS)
    with pytest.raises(ValueError, match="export format 'onnx'; use one of saved-model"):
        export_run("onnx", None, "run", "out")
    with pytest.raises(ValueError, match="merge_lora goes with the hf format"):
        export_run("peft", None, "run", "out", merge_lora=True)
