"""A peer lost while the loop saves or evaluates is a lost peer (exit 76, one line), as it
is in a step: every collective the loop and the checkpointer issue goes through the same
classification (tfllm.runtime.watchdog.peer_from_error)."""

import pytest
import tensorflow as tf

from tfllm.checkpoint.checkpointer import Checkpointer
from tfllm.config import load_config
from tfllm.runtime.watchdog import PeerLost
from tfllm.train import loop
from tests.harness import tiny_overrides


def _unavailable(*args, **kwargs):
    # What a survivor's agreement collective raises when client 1 is gone.
    raise tf.errors.UnavailableError(
        None, None, "Collective ops is aborted by: failed to connect to all addresses "
        "/job:worker/replica:0/task:1")


@pytest.mark.slow  # a training run each: ~10-30 s on 2 shared cores
@pytest.mark.parametrize("where", ["save", "evaluate"])
def test_a_peer_lost_in_a_save_or_an_evaluation_is_one_line(tmp_path, monkeypatch, where):
    config = load_config(None, tiny_overrides("gpt", **{
        "train.steps": 2, "checkpoint.every": 1, "train.eval_every": 1,
        "data.source": "text", "data.paths": "[" + str(tmp_path / "t.txt") + "]",
        "data.tokenizer": "byte", "model.vocab_size": 257, "train.peer_timeout_s": 0,
        "train.sample_tokens": 0}))
    (tmp_path / "t.txt").write_text("<|endoftext|>".join(f"document {i}: a b c d e f g"
                                                         for i in range(64)))
    monkeypatch.setattr(loop, "num_clients", lambda: 2)  # as client 0 of two
    if where == "save":
        monkeypatch.setattr(Checkpointer, "save", _unavailable)
    else:
        monkeypatch.setattr(loop.Run, "evaluate", _unavailable)
    with pytest.raises(PeerLost) as caught:
        loop.train(config, str(tmp_path / "run"))
    message = str(caught.value)
    assert "client 1 stopped responding" in message and "at step 1" in message
    assert "\n" not in message
