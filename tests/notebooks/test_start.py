"""`tfllm.notebook.start`, the first cell of every notebook: needs in one line, CPU mesh."""

import os
import subprocess
import sys

import pytest

from tfllm.notebook import NotebookNeeds, start
from tests.harness import TF_HANG_S

ROOT = __file__.rsplit("/tests/", 1)[0]


def test_a_missing_extra_names_it_and_the_install_command(monkeypatch):
    from tfllm import notebook
    monkeypatch.setitem(notebook.EXTRAS, "plan", ("a_module_that_is_not_installed",))
    with pytest.raises(NotebookNeeds, match=r'needs the `plan` extra .*pip install -e "\.\[plan\]"'):
        start(devices=2, needs=["plan"])


@pytest.mark.slow
def test_fresh_kernel_gets_cpu_devices_and_no_gpu_then_a_late_call_says_restart():
    # A process of its own: the device split happens only before TensorFlow initializes.
    code = (
        "from tfllm.notebook import start, NotebookNeeds\n"
        "import tensorflow as tf\n"
        "print(start(devices=4))\n"
        "assert len(tf.config.list_logical_devices('CPU')) == 4\n"
        "assert not tf.config.get_visible_devices('GPU')\n"
        "try:\n"
        "    start(devices=8)\n"
        "except NotebookNeeds as e:\n"
        "    print('NEEDS', e)\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                         text=True, timeout=TF_HANG_S)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.startswith("4 logical CPU devices (GPUs hidden")
    assert "NEEDS TensorFlow was initialized before this cell (4 CPU devices, 8 needed): " \
           "restart the kernel" in out.stdout


@pytest.mark.slow
def test_a_profile_after_start_traces_the_allocations_with_onednn_off(tmp_path):
    # Notebook 01 (section 6) reads the memory peak from the allocator's MemoryAllocation
    # events. TensorFlow's plain CPU allocator, its default wherever oneDNN is off (with
    # TF_ENABLE_ONEDNN_OPTS=0, as here, and unless it is 1 on x86 CPUs without AVX-512
    # VNNI/BF16, AVX-VNNI or AMX), traces none: `start` picks its BFC allocator, which does.
    env = {k: v for k, v in os.environ.items() if k != "TF_CPU_ALLOCATOR_USE_BFC"}
    env["TF_ENABLE_ONEDNN_OPTS"] = "0"
    code = (
        "import os\n"
        "from tfllm.notebook import start\n"
        "start(devices=2)\n"
        "import tensorflow as tf\n"
        "from tfllm.train.profile import summary\n"
        "x = tf.ones([64, 64])\n"
        "tf.profiler.experimental.start(os.environ['LOGDIR'])\n"
        "tf.matmul(x, x).numpy()\n"
        "tf.profiler.experimental.stop()\n"
        "planes = summary(os.environ['LOGDIR'])['planes']\n"
        "print('MEMORY', [p['memory'] for p in planes.values() if 'memory' in p])\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                         text=True, timeout=TF_HANG_S, env=dict(env, LOGDIR=str(tmp_path)))
    assert out.returncode == 0, out.stderr[-2000:]
    line = next(s for s in out.stdout.splitlines() if s.startswith("MEMORY"))
    assert "'peak_bytes': " in line and "'allocations': " in line, line
    assert "MatMul" in line, line  # the op whose allocation reached the peak
