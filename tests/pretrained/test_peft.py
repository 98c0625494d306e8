"""LoRA adapters across the border, with transformers + peft as the reference.

peft makes a random adapter (A and B both random, so every tensor matters) on the tiny
transformers model of each family; tfllm imports base + adapter and computes peft's
logits; `tfllm export --format peft` writes the adapter's tensors back bit for bit and
peft loads it; `--format hf --merge-lora` loads in plain transformers with the same
logits; what vLLM would refuse is refused with one line.
"""

import collections
import json

import numpy as np
import pytest

from tfllm.cli.main import main
from tests.pretrained import helpers
from tests.pretrained import transformers_reference as ref

#: peft's module names per family (tfllm's default: every projection)
TARGETS = {"gpt2": ["c_attn", "c_proj", "c_fc"],
           "llama3": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                      "down_proj"]}
FAMILIES = ["gpt2", "llama3", "mistral", "qwen2", "qwen3", "gemma3"]


def _peft():
    import peft
    return peft


def _adapter(name, base_dir, out, rank=8, alpha=16.0, rslora=False, seed=3):
    """A random peft adapter of the saved base model `name`; returns the PeftModel."""
    config = _peft().LoraConfig(r=rank, lora_alpha=alpha, use_rslora=rslora,
                                target_modules=TARGETS.get(name, TARGETS["llama3"]),
                                init_lora_weights=False, task_type="CAUSAL_LM",
                                fan_in_fan_out=name == "gpt2")
    return _random_adapter(base_dir, config, out, seed)


def _random_adapter(base_dir, config, out, seed):
    """peft's adapter of `config` on the saved base model, its A and B of std 0.3 (the
    adapter moves every logit), saved in `out`; returns the PeftModel in eval mode."""
    torch, _ = ref.load_torch_transformers()
    torch.manual_seed(seed)
    adapted = _peft().get_peft_model(ref.load(base_dir), config)
    with torch.no_grad():
        for n, p in adapted.named_parameters():
            if "lora_" in n:
                p.copy_(torch.randn(p.shape) * 0.3)
    adapted.save_pretrained(str(out))
    return adapted.eval()


def _import(tmp_path, name, *extra):
    tokenizer = []
    if name in ("qwen2", "qwen3", "qwen3_moe", "mixtral"):  # see ref.MODELS
        ref.keras_hub_tokenizer(ref.MODELS[name][2]).save_to_preset(str(tmp_path / "tok"))
        tokenizer = ["--tokenizer", str(tmp_path / "tok")]
    assert main(["import", "--preset", str(tmp_path / "hf"), "--workdir",
                 str(tmp_path / "run"), *tokenizer, *extra]) == 0


def _tfllm_logits(workdir, ids):
    from tfllm.checkpoint.workdir import Workdir
    from tfllm.config import load_config
    from tfllm.models import build_model
    config = load_config(str(workdir / "config.yaml"))
    model = build_model(config.model, config.precision, config.lora, seed=config.train.seed)
    Workdir(str(workdir)).restore_weights(model)
    return np.asarray(model(ids), np.float32)


@pytest.mark.parametrize("name", FAMILIES)
def test_a_peft_adapter_imports_exports_bit_exactly_and_merges(name, tmp_path):
    ref.save(name, tmp_path / "hf")
    adapted = _adapter(name, tmp_path / "hf", tmp_path / "adapter")
    ids = helpers.token_ids()
    theirs = ref.logits(adapted, ids)
    _import(tmp_path, name, "--adapter", str(tmp_path / "adapter"))
    ref.assert_same_model(_tfllm_logits(tmp_path / "run", ids), theirs)
    # The adapter back out: peft's tensors bit for bit (GPT-2's c_attn as rank 3r).
    vllm = [] if name != "gpt2" else ["--skip-vllm-checks"]
    assert main(["export", "--workdir", str(tmp_path / "run"), "--out",
                 str(tmp_path / "out"), "--format", "peft", *vllm]) == 0
    mine, source = ref.safetensors_of(tmp_path / "out"), ref.safetensors_of(tmp_path / "adapter")
    assert sorted(mine) == sorted(source)
    if name != "gpt2":
        for key in source:
            np.testing.assert_array_equal(mine[key], source[key], err_msg=key)
    with open(tmp_path / "out" / "adapter_config.json") as f:
        config = json.load(f)
    assert config["peft_type"] == "LORA" and config["r"] == 8 and config["bias"] == "none"
    # peft loads it onto the base and computes the same logits
    peft = _peft()
    reloaded = peft.PeftModel.from_pretrained(ref.load(tmp_path / "hf"), str(tmp_path / "out"))
    ref.assert_same_model(ref.logits(reloaded.eval(), ids), theirs)
    # merged weights load in plain transformers
    assert main(["export", "--workdir", str(tmp_path / "run"), "--out",
                 str(tmp_path / "merged"), "--format", "hf", "--merge-lora"]) == 0
    ref.assert_same_model(ref.logits(ref.load(tmp_path / "merged"), ids), theirs)


