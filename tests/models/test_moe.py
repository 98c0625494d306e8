"""The mixture-of-experts block (tfllm.models.common.moe), judged by transformers.

Its output, auxiliary loss and gradients equal transformers' sparse MoE blocks (Mixtral,
Qwen3-MoE with and without norm_topk_prob, Qwen2-MoE's shared expert) with the weights
copied in, for both dropless dispatches (slots, and grouped with tiles of 4 rows so that
groups span several tiles and padding occurs); the XLA-compiled block equals eager; the
router statistics keep their gradients under remat; capacity mode drops exactly the
assignments tfllm.models.common.dispatch names; the grouped matmul's compiled gradient
holds nothing per tile (cost, read from the optimized HLO); bfloat16 runs.

Tolerances (float32): both sides compute the same sums of at most D = 32 or F = 16
products in different orders (torch's per-expert loop, our batched einsums), so they
differ by a few ulps of the largest partial sum, ~1e-6 relative; rtol 1e-5 leaves 10x
room, atol 1e-6 covers outputs that cancel to near zero. Gradients sum over B*T = 14
tokens more: rtol 1e-4, and an atol of 1e-5 of the tensor's largest value, since an
element that cancels to near zero keeps the rounding of partial sums of that size (an
input gradient of -0.0044 among values up to 2.97 once differed by 2.1e-6, 9 ulps of
2.97, under a loaded machine; 1e-5 of it is ~80 ulps). Routing is compared exactly first (the chosen experts
are the same indices), so a tolerance never hides a different routing.
"""

import re

import numpy as np
import pytest
import tensorflow as tf

from tests.pretrained.transformers_reference import load_torch_transformers
from tfllm.models.common import noise
from tfllm.models.common.dispatch import (expert_capacity, num_tiles, plan_grouped,
                                          plan_slots)
from tfllm.models.common.grouped import grouped_matmul
from tfllm.models.common.moe import MoeMLP, load_balancing_loss, route, router_z_loss
from tfllm.models.common.remat import recompute

D, F, E, K, B, T = 32, 16, 8, 2, 2, 7
RTOL, ATOL = 1e-5, 1e-6  # float32, same sums in another order (module docstring)
GRAD_RTOL = 1e-4  # gradients sum over the tokens too
GRAD_ATOL_OF_MAX = 1e-5  # of the gradient's largest value (module docstring)

# name -> (transformers config class, its arguments, our MoeMLP arguments)
VARIANTS = {
    "mixtral": ("MixtralConfig", dict(intermediate_size=F, num_local_experts=E,
                                      router_jitter_noise=0.0),
                dict(routing="topk_then_softmax")),
    "qwen3_moe": ("Qwen3MoeConfig", dict(moe_intermediate_size=F, num_experts=E,
                                         norm_topk_prob=True),
                  dict(routing="softmax_then_topk", normalize_top_k=True)),
    "qwen3_moe_unnormalized": ("Qwen3MoeConfig", dict(moe_intermediate_size=F, num_experts=E,
                                                      norm_topk_prob=False),
                               dict(routing="softmax_then_topk", normalize_top_k=False)),
    "qwen2_moe_shared": ("Qwen2MoeConfig", dict(moe_intermediate_size=F, num_experts=E,
                                                norm_topk_prob=False,
                                                shared_expert_intermediate_size=24),
                         dict(routing="softmax_then_topk", normalize_top_k=False,
                              shared_intermediate_dim=24)),
}
_BLOCKS = {"MixtralConfig": "mixtral.modeling_mixtral.MixtralSparseMoeBlock",
           "Qwen3MoeConfig": "qwen3_moe.modeling_qwen3_moe.Qwen3MoeSparseMoeBlock",
           "Qwen2MoeConfig": "qwen2_moe.modeling_qwen2_moe.Qwen2MoeSparseMoeBlock"}


