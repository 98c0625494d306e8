"""`tfllm eval --tasks` judged by lm-eval's own Hugging Face backend.

A tiny random Llama written by transformers (`tests.pretrained.transformers_reference`)
is imported into a tfllm run and exported back with `tfllm export --format hf`. lm-eval
scores tfllm's three shipped local tasks (multiple choice, generation, perplexity) with
its `hf` model on the exported folder, and `tfllm eval --tasks` scores them on the run,
on one device and on a mesh of 8 logical CPU devices: the same metrics, the same
per-sample log-likelihoods within float32 rounding, the same greedy generations, and the
same token ids for every request. Nothing touches the network (HF_*_OFFLINE).

Tolerance: float32 on both sides, only summation orders differ (torch's matmuls and
softmax vs TensorFlow's, on one device or reduced over shards). A request's
log-likelihood sums up to 64 token log-probabilities of magnitude ~1-10, each a
log-softmax over 288 logits: measured at most 4.3e-6 apart for the multiple-choice
requests (sums ~10-40) and 3.0e-5 for the perplexity sums (~170-610, 2-4 windows), i.e.
~1e-7 relative, a few float32 ulps per term. LOGLIK_RTOL 1e-6 with LOGLIK_ATOL 1e-4 leaves
~10x headroom over that and still catches one token scored differently (>= 1e-2 apart).
Metrics built from those sums (acc, perplexities) follow; acc is compared exactly (the
test checks that no two choices are closer than the tolerance, so rounding cannot flip
it).
"""

import glob
import json
import os

import numpy as np
import pytest

pytest.importorskip("lm_eval")

from tests.pretrained import transformers_reference as ref  # noqa: E402
from tfllm.cli.main import main  # noqa: E402
from tfllm.evals.benchmark import SHIPPED_TASKS  # noqa: E402

# Each case loads the run and compiles its scorer and generator (a mesh: XLA per device).
pytestmark = pytest.mark.slow

TASKS = ["tfllm_tiny_mc", "tfllm_tiny_gen", "tfllm_tiny_ppl"]
#: documents of each shipped task's test split; --limit 5 takes at most 5
DOCUMENTS = {"tfllm_tiny_mc": 8, "tfllm_tiny_gen": 6, "tfllm_tiny_ppl": 3}
LOGLIK_RTOL, LOGLIK_ATOL = 1e-6, 1e-4


@pytest.fixture(autouse=True)
def _offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """(run, exported Hugging Face folder): the tiny Llama imported, then exported."""
    folder = tmp_path_factory.mktemp("evals")
    ref.save("llama3", folder / "hf")
    assert main(["import", "--preset", str(folder / "hf"), "--workdir",
                 str(folder / "run")]) == 0
    assert main(["export", "--workdir", str(folder / "run"), "--out", str(folder / "exp"),
                 "--format", "hf"]) == 0
    return folder / "run", folder / "exp"


@pytest.fixture(scope="module")
def judge(folders):
    """lm-eval's `hf` backend on the exported folder: 1-shot, 5 documents per task."""
    import lm_eval
    from lm_eval.tasks import TaskManager
    os.environ.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    return lm_eval.simple_evaluate(
        model="hf", model_args={"pretrained": str(folders[1]), "dtype": "float32",
                                "device": "cpu"},
        tasks=TASKS, num_fewshot=1, limit=5, batch_size=4, log_samples=True,
        bootstrap_iters=0,
        task_manager=TaskManager(include_path=SHIPPED_TASKS, include_defaults=False))


def _tfllm_eval(workdir, *extra):
    """`tfllm eval --tasks` on the run: (printed JSON, {task: {doc_id: sample}})."""
    for old in glob.glob(os.path.join(workdir, "eval", "*")):
        os.remove(old)
    args = ["eval", "--workdir", str(workdir), "--tasks", ",".join(TASKS), "--num-fewshot",
            "1", "--limit", "5", "--batch-size", "4", "--log-samples", *extra]
    assert main(args) == 0
    results = glob.glob(os.path.join(workdir, "eval", "results_*.json"))
    assert len(results) == 1
    with open(results[0]) as f:
        written = json.load(f)
    samples = {}
    for task in TASKS:
        (path,) = glob.glob(os.path.join(workdir, "eval", f"samples_{task}_*.jsonl"))
        with open(path) as f:
            samples[task] = {s["doc_id"]: s for s in map(json.loads, f)}
    return written, samples


