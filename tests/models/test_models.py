"""Model behaviour on one device: shapes, causality, GQA, subclassing hooks, policies."""

import keras
import numpy as np
import pytest
import tensorflow as tf

from tfllm.config.schema import LoraConfig, PrecisionConfig
from tfllm.models import GPT, CausalLM, Gemma3, Llama, build_model
from tfllm.models.common import MLP, add_param, rotary
from tests.harness import sections, tiny_config


def _tokens(batch=2, length=12, vocab=128, seed=0):
    return tf.constant(np.random.default_rng(seed).integers(0, vocab, (batch, length)), tf.int32)


@pytest.mark.parametrize("family, cls", [("gpt", GPT), ("llama", Llama), ("gemma3", Gemma3)])
def test_forward_shape_and_causality(family, cls):
    model = build_model(*sections(tiny_config(family)))
    assert isinstance(model, cls) and isinstance(model, CausalLM)
    tokens = _tokens()
    logits = model(tokens)
    assert logits.shape == (2, 12, 128) and logits.dtype == tf.float32
    # Changing a later token must not change earlier logits.
    changed = tf.concat([tokens[:, :6], (tokens[:, 6:] + 1) % 128], axis=1)
    np.testing.assert_allclose(model(changed)[:, :6], logits[:, :6], atol=1e-6)
    assert not np.allclose(model(changed)[:, 6:], logits[:, 6:])


def test_sliding_window_sees_exactly_the_last_keys():
    # One local layer, window 5: the logits at t depend on tokens t-4 .. t only.
    model = build_model(*sections(tiny_config(
        "gemma3", **{"model.num_layers": 1, "model.sliding_window_pattern": 0})))
    assert model.is_local(0)
    tokens = _tokens()
    logits = model(tokens).numpy()
    changed = model(tf.concat([(tokens[:, :1] + 1) % 128, tokens[:, 1:]], axis=1)).numpy()
    np.testing.assert_array_equal(changed[:, 5:], logits[:, 5:])  # token 0 out of window
    assert not np.allclose(changed[:, 4], logits[:, 4])  # ... and in it at t = 4


def test_gemma3_cached_decoding_and_packing_equal_the_full_forward():
    # Local (window 5) and global layers: the cache path and packed documents apply the
    # same windows as the training path.
    model = build_model(*sections(tiny_config("gemma3")))
    assert [model.is_local(i) for i in range(2)] == [True, False]
    tokens = _tokens(length=16)
    full = model(tokens).numpy()
    cache = model.init_cache(2, 16)
    first, cache = model.call_with_cache(tokens[:, :9], cache, 0)
    rest = []
    for t in range(9, 16):  # one token at a time, as generation does
        logits, cache = model.call_with_cache(tokens[:, t:t + 1], cache, t)
        rest.append(logits.numpy())
    np.testing.assert_allclose(np.concatenate([first.numpy()] + rest, 1), full, atol=1e-5)
    segments = tf.constant([[0] * 7 + [1] * 9] * 2)
    packed = model(tokens, segment_ids=segments).numpy()
    np.testing.assert_allclose(packed[:, :7], full[:, :7], atol=1e-5)
    np.testing.assert_allclose(packed[:, 7:], model(tokens[:, 7:]).numpy(), atol=1e-5)


def test_family_defaults_tie_and_bias():
    gpt = build_model(*sections(tiny_config("gpt")))
    llama = build_model(*sections(tiny_config("llama")))
    assert gpt.tie_embeddings and gpt.lm_head is None and gpt.use_bias
    assert not llama.tie_embeddings and llama.lm_head is not None and not llama.use_bias
    assert not any(v.path.endswith("bias") for v in llama.variables)