def _torch_block(variant, seed=0):
    torch, transformers = load_torch_transformers()
    config_name, args, _ = VARIANTS[variant]
    config = getattr(transformers, config_name)(hidden_size=D, num_experts_per_tok=K,
                                                hidden_act="silu", **args)
    module, cls = _BLOCKS[config_name].rsplit(".", 1)
    block = getattr(getattr(transformers.models, module.split(".")[0]),
                    module.split(".")[1])
    block = getattr(block, cls)(config)
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in block.parameters():  # std 0.3: logits of order 1, so routing is decisive
            p.normal_(0.0, 0.3)
    return block.eval()


def _ours_from(block, variant, dtype="float32", **extra):
    """Our block with the torch block's weights copied in (transposed to (in, out))."""
    layer = MoeMLP(D, F, E, K, name="mlp", dtype=dtype, **{**VARIANTS[variant][2], **extra})
    layer.build(None)
    t = lambda p: p.detach().numpy()  # noqa: E731
    experts = block.experts
    layer.router.kernel.assign(t(block.gate.weight).T)  # (E, D) -> (D, E)
    gate_up = t(experts.gate_up_proj)  # (E, 2F, D): gate rows first, then up
    layer.gate.kernel.assign(gate_up[:, :F].transpose(0, 2, 1))  # (E, D, F)
    layer.up.kernel.assign(gate_up[:, F:].transpose(0, 2, 1))
    layer.down.kernel.assign(t(experts.down_proj).transpose(0, 2, 1))  # (E, D, F) -> (E, F, D)
    if layer.shared_expert is not None:
        shared = block.shared_expert
        for ours, theirs in ((layer.shared_expert.gate, shared.gate_proj),
                             (layer.shared_expert.up, shared.up_proj),
                             (layer.shared_expert.down, shared.down_proj)):
            ours.kernel.assign(t(theirs.weight).T)
        layer.shared_expert_gate.kernel.assign(t(block.shared_expert_gate.weight).T)
    return layer


def _tokens(seed=1, rows=B, length=T):
    return np.random.RandomState(seed).normal(size=(rows, length, D)).astype("float32")


def _mask():
    mask = np.ones((B, T), "float32")
    mask[1, 4:] = 0  # the second row is padded after 4 tokens
    return mask


DISPATCH = {"slots": dict(dispatch="slots"), "grouped": dict(dispatch="grouped", tile=4)}


@pytest.mark.parametrize("dispatch", sorted(DISPATCH))
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_block_equals_transformers_with_its_aux_loss(variant, dispatch):
    torch, transformers = load_torch_transformers()
    blocks = [_torch_block(variant, seed) for seed in (0, 1)]  # two layers for the aux loss
    layers = [_ours_from(b, variant, **DISPATCH[dispatch]) for b in blocks]
    x = _tokens()
    mask = _mask()
    stats, logits = [], []
    for block, layer in zip(blocks, layers):
        xt = torch.from_numpy(x)
        with torch.no_grad():
            want = block(xt).numpy()
            layer_logits, _, want_experts = block.gate(xt.reshape(-1, D))
        y, s = layer(tf.constant(x), token_mask=tf.constant(mask))
        _, experts = route(tf.cast(layer.router(tf.constant(x)), tf.float32), K,
                           layer.routing, layer.normalize_top_k)
        # Same experts chosen, in the same order (largest first), before any tolerance.
        np.testing.assert_array_equal(np.reshape(experts, (-1, K)), want_experts.numpy())
        np.testing.assert_allclose(y, want, rtol=RTOL, atol=ATOL)
        stats.append(s)
        logits.append(layer_logits)
    lbl = transformers.models.mixtral.modeling_mixtral.load_balancing_loss_func
    want_aux = lbl(tuple(logits), E, K, torch.from_numpy(mask)).item()
    np.testing.assert_allclose(load_balancing_loss(stats), want_aux, rtol=RTOL)
    # Without a mask every token counts, as transformers without an attention mask.
    unmasked = [layer(tf.constant(x))[1] for layer in layers]
    np.testing.assert_allclose(load_balancing_loss(unmasked),
                               lbl(tuple(logits), E, K).item(), rtol=RTOL)
    # Per-expert counts: every unmasked token's k choices; the z-loss from the logits.
    assert float(tf.reduce_sum(stats[0].expert_counts)) == K * mask.sum()
    z = [(torch.logsumexp(l, -1).numpy().reshape(B, T) ** 2 * mask).sum() / mask.sum()
         for l in logits]
    np.testing.assert_allclose(router_z_loss(stats), np.mean(z), rtol=RTOL)
    assert float(stats[0].dropped) == 0.0  # dropless