def _assert_same_as_judge(judge, written, samples):
    for task in TASKS:
        assert written["n-shot"][task] == 1
        theirs_samples = judge["samples"][task]
        assert sorted(samples[task]) == sorted(s["doc_id"] for s in theirs_samples)
        assert len(samples[task]) == min(5, DOCUMENTS[task])  # --limit
        for theirs in theirs_samples:
            ours = samples[task][theirs["doc_id"]]
            # the same requests: contexts with the same few-shot example, continuations
            assert ours["arguments"] == json.loads(json.dumps(theirs["arguments"]))
            for mine, its in zip(ours["resps"], theirs["resps"]):
                mine, its = mine[0], its[0]
                if task == "tfllm_tiny_gen":  # greedy: the same text
                    assert mine == its, theirs["doc_id"]
                elif task == "tfllm_tiny_ppl":
                    np.testing.assert_allclose(mine, its, rtol=LOGLIK_RTOL,
                                               atol=LOGLIK_ATOL)
                else:
                    np.testing.assert_allclose(mine[0], its[0], rtol=LOGLIK_RTOL,
                                               atol=LOGLIK_ATOL)
                    assert mine[1] == its[1]
            if task == "tfllm_tiny_mc":  # no near-tie that rounding could flip
                lls = sorted(r[0][0] for r in theirs["resps"])
                assert min(np.diff(lls)) > 10 * LOGLIK_ATOL
        for metric, value in judge["results"][task].items():
            if metric.endswith(",none") and "stderr" not in metric:
                np.testing.assert_allclose(written["results"][task][metric], value,
                                           rtol=1e-5, err_msg=f"{task} {metric}")
        assert written["results"][task]["acc,none" if task == "tfllm_tiny_mc" else
                                        "sample_len"] == \
            judge["results"][task]["acc,none" if task == "tfllm_tiny_mc" else "sample_len"]


def test_one_device_scores_as_lm_eval_s_hf_backend(folders, judge):
    written, samples = _tfllm_eval(folders[0])
    _assert_same_as_judge(judge, written, samples)
    assert written["config"]["step"] == 0 and written["config"]["model"] == "tfllm"


def test_a_mesh_scores_as_lm_eval_s_hf_backend(folders, judge):
    written, samples = _tfllm_eval(folders[0], "--set", "mesh.axes=data=2,model=4")
    _assert_same_as_judge(judge, written, samples)
    assert written["config"]["mesh"] == "data=2,model=4"


def test_requests_tokenize_as_transformers(folders, judge):
    """Every context and continuation of the judged requests: tfllm's ids are HFLM's."""
    from lm_eval.models.huggingface import HFLM

    from tfllm.evals.lm import TfllmLM
    from tfllm.train.saved_run import restored_run, saved_config
    hf = HFLM(pretrained=str(folders[1]), dtype="float32", device="cpu")
    run, _ = restored_run(str(folders[0]), saved_config(str(folders[0])))
    ours = TfllmLM(run)
    assert (ours.eot_token_id, ours.prefix_token_id, ours.max_length) == \
        (hf.eot_token_id, hf.prefix_token_id, hf.max_length)
    for task in TASKS:
        for sample in judge["samples"][task]:
            for args in sample["arguments"]:
                texts = [args[0]] if task != "tfllm_tiny_mc" else list(args)
                if task == "tfllm_tiny_mc":
                    assert ours._encode_pair(*args) == hf._encode_pair(*args)
                for text in texts:
                    if isinstance(text, str) and text:
                        assert ours.tok_encode(text) == hf.tok_encode(text)


