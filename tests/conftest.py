"""Test setup: 8 logical CPU devices, tiny configs, global-state hygiene."""

import os

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
# Reference and sharded runs must differ only by sharding, not by oneDNN's blocked
# kernels choosing different summation orders for different shard shapes.
os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "0")

import keras  # noqa: E402
import pytest  # noqa: E402

from tfllm.parallel.mesh import setup_cpu_devices  # noqa: E402

NUM_DEVICES = 8
assert setup_cpu_devices(NUM_DEVICES) == NUM_DEVICES, "TensorFlow was initialized too early"


def pytest_addoption(parser):
    parser.addoption("--update-golden", action="store_true",
                     help="Rewrite tests/golden/*.json from the current layouts.")


@pytest.fixture
def update_golden(request):
    return request.config.getoption("--update-golden")


@pytest.fixture(autouse=True)
def _reset_keras_state():
    """Dtype policies and Keras global state never leak from one test to the next."""
    yield
    keras.config.set_dtype_policy("float32")


@pytest.fixture(autouse=True)
def _restore_environment():
    """A command run in this process (`main([...])`) sets variables for its own process
    (TF_XLA_FLAGS naming its workdir's XLA cache, NCCL and allocator settings). They must
    not reach the next test's child processes: a later `tfllm train` child would load
    programs another test compiled and dump nothing."""
    saved = dict(os.environ)
    yield
    for name in set(os.environ) - set(saved):
        del os.environ[name]
    os.environ.update(saved)


def tiny_overrides(family="gpt", axes="data=1", **extra):
    """--set overrides for the test model: vocab 128, hidden 64, 2 layers.

    Llama gets 16 query / 8 key-value heads so that grouped-query attention is exercised
    and both divide over model=8; GPT gets 8 heads.
    """
    heads = {"gpt": (8, 0), "llama": (16, 8), "gemma3": (16, 8)}[family]
    values = {
        "model.family": family, "model.vocab_size": 128, "model.hidden_dim": 64,
        "model.num_layers": 2, "model.num_query_heads": heads[0],
        "model.num_key_value_heads": heads[1], "model.intermediate_dim": 128,
        "model.max_sequence_length": 32, "data.sequence_length": 16,
        "train.global_batch_size": 16, "train.steps": 3, "optimizer.warmup_steps": 1,
        "optimizer.learning_rate": 1e-2, "mesh.axes": axes, "data.source": "synthetic",
    }
    if family == "gemma3":  # a local (window 5 < 16 tokens) and a global layer
        values.update({"model.sliding_window": 5, "model.sliding_window_pattern": 2,
                       "model.rope_local_theta": 10000.0, "model.rope_theta": 1e6,
                       "model.query_pre_attn_scalar": 24.0})
    values.update(extra)
    return [f"{k}={v}" for k, v in values.items()]


def write_text_corpus(directory, files=4, docs_per_file=12, seed=0):
    """Small multi-line text files whose documents are separated by <|endoftext|>."""
    import random
    rng = random.Random(seed)
    words = "the cat sat on a mat and the dog ran to the park with a red ball".split()
    directory.mkdir(parents=True, exist_ok=True)
    for f in range(files):
        docs = ["\n".join(" ".join(rng.choice(words) for _ in range(12)) for _ in range(8))
                for _ in range(docs_per_file)]
        (directory / f"f{f}.txt").write_text("<|endoftext|>".join(docs))
    return str(directory / "*.txt")


def text_overrides(tmp_path, axes="data=2,model=4", **extra):
    """tiny_overrides for a byte-tokenized run on write_text_corpus files."""
    pattern = write_text_corpus(tmp_path / "corpus")
    values = {"data.source": "text", "data.paths": f'["{pattern}"]', "data.tokenizer": "byte",
              "model.vocab_size": 260, "data.validation_fraction": 0.2,
              "data.data_dir": str(tmp_path / "cache"), "train.eval_steps": 2,
              "train.sample_tokens": 0}
    values.update(extra)
    return tiny_overrides("gpt", axes, **values)


def free_ports(n):
    """n free localhost TCP ports (for DTENSOR_JOBS in multi-client tests)."""
    import socket
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("localhost", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


# XLA on CPU maps executable code per compiled cluster and per device, and TensorFlow
# never frees compiled clusters: a process that compiles the 8-device parity meshes
# exhausts the kernel's vm.max_map_count (65,530 mappings; measured ~6,500 per llama
# parity case) and segfaults. Such tests run in a child pytest process of their own.
IN_CHILD = "TFLLM_TEST_IN_CHILD"


def run_in_child(request, timeout=900, env=None):
    """Runs the calling test alone in a fresh pytest process; True if this is that child.

    Usage: `if not run_in_child(request): return` at the top of a test.

    Args:
      env: variables added to the child's environment (e.g. XLA_FLAGS, read once per
        process).
    """
    import subprocess
    import sys
    if os.environ.get(IN_CHILD):
        return True
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, **(env or {}), **{IN_CHILD: "1"})
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider",
                          request.node.nodeid], cwd=root, env=env, capture_output=True,
                         text=True, timeout=timeout)
    assert out.returncode == 0, (out.stdout[-6000:] + out.stderr[-3000:])
    return False


def snapshot_tree(directory):
    """Every file and folder under `directory`, with its content (None for a folder): what
    a refused command must leave unchanged."""
    out = {}
    for root, dirs, files in os.walk(directory):
        for name in dirs + files:
            path = os.path.join(root, name)
            out[os.path.relpath(path, directory)] = (
                open(path, "rb").read() if os.path.isfile(path) else None)
    return out
