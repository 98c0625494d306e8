"""A checkpoint saved by 2 real clients (2 x 4 logical CPU devices) restores in one process."""

import json
import os

import pytest

from tfllm.checkpoint import Checkpointer, Reader
from tests.checkpoint.helpers import gathered
from tests.checkpoint.multiclient_save import build_state, reference_value
from tests.harness import PY, ROOT, TF_HANG_S, run_clients, tiny_overrides

TIMEOUT_S = TF_HANG_S  # bounds a hang only
SCRIPT = os.path.join(ROOT, "tests", "checkpoint", "multiclient_save.py")


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.parametrize("target_axes", ["data=2,model=4", "fsdp=8"])
def test_two_client_save_restores_in_one_process(tmp_path_factory, target_axes):
    directory = tmp_path_factory.getbasetemp() / "multiclient_ckpt"
    if not directory.exists():
        reports = run_clients([PY, SCRIPT, str(directory),
                               json.dumps(tiny_overrides("gpt", "data=2,model=4"))],
                              clients=2, timeout=TIMEOUT_S)
        assert [r["checkpointer"] for r in reports] == [[0, 2], [1, 2]]
        assert [r["client_id"] for r in reports] == [0, 1]
        assert all(r["local_devices"] == 4 for r in reports)
    assert sorted(os.listdir(directory)) == ["step_00000007"]
    reader = Reader(str(directory / "step_00000007"))
    assert reader.num_clients == 2
    # Each client wrote only its own shards: both shard files hold data.
    assert all(reader.files[f"client_0000{c}/shards.bin"]["bytes"] > 0 for c in (0, 1))
    assert [json.loads(reader.client_files(c)["iterator.json"]) for c in (0, 1)] == [
        {"client": 0}, {"client": 1}]
    from tfllm.config import load_config
    from tfllm.parallel import make_parallel
    overrides = tiny_overrides("gpt", target_axes)
    parallel = make_parallel(load_config(None, overrides).mesh)
    variables = build_state(overrides, parallel)
    metadata = Checkpointer(str(directory), parallel).restore_latest(variables)
    assert metadata == {"note": "multiclient", "step": 7}
    for name, value in gathered(variables).items():
        expected = reference_value(name, value.shape, value.dtype)
        assert (value == expected).all(), name
