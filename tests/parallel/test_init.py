"""Mesh-independent initial values: fixed values, and one generator program per shape."""

import numpy as np

from tfllm.parallel import init


def test_values_are_pinned():
    # Values of the counter-based generator as first written (key and std were then
    # compile-time constants): making them arguments must not change a single bit, or
    # every seed's initial model would change.
    key = init.variable_key(7, "block_0/attention/q/kernel")
    assert key == 990795868
    block = init.initial_block(("normal", 0.02), (6, 10), key, [2, 5], [3, 5]).numpy()
    np.testing.assert_array_equal(
        block.ravel()[:4], np.array([-0.008296883665025234, 0.010710170492529869,
                                     0.0008752835565246642, -0.014131993055343628], np.float32))


def test_same_shaped_variables_share_one_compiled_generator():
    # On GPU every generator is an XLA program compiled per device; with the key and std
    # as constants llama-7b compiled ~300 of them per GPU at start-up.
    before = init.generator_count()
    blocks = [init.initial_block(("normal", std), (8, 5), init.variable_key(0, f"layer_{i}"),
                                 [0, 0], [8, 5], "float32", jit=True).numpy()
              for i, std in enumerate((0.02, 0.02, 0.5))]
    assert init.generator_count() == before + 1
    # ... and still gives each variable its own values and scale.
    assert not np.array_equal(blocks[0], blocks[1])
    assert 5 < blocks[2].std() / blocks[1].std() < 50
