"""train.profile_steps: a TensorFlow profiler trace of the chosen steps, and its summary."""

import pytest

from tfllm.cli.main import main
from tfllm.config import ConfigError, load_config
from tfllm.train.profile import summary, trace_files


def test_profile_steps_writes_a_trace_of_those_steps_that_summary_reads(tmp_path, capsys):
    workdir = tmp_path / "run"
    assert main(["train", "--config", "configs/tiny.yaml", "--workdir", str(workdir),
                 "--set", "mesh.axes=data=2", "--set", "train.steps=4",
                 "--set", "train.log_every=4", "--set", "train.eval_every=0",
                 "--set", "train.profile_steps=2-3", "--set", "train.xla_cache=off"]) == 0
    out = capsys.readouterr().out
    assert f"profile of steps 2-3 in {workdir}/tensorboard" in out
    files = trace_files(str(workdir / "tensorboard"))
    assert len(files) == 1  # one trace: steps 2..3
    planes = summary(str(workdir / "tensorboard"))["planes"]
    host = next(p for name, p in planes.items() if "host" in name.lower())
    names = [name for name, _, _ in host["top"]]
    # The step ran inside the trace: its TF function (two calls) is among the host's
    # heaviest events.
    step = [(name, n) for name, _, n in host["top"] if "train_step" in name]
    assert step and step[0][1] == 2, names


@pytest.mark.parametrize("value", ["0-2", "3-2", "x", "1-2-3", "9"])
def test_a_malformed_profile_range_is_one_line(value):
    with pytest.raises(ConfigError, match="train.profile_steps"):
        load_config(None, [f"train.profile_steps={value}", "train.steps=8"])
