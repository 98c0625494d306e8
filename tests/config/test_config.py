import dataclasses
import os

import pytest
import yaml

from tfllm.config import ConfigError, Config, load_config, save_config
from tfllm.config import schema

# Every config key. Adding a knob means adding it here: new settings are deliberate.
ALL_KEYS = {
    "model": ["family", "vocab_size", "hidden_dim", "num_layers", "num_query_heads",
              "num_key_value_heads", "head_dim", "intermediate_dim", "max_sequence_length",
              "tie_embeddings", "use_bias", "norm_epsilon", "rope_theta", "rope_scaling",
              "rope_scaling_factor", "rope_low_freq_factor", "rope_high_freq_factor",
              "rope_original_max_length", "qkv_bias", "qk_norm", "sliding_window",
              "sliding_window_pattern", "rope_local_theta", "query_pre_attn_scalar",
              "attention", "attention_chunk", "remat", "init_std", "num_experts",
              "num_experts_per_tok", "moe_intermediate_dim", "moe_routing", "norm_topk_prob",
              "router_aux_loss_coef", "router_z_loss_coef", "decoder_sparse_step",
              "mlp_only_layers", "moe_dispatch", "moe_capacity_factor"],
    "mesh": ["axes", "device_type", "num_cpu_devices", "rules", "gpu_memory_reserve_mb",
             "gpu_allocator", "gradient_bucket_mb"],
    "precision": ["policy", "fp8_recipe", "fp8_amax_history_length", "fp8_margin",
                  "fp8_exclude", "fp8_gather", "tf32", "loss_scale_initial",
                  "loss_scale_growth_interval"],
    "optimizer": ["learning_rate", "warmup_steps", "decay_steps", "min_learning_rate_ratio",
                  "beta1", "beta2", "epsilon", "weight_decay", "weight_decay_exclude",
                  "clip_norm", "shard_optimizer_state"],
    "data": ["source", "paths", "eval_paths", "format", "chat_template", "text_key", "hf_dataset",
             "hf_config", "hf_split", "hf_eval_split", "hf_streaming", "tfds_name", "tfds_split",
             "tfds_eval_split", "tfds_data_dir", "data_dir", "validation_fraction",
             "tokenizer", "tokenizer_path", "packing_mask", "shuffle_buffer",
             "sequence_length", "seed"],
    "train": ["steps", "global_batch_size", "objective", "grad_accum_steps", "loss_on", "memory_check", "seed",
              "jit_compile",
              "profile_steps", "xla_cache", "log_every", "eval_every", "eval_steps", "deterministic", "progress",
              "on_nonfinite", "loss_spike_factor", "loss_spike_window", "sample_prompt",
              "sample_tokens", "peer_timeout_s"],
    "checkpoint": ["every", "max_to_keep", "async_save", "on_corruption"],
    "lora": ["rank", "alpha", "dropout", "rslora", "targets"],
    "dpo": ["loss", "beta", "label_smoothing", "rpo_alpha", "precompute_reference"],
    "tracking": ["loggers", "run_name", "mlflow_uri", "mlflow_experiment", "wandb_project",
                 "wandb_entity", "wandb_mode"],
}


def test_every_key_is_listed():
    cfg = Config()
    got = {s: [f.name for f in dataclasses.fields(getattr(cfg, s))] for s in schema.SECTIONS}
    assert got == ALL_KEYS


def test_every_field_is_documented():
    for section in schema.SECTIONS:
        for f in dataclasses.fields(getattr(Config(), section)):
            assert f.metadata.get("help"), f"{section}.{f.name} has no help text"


def test_defaults_validate():
    cfg = load_config()
    assert cfg.model.family == "gpt" and cfg.train.jit_compile == "auto"


