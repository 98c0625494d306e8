"""The fence of private APIs (`tfllm.internals`): one version table, nothing past it, and
collecting the executed graphs of one call leaves nothing collecting afterwards."""

import pytest
import tensorflow as tf

from tfllm import internals
from tfllm.internals import collect_executed_graphs


def test_collection_stops_at_the_end_of_the_block():
    inside = tf.function(lambda x: x * 2.0, autograph=False)
    with collect_executed_graphs() as graphs:
        inside(tf.ones(2))
    assert len(graphs()) >= 1
    # A function first run after the block must not be stored: TensorFlow kept every
    # later function's graph when graph collection was disabled before run metadata,
    # until a long test session's store grew too large to parse.
    after = tf.function(lambda x: x + 1.0, autograph=False)
    after(tf.ones(3))
    metadata = internals.eager_context().export_run_metadata()
    assert len(metadata.function_graphs) == 0


def test_keras_version_is_checked_before_the_bridge_uses_internals():
    internals.check_keras()  # the installed one
    internals.check_keras("3.5.0")
    for bad in ("4.0.0", "3.4.1", "2.15.0"):
        with pytest.raises(RuntimeError, match=r"keras>=3.5,<4"):
            internals.check_keras(bad)


def test_every_fenced_library_has_one_range_and_one_message():
    # One table: each library's range, and a version outside it named with the fix.
    internals.check_version("tensorflow")  # the installed ones are inside
    internals.check_version("tensorflow", "2.21.0")
    for library, bad in (("tensorflow", "2.22.0"), ("tensorflow", "2.15.1"),
                         ("keras_hub", "1.0.0"), ("keras_hub", "0.19.0"), ("jax", "0.11.0"),
                         ("jax", "0.10.1")):  # jax: the exact release checked, no other
        with pytest.raises(RuntimeError, match="is not supported.*install"):
            internals.check_version(library, bad)
    internals.check_version("keras_hub", "0.32.0")
    internals.check_version("jax", "0.10.2")


def test_no_module_outside_the_fence_imports_private_apis():
    """`tensorflow.python`, `keras.src`, `keras_hub.src` and `jax._src` appear in one
    module of tfllm: the fence."""
    import pathlib
    root = pathlib.Path(internals.__file__).parent
    private = ("tensorflow.python", "keras.src", "keras_hub.src", "jax._src")
    leaks = []
    for path in root.rglob("*.py"):
        if path.name == "internals.py" and path.parent == root:
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            code = line.split("#")[0]
            if ("import" in code and any(p in code for p in private)):
                leaks.append(f"{path.relative_to(root.parent)}:{number}: {line.strip()}")
    assert not leaks, leaks


def test_no_module_outside_the_fence_reads_another_objects_private_attributes():
    """A private attribute of another library's object (Keras' `Variable._value`,
    `Layer._flatten_layers`) is read through the fence too: neither by name
    (`var._value`) on a Keras object, nor by `getattr`/`hasattr`/`setattr` with a private
    name on anything but the module's own objects (`self`)."""
    import ast
    import pathlib
    root = pathlib.Path(internals.__file__).parent
    fenced = ("_value", "_initializer", "_initialize", "_flatten_layers")
    leaks = []
    for path in sorted(root.rglob("*.py")):
        if path.name == "internals.py" and path.parent == root:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            where = f"{path.relative_to(root.parent)}:{getattr(node, 'lineno', 0)}"
            if isinstance(node, ast.Attribute) and node.attr in fenced:
                leaks.append(f"{where}: {ast.unparse(node)}")
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                    and node.func.id in ("getattr", "hasattr", "setattr")
                    and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant)
                    and str(node.args[1].value).startswith("_")
                    and not str(node.args[1].value).startswith("__")
                    and not (isinstance(node.args[0], ast.Name)
                             and node.args[0].id in ("self", "cls"))):
                leaks.append(f"{where}: {ast.unparse(node)}")
    assert not leaks, leaks


def test_xla_context_is_seen_only_where_xla_compiles():
    # flash attention's bf16 x bf16 -> float32 GEMM has no TensorFlow kernel: it may be
    # built only inside a jit_compile function (and what that function calls)
    seen = {}

    def probe(name):
        seen[name] = internals.in_xla_context()
        return tf.constant(0.0)

    probe("eager")
    tf.function(lambda: probe("graph"))()
    tf.function(lambda: tf.function(lambda: probe("nested"))(), jit_compile=True)()
    tf.function(lambda: probe("xla"), jit_compile=True)()
    assert seen == {"eager": False, "graph": False, "nested": True, "xla": True}
