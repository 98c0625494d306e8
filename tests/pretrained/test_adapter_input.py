"""A PEFT adapter folder is input: every malformed adapter_config.json, damaged
safetensors file or tensor of the wrong content is one PretrainedError line naming the
file and the fix, found before a model is built or anything written."""

import json
import os
import random
import struct

import numpy as np
import pytest
from safetensors.numpy import save_file

from tfllm.config import Config
from tfllm.families import PretrainedError
from tfllm.pretrained.peft import check_adapter_shapes, read_adapter

HIDDEN, Q, KV = 32, 32, 16  # 4 query heads and 2 key/value heads of 8


def model():
    m = Config().model
    m.hidden_dim, m.num_query_heads, m.num_key_value_heads = HIDDEN, 4, 2
    m.intermediate_dim, m.num_layers = 64, 2
    return m


def tensors(r=4, seed=0):
    """peft's tensors of a rank-r adapter on q_proj and v_proj of 2 layers."""
    rng = np.random.default_rng(seed)
    out = {}
    for i in range(2):
        for name, width in (("q_proj", Q), ("v_proj", KV)):
            key = f"base_model.model.model.layers.{i}.self_attn.{name}"
            out[key + ".lora_A.weight"] = rng.normal(size=(r, HIDDEN)).astype(np.float32)
            out[key + ".lora_B.weight"] = rng.normal(size=(width, r)).astype(np.float32)
    return out


def adapter(folder, config=None, weights=None, **fields):
    os.makedirs(folder, exist_ok=True)
    c = {"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"],
         "bias": "none", "task_type": "CAUSAL_LM", **fields}
    text = config if config is not None else json.dumps(c)
    with open(os.path.join(folder, "adapter_config.json"), "wb") as f:
        f.write(text if isinstance(text, bytes) else text.encode("utf-8", "surrogatepass"))
    path = os.path.join(folder, "adapter_model.safetensors")
    if isinstance(weights, bytes):
        with open(path, "wb") as f:
            f.write(weights)
    else:
        save_file(weights if weights is not None else tensors(), path)
    return str(folder)


def refused(folder, says):
    with pytest.raises(PretrainedError) as e:
        settings, arrays = read_adapter(folder, "llama")
        check_adapter_shapes(arrays, model(), "llama")
    message = str(e.value)
    assert says in message and "\n" not in message, message
    return message


def test_a_good_adapter_reads_in_tfllm_orientation(tmp_path):
    settings, arrays = read_adapter(adapter(tmp_path / "a"), "llama")
    check_adapter_shapes(arrays, model(), "llama")
    assert settings["lora.rank"] == 4 and settings["lora.alpha"] == 8.0
    stored = tensors()
    a = stored["base_model.model.model.layers.1.self_attn.v_proj.lora_A.weight"]
    assert np.array_equal(arrays["block_1/attention/value/lora_a"], a.T)  # (in, r)
    # a pattern that says the adapter's own rank and alpha is honoured
    read_adapter(adapter(tmp_path / "b", rank_pattern={"q_proj": 4},
                         alpha_pattern={"v_proj": 8}), "llama")


@pytest.mark.parametrize("config, says", [
    ("[1, 2]", "a JSON list, not an object"),
    ('{"peft_type": "LORA", "target_modules": ["q_proj"]}', "r=None: the rank must be"),
    ('{"peft_type": "LORA", "r": "four", "target_modules": ["q_proj"]}', "r=four"),
    ('{"peft_type": "LORA", "r": 4.0, "target_modules": ["q_proj"]}', "r=4.0"),
    ('{"peft_type": "LORA", "r": 4, "target_modules": [5]}', "target_modules=[5]"),
    ('{"peft_type": "LORA", "r": 4, "target_modules": "q_proj|v_proj"}', "regular expr"),
    ('{"peft_type": "LORA", "r": 4, "target_modules": ["q_proj"], "rank_pattern": [1]}',
     "rank_pattern=[1]: must map"),
    ('{"peft_type": "LORA", "r": 4, "target_modules": ["q_proj"], "lora_alpha": NaN}',
     "not JSON"),
    ('{"peft_type": "LORA", "r": 4, "target_modules": ["q_proj"], "lora_alpha": -1}',
     "lora_alpha=-1"),
    ('{"peft_type": "LORA", "r": 4, "target_modules": ["q_proj"], "r": 1' + "0" * 5000 + "}",
     "not JSON"),
    ("[" * 100_000 + "]" * 100_000, "nested too deep"),
    (b'{"peft_type": "\xff"}', "not JSON"),
    ('{"peft_type": "LORA", "r": 4, "target_modules": ["q_proj", "v_proj"], '
     '"rank_pattern": {"q_proj": 8}}', "rank_pattern gives 'q_proj' 8"),
    ('{"peft_type": "LORA", "r": 4, "target_modules": ["q_proj", "v_proj"], '
     '"alpha_pattern": {"model.layers.0.self_attn.q_proj": 2}}', "alpha_pattern gives"),
])
def test_a_malformed_adapter_config_is_one_line(tmp_path, config, says):
    refused(adapter(tmp_path / "a", config=config), says)


def _with(key, array):
    t = tensors()
    t[key] = array
    return t


A0 = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
B1 = "base_model.model.model.layers.1.self_attn.v_proj.lora_B.weight"


def _nan_b():
    b = tensors()[B1].copy()
    b[3, 2] = np.nan
    return _with(B1, b)