def test_a_task_of_your_own_on_local_json_files(folders, tmp_path):
    """A task YAML as a user writes it (dataset_path: json, data_files) in --include-path;
    --limit and --num-fewshot reach lm-eval."""
    data = tmp_path / "data"
    data.mkdir()
    rows = [{"question": f"Is {n} even?", "choices": ["yes", "no"], "answer": n % 2}
            for n in range(6)]
    for split, part in (("test", rows[:4]), ("train", rows[4:])):
        (data / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in part))
    tasks = tmp_path / "my_tasks"
    tasks.mkdir()
    (tasks / "my_qa.yaml").write_text(
        "task: my_qa\ndataset_path: json\ndataset_kwargs:\n  data_files:\n"
        f"    test: {data / 'test.jsonl'}\n    train: {data / 'train.jsonl'}\n"
        "output_type: multiple_choice\ntest_split: test\nfewshot_split: train\n"
        "doc_to_text: \"Question: {{question}}\\nAnswer:\"\ndoc_to_choice: \"{{choices}}\"\n"
        "doc_to_target: answer\nmetric_list:\n  - metric: acc\n")
    assert main(["eval", "--workdir", str(folders[0]), "--include-path", str(tasks),
                 "--tasks", "my_qa", "--limit", "3", "--num-fewshot", "2"]) == 0
    (path,) = sorted(glob.glob(os.path.join(folders[0], "eval", "results_*.json")))[-1:]
    with open(path) as f:
        written = json.load(f)
    assert written["n-shot"]["my_qa"] == 2
    assert written["n-samples"]["my_qa"] == {"original": 4, "effective": 3}
    assert 0 <= written["results"]["my_qa"]["acc,none"] <= 1


def test_the_chat_template_renders_contexts_as_transformers(folders, tmp_path):
    """--apply-chat-template: the run's chat template (ChatML, its own copy), few-shot
    examples as turns, equals lm-eval's hf backend with apply_chat_template and
    fewshot_as_multiturn on the export (which carries the template): the same rendered
    contexts, log-likelihoods and generations."""
    import lm_eval
    from lm_eval.tasks import TaskManager
    chatml = os.path.join(os.path.dirname(SHIPPED_TASKS), "..", "data", "templates",
                          "chatml.jinja")
    hf_folder = os.path.join(os.path.dirname(folders[0]), "hf")
    run, exported = tmp_path / "run", tmp_path / "exp"
    assert main(["import", "--preset", hf_folder, "--workdir", str(run), "--set",
                 f"data.chat_template={os.path.abspath(chatml)}"]) == 0
    assert main(["export", "--workdir", str(run), "--out", str(exported), "--format",
                 "hf"]) == 0
    tasks = ["tfllm_tiny_mc", "tfllm_tiny_gen"]
    assert main(["eval", "--workdir", str(run), "--tasks", ",".join(tasks), "--num-fewshot",
                 "1", "--limit", "3", "--log-samples", "--apply-chat-template"]) == 0
    theirs = lm_eval.simple_evaluate(
        model="hf", model_args={"pretrained": str(exported), "dtype": "float32",
                                "device": "cpu"},
        tasks=tasks, num_fewshot=1, limit=3, batch_size=4, log_samples=True,
        bootstrap_iters=0, apply_chat_template=True, fewshot_as_multiturn=True,
        task_manager=TaskManager(include_path=SHIPPED_TASKS, include_defaults=False))
    for task in tasks:
        (path,) = glob.glob(os.path.join(run, "eval", f"samples_{task}_*.jsonl"))
        with open(path) as f:
            ours = {s["doc_id"]: s for s in map(json.loads, f)}
        for sample in theirs["samples"][task]:
            mine = ours[sample["doc_id"]]
            assert mine["arguments"] == json.loads(json.dumps(sample["arguments"]))
            assert "<|im_start|>user" in mine["arguments"][0][0]  # rendered by ChatML
            for a, b in zip(mine["resps"], sample["resps"]):
                if task == "tfllm_tiny_gen":
                    assert a[0] == b[0]
                else:
                    np.testing.assert_allclose(a[0][0], b[0][0], rtol=LOGLIK_RTOL,
                                               atol=LOGLIK_ATOL)