@pytest.mark.parametrize("dispatch", sorted(DISPATCH))
@pytest.mark.parametrize("variant", ["mixtral", "qwen3_moe", "qwen2_moe_shared"])
def test_gradients_equal_torch_autograd(variant, dispatch):
    """d(sum(y * r) + 0.1 aux)/d(x, router, gate, up, down), ours against torch's."""
    torch, transformers = load_torch_transformers()
    block = _torch_block(variant)
    layer = _ours_from(block, variant, **DISPATCH[dispatch])
    x = _tokens()
    r = np.random.RandomState(2).normal(size=x.shape).astype("float32")
    xt = torch.from_numpy(x).requires_grad_(True)
    lbl = transformers.models.mixtral.modeling_mixtral.load_balancing_loss_func
    logits, _, _ = block.gate(xt.reshape(-1, D))
    loss = (block(xt) * torch.from_numpy(r)).sum() + 0.1 * lbl((logits,), E, K)
    loss.backward()
    xs = tf.constant(x)
    with tf.GradientTape() as tape:
        tape.watch(xs)
        y, stats = layer(xs)
        ours = tf.reduce_sum(y * r) + 0.1 * load_balancing_loss([stats])
    weights = [layer.router.kernel, layer.gate.kernel, layer.up.kernel, layer.down.kernel]
    got = tape.gradient(ours, [xs] + weights)
    gate_up = block.experts.gate_up_proj.grad.numpy()
    want = [xt.grad.numpy(), block.gate.weight.grad.numpy().T,
            gate_up[:, :F].transpose(0, 2, 1), gate_up[:, F:].transpose(0, 2, 1),
            block.experts.down_proj.grad.numpy().transpose(0, 2, 1)]
    for g, w in zip(got, want):
        assert np.abs(w).max() > 0  # every weight is reached
        np.testing.assert_allclose(g, w, rtol=GRAD_RTOL,
                                   atol=max(ATOL, GRAD_ATOL_OF_MAX * np.abs(w).max()))


@pytest.mark.parametrize("options", [dict(), dict(capacity_factor=1.0), DISPATCH["grouped"]],
                         ids=["dropless", "capacity", "grouped"])
def test_xla_compiled_block_equals_eager(options):
    layer = _ours_from(_torch_block("qwen3_moe"), "qwen3_moe", **options)
    x = tf.constant(_tokens())

    def step(x):
        with tf.GradientTape() as tape:
            y, stats = layer(x)
            loss = tf.reduce_sum(tf.square(y)) + load_balancing_loss([stats])
        return y, stats, tape.gradient(loss, layer.trainable_variables)

    eager = step(x)
    compiled = tf.function(step, jit_compile=True)(x)
    # XLA fuses and reorders the same float32 sums; an entry that cancels to near zero
    # keeps the rounding of its largest terms, on the scale of the tensor's largest entry.
    for got, want in zip(tf.nest.flatten(compiled), tf.nest.flatten(eager)):
        scale = float(np.abs(want).max())
        np.testing.assert_allclose(got, want, rtol=RTOL, atol=RTOL * scale + ATOL)