@pytest.mark.parametrize("weights, says", [
    (_nan_b(), "holds 1 NaN or infinite values"),
    # peft writes lora_A as (r, in): stored (in, r) it would be a scrambled matrix
    (_with(A0, np.ones((HIDDEN, 4), np.float32)), "is [32, 4], but peft writes lora_A as "
                                                  "(r, in) with r = 4"),
    (_with(B1, np.ones((4, KV), np.float32)), "lora_B as (out, r)"),
    (_with(A0, np.ones((4, HIDDEN), np.int32)), "not a floating-point matrix"),
    (_with(A0, np.ones((4, HIDDEN, 1), np.float32)), "not a floating-point matrix"),
    ({**tensors(), "base_model.model.lm_head.lora_A.weight": np.ones((4, 4), np.float32)},
     "does not name"),
    ({k: v for k, v in tensors().items() if "layers.1.self_attn.q_proj.lora_B" not in k},
     "holds no base_model.model.model.layers.1.self_attn.q_proj.lora_B.weight"),
    # another base: in = 48, where the model's q_proj reads 32
    ({k: (np.ones((4, 48), np.float32) if "lora_A" in k else v)
      for k, v in tensors().items()}, "in = 48 where the model's attention/query has 32"),
])
def test_wrong_tensors_are_refused_never_reshaped(tmp_path, weights, says):
    refused(adapter(tmp_path / "a", weights=weights), says)


def test_damaged_safetensors_are_one_line(tmp_path):
    good = tmp_path / "good"
    adapter(good)
    data = (good / "adapter_model.safetensors").read_bytes()
    refused(adapter(tmp_path / "t", weights=data[:-7]), "not a readable safetensors file")
    header = struct.pack("<Q", 2 ** 60) + data[8:]  # a header of 2^60 bytes
    refused(adapter(tmp_path / "h", weights=header), "not a readable safetensors file")
    os.remove(good / "adapter_model.safetensors")
    os.mkfifo(good / "adapter_model.safetensors")
    refused(str(good), "FIFO")


def test_a_huge_or_fifo_config_is_refused_unread(tmp_path):
    folder = adapter(tmp_path / "a")
    with open(os.path.join(folder, "adapter_config.json"), "wb") as f:
        f.truncate(2 << 20)  # 2 MiB of zero bytes, over the bound
    refused(folder, "at most 1048576")
    os.remove(os.path.join(folder, "adapter_config.json"))
    os.mkfifo(os.path.join(folder, "adapter_config.json"))
    refused(folder, "FIFO")


def test_fuzzed_adapters_are_one_line_or_read(tmp_path):
    """Seeded fuzz: adapter_config.json with a field swapped for another type, a huge or
    non-finite number or deep nesting; safetensors truncated or with header bytes
    flipped. Each is one PretrainedError line or an adapter read with finite (in, r) and
    (r, out) arrays of the model's sizes."""
    rng = random.Random(48)
    good = json.loads(json.dumps({"peft_type": "LORA", "r": 4, "lora_alpha": 8,
                                  "target_modules": ["q_proj", "v_proj"], "bias": "none",
                                  "rank_pattern": {}, "alpha_pattern": {},
                                  "use_rslora": False, "lora_dropout": 0.0}))
    swaps = [None, 0, -3, 4, 2.5, 1e308, "x", "four", [], {}, [5], {"q_proj": 8}, True,
             [[[[["deep"]]]]], 10 ** 30]
    weights = tmp_path / "w.safetensors"
    save_file(tensors(), str(weights))
    data = weights.read_bytes()
    for case in range(150):
        config, blob = dict(good), data
        if case % 2:
            config[rng.choice(sorted(config))] = rng.choice(swaps)
        else:
            cut = bytearray(data[:rng.randrange(8, len(data) + 1)])
            if rng.random() < 0.5:
                at = rng.randrange(min(len(cut), 200))
                cut[at] = rng.randrange(256)
            blob = bytes(cut)
        folder = adapter(tmp_path / f"c{case}", config=json.dumps(config), weights=blob)
        try:
            _, arrays = read_adapter(folder, "llama")
            check_adapter_shapes(arrays, model(), "llama")
        except PretrainedError as e:
            assert "\n" not in str(e), str(e)
            continue
        for name, array in arrays.items():
            assert np.isfinite(array).all() and array.ndim == 2


def test_a_bfloat16_adapter_reads_as_float32(tmp_path):
    # peft saves a bfloat16 model's adapter in bfloat16 (numpy has no such dtype), and so
    # does tfllm export --format peft --dtype bfloat16
    stored = tensors()
    header, blobs, at = {}, [], 0
    for key in sorted(stored):
        bits = (stored[key].view(np.uint32) >> 16).astype("<u2")  # truncated to bfloat16
        header[key] = {"dtype": "BF16", "shape": list(stored[key].shape),
                       "data_offsets": [at, at + bits.nbytes]}
        blobs.append(bits.tobytes())
        at += bits.nbytes
    text = json.dumps(header).encode()
    data = struct.pack("<Q", len(text)) + text + b"".join(blobs)
    _, arrays = read_adapter(adapter(tmp_path / "a", weights=data), "llama")
    a = stored["base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"]
    want = ((a.view(np.uint32) >> 16) << 16).view(np.float32)
    assert arrays["block_0/attention/query/lora_a"].dtype == np.float32
    assert np.array_equal(arrays["block_0/attention/query/lora_a"], want.T)
