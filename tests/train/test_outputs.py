"""What `tfllm train` leaves in its workdir, and what eval/generate/export do with it.

One tiny byte-tokenized text run on data=2,model=4 (module-scoped: trained once), of 8
rows: the fewest the fsdp=8 evaluation below splits, and each row is a tf.data stream of
its own (16 rows cost ~15 CPU s more on 2 cores, when every evaluation still built its
streams again).
"""

import glob
import json
import os

import numpy as np
import pytest
import tensorflow as tf

from tests.harness import metrics_records, run_tfllm, tiny_text_config
from tfllm.data import feed
from tfllm.train.loop import train


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("outputs")
    cfg = tiny_text_config(tmp, **{
        "train.global_batch_size": 8, "train.steps": 8, "train.log_every": 2, "train.eval_every": 4,
        "checkpoint.every": 4, "train.sample_tokens": 8, "train.sample_prompt": "the"})
    last = train(cfg, str(tmp / "run"))
    return tmp / "run", cfg, last


@pytest.mark.slow
def test_workdir_holds_metrics_tensorboard_plot_checkpoints_config(run_dir):
    workdir, cfg, last = run_dir
    records = metrics_records(workdir)
    train_steps = [r["step"] for r in records if "loss" in r]
    assert train_steps == [1, 2, 4, 6, 8]
    for r in records:
        if "loss" in r:
            assert {"grad_norm", "learning_rate", "tokens_per_s"} <= set(r)
            assert "mfu" not in r  # no MFU on CPU (tfllm.train.metrics.NO_CPU_PEAK)
    assert [r["step"] for r in records if "eval_loss" in r] == [4, 8]
    assert last["eval_loss"] == records[-1]["eval_loss"] and last["sample"].startswith("the")
    assert (workdir / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (workdir / "config.yaml").exists()
    assert sorted(os.listdir(workdir / "checkpoints")) == ["step_00000004", "step_00000008"]
    tags = set()
    for path in glob.glob(str(workdir / "tensorboard" / "events.*")):
        for event in tf.compat.v1.train.summary_iterator(path):
            tags.update(v.tag for v in event.summary.value)
    assert {"loss", "learning_rate", "grad_norm", "tokens_per_s", "eval_loss"} <= tags


@pytest.mark.slow
def test_eval_on_another_mesh_matches_training_eval(run_dir):
    workdir, _, last = run_dir
    r = run_tfllm("eval", "--workdir", str(workdir), "--set", "mesh.axes=fsdp=8")
    assert r.returncode == 0, r.stderr[-3000:]
    result = json.loads(r.stdout.strip().splitlines()[-1])
    # The same weights and batches on another mesh: only float32 summation order differs.
    assert result["step"] == 8
    assert result["eval_loss"] == pytest.approx(last["eval_loss"], rel=1e-5)
    assert result["eval_perplexity"] == pytest.approx(np.exp(result["eval_loss"]), rel=1e-6)


@pytest.mark.slow
def test_generate_cli_is_seeded(run_dir):
    workdir, _, _ = run_dir
    args = ["generate", "--workdir", str(workdir), "--prompt", "the cat", "--max-new-tokens",
            "6", "--temperature", "1.0", "--top-k", "20", "--top-p", "0.9", "--seed", "3"]
    first, second = run_tfllm(*args), run_tfllm(*args)
    assert first.returncode == 0, first.stderr[-3000:]
    assert first.stdout == second.stdout and first.stdout.startswith("the cat")


@pytest.mark.slow
def test_export_serves_the_sharded_models_logits(run_dir, tmp_path):
    from tfllm.checkpoint import Checkpointer, run_state_variables
    from tfllm.models import build_model
    from tfllm.parallel import context, make_parallel
    from tfllm.parallel.placement import to_numpy
    from tfllm.train.export import export_model
    workdir, cfg, _ = run_dir
    out = tmp_path / "exported"
    summary = export_model(cfg, str(workdir), str(out))
    assert summary["step"] == 8
    ids = np.array([[5, 17, 99, 3, 44, 101, 7, 8]], np.int32)
    loaded = tf.saved_model.load(str(out / "saved_model"))  # keep it: it owns the weights
    served = loaded.serve(tf.constant(ids)).numpy()

    # data=2,model=4: the mesh it was trained on
    parallel = make_parallel(cfg.mesh, cfg.model, cfg.optimizer)
    model = build_model(cfg.model, cfg.precision, cfg.lora, parallel=parallel)
    Checkpointer(str(workdir / "checkpoints"), parallel, cfg.checkpoint).restore_latest(
        run_state_variables(model), strict=False)
    batch = feed.place(parallel, np.repeat(ids, 2, axis=0))  # 2 rows: one per data shard

    @tf.function
    def logits(x):
        with context.use(parallel):
            return model(x)
    sharded = to_numpy(logits(batch))[:1]
    # One device vs an 8-device mesh: the same weights, float32 sums in another order.
    np.testing.assert_allclose(served, sharded, rtol=1e-4, atol=1e-5)
    # The Keras weights load into a mesh-free model.
    plain = build_model(cfg.model, cfg.precision, cfg.lora)
    plain.load_weights(str(out / "model.weights.h5"))
    np.testing.assert_allclose(plain(tf.constant(ids)).numpy(), served, rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_a_workdir_with_a_different_run_is_refused(run_dir):
    workdir, _, _ = run_dir
    r = run_tfllm("train", "--workdir", str(workdir), "--config", "configs/tiny.yaml",
                  "--set", "model.hidden_dim=32")
    assert r.returncode == 2
    assert f"{workdir} holds a different run" in r.stderr and "model.hidden_dim" in r.stderr


@pytest.mark.slow
def test_a_corrupt_checkpoint_is_named_or_skipped(run_dir, tmp_path):
    import shutil
    workdir, _, _ = run_dir
    copy = tmp_path / "copy"
    shutil.copytree(workdir, copy)
    shards = copy / "checkpoints" / "step_00000008" / "client_00000" / "shards.bin"
    index = json.loads((shards.parent / "index.json").read_text())["variables"]
    # A byte of a model weight (eval reads only the model's blocks).
    name = next(n for n in sorted(index) if n.startswith("model/") and index[n]["blocks"])
    data = bytearray(shards.read_bytes())
    data[index[name]["blocks"][0]["offset"]] ^= 0xFF
    shards.write_bytes(bytes(data))
    r = run_tfllm("eval", "--workdir", str(copy), "--steps", "1")
    assert r.returncode == 2 and "shards.bin" in r.stderr and "corrupt" in r.stderr
    r = run_tfllm("eval", "--workdir", str(copy), "--steps", "1",
                  "--set", "checkpoint.on_corruption=fallback")
    assert r.returncode == 0, r.stderr[-3000:]
    assert json.loads(r.stdout.strip().splitlines()[-1])["step"] == 4
    assert "falling back" in r.stderr
