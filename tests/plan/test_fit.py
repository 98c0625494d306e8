"""Presets that fit (tfllm.footprint.fit): every model preset on one node of 8 H100s as shipped,
the estimate against XLA's compiled H100 programs, and the one-line refusal of `tfllm
train` on GPUs and `tfllm doctor --config`."""

import copy
import glob
import importlib.util
import json
import os

import pytest

from tfllm.config import load_config
from tfllm.contracts import BAD_INPUT_EXIT_CODE
from tfllm.runtime import gpu_checks
from tfllm.footprint import fit
from tests.harness import ROOT

GIB = 2 ** 30
PRESETS = sorted(os.path.splitext(os.path.basename(p))[0]
                 for p in glob.glob(os.path.join(ROOT, "configs", "*.yaml")))
MODELS = [p for p in PRESETS if p != "tiny"]  # tiny is the CPU test config
H100 = gpu_checks.Gpu("NVIDIA H100 80GB HBM3", (9, 0), "560.35.03")


def preset(name, *sets):
    return load_config(os.path.join(ROOT, "configs", f"{name}.yaml"), list(sets))


def test_every_model_preset_is_listed():
    # a new preset joins the parametrized tests below by itself; this guards the glob
    assert MODELS == ["gpt2-medium", "gpt2-small", "llama-1b", "llama-70b", "llama-7b",
                      "qwen3-30b-a3b"]


def _chosen(config):
    return {k: v for k, v in {"model.attention_chunk": str(config.model.attention_chunk),
                              "model.remat": config.model.remat,
                              "train.grad_accum_steps": str(config.train.grad_accum_steps),
                              }.items()
            if v not in ("0", "1", "none")}


# slow: 1-3 s in three clean-clone runs of the full suite under -n 2, and 67 s in a
# fourth (its first case; cause not found): over the unmarked tests' 40 s guard there.
@pytest.mark.slow
@pytest.mark.parametrize("name", MODELS)
def test_each_preset_fits_its_h100s_as_shipped_and_is_the_plans_cheapest_fit(name):
    config = preset(name)
    e = fit.estimate(config, 8)
    assert config.precision.policy == "bfloat16"
    # one node of 8 H100s; llama-70b names its nodes in its comment and its mesh
    nodes = 16 if name == "llama-70b" else 1
    assert e.devices == 8 * nodes
    text = open(os.path.join(ROOT, "configs", f"{name}.yaml")).read()
    assert (f"Needs {nodes} nodes of 8 H100s" if nodes > 1
            else "Fits one node of 8 H100s") in text
    assert e.fits, e.summary()
    # what TensorFlow can use: the H100's 79.1 GiB less mesh.gpu_memory_reserve_mb
    assert e.usable == 84942979072 - 4096 * 2 ** 20
    # The plan chose the preset's attention, remat and accumulation at the recipe's
    # global batch: from standard attention without remat or accumulation, the search
    # lands on exactly them; where a compiled plan overruled the arithmetic's choice, on
    # the rest, and the stored compile shows the arithmetic's own choice not fitting.
    plain = copy.deepcopy(config)
    plain.model.remat, plain.model.attention_chunk = "none", 0
    plain.train.grad_accum_steps = 1
    overruled = COMPILE_OVERRULED.get(name)
    if overruled:
        arithmetic_sets, _ = fit.suggest(plain, 8)
        path = os.path.join(ROOT, "benchmarks", "results", overruled["compiled"])
        with open(path) as f:
            stored = json.load(f)
        # the compile of the arithmetic's choice: it fitted by the arithmetic, not compiled
        assert stored["fit"]["fits"] and not stored["memory"]["fits"]
        assert stored["memory"]["total"] > stored["memory"]["usable"]
        chosen = overruled["arithmetic"]
        assert {k: arithmetic_sets.get(k) for k in chosen} == chosen
        for key in chosen:  # the rest of the search starts from the preset's setting
            section, field = key.split(".")
            setattr(getattr(plain, section), field, getattr(getattr(config, section), field))
    sets, _ = fit.suggest(plain, 8)
    if overruled:
        sets.update({k: _chosen(config)[k] for k in overruled["arithmetic"]})
    assert sets == _chosen(config)