@pytest.mark.parametrize("dispatch", sorted(DISPATCH))
@pytest.mark.parametrize("traced", [False, True])
def test_router_stats_survive_recomputation(traced, dispatch):
    """Under remat a decoder block runs inside tfllm's `recompute`: the statistics are
    outputs of the recomputed function, so the aux and z losses' gradients reach the
    router through it; selective remat (the activation recomputed) changes nothing."""
    layer = _ours_from(_torch_block("qwen3_moe"), "qwen3_moe", **DISPATCH[dispatch])
    x = tf.constant(_tokens())

    def gradients(forward, output_weight=1.0):
        def run(x):
            with tf.GradientTape() as tape:
                y, stats = forward(x)
                loss = (output_weight * tf.reduce_sum(y * y) + load_balancing_loss([stats])
                        + router_z_loss([stats]))
            return tape.gradient(loss, layer.trainable_variables,
                                 unconnected_gradients=tf.UnconnectedGradients.ZERO)
        return (tf.function(run) if traced else run)(x)

    plain, plain_stats_only = gradients(layer), gradients(layer, 0.0)
    assert np.abs(plain_stats_only[0]).max() > 1e-3  # the router's, from the stats alone
    full, full_stats_only = gradients(recompute(layer)), gradients(recompute(layer), 0.0)
    layer.recompute_activation = True
    selective = gradients(layer)
    # The same float32 operations run again: equal within the module's tolerances.
    for got, want in ((full, plain), (selective, plain), (full_stats_only, plain_stats_only)):
        for g, w in zip(got, want):
            np.testing.assert_allclose(g, w, rtol=RTOL, atol=ATOL)


def test_slot_plan_gives_first_choices_priority_and_drops_the_rest():
    # One row of 3 tokens, 2 experts, capacity 2. Choice-major order: the first choices
    # (t0 -> 0, t1 -> 0, t2 -> 1) claim slots before the second ones (t0 -> 1, t1 -> 1,
    # t2 -> 0): expert 0 keeps t0, t1 and drops t2's second choice; expert 1 keeps t2, t0
    # and drops t1's second choice.
    plan = plan_slots(tf.constant([[[0, 1], [0, 1], [1, 0]]], tf.int32), 2, 2)
    np.testing.assert_array_equal(plan.row_token, [[0, 1, 2, 0]])  # (e0: t0 t1, e1: t2 t0)
    dropped = 2 * 2  # E * C: the zero row
    np.testing.assert_array_equal(plan.assignment_row, [[[0, 1, 2], [3, dropped, dropped]]])
    # All four tokens want expert 0 (k = 1); capacity 2 keeps the first two in order.
    plan = plan_slots(tf.zeros((1, 4, 1), tf.int32), 2, 2)
    np.testing.assert_array_equal(plan.row_token, [[0, 1, 4, 4]])  # expert 1's slots empty
    np.testing.assert_array_equal(plan.assignment_row, [[[0, 1, 4, 4]]])
    assert expert_capacity(4, 1, 2, None) == 4  # dropless: T
    assert expert_capacity(8, 2, 4, 1.0) == 4  # ceil(1.0 * 8 * 2 / 4)
    assert expert_capacity(8, 2, 4, 0.01) == 1 and expert_capacity(8, 2, 4, 9.0) == 8


def test_grouped_plan_pads_each_expert_to_whole_tiles():
    # 5 tokens, k = 1, 3 experts, tiles of 2: expert 0 has t0 t2 t4 (2 tiles, one padded
    # row), expert 1 none (no tile), expert 2 has t1 t3 (1 tile). Tile bound:
    # ceil((5 + 3 * 1) / 2) = 4 tiles; the last is padding.
    plan = plan_grouped(tf.constant([[[0], [2], [0], [2], [0]]], tf.int32), 3, 2)
    np.testing.assert_array_equal(plan.tile_expert, [[0, 0, 2, 2]])
    np.testing.assert_array_equal(plan.row_token, [[0, 2, 4, 5, 1, 3, 5, 5]])  # 5: zeros
    np.testing.assert_array_equal(plan.assignment_row, [[[0, 4, 1, 5, 2]]])