def test_yaml_and_overrides_apply_in_order(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("model:\n  hidden_dim: 32\n  num_query_heads: 2\ntrain:\n  steps: 7\n")
    cfg = load_config(str(path), ["train.steps=9", "optimizer.learning_rate=1e-3",
                                  "mesh.axes=data=2,model=4", "train.jit_compile=true",
                                  "optimizer.shard_optimizer_state=true"])
    assert cfg.model.hidden_dim == 32 and cfg.train.steps == 9
    assert cfg.optimizer.learning_rate == 1e-3 and isinstance(cfg.optimizer.learning_rate, float)
    assert cfg.mesh.axes == "data=2,model=4"
    assert cfg.train.jit_compile == "true" and cfg.optimizer.shard_optimizer_state is True


@pytest.mark.parametrize("override, message", [
    ("model.hiden_dim=3", "unknown key 'model.hiden_dim'. Did you mean 'model.hidden_dim'"),
    ("modle.hidden_dim=3", "unknown section 'modle'. Did you mean 'model'"),
    ("model.hidden_dim=abc", "model.hidden_dim: expected an integer"),
    ("model.hidden_dim=true", "model.hidden_dim: expected an integer"),
    ("model.hidden_dim=0", "model.hidden_dim: 0 is below the minimum 1"),
    ("optimizer.beta1=1.5", "optimizer.beta1: 1.5 is above the maximum 1.0"),
    ("model.family=gtp", "model.family: 'gtp' is not one of ['gpt', 'llama', 'gemma3']. Did you mean 'gpt'"),
    ("optimizer.shard_optimizer_state=maybe", "expected true or false"),
    ("hidden_dim=3", "must be section.key"),
    ("train.steps", "expected section.key=value"),
    ("mesh.axes=data=3,foo=2", "unknown axis 'foo'"),
    ("mesh.axes=data=-1,model=-1", "only one axis may be -1"),
    ("model.num_query_heads=3", "model.hidden_dim (128) must be divisible by model.num_query_heads"),
    ("data.sequence_length=4096", "data.sequence_length (4096) exceeds model.max_sequence_length"),
    ("train.grad_accum_steps=3", "train.global_batch_size (16) must be divisible by "
                                 "train.grad_accum_steps (3)"),
    ("optimizer.weight_decay_exclude=bias,norms", "unknown kind(s) ['norms']"),
    # cuDNN's fused attention cannot run inside a DTensor step (tests/parallel/
    # test_dtensor_limits.py): a documented refusal, one line naming the way out
    ("model.attention=cudnn", "model.attention=cudnn: TensorFlow 2.21's DTensor cannot run "
                              "cuDNN's fused attention inside a step"),
    ("model.attention=flash", "model.attention: 'flash' is not one of ['xla', 'cudnn']"),
])
def test_bad_overrides_name_the_key(override, message):
    with pytest.raises(ConfigError) as e:
        load_config(None, [override])
    assert message in str(e.value)


def test_yaml_unknown_key_names_file_and_key(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("train:\n  stepz: 3\n")
    with pytest.raises(ConfigError, match=r"bad.yaml: unknown key 'train.stepz'. Did you mean "
                                          r"'train.steps'"):
        load_config(str(path))


def test_yaml_must_be_sections(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="top level must be a mapping"):
        load_config(str(path))
    with pytest.raises(ConfigError, match="no such file"):
        load_config(str(tmp_path / "missing.yaml"))


def test_rules_override_parses_null():
    cfg = load_config(None, ['mesh.rules=[["embed", null], ["vocab", "model"]]',
                             "mesh.axes=model=-1"])
    assert cfg.mesh.rules == [["embed", None], ["vocab", "model"]]
    with pytest.raises(ConfigError, match="unknown axis 'data'; the rules table uses model"):
        load_config(None, ['mesh.rules=[["vocab", "model"]]', "mesh.axes=data=2"])
    with pytest.raises(ConfigError, match="mesh.rules: expected a list of"):
        load_config(None, ['mesh.rules=[["embed"]]'])


def test_resolved_config_round_trips(tmp_path):
    cfg = load_config(None, ["model.hidden_dim=32", "model.num_query_heads=4"])
    path = save_config(cfg, str(tmp_path / "run"))
    again = load_config(path)
    assert again == cfg
    assert yaml.safe_load(open(path))["model"]["hidden_dim"] == 32


@pytest.mark.parametrize("preset", ["tiny", "gpt2-small", "gpt2-medium", "llama-1b",
                                    "llama-7b", "llama-70b", "bench/gpt_5m"])
def test_presets_load(preset):
    load_config(f"configs/{preset}.yaml")


FLOAT_KEYS = [f"{s}.{f.name}" for s in schema.SECTIONS
              for f in dataclasses.fields(getattr(Config(), s)) if str(f.type) == "float"]


def test_the_float_keys_are_found():
    # The parametrization below must cover the examples, not an empty list.
    assert {"optimizer.learning_rate", "optimizer.beta1", "optimizer.weight_decay",
            "model.norm_epsilon", "train.peer_timeout_s"} <= set(FLOAT_KEYS)


@pytest.mark.parametrize("key", FLOAT_KEYS)
@pytest.mark.parametrize("value", ["nan", ".nan", "inf", "-inf", ".inf", "1e999"])
def test_every_float_key_refuses_nan_and_infinity(key, value):
    # Comparisons with NaN are all false: a range check alone lets nan through.
    with pytest.raises(ConfigError, match=f"^{key}: .* is not a finite number"):
        load_config(None, [f"{key}={value}"])


def test_yaml_nan_names_the_file_and_key(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("optimizer:\n  learning_rate: .nan\n")
    with pytest.raises(ConfigError, match="optimizer.learning_rate: nan is not a finite"):
        load_config(str(path))


def test_a_config_that_is_not_utf8_is_one_line(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_bytes(b"train:\n  sample_prompt: caf\xe9\n")
    with pytest.raises(ConfigError, match=r"c.yaml: not UTF-8 text \(byte offset 27\); save "
                                          "it as UTF-8"):
        load_config(str(path))
    path.write_text("train: [1\n")
    with pytest.raises(ConfigError) as e:
        load_config(str(path))
    assert "not valid YAML" in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("overrides, message", [
    (["model.family=gpt", "model.sliding_window=8"],
     "model.sliding_window=8 is a setting of the llama and gemma3 families"),
    (["model.family=gpt", "model.query_pre_attn_scalar=4"], "query_pre_attn_scalar=4.0"),
    (["model.family=llama", "model.sliding_window_pattern=6"],
     "sliding_window_pattern=6 needs model.sliding_window"),
])
def test_local_attention_settings_are_checked(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, overrides)


# ---- bounded input (issue 38) ------------------------------------------------------------------
def test_yaml_aliases_are_refused_before_they_expand(tmp_path):
    path = tmp_path / "c.yaml"  # 9**6 strings if the aliases were followed
    path.write_text("train: {sample_prompt: &a x}\n" + "".join(
        f"k{i}: &{chr(98 + i)} [{', '.join(['*' + chr(97 + i)] * 9)}]\n" for i in range(6)))
    with pytest.raises(ConfigError, match=r"c.yaml: a YAML alias \(\*a\) at line 2"):
        load_config(str(path))


def test_deep_nesting_is_refused_without_recursing(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("{a: " * 50000 + "1" + "}" * 50000)
    with pytest.raises(ConfigError, match="c.yaml: nested deeper than 8 levels at line 1"):
        load_config(str(path))


def test_overrides_are_bounded_as_files_are():
    with pytest.raises(ConfigError, match=r"--set mesh.rules: a YAML alias \(\*x\)"):
        load_config(None, ["mesh.rules=[[batch, &x data], [embed, *x]]"])
    # a value that is not YAML (here: too long a number for Python's int) stays a string,
    # which the setting then refuses in a line of bounded length
    with pytest.raises(ConfigError, match=r"train.steps: expected an integer, got '9999.*"
                                          r"\(5002 characters\)\.$"):
        load_config(None, ["train.steps=" + "9" * 5000])


@pytest.mark.parametrize("override, fragment", [
    ("optimizer.learning_rate=" + "1" * 400, "is not a finite number"),
    ("train.seed=" + "9" * 20, "is out of range; integer settings are at most"),
    ("model.hidden_dim=" + str(2 ** 21), "is above the maximum 1048576"),
    ("mesh.num_cpu_devices=1000000", "above the maximum 256 logical CPU devices"),
    ("mesh.axes=data=65537", "a mesh holds at most 65536"),
    # issue 48: a TensorFlow OOM traceback before; bounded by the model's own width
    ("lora.rank=1000000000", "is above the maximum 1048576"),
    ("lora.rank=129", "lora.rank=129 is above model.hidden_dim (128)"),
])
def test_numbers_beyond_their_field_are_one_line(override, fragment):
    with pytest.raises(ConfigError) as error:
        load_config(None, [override])
    assert fragment in str(error.value) and len(str(error.value)) < 300


def test_the_model_size_bound_brackets_the_built_model():
    """weight_elements' bounds hold the exact count of every preset's model (the bounds
    decide refusals: the upper against the config's limit, the lower against the host)."""
    from tfllm.config.loader import weight_elements
    from tfllm.footprint.layout import param_count
    for name in ("tiny", "gpt2-small", "llama-1b"):
        config = load_config(f"configs/{name}.yaml")
        low, high = weight_elements(config.model)
        assert low <= param_count(config) <= high, name


def test_a_config_file_that_is_no_regular_file_is_refused(tmp_path):
    os.mkfifo(tmp_path / "pipe.yaml")  # opened as a file, it would wait for a writer
    with pytest.raises(ConfigError, match="pipe.yaml: is a FIFO"):
        load_config(str(tmp_path / "pipe.yaml"))