#: Presets whose setting a compiled plan (`tfllm plan`) overruled the arithmetic estimate
#: on: the stored JSON of the compile of the arithmetic's choice, and that choice (the
#: search's overrides; None: it kept the search's start). llama-70b: the arithmetic keeps
#: standard attention at 8192 tokens under full remat (66.6 GiB of 75.1); XLA compiles
#: it, with its Triton softmax rewriter, to 88.6 GiB (112 GiB of temporaries; blocked
#: 512 compiles to 46.6). benchmarks/results/h100_plan.md, "llama-70b planned with
#: measured collectives".
COMPILE_OVERRULED = {
    "llama-70b": {"compiled": "h100_llama70b_2026-11-29_standard.json",
                  "arithmetic": {"model.attention_chunk": None}},
}


def test_llama_70b_fits_no_single_node_and_says_how_many_devices_its_state_needs():
    config = preset("llama-70b", "mesh.axes=fsdp=1,model=8", "train.global_batch_size=8")
    with pytest.raises(fit.FitError) as e:
        fit.check(config, 8, "h100")
    message = str(e.value)
    assert "\n" not in message
    # 70.6e9 parameters x 16 bytes (float32 weight, two AdamW moments, gradient) over
    # 75.1 GiB per H100
    assert "at least 14 devices (2 nodes of 8)" in message
    assert fit.min_devices(config) == 14


def test_a_preset_that_does_not_fit_is_refused_with_the_set_that_fits():
    config = preset("llama-7b", "model.remat=none", "model.attention_chunk=0")
    with pytest.raises(fit.FitError) as e:
        fit.check(config, 8, "h100")
    message = str(e.value)
    assert "\n" not in message
    assert "mesh.gpu_memory_reserve_mb=4096" in message
    assert "--set model.attention_chunk=512 --set model.remat=full fits" in message, message
    # the named --set does fit
    fixed = preset("llama-7b", "model.remat=full", "model.attention_chunk=512")
    assert fit.check(fixed, 8, "h100").fits


def test_the_reserve_is_subtracted_from_what_fits():
    config = preset("llama-7b")
    e = fit.estimate(config, 8)
    # a reserve that leaves less than the estimate turns the same step into a misfit
    config.mesh.gpu_memory_reserve_mb = (84942979072 - e.peak) // 2 ** 20 + 1
    assert not fit.estimate(config, 8).fits
    config.mesh.gpu_memory_reserve_mb = (84942979072 - e.peak) // 2 ** 20 - 1
    assert fit.estimate(config, 8).fits


def test_state_and_gradients_are_divided_by_the_layout():
    one = fit.estimate(preset("llama-7b", "mesh.axes=data=1"), 1)
    eight = fit.estimate(preset("llama-7b"), 8)
    # fsdp=8: each device holds an eighth of the weights, moments and gradients (the
    # 32000-row embedding and every kernel divide by 8: exact)
    assert eight.state * 8 == pytest.approx(one.state, rel=1e-3)
    assert eight.gradients * 8 == pytest.approx(one.gradients, rel=1e-3)


def test_accumulated_micro_batches_are_counted_one_at_a_time():
    # tfllm.train.step runs them one after another (after_backward): the estimate holds one
    # micro-batch's activations, beside the running sum of the gradients
    one = fit.estimate(preset("llama-7b", "train.global_batch_size=64",
                              "train.grad_accum_steps=1"), 8)
    two = fit.estimate(preset("llama-7b", "train.global_batch_size=128",
                              "train.grad_accum_steps=2"), 8)
    assert fit.MICRO_BATCHES_LIVE == 1
    assert two.activations == one.activations
    assert two.gradients == 2 * one.gradients