@pytest.mark.parametrize("length", [1, 3])
def test_short_sequences_and_decoding_agree_across_dispatches(length):
    """One token per row (decoding) and rows shorter than a tile: the grouped dispatch
    uses tiles of at most T rows and equals the slot dispatch."""
    block = _torch_block("mixtral")
    x = tf.constant(_tokens(4, length=length))
    slots = _ours_from(block, "mixtral")(x)[0]
    grouped = _ours_from(block, "mixtral", dispatch="grouped", tile=64)(x)[0]
    np.testing.assert_allclose(grouped, slots, rtol=RTOL, atol=ATOL)


def test_grouped_backward_holds_no_kernel_slice_per_tile():
    """Cost, not only value: the compiled gradient of `grouped_matmul` holds no array of
    one kernel slice per tile ((J, B, I, O), what TensorFlow's own while-loop gradient
    would stack) and no padded copy of its input (what a dynamic `tf.slice` made): its
    largest float32 array is the kernel gradient (E, I, O) or an activation (B, J*tile, I)."""
    tile = 4
    plan = plan_grouped(tf.math.top_k(tf.random.stateless_normal((B, T, E), [0, 1]), K)[1],
                        E, tile)
    tiles = num_tiles(T, K, E, tile)
    kernel = tf.Variable(tf.random.stateless_normal((E, D, F), [0, 2]))
    x = tf.random.stateless_normal((B, tiles * tile, D), [0, 3])

    @tf.function(jit_compile=True)
    def kernel_gradient(x, tile_expert):
        with tf.GradientTape() as tape:
            y = grouped_matmul(x, kernel, tile_expert, tile)
            loss = tf.reduce_sum(y * y)
        return tape.gradient(loss, kernel)

    hlo = kernel_gradient.experimental_get_compiler_ir(x, plan.tile_expert)(
        stage="optimized_hlo")
    sizes = {shape: int(np.prod([int(n) for n in shape.split(",")]))
             for shape in re.findall(r"f32\[([0-9,]+)\]", hlo)}
    bound = max(E * D * F, B * tiles * tile * D)
    assert tiles * B * D * F > bound  # a stacked slice per tile would show
    assert max(sizes.values()) <= bound, sorted(sizes.items(), key=lambda kv: -kv[1])[:3]
    assert "while" in hlo  # the tiles are a loop, not unrolled


def test_capacity_mode_drops_exactly_the_documented_assignments():
    """A per-token reference applying the docstring's rule: choice-major, token order,
    the first C assignments of each expert in a row are kept, the rest contribute 0."""
    length, capacity_factor = 12, 0.5
    layer = MoeMLP(D, F, 4, K, capacity_factor=capacity_factor, name="mlp")
    layer.build(None)
    x = _tokens(3, length=length)
    capacity = expert_capacity(length, K, 4, capacity_factor)  # ceil(0.5 * 12 * 2 / 4) = 3
    y, stats = layer(tf.constant(x))
    weights, experts = route(tf.cast(layer.router(tf.constant(x)), tf.float32), K,
                             layer.routing, layer.normalize_top_k)
    weights, experts = np.asarray(weights), np.asarray(experts)
    g, u, d = (np.asarray(v) for v in (layer.gate.kernel, layer.up.kernel, layer.down.kernel))
    want, dropped, lost = np.zeros_like(x), 0, np.zeros((B, length), bool)
    for b in range(B):
        taken = np.zeros(4, int)
        for j in range(K):  # choice-major
            for t in range(length):
                e = experts[b, t, j]
                taken[e] += 1
                if taken[e] > capacity:
                    dropped, lost[b, t] = dropped + 1, True
                    continue
                h = x[b, t] @ g[e]
                want[b, t] += weights[b, t, j] * ((h / (1 + np.exp(-h))) * (x[b, t] @ u[e])) @ d[e]
    assert dropped > 0  # the case exercises dropping
    assert float(stats.dropped) == dropped
    np.testing.assert_allclose(y, want, rtol=RTOL, atol=ATOL)
    # The same weights dropless differ exactly on the tokens that lost an assignment.
    dropless = MoeMLP(D, F, 4, K, name="mlp")
    dropless.build(None)
    for ours, theirs in zip(dropless.weights, layer.weights):
        ours.assign(theirs)
    full, full_stats = dropless(tf.constant(x))
    assert float(full_stats.dropped) == 0.0
    np.testing.assert_allclose(np.asarray(full)[~lost], np.asarray(y)[~lost], rtol=RTOL,
                               atol=ATOL)
    # A lost assignment's term (weight ~0.5 x an output of ~1e-3 at init std 0.02) is far
    # above rounding (~1e-10 at that scale).
    assert np.all(np.abs(np.asarray(full) - np.asarray(y)).max(-1)[lost] > 10 * ATOL)