def test_rslora_and_a_subset_of_targets_keep_peft_s_scale(tmp_path):
    ref.save("llama3", tmp_path / "hf")
    config = _peft().LoraConfig(r=16, lora_alpha=8.0, use_rslora=True,
                                target_modules=["q_proj", "v_proj"], init_lora_weights=False,
                                task_type="CAUSAL_LM")
    adapted = _random_adapter(tmp_path / "hf", config, tmp_path / "adapter", seed=5)
    ids = helpers.token_ids()
    _import(tmp_path, "llama3", "--adapter", str(tmp_path / "adapter"))
    ref.assert_same_model(_tfllm_logits(tmp_path / "run", ids), ref.logits(adapted, ids))
    with open(tmp_path / "run" / "config.yaml") as f:
        text = f.read()
    assert "rslora: true" in text and "self_attn.q_proj" in text


@pytest.mark.parametrize("setting,expected", [
    (["--set", "lora.rank=4"], "lora.rank=4 is not a rank vLLM serves"),
    (["--set", "model.family=gpt"], "vLLM's GPT-2 takes no LoRA adapters"),
])
def test_what_vllm_would_refuse_is_refused_naming_the_fix(tmp_path, capsys, setting,
                                                          expected):
    from tests.harness import tiny_overrides
    overrides = [a for o in tiny_overrides("llama") for a in ("--set", o)]
    overrides += ["--set", "lora.rank=8", "--set", "train.steps=1", *setting]
    if "model.family=gpt" in setting:
        overrides = [a for o in tiny_overrides("gpt") for a in ("--set", o)] + [
            "--set", "lora.rank=8", "--set", "train.steps=1"]
    assert main(["train", "--workdir", str(tmp_path / "run"), *overrides]) == 0
    capsys.readouterr()
    assert main(["export", "--workdir", str(tmp_path / "run"), "--out",
                 str(tmp_path / "out"), "--format", "peft"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and expected in err[0] and "--skip-vllm-checks" in err[0], err
    assert not (tmp_path / "out").exists()
    # an hf export without --merge-lora would drop the adapters: refused
    assert main(["export", "--workdir", str(tmp_path / "run"), "--out",
                 str(tmp_path / "out"), "--format", "hf"]) == 2
    assert "--merge-lora" in capsys.readouterr().err


def test_a_dora_adapter_is_refused_in_one_line(tmp_path, capsys):
    ref.save("llama3", tmp_path / "hf")
    _adapter("llama3", tmp_path / "hf", tmp_path / "adapter")
    path = tmp_path / "adapter" / "adapter_config.json"
    config = json.loads(path.read_text())
    config["use_dora"] = True
    path.write_text(json.dumps(config))
    capsys.readouterr()
    assert main(["import", "--preset", str(tmp_path / "hf"), "--workdir",
                 str(tmp_path / "run"), "--adapter", str(tmp_path / "adapter")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "use_dora=True: DoRA is not supported" in err[0], err
    assert not (tmp_path / "run").exists()


def test_an_import_with_adapters_starts_them_from_their_init(tmp_path):
    # The import builds the model zero-filled for the preset's weights; adapters, which
    # no preset holds, must still start random (A) and zero (B), or A = B = 0 never moves.
    import math

    from tfllm.checkpoint.reader import Reader
    from tfllm.checkpoint.workdir import Workdir
    ref.save("llama3", tmp_path / "hf")
    _import(tmp_path, "llama3", "--set", "lora.rank=8")
    reader = Reader(Workdir(str(tmp_path / "run")).latest_checkpoint())
    a = reader.whole("model/llama/block_0/attention/query/lora_a")
    b = reader.whole("model/llama/block_0/attention/query/lora_b")
    assert not b.any()
    # peft's Kaiming-uniform variance 1 / (3 fan_in), fan_in = hidden 32
    assert abs(a.std() - 1 / math.sqrt(3 * 32)) < 0.25 / math.sqrt(3 * 32)


def test_a_broken_adapter_is_one_line_and_writes_nothing(tmp_path, capsys):
    """Through the command: a NaN in lora_B (imported silently before) and a lora_A stored
    (in, r) (reshaped into a scrambled matrix before) are refused, and no run is left."""
    from safetensors.numpy import load_file, save_file
    ref.save("llama3", tmp_path / "hf")
    _adapter("llama3", tmp_path / "hf", tmp_path / "adapter", rank=8)
    weights = tmp_path / "adapter" / "adapter_model.safetensors"
    good = load_file(str(weights))
    a_key = next(k for k in sorted(good) if "q_proj.lora_A" in k)
    b_key = next(k for k in sorted(good) if "v_proj.lora_B" in k)
    for name, edit, says in (
            ("nan", lambda t: t[b_key].__setitem__((0, 0), np.nan), "NaN or infinite"),
            ("transposed", lambda t: t.__setitem__(a_key, np.ascontiguousarray(t[a_key].T)),
             "peft writes lora_A as (r, in)")):
        tensors = {k: v.copy() for k, v in good.items()}
        edit(tensors)
        save_file(tensors, str(weights))
        capsys.readouterr()
        run = tmp_path / f"run_{name}"
        assert main(["import", "--preset", str(tmp_path / "hf"), "--workdir", str(run),
                     "--adapter", str(tmp_path / "adapter")]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and says in err[0], err
        assert not run.exists() and not (tmp_path / f"run_{name}.importing").exists()


def test_export_with_another_rank_than_trained_is_one_line(tmp_path, capsys):
    # `export --format peft --set lora.rank=...` was an AssertionError
    ref.save("llama3", tmp_path / "hf")
    _import(tmp_path, "llama3", "--set", "lora.rank=8")
    capsys.readouterr()
    assert main(["export", "--workdir", str(tmp_path / "run"), "--out",
                 str(tmp_path / "out"), "--format", "peft", "--set", "lora.rank=16"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "(rank 8), not what lora.rank=16" in err[0], err
    assert not (tmp_path / "out").exists()


def test_a_bfloat16_peft_export_imports_back(tmp_path):
    # numpy has no bfloat16: the adapter reader converts it (a traceback-free refusal before)
    from tfllm.checkpoint.reader import Reader
    from tfllm.checkpoint.workdir import Workdir
    ref.save("llama3", tmp_path / "hf")
    _import(tmp_path, "llama3", "--set", "lora.rank=8")
    assert main(["export", "--workdir", str(tmp_path / "run"), "--out",
                 str(tmp_path / "adapter"), "--format", "peft", "--dtype", "bfloat16"]) == 0
    assert main(["import", "--preset", str(tmp_path / "hf"), "--workdir",
                 str(tmp_path / "back"), "--adapter", str(tmp_path / "adapter")]) == 0
    name = "model/llama/block_1/mlp/down/lora_a"
    a = Reader(Workdir(str(tmp_path / "run")).latest_checkpoint()).whole(name)
    back = Reader(Workdir(str(tmp_path / "back")).latest_checkpoint()).whole(name)
    rounded = a.astype(np.float32).view(np.uint32)
    # bfloat16 keeps the top 16 bits, rounded to nearest even
    rounded = ((rounded + 0x7FFF + ((rounded >> 16) & 1)) >> 16 << 16).view(np.float32)
    assert np.array_equal(back, rounded)


@pytest.mark.slow  # two imports, an export and peft's loads: ~20 s each under load
@pytest.mark.parametrize("name", ["qwen3_moe", "mixtral"])
def test_a_mixture_of_experts_attention_adapter_round_trips_through_peft(name, tmp_path):
    """LoRA on the attention of an MoE model: peft's adapter imports with peft's logits,
    and tfllm's export loads in peft with them (the experts stay frozen)."""
    ref.save(name, tmp_path / "hf")
    peft = _peft()
    config = peft.LoraConfig(r=8, lora_alpha=16.0, init_lora_weights=False,
                             target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
                             task_type="CAUSAL_LM")
    adapted = _random_adapter(tmp_path / "hf", config, tmp_path / "adapter", seed=3)
    ids = helpers.token_ids()
    theirs = ref.logits(adapted, ids)
    # Four experts: the default mesh (data=8) would split them 8 ways, which expert
    # parallelism refuses; data=2 holds two experts per device, and the one-device
    # model below restores that expert-parallel checkpoint.
    _import(tmp_path, name, "--adapter", str(tmp_path / "adapter"),
            "--set", "mesh.axes=data=2,model=4")
    ref.assert_same_model(_tfllm_logits(tmp_path / "run", ids), theirs)
    assert main(["export", "--workdir", str(tmp_path / "run"), "--out",
                 str(tmp_path / "out"), "--format", "peft"]) == 0
    mine, source = ref.safetensors_of(tmp_path / "out"), ref.safetensors_of(tmp_path / "adapter")
    assert sorted(mine) == sorted(source)
    for key in source:
        np.testing.assert_array_equal(mine[key], source[key], err_msg=key)
    reloaded = peft.PeftModel.from_pretrained(ref.load(tmp_path / "hf"), str(tmp_path / "out"))
    ref.assert_same_model(ref.logits(reloaded.eval(), ids), theirs)


@pytest.mark.slow  # an import, three exports and peft's loads: 6-28 s each (load 9)
@pytest.mark.parametrize("name,targets,parameters", [
    # both expert parameters (peft nests down_proj's wrapper around gate_up_proj's: the
    # latter's tensors are named experts.base_layer.lora_*); peft would read gate_proj,
    # up_proj and down_proj as the experts' (transformers 4 names): see the next test
    ("qwen3_moe", ["q_proj", "v_proj"], ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]),
    # one expert parameter alone (experts.lora_*), by its last part as peft allows
    ("mixtral", ["o_proj"], ["gate_up_proj"])])
def test_an_expert_adapter_round_trips_through_peft(name, targets, parameters, tmp_path,
                                                    capsys, monkeypatch):
    """LoRA on the experts, peft's target_parameters (its ParamWrapper: per expert one
    lora_A (E r, in) shared by gate and up, lora_B (out, r E)): peft's adapter imports
    on an expert-parallel mesh with peft's logits, exports back bit for bit, loads in
    peft with them, and merges into a folder transformers computes them from."""
    ref.save(name, tmp_path / "hf")
    peft = _peft()
    config = peft.LoraConfig(r=4, lora_alpha=8.0, init_lora_weights=False,
                             target_modules=targets, target_parameters=parameters,
                             task_type="CAUSAL_LM")
    adapted = _random_adapter(tmp_path / "hf", config, tmp_path / "adapter", seed=4)
    ids = helpers.token_ids()
    theirs = ref.logits(adapted, ids)
    base = ref.logits(ref.load(tmp_path / "hf"), ids)
    assert np.abs(theirs - base).max() > 0.1 * np.abs(base).max()  # the adapter matters
    _import(tmp_path, name, "--adapter", str(tmp_path / "adapter"),
            "--set", "mesh.axes=data=2,model=4")  # two of the four experts per device
    ref.assert_same_model(_tfllm_logits(tmp_path / "run", ids), theirs)
    # vLLM does not serve these adapters: refused unless asked, in one line
    capsys.readouterr()
    assert main(["export", "--workdir", str(tmp_path / "run"), "--out",
                 str(tmp_path / "out"), "--format", "peft"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "target_parameters" in err[0] and "--merge-lora" in err[0], err
    assert main(["export", "--workdir", str(tmp_path / "run"), "--out",
                 str(tmp_path / "out"), "--format", "peft", "--skip-vllm-checks"]) == 0
    mine, source = ref.safetensors_of(tmp_path / "out"), ref.safetensors_of(tmp_path / "adapter")
    assert sorted(mine) == sorted(source)
    for key in source:
        np.testing.assert_array_equal(mine[key], source[key], err_msg=key)
    with open(tmp_path / "out" / "adapter_config.json") as f:
        written = json.load(f)
    assert sorted(written["target_parameters"]) == sorted(
        f"mlp.experts.{p.rsplit('.', 1)[-1]}" for p in parameters)
    reloaded = peft.PeftModel.from_pretrained(ref.load(tmp_path / "hf"), str(tmp_path / "out"))
    ref.assert_same_model(ref.logits(reloaded.eval(), ids), theirs)
    # the merge reads each stacked expert kernel once, not once per expert's tensor
    from tfllm.checkpoint.reader import Reader
    reads, whole = collections.Counter(), Reader.whole
    monkeypatch.setattr(Reader, "whole", lambda self, n: reads.update([n]) or whole(self, n))
    assert main(["export", "--workdir", str(tmp_path / "run"), "--out",
                 str(tmp_path / "merged"), "--format", "hf", "--merge-lora"]) == 0
    ref.assert_same_model(ref.logits(ref.load(tmp_path / "merged"), ids), theirs)
    assert max(n for k, n in reads.items() if k.endswith("/kernel")) == 1, reads


@pytest.mark.slow  # an import and a merged export: 21 s alone (load 10)
def test_lora_on_the_dense_mlp_of_a_qwen3_moe_has_no_peft_form(tmp_path, capsys):
    """peft rewrites target_modules gate_proj/up_proj/down_proj of an MoE model into its
    experts' target_parameters (transformers 4's names): tfllm trains adapters on the
    dense layer's MLP (model.mlp_only_layers) but refuses to write them for peft, in one
    line naming the fix, and merges them."""
    ref.save("qwen3_moe", tmp_path / "hf")
    _import(tmp_path, "qwen3_moe", "--set", "lora.rank=8",
            "--set", "lora.targets=[q_proj,gate_proj,experts.down_proj]",
            "--set", "mesh.axes=data=2,model=4")
    capsys.readouterr()
    assert main(["export", "--workdir", str(tmp_path / "run"), "--out",
                 str(tmp_path / "out"), "--format", "peft", "--skip-vllm-checks"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "dense layers' MLP" in err[0] and "mlp.gate_proj" in err[0] \
        and "--merge-lora" in err[0], err
    assert not (tmp_path / "out").exists()
    assert main(["export", "--workdir", str(tmp_path / "run"), "--out",
                 str(tmp_path / "merged"), "--format", "hf", "--merge-lora"]) == 0


def test_transformers_4_expert_names_fuse_to_a_rank_tfllm_does_not_train(tmp_path, capsys):
    """peft (with transformers 5) turns target_modules gate_proj/up_proj/down_proj of a
    Qwen3-MoE into target_parameters, gate_up_proj at rank 2r (rank_pattern) with one A
    for both: tfllm trains one rank, so the import is refused in one line naming it."""
    ref.save("qwen3_moe", tmp_path / "hf")
    torch, _ = ref.load_torch_transformers()
    peft = _peft()
    config = peft.LoraConfig(r=4, lora_alpha=8.0, target_modules=["q_proj", "gate_proj",
                                                                  "up_proj", "down_proj"],
                             task_type="CAUSAL_LM")
    peft.get_peft_model(ref.load(tmp_path / "hf"), config).save_pretrained(
        str(tmp_path / "adapter"))
    capsys.readouterr()
    assert main(["import", "--preset", str(tmp_path / "hf"), "--workdir",
                 str(tmp_path / "run"), "--adapter", str(tmp_path / "adapter")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "rank_pattern gives" in err[0] and "gate_up_proj" in err[0] \
        and "one rank and alpha" in err[0], err
    assert not (tmp_path / "run").exists()


def test_a_per_expert_adapter_of_transformers_4_is_refused_naming_the_way_out(tmp_path,
                                                                             capsys):
    """An adapter of transformers 4's per-expert modules (experts.{j}.gate_proj: gate and
    up with an A each) has no tfllm form: one line naming peft's merge."""
    from safetensors.numpy import load_file, save_file
    ref.save("mixtral", tmp_path / "hf")
    _adapter("mixtral", tmp_path / "hf", tmp_path / "adapter", rank=8)
    weights = tmp_path / "adapter" / "adapter_model.safetensors"
    tensors = load_file(str(weights))
    key = "base_model.model.model.layers.0.mlp.experts.1.gate_proj.lora_A.weight"
    tensors[key] = np.zeros((8, 32), np.float32)
    save_file(tensors, str(weights))
    capsys.readouterr()
    assert main(["import", "--preset", str(tmp_path / "hf"), "--workdir",
                 str(tmp_path / "run"), "--adapter", str(tmp_path / "adapter")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and key in err[0] and "merge_and_unload" in err[0], err
    assert not (tmp_path / "run").exists()