@pytest.mark.slow  # two deviceless H100 compiles of a small llama step, ~1 minute
def test_the_compiled_step_keeps_one_micro_batch_of_temporaries():
    from tests.harness import tiny_config
    from tfllm.plan.planner import plan
    temps = {}
    for accum in (1, 4):
        cfg = tiny_config("llama", **{
            "precision.policy": "bfloat16", "train.global_batch_size": 16 * accum,
            "train.grad_accum_steps": accum, "data.sequence_length": 128,
            "model.max_sequence_length": 128, "model.hidden_dim": 128,
            "model.intermediate_dim": 512})
        temps[accum] = plan(cfg, layers="full", collectives="assumed").memory.temp
    # measured 1.04x (the running gradient sum and the loop's bookkeeping); 2.70x when
    # XLA ran the four forward passes first
    assert temps[4] < 1.2 * temps[1], temps


def _compiled_rows():
    """One-device rows of the stored compiled H100 plans: (overrides, model, compiled GiB)."""
    out = []
    for name, chunk in (("h100_plan", 0), ("h100_plan_blocked", 512)):
        with open(os.path.join(ROOT, "benchmarks", "results", f"{name}.json")) as f:
            results = json.load(f)
        for r in results["rows"]:
            out.append((r["model"], [
                f"precision.policy={r['policy']}", "data.sequence_length=2048",
                "model.max_sequence_length=2048", f"train.global_batch_size={r['batch']}",
                "train.grad_accum_steps=1", "mesh.axes=data=1", "model.remat=none",
                f"model.attention_chunk={chunk}"], r["total_gib"]))
    return out


def test_the_estimate_errs_high_against_xlas_compiled_h100_programs_by_at_most_half():
    rows = _compiled_rows()
    assert len(rows) >= 40
    ratios, static = [], {}
    for model, sets, compiled in rows:
        config = preset(model, *sets)
        key = (model, config.precision.policy)  # the state is the same at every batch
        static[key] = static.get(key) or fit.static_bytes(config, 1)
        ratios.append(fit.estimate(config, 1, "h100", static[key]).peak / GIB / compiled)
    # Measured 0.99-1.51: the model keeps every layer's activations alive at once, where
    # XLA's scheduler (and, near the device's memory, its own rematerialization) keeps
    # less; 2% under for llama-1b's blocked attention at batch 1 (XLA's temporaries that
    # the model does not name). Errs high, so a refused config may still fit when
    # compiled: the message says to confirm with `tfllm plan`.
    assert min(ratios) >= 0.97, min(ratios)
    assert max(ratios) <= 1.55, max(ratios)


def _train(tmp_path, monkeypatch, capsys, *sets):
    from tfllm.cli.main import main
    monkeypatch.setattr(gpu_checks, "wanted", lambda requested: True)
    monkeypatch.setattr(gpu_checks, "driver_gpus", lambda: [H100] * 8)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    workdir = tmp_path / "run"
    sets = [a for s in sets for a in ("--set", s)]
    code = main(["train", "--config", os.path.join(ROOT, "configs", "llama-7b.yaml"),
                 "--workdir", str(workdir), *sets])
    return code, capsys.readouterr().err, workdir


def test_a_gpu_run_that_will_not_fit_stops_before_anything_with_one_line(
        tmp_path, monkeypatch, capsys):
    code, err, workdir = _train(tmp_path, monkeypatch, capsys, "model.remat=none")
    assert code == BAD_INPUT_EXIT_CODE
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("tfllm train: error: the step needs")
    assert "--set model.remat=full fits" in lines[0]
    assert not workdir.exists()


def test_train_memory_check_false_skips_the_check(tmp_path, monkeypatch, capsys):
    seen = []

    def check_workdir(*args):  # the step after the memory check: record it and stop
        seen.append(args)
        raise FileNotFoundError("stopped after the memory check")

    monkeypatch.setattr("tfllm.checkpoint.workdir.check_workdir", check_workdir)
    code, err, _ = _train(tmp_path, monkeypatch, capsys, "model.remat=none",
                          "train.memory_check=false")
    assert seen and "stopped after the memory check" in err and code == BAD_INPUT_EXIT_CODE