@pytest.mark.parametrize("dispatch", sorted(DISPATCH))
def test_bfloat16_runs_and_stays_near_float32(dispatch):
    block = _torch_block("qwen3_moe")
    full = _ours_from(block, "qwen3_moe")
    half = _ours_from(block, "qwen3_moe", dtype="mixed_bfloat16", **DISPATCH[dispatch])
    x = tf.constant(_tokens())
    with tf.GradientTape() as tape:
        y, stats = half(x)
        loss = tf.reduce_sum(tf.cast(y, tf.float32) ** 2) + load_balancing_loss([stats])
    grads = tape.gradient(loss, half.trainable_variables)
    assert y.dtype == tf.bfloat16 and half.gate.kernel.dtype == "float32"
    assert all(bool(tf.reduce_all(tf.math.is_finite(g))) for g in grads)
    # Compare tokens whose routing bfloat16 cannot flip: the k-th and (k+1)-th float32
    # logits differ by more than 0.1, beyond bfloat16's logit error (~2^-8 relative of
    # logits of order 1 summed over D = 32). There the output differs by bfloat16
    # rounding of each product, ~2^-8 relative: atol 3% of the output's scale.
    logits = np.sort(np.asarray(full.router(x)), axis=-1)
    decisive = (logits[..., -K] - logits[..., -K - 1]) > 0.1
    want = np.asarray(full(x)[0])
    assert decisive.sum() >= T  # most tokens
    np.testing.assert_allclose(np.asarray(tf.cast(y, tf.float32))[decisive], want[decisive],
                               atol=0.03 * np.abs(want).max())


def test_router_jitter_acts_in_training_only_and_follows_the_seed():
    layer = MoeMLP(D, F, E, K, routing="topk_then_softmax", router_jitter=0.1, name="mlp")
    layer.build(None)
    x = tf.constant(_tokens())
    plain = layer(x)[0]
    with noise.noise_seed(tf.constant(7)):
        first, again = layer(x)[0], layer(x)[0]
    with noise.noise_seed(tf.constant(8)):
        other = layer(x)[0]
    np.testing.assert_array_equal(first, again)  # a recomputation draws the same noise
    assert not np.allclose(first, plain) and not np.allclose(first, other)
    np.testing.assert_array_equal(layer(x)[0], plain)  # evaluation: no noise


def test_refusals_name_the_setting():
    with pytest.raises(ValueError, match="routing 'softmax'"):
        MoeMLP(D, F, E, K, routing="softmax")
    with pytest.raises(ValueError, match="top_k=9 with 8 experts"):
        MoeMLP(D, F, E, 9)
    with pytest.raises(ValueError, match="capacity_factor=0"):
        MoeMLP(D, F, E, K, capacity_factor=0)
    with pytest.raises(ValueError, match="grouped dispatch is dropless"):
        MoeMLP(D, F, E, K, capacity_factor=1.0, dispatch="grouped")
