"""A quiet start: TensorFlow's C++ start-up records stay off stderr unless asked for."""

import os

import pytest

from tfllm.quiet import is_noise
from tests.harness import run_tfllm

ONEDNN = ("I0000 00:00:1795338973.266483    4674 port.cc:153] oneDNN custom operations are "
          "on.")
CUINIT = ("E0000 00:00:1795334976.182550   20564 cuda_platform.cc:52] failed call to cuInit: "
          "INTERNAL: CUDA error")
OOM = "E1122 09:00:00.000001   20564 bfc_allocator.cc:1] Allocator ran out of memory"
ABSL = ("WARNING: All log messages before absl::InitializeLog() is called are written to "
        "STDERR")
SENTENCEPIECE = ("normalizer.cc(51) LOG(INFO) precompiled_charsmap is empty. use identity "
                 "normalization.")


def test_noise_by_level():
    assert is_noise(ONEDNN, 2) and is_noise(ABSL, 2) and is_noise(CUINIT, 2)
    assert not is_noise(OOM, 2)  # a real error passes at the default level
    assert is_noise(OOM, 3)
    assert not any(is_noise(line, 0) for line in (ONEDNN, ABSL, CUINIT, OOM))
    assert not is_noise("Traceback (most recent call last):", 3)
    assert not is_noise("tfllm train: error: data.path: no such file", 3)
    # SentencePiece's own records (at every model load), by the same levels
    assert is_noise(SENTENCEPIECE, 1) and not is_noise(SENTENCEPIECE, 0)
    assert not is_noise(SENTENCEPIECE.replace("LOG(INFO)", "LOG(ERROR)"), 2)


def _layouts_stderr(**env):
    base = {k: v for k, v in os.environ.items() if k != "TF_CPP_MIN_LOG_LEVEL"}
    r = run_tfllm("layouts", "--config", "configs/tiny.yaml", "--set", "mesh.axes=data=2",
                  "--set", "model.bogus=1", env=dict(base, **env))
    assert r.returncode == 2
    return r.stderr


@pytest.mark.slow
@pytest.mark.parametrize("level", [None, "0"])
def test_tfllm_command_stderr(level):
    err = _layouts_stderr(**({"TF_CPP_MIN_LOG_LEVEL": level} if level else {}))
    # tfllm's own message always comes through.
    assert "unknown key 'model.bogus'" in err
    records = [line for line in err.splitlines() if line[:1] in "IWE" and "] " in line]
    if level is None:
        assert records == [] and "absl::InitializeLog" not in err, err
    else:  # asked for: TensorFlow's records are shown as TensorFlow writes them
        assert records or "absl::InitializeLog" in err, err