def test_doctor_with_a_config_plans_its_memory(monkeypatch, capsys):
    from tfllm.cli.main import main
    llama = os.path.join(ROOT, "configs", "llama-7b.yaml")
    assert main(["doctor", "--config", llama]) == 0  # this host: no GPU
    out = capsys.readouterr().out.splitlines()
    assert out[-1].startswith("ok: memory: ") and "8 devices" in out[-1]
    assert "(no GPU here: planned for one node of 8 H100s)" in out[-1]
    assert main(["doctor", "--config", llama, "--set", "model.remat=none"]) == 2
    out = capsys.readouterr().out.splitlines()
    assert out[-1].startswith("error: memory") and "--set model.remat=full" in out[-1]
    # on a host with 8 H100s: the same plan, without the note
    monkeypatch.setattr(gpu_checks, "gather", lambda: gpu_checks.HostFacts(
        [H100] * 8, 8, "2.21.0", {"is_cuda_build": True, "cuda_version": "12.5",
                                  "cuda_compute_capabilities": ["sm_90"]}))
    assert main(["doctor", "--config", llama]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[-1].startswith("ok: memory: ") and "no GPU here" not in out[-1]


def test_gpus_without_a_memory_model_are_named_not_planned():
    assert fit.target_for_gpu("NVIDIA H100 80GB HBM3") == "h100"
    assert fit.target_for_gpu("NVIDIA A100-SXM4-40GB") is None
    level, message = fit.check_host(preset("llama-7b"), [gpu_checks.Gpu(
        "NVIDIA L4", (8, 9), "560")] * 8, 1)
    assert level == "warning" and "NVIDIA L4" in message


def _fsdp_memory_config(results, mesh):
    """The config benchmarks/fsdp_memory.py ran (its SIZES and COMMON), on `mesh`."""
    spec = importlib.util.spec_from_file_location(
        "fsdp_memory", os.path.join(ROOT, "benchmarks", "fsdp_memory.py"))
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    values = dict(bench.COMMON, **bench.SIZES[results["meta"]["size"]])
    values.update({"precision.policy": results["meta"]["policy"], "mesh.axes": mesh})
    return load_config(None, [f"{k}={v}" for k, v in values.items()])


@pytest.mark.parametrize("name", ["fsdp_memory", "fsdp_memory_bf16"])
def test_block_buffers_match_the_measured_fsdp_step_within_a_quarter(name):
    """The block buffers against what a real fsdp=8 step keeps beyond its share of one
    device's tensors (benchmarks/results/fsdp_memory*.json: a 120M llama on 8 CPU devices
    sharing one allocator: (peak live bytes on fsdp=8 - on one device) / 8)."""
    with open(os.path.join(ROOT, "benchmarks", "results", f"{name}.json")) as f:
        results = json.load(f)
    peaks = {r["mesh"]: r["peak_tensor_gib"] * GIB for r in results["rows"]}
    measured = (peaks["fsdp=8"] - peaks["none"]) / 8
    config = _fsdp_memory_config(results, "fsdp=8")
    from tfllm.footprint import layout as footprint
    b = footprint.mesh_plan(config).buffers
    # Without NCCL (CPU devices) DTensor reduce-scatters by an all-reduce and a slice:
    # the all-reduce's output is the whole float32 buffer once more.
    cpu = b.bytes + b.gradient
    # Measured 1.06 (bf16, medians of 3 runs) and 0.82 (float32, 1 run): the CPU executor
    # runs the packing's cast, transposes and concatenation as separate ops (XLA fuses
    # them on a GPU), and one device's peak varies by up to 0.6 GiB between runs (the
    # executor's order; 3.28-3.87 GiB in bf16), 0.07 GiB of the per-device excess
    assert 0.75 <= cpu / measured <= 1.25, (cpu / GIB, measured / GIB)