def test_gqa_equals_mha_with_repeated_kv_heads():
    # A GQA layer equals an MHA layer whose k/v kernels repeat each kv head per group.
    cfg = tiny_config("llama")
    gqa = build_model(*sections(cfg)).blocks[0].attention
    x = tf.random.stateless_normal((2, 5, 64), seed=(1, 2))
    q, k, v = gqa.query(x), gqa.key(x), gqa.value(x)
    out = gqa.attend(rotary(q, 1e4), rotary(k, 1e4), v)
    groups = 16 // 8
    k_rep, v_rep = tf.repeat(k, groups, axis=2), tf.repeat(v, groups, axis=2)
    # Naive causal attention per head.
    qr, kr = rotary(q, 1e4).numpy(), rotary(k_rep, 1e4).numpy()
    scores = np.einsum("bthd,bshd->bhts", qr, kr) / np.sqrt(q.shape[-1])
    scores = np.where(np.tril(np.ones((5, 5), bool)), scores, -np.inf)
    probs = np.exp(scores - scores.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    want = np.einsum("bhts,bshd->bthd", probs, v_rep.numpy())
    np.testing.assert_allclose(out.numpy(), want, atol=1e-5)


def test_rotary_preserves_norm_and_relative_positions():
    x = tf.random.stateless_normal((1, 6, 2, 8), seed=(3, 4))
    y = rotary(x, 10000.0)
    np.testing.assert_allclose(tf.norm(y, axis=-1), tf.norm(x, axis=-1), rtol=1e-5)
    # Position 0 is not rotated.
    np.testing.assert_allclose(y[:, 0], x[:, 0], atol=1e-6)
    # q.k depends only on the offset: same vector at positions (1, 3) and (2, 4).
    same = tf.tile(x[:, :1], [1, 6, 1, 1])
    r = rotary(same, 10000.0).numpy()[0, :, 0]
    np.testing.assert_allclose(r[1] @ r[3], r[2] @ r[4], rtol=1e-5)


class SquaredMLP(keras.layers.Layer):
    """A user's MLP: relu(x W)^2, one weight with declared logical axes."""

    def __init__(self, hidden_dim, **kwargs):
        super().__init__(**kwargs)
        self.hidden_dim = hidden_dim

    def build(self, input_shape=None):
        self.kernel = add_param(self, "kernel", (self.hidden_dim, self.hidden_dim),
                                ("embed", "mlp"), ("normal", 0.02), "kernel")

    def call(self, x):
        return tf.square(tf.nn.relu(tf.einsum("btd,de->bte", x, self.kernel)))


class MyLlama(Llama):
    def make_mlp(self, index):
        return SquaredMLP(self.config.hidden_dim, name="mlp")

    def compute_lm_loss(self, logits, targets, mask=None):
        return 2.0 * super().compute_lm_loss(logits, targets, mask)


@pytest.mark.slow
def test_subclass_replaces_mlp_and_loss_and_trains_on_a_mesh(tmp_path):
    from tfllm.train.loop import train
    cfg = tiny_config("llama", "data=2,model=4",
                      **{"train.steps": 2, "train.log_every": 1})
    model = build_model(*sections(cfg), model_cls=MyLlama)
    assert any("block_0/mlp/kernel" in v.path for v in model.variables)
    assert not any(isinstance(l, MLP) for l in model._flatten_layers())
    last = train(cfg, str(tmp_path), model_cls=MyLlama)
    assert last["step"] == 2 and np.isfinite(last["loss"])
    assert last["loss"] > 1.5 * np.log(128) * 0.9  # the doubled loss is in effect


def test_weights_without_logical_axes_are_rejected():
    class PlainKerasWeight(keras.layers.Layer):
        def build(self, input_shape=None):
            self.kernel = self.add_weight(shape=(64, 64), name="kernel")

        def call(self, x):
            return x @ self.kernel

    class Bad(GPT):
        def make_mlp(self, index):
            return PlainKerasWeight(name="mlp")

    with pytest.raises(ValueError, match="created without tfllm.models.common.add_param"):
        build_model(*sections(tiny_config("gpt")), model_cls=Bad)


def test_build_model_takes_the_sections_it_reads():
    # build_model reads the model, precision and lora sections (and a seed), not the
    # whole Config (issue 51): a Config, or something else in a section's place, is
    # refused in one line naming the fix before anything is built; the options are
    # keyword-only, so the old positional build_model(config, parallel) cannot mean
    # something else.
    cfg = tiny_config("llama")
    with pytest.raises(TypeError, match=r"not a whole Config: pass config\.model, "
                                        r"config\.precision, config\.lora") as whole:
        build_model(cfg)
    with pytest.raises(TypeError, match=r"lora must be a LoraConfig \(config\.lora\) or "
                                        r"None, not Config") as misplaced:
        build_model(cfg.model, None, cfg)
    assert "\n" not in str(whole.value) + str(misplaced.value)
    with pytest.raises(TypeError, match="positional"):
        build_model(*sections(cfg), None)  # parallel must be named
    # None stands for the defaults (float32, no adapters), the seed for train.seed's 0.
    assert (cfg.precision, cfg.lora, cfg.train.seed) == (PrecisionConfig(), LoraConfig(), 0)
    default = build_model(cfg.model)
    full = build_model(*sections(cfg), seed=cfg.train.seed)
    assert [(v.path, v.trainable, v.dtype) for v in default.variables] == \
        [(v.path, v.trainable, v.dtype) for v in full.variables]
    for a, b in zip(default.variables, full.variables):
        np.testing.assert_array_equal(a.numpy(), b.numpy())


@pytest.mark.parametrize("policy, compute", [("float32", "float32"), ("bfloat16", "bfloat16")])
def test_precision_policy_dtypes(policy, compute):
    cfg = tiny_config("llama", **{"precision.policy": policy})
    model = build_model(*sections(cfg))
    assert all(v.dtype == "float32" for v in model.variables)  # master weights stay fp32
    for layer in model._flatten_layers():
        assert layer.dtype_policy.compute_dtype == compute, layer.name
    logits = model(_tokens())
    assert logits.dtype == tf.float32  # logits and loss are float32 under every policy


def test_a_shapes_only_model_is_never_initialized_by_a_later_keras_build():
    # build_model(allocate=False) (the plan, tfllm layouts) leaves no variable in Keras'
    # list awaiting deferred initialization: the next Keras model built in the process
    # would otherwise allocate them all (after planning llama-7b, ~28 GB: an
    # out-of-memory kill of a test worker).
    from tfllm.internals import is_allocated
    model = build_model(*sections(tiny_config("llama")), allocate=False)
    assert model.variables and not any(is_allocated(v) for v in model.variables)
    with keras.StatelessScope():  # leaving one initializes every pending variable
        pass
    assert not any(is_allocated(v) for v in model.variables)
