"""The one place tfllm compiles step functions (`tfllm.compiler.jit`)."""

import pytest
import tensorflow as tf

from tfllm.compiler import jit
from tfllm.parallel import context

MESH = object()  # stands for a Parallel: Retraced only asks whether there is one


def test_resolve_jit_auto_is_xla_on_gpu_only():
    assert jit.resolve_jit("auto", "GPU") is True
    assert jit.resolve_jit("auto", "CPU") is False
    assert jit.resolve_jit("true", "CPU") is True and jit.resolve_jit("false", "GPU") is False


def test_compiled_functions_trace_inside_the_mesh_context():
    seen = []
    sentinel = object()

    def fn(x):
        seen.append(context.current())
        return x * 2
    assert float(jit.compile_fn(fn, None, False)(tf.constant(2.0))) == 4.0
    assert seen == [None]
    # A mesh's Parallel is what `constrain` sees while the function is traced; a tf.function
    # traced without XLA runs the trace once, with the context set, and leaves it unset.
    traced = jit.compile_fn(fn, sentinel, False)
    traced.get_concrete_function(tf.TensorSpec((), tf.float32))
    assert seen[-1] is sentinel and context.current() is None


def test_dtensor_function_name_clash_is_retraced_once_more_and_nothing_else(monkeypatch):
    clash = tf.errors.InvalidArgumentError(
        None, None, "Cannot add function 'decode_i_body' because a different function "
        "with the same name already exists. [Op:__inference__decode_fn_65556]")
    traces = []

    def compile_fn(fn, parallel, jit_compile):
        traces.append(fn)
        failing = len(traces) == 1  # the first trace trips, the second runs

        def compiled(x):
            if failing:
                raise clash
            return fn(x)
        return compiled

    monkeypatch.setattr(jit, "compile_fn", compile_fn)
    retraced = jit.Retraced(lambda x: x + 1, MESH, True)
    assert retraced(1) == 2 and retraced.retraces == 1 and len(traces) == 2
    # Without a mesh, or for any other error, nothing is retried.
    traces.clear()
    with pytest.raises(tf.errors.InvalidArgumentError, match="same name"):
        jit.Retraced(lambda x: x, None, True)(1)
    other = tf.errors.InvalidArgumentError(None, None, "Incompatible shapes")

    def always(fn, parallel, jit_compile):
        def compiled(x):
            raise other
        return compiled
    monkeypatch.setattr(jit, "compile_fn", always)
    with pytest.raises(tf.errors.InvalidArgumentError, match="Incompatible"):
        jit.Retraced(lambda x: x, MESH, True)(1)


def test_each_compiled_function_keeps_its_own_retracing_count(caplog):
    # tf.function counts traces per wrapped function's code: compiled steps must not all
    # count as one (`traced`), or a run that traces prefill, decode and its train step a
    # few times each is warned of "excessive retracing".
    class Steps:
        def double(self, x):
            return x * 2

        def plus(self, x):
            return x + 1

        def minus(self, x):
            return x - 1
    steps = Steps()
    with caplog.at_level("WARNING", logger="tensorflow"):
        for method in (steps.double, steps.plus, steps.minus):
            compiled = jit.compile_fn(method, None, False)
            for length in (1, 2, 3):  # three traces each: below TensorFlow's threshold
                compiled(tf.zeros((length,)))
    assert "retracing" not in caplog.text
