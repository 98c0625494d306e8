"""The README and docs/ stay true to the repository: links resolve, the site builds with
MkDocs in strict mode, the tests the testing page names exist, and the quick-loop command
it gives is the tier pytest.ini defines."""

import ast
import glob
import os
import re
import shlex

import pytest

from tests.harness import ROOT

PAGES = [os.path.join(ROOT, "README.md")] + sorted(glob.glob(os.path.join(ROOT, "docs", "*.md")))
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def _slug(heading):
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to dashes."""
    text = heading.strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def _anchors(path):
    with open(path) as f:
        text = re.sub(r"```.*?```", "", f.read(), flags=re.S)
    return {_slug(line.lstrip("#")) for line in text.splitlines() if line.startswith("#")}


@pytest.mark.parametrize("page", PAGES, ids=lambda p: os.path.relpath(p, ROOT))
def test_every_relative_link_resolves(page):
    with open(page) as f:
        text = re.sub(r"```.*?```", "", f.read(), flags=re.S)
    broken = []
    for target in LINK.findall(text):
        if re.match(r"[a-z]+:", target):  # http(s), mailto: not checked offline
            continue
        path, _, anchor = target.partition("#")
        full = os.path.normpath(os.path.join(os.path.dirname(page), path)) if path else page
        if not os.path.exists(full):
            broken.append(f"{target}: no such file")
        elif anchor and full.endswith(".md") and anchor not in _anchors(full):
            broken.append(f"{target}: no heading with that anchor")
    assert broken == [], f"{os.path.relpath(page, ROOT)}: {broken}"


def _listed_tests(page):
    with open(page) as f:
        return re.findall(r"`(tests/[\w/]+\.py)::(\w+)", f.read())


def test_the_slowest_tests_the_testing_page_lists_exist():
    listed = _listed_tests(os.path.join(ROOT, "docs", "testing.md"))
    assert len(listed) >= 25
    missing = []
    for path, name in listed:
        full = os.path.join(ROOT, path)
        names = set()
        if os.path.exists(full):
            with open(full) as f:
                names = {n.name for n in ast.parse(f.read()).body
                         if isinstance(n, ast.FunctionDef)}
        if name not in names:
            missing.append(f"{path}::{name}")
    assert missing == []


def test_docs_give_the_tier_commands_pytest_ini_defines():
    with open(os.path.join(ROOT, "pytest.ini")) as f:
        ini = f.read()
    assert "--strict-markers" in ini and "slow:" in ini
    for page in (os.path.join(ROOT, "README.md"), os.path.join(ROOT, "docs", "testing.md")):
        with open(page) as f:
            text = f.read()
        assert 'python -m pytest -q -n 2 -m "not slow"' in text, page
    with open(os.path.join(ROOT, ".ci", "run")) as f:
        ci = f.read()
    with open(os.path.join(ROOT, "README.md")) as f:
        readme = f.read()
    command = re.search(r"^python -m pytest.*$", ci, re.M).group(0)
    assert command in readme, "CI runs the README's test command"


def test_the_configuration_reference_is_generated_from_the_schema():
    from tfllm.config.reference import reference
    with open(os.path.join(ROOT, "docs", "configuration.md"), encoding="utf-8") as f:
        stored = f.read()
    assert stored == reference(), ("docs/configuration.md is stale: python -m "
                                   "tfllm.config.reference > docs/configuration.md")


def test_the_site_builds_in_strict_mode(tmp_path):
    # `mkdocs build --strict` in this process (about a second): any warning, such as a link
    # to a page, file or heading that does not exist, or a page that does not build, fails.
    try:
        from mkdocs.commands.build import build
        from mkdocs.config import load_config
        from mkdocs.exceptions import Abort
    except ImportError:
        pytest.skip("mkdocs is not installed: pip install -e '.[docs]' (the test extra has it)")
    import logging

    class Warnings(logging.Handler):
        def __init__(self):
            super().__init__(logging.WARNING)
            self.lines = []

        def emit(self, record):
            self.lines.append(record.getMessage())

    warnings = Warnings()
    logger = logging.getLogger("mkdocs")
    logger.addHandler(warnings)
    try:
        config = load_config(os.path.join(ROOT, "mkdocs.yml"), site_dir=str(tmp_path / "site"))
        assert config.strict, "mkdocs.yml sets strict: true"
        try:
            build(config)
        except Abort:
            pass  # the warnings say why
    finally:
        logger.removeHandler(warnings)
    assert warnings.lines == []
    assert (tmp_path / "site" / "index.html").exists()
    # The notebooks the pages link to are part of the site.
    assert (tmp_path / "site" / "repo" / "notebooks" / "01_quickstart.ipynb").exists()


# ---- every command shown in the README and docs/ is run by a test, or says why not --------
# A command is a line of a ```bash block (or, in a block whose lines start with `$ `, each
# such line), `\` continuations joined and a trailing `# comment` dropped. COMMANDS says who
# runs each one:
#   ("test", "tests/PATH.py::NAME", note): that test runs it. Unless the test is in this
#     file (which takes the command from the page itself), the command's words (the tfllm
#     subcommand, each --flag and each --set key; the launcher's own flags) must appear as
#     strings in the test's module or the tests modules it imports, so that a changed
#     command, or a changed test, shows here. The note says where the test's run differs
#     (a shorter run, a tiny model, a folder made in the test).
#   ("ci", ".ci/run", note): CI runs it; .ci/run must hold the command.
#   ("not run", reason): no test can run it here (a GPU, a download, a real cluster, an
#     install, an interactive program) or it takes longer than the suite allows.
# A new command in the docs fails until it has a row; a row whose command is gone fails too.
NOT_RUN_REASONS = ("needs a GPU", "downloads", "installs packages", "interactive",
                   "takes longer than the suite allows", "shell")

COMMANDS = {
    # README: the two commands
    'python3 -m venv .venv && .venv/bin/pip install -q -e ".[test]" && .venv/bin/tfllm train':
        ("test", "tests/train/test_main_job.py::test_default_run_on_the_embedded_corpus",
         "the main job, 40 of its 1,200 steps, with a private corpus cache; the install is "
         ".ci/run's"),
    ".venv/bin/python -m pytest -q -n 2": ("ci", ".ci/run", "the full suite"),
    # training and data
    "tfllm train --workdir runs/mine --set data.source=text --set 'data.paths=[\"books/*.txt\"]'":
        ("test", "tests/test_docs.py::test_the_text_recipe_trains_and_its_run_exports",
         "text files the test writes, a tiny model, 2 steps"),
    "tfllm train --workdir runs/lm1b --set data.source=tfds --set data.tfds_name=lm1b "
    "--set data.tfds_data_dir=/data/tfds --set data.tfds_split=train "
    "--set data.tfds_eval_split=test --set data.text_key=text":
        ("not run", "downloads",
         "lm1b; tests/data/test_tfds.py reads a TFDS source through tfds.testing.mock_data, "
         "whose generator a run's checkpoint cannot save"),
    "tfllm train --workdir runs/pq --set data.source=hf --set 'data.paths=[\"data/*.parquet\"]'":
        ("test", "tests/cli/test_hf_input.py::"
                 "test_the_hf_recipes_train_from_parquet_and_from_a_saved_folder",
         "a parquet file datasets writes in the test, a tiny model"),
    "tfllm train --workdir runs/saved --set data.source=hf --set data.hf_dataset=./my_set "
    "--set data.hf_split=train --set data.hf_eval_split=test":
        ("test", "tests/cli/test_hf_input.py::"
                 "test_the_hf_recipes_train_from_parquet_and_from_a_saved_folder",
         "a DatasetDict saved in the test, a tiny model"),
    "tfllm train --workdir runs/wiki --set data.source=hf --set data.hf_dataset=user/name "
    "--set data.hf_config=en --set data.hf_streaming=true --set data.text_key=text":
        ("not run", "downloads",
         "a hub dataset; tests/data/test_hf.py streams local files, and an uncached hub "
         "name offline is one line"),
    'tfllm generate --workdir runs/default --prompt "def parse(" --max-new-tokens 64 '
    '--temperature 0.8 --top-k 40 --top-p 0.95 --seed 1':
        ("test", "tests/train/test_outputs.py::test_generate_cli_is_seeded", "a tiny run"),
    "tfllm eval --workdir runs/default":
        ("test", "tests/train/test_outputs.py::test_eval_on_another_mesh_matches_training_eval",
         "a tiny run"),
    "tfllm eval --workdir runs/default --tasks tfllm_tiny_mc,tfllm_tiny_gen":
        ("test", "tests/evals/test_lm_eval.py::test_one_device_scores_as_lm_eval_s_hf_backend",
         "a tiny imported Llama, judged by lm-eval's hf backend on its export"),
    # benchmarks (lm-eval)
    'pip install -e ".[eval]"': ("not run", "installs packages", "CI installs the test extra"),
    "tfllm eval --workdir runs/l1b --tasks tfllm_tiny_mc,tfllm_tiny_gen --num-fewshot 1 "
    "--limit 5":
        ("test", "tests/evals/test_lm_eval.py::test_one_device_scores_as_lm_eval_s_hf_backend",
         "a tiny imported Llama; the three shipped tasks"),
    "tfllm eval --workdir runs/l1b --tasks tfllm_tiny_mc --set mesh.axes=data=2,model=4":
        ("test", "tests/evals/test_lm_eval.py::test_a_mesh_scores_as_lm_eval_s_hf_backend",
         "a tiny imported Llama; the three shipped tasks"),
    "tfllm eval --workdir runs/l1b --include-path my_tasks/ --tasks my_qa":
        ("test", "tests/evals/test_lm_eval.py::test_a_task_of_your_own_on_local_json_files",
         "the task and its JSON lines written by the test"),
    "tfllm export --workdir runs/default --out exported/":
        ("test", "tests/test_docs.py::test_the_text_recipe_trains_and_its_run_exports",
         "the run the text recipe trained"),
    "tfllm train --config configs/tiny.yaml --workdir runs/tiny --set mesh.axes=data=2,fsdp=2,model=2":
        ("test", "tests/cli/test_cli.py::test_train_tiny_on_a_mesh_writes_metrics_and_config",
         "fewer steps"),
    "tfllm train --set model.hiden_dim=64":
        ("test", "tests/test_docs.py::test_the_unknown_key_error_shown_is_what_tfllm_prints", ""),
    # fine-tuning
    "tfllm import --preset llama-3.2-1b --workdir runs/l1b":
        ("test", "tests/pretrained/test_transformers.py::"
                 "test_export_hf_loads_in_transformers_and_writes_the_source_tensors",
         "a tiny folder written by transformers' save_pretrained"),
    "tfllm train --workdir runs/l1b --set data.source=text --set 'data.paths=[\"text/*.py\"]'":
        ("test", "tests/pretrained/test_run.py::"
                 "test_fine_tune_starts_from_the_imported_weights_then_resumes_normally",
         "a tiny preset, text files the test writes"),
    "tfllm export --workdir runs/l1b --format hf --dtype bfloat16 --out exported/l1b-hf":
        ("test", "tests/pretrained/test_transformers.py::test_export_hf_bfloat16_in_shards_with_an_index",
         "a tiny import"),
    "python -c \"import transformers as t; m = t.AutoModelForCausalLM.from_pretrained("
    "'exported/l1b-hf'); tok = t.AutoTokenizer.from_pretrained('exported/l1b-hf'); "
    "print(tok.decode(m.generate(**tok('def parse(', return_tensors='pt'), "
    "max_new_tokens=16)[0]))\"":
        ("test", "tests/pretrained/test_transformers.py::"
                 "test_export_hf_loads_in_transformers_and_writes_the_source_tensors",
         "loads the exported model and tokenizer and compares logits"),
    "vllm serve exported/l1b-hf": ("not run", "needs a GPU"),
    "tfllm import --preset ./Llama-3.2-1B-Instruct --workdir runs/sft "
    "--config configs/recipes/sft-lora.yaml":
        ("test", "tests/cli/test_sft_lora.py::test_the_sft_lora_recipe_trains_adapters_that_peft_serves",
         "a tiny Llama 3 folder written by transformers; the recipe with 6 steps"),
    "tfllm train --workdir runs/sft":
        ("test", "tests/cli/test_sft_lora.py::test_the_sft_lora_recipe_trains_adapters_that_peft_serves",
         ""),
    "tfllm export --workdir runs/sft --format peft --out runs/sft-adapter":
        ("test", "tests/cli/test_sft_lora.py::test_the_sft_lora_recipe_trains_adapters_that_peft_serves",
         "peft loads the adapter onto the transformers base"),
    "tfllm import --preset ./Llama-3.2-1B-Instruct --workdir runs/dpo "
    "--config configs/recipes/dpo-lora.yaml":
        ("test", "tests/cli/test_dpo_lora.py::"
                 "test_the_dpo_lora_recipe_trains_adapters_trl_evaluates_alike",
         "a tiny Llama 3 folder written by transformers; the recipe with 8 steps"),
    "tfllm train --workdir runs/dpo":
        ("test", "tests/cli/test_dpo_lora.py::"
                 "test_the_dpo_lora_recipe_trains_adapters_trl_evaluates_alike", ""),
    "tfllm export --workdir runs/dpo --format peft --out runs/dpo-adapter":
        ("test", "tests/cli/test_dpo_lora.py::"
                 "test_the_dpo_lora_recipe_trains_adapters_trl_evaluates_alike",
         "TRL evaluates the adapter on the held-out pairs"),
    "vllm serve ./Llama-3.2-1B-Instruct --enable-lora --lora-modules sft=runs/sft-adapter":
        ("not run", "needs a GPU"),
    'tfllm generate --workdir runs/sft --chat --prompt "What is the capital of France?"':
        ("test", "tests/cli/test_chat_cli.py::test_sft_on_an_imported_model_then_chat",
         "another prompt"),
    "python -m tfllm.pretrained.demo --out presets/small-llama3":
        ("test", "tests/test_docs.py::test_the_demo_preset_command_prints_what_the_page_shows", ""),
    "tfllm import --preset presets/small-llama3 --workdir runs/ft --set mesh.axes=data=2,model=4":
        ("test", "tests/pretrained/test_run.py::"
                 "test_hugging_face_llama_on_a_mesh_fine_tunes_generates_and_exports",
         "a tiny folder on data=2,model=4"),
    "ls runs/ft": ("not run", "shell"),
    "tfllm train --workdir runs/ft --set data.source=text --set 'data.paths=[\"text/*.py\"]' "
    "--set train.steps=60 --set train.global_batch_size=8 --set optimizer.learning_rate=2e-3":
        ("test", "tests/pretrained/test_run.py::"
                 "test_fine_tune_starts_from_the_imported_weights_then_resumes_normally",
         "fewer steps"),
    "tfllm export --workdir runs/ft --format keras-hub --out exported/ft-keras-hub":
        ("test", "tests/pretrained/test_run.py::"
                 "test_export_keras_hub_loads_in_keras_hub_and_round_trips_bit_exactly", ""),
    "python -c \"import keras_hub; lm = keras_hub.models.CausalLM.from_preset("
    "'exported/ft-keras-hub'); print(type(lm).__name__)\"":
        ("test", "tests/pretrained/test_run.py::"
                 "test_export_keras_hub_loads_in_keras_hub_and_round_trips_bit_exactly",
         "loads the export in keras-hub and compares logits"),
    "tfllm train --config configs/tiny.yaml --workdir runs/sft --set data.source=text "
    "--set data.format=messages --set 'data.paths=[tfllm/data/chat_example.jsonl]' "
    "--set data.chat_template=tfllm/data/templates/chatml.jinja --set train.loss_on=assistant "
    "--set data.tokenizer=byte --set model.vocab_size=257 --set data.sequence_length=256 "
    "--set model.max_sequence_length=256 --set train.global_batch_size=4 --set train.steps=20 "
    "--set data.validation_fraction=0.1 --set train.eval_every=10 --set mesh.axes=data=2":
        ("test", "tests/test_docs.py::test_the_chat_example_command_trains", "2 steps"),
    # clusters
    "launch/multiworker.sh --mode local --num-workers 2 -- tfllm train --config "
    "configs/tiny.yaml --workdir runs/x --set mesh.num_cpu_devices=4":
        ("test", "tests/launch/test_train.py::test_two_workers_match_one_client",
         "the test's own tiny settings, data=2,fsdp=4"),
    # GPUs and planning
    "tfllm doctor --config configs/llama-7b.yaml":
        ("test", "tests/plan/test_fit.py::test_doctor_with_a_config_plans_its_memory",
         "on this host, without a GPU: plans one node of 8 H100s"),
    "tfllm plan --config configs/llama-7b.yaml --set mesh.axes=fsdp=8 "
    "--set precision.policy=bfloat16 --set data.sequence_length=2048 "
    "--set train.global_batch_size=16":
        ("not run", "takes longer than the suite allows"),
    # docs/planning.md's example; its output: benchmarks/results/
    # h100_llama7b_fsdp8_b16_2026-11-30_bf16.txt (576 s on 2 cores)
    "tfllm plan --config configs/llama-7b.yaml --set mesh.axes=fsdp=8 "
    "--set precision.policy=bfloat16 --set data.sequence_length=2048 "
    "--set train.global_batch_size=16 --set train.grad_accum_steps=1 "
    "--set model.remat=none --set model.attention_chunk=0":
        ("not run", "takes longer than the suite allows"),
    "tfllm plan --config configs/gpt2-small.yaml --set precision.policy=fp8 "
    "--set train.global_batch_size=8":
        ("not run", "takes longer than the suite allows"),
    'pip install -e ".[plan]"': ("not run", "installs packages"),
    "tfllm bench --config configs/bench/gpt_5m.yaml --steps 20":
        ("test", "tests/cli/test_cli.py::test_bench_prints_one_json_line", "2 steps"),
    "tfllm layouts --config configs/llama-70b.yaml":
        ("test", "tests/test_docs.py::test_the_llama_70b_layouts_shown_are_what_tfllm_prints", ""),
    # notebooks and tests
    'pip install -e ".[notebooks,plan]"': ("not run", "installs packages"),
    "jupyter lab notebooks/": ("not run", "interactive"),
    "python -m tests.notebooks.execute":
        ("test", "tests/notebooks/test_notebooks.py::test_fresh_execution_matches_the_stored_outputs",
         "executes every notebook and compares, without storing"),
    "python -m tests.notebooks.execute --check --kernels avx512":
        ("not run", "takes longer than the suite allows"),
    'python -m pytest -q -n 2 -m "not slow"':
        ("ci", ".ci/run", "the quick tier of the same suite: -m \"not slow\""),
    "python -m pytest -q -n 2": ("ci", ".ci/run", "the full suite"),
    # the heavy tier (tests/heavy.txt: over an hour on 2 cores) and everything (two hours)
    "python -m pytest -q -n 2 -m heavy": ("not run", "takes longer than the suite allows"),
    "TFLLM_HEAVY=1 python -m pytest -q -n 2": ("not run", "takes longer than the suite allows"),
    # docs/testing.md, "A busy machine": the loaded run a maintainer repeats
    'python3 -c "while True: pass" & python3 -c "while True: pass" &': ("not run", "shell"),
    "python -m pytest -q -n 2 tests/notebooks -k fresh_execution":
        ("test", "tests/notebooks/test_notebooks.py::test_fresh_execution_matches_the_stored_outputs",
         "the notebooks' fresh executions (the full suite runs them)"),
    "kill %1 %2": ("not run", "shell"),
    # experiment trackers (docs/training.md, README)
    'pip install -e ".[trackers]"': ("not run", "installs packages"),
    "tfllm train --workdir runs/x --set tracking.loggers=mlflow,wandb":
        ("test", "tests/train/test_trackers.py::"
                 "test_tfllm_train_with_a_tracker_that_cannot_start_exits_2_before_step_1",
         "a tiny model and a store that cannot be opened; the module's fixture trains and "
         "resumes with both trackers"),
    "mlflow ui --backend-store-uri sqlite:///mlflow.db": ("not run", "interactive"),
}


def _shown_commands(path):
    """The commands shown in one Markdown file, in order."""
    with open(path, encoding="utf-8") as f:
        text = f.read()
    commands = []
    for block in re.finditer(r"^```(\w*)\n(.*?)^```", text, re.S | re.M):
        lines, pending = [], ""
        for line in block.group(2).split("\n"):
            line = f"{pending} {line.strip()}" if pending else line
            if line.endswith("\\"):
                pending = line[:-1].rstrip()
                continue
            lines.append(line)
            pending = ""
        prompted = any(line.startswith("$ ") for line in lines)
        if block.group(1) not in ("bash", "sh", "console") and not prompted:
            continue
        for line in lines:
            if prompted:
                if not line.startswith("$ "):
                    continue  # output
                line = line[2:]
            line = re.sub(r"\s+#(\s.*)?$", "", line).strip()
            if line and not line.startswith("#"):
                commands.append(" ".join(line.split()))
    return commands


def _all_shown():
    return {c: os.path.relpath(page, ROOT) for page in PAGES for c in _shown_commands(page)}


def _shown(prefix):
    """The one command shown in the docs that starts with `prefix`, as argv."""
    found = [c for c in _all_shown() if c.startswith(prefix)]
    assert len(found) == 1, (prefix, found)
    return shlex.split(found[0])


def _words(command):
    """What a test running `command` must spell out: the tfllm subcommand, each --flag and
    each --set key (the launcher's flags and its tfllm command for multiworker.sh)."""
    argv = shlex.split(command.split("&&")[-1])
    program = os.path.basename(argv[0])
    if program == "multiworker.sh":
        cut = argv.index("--")
        return [a for a in argv[1:cut] if a.startswith("--")] + _words(shlex.join(argv[cut + 1:]))
    if program != "tfllm":
        return []
    words = [argv[1]] if len(argv) > 1 and not argv[1].startswith("-") else []
    for i, arg in enumerate(argv):
        if arg.startswith("--"):
            words.append(arg)
            if arg == "--set":
                words.append(argv[i + 1].split("=")[0])
    return words


def _test_sources(path):
    """A test module's text and that of the tests modules it imports."""
    with open(os.path.join(ROOT, path)) as f:
        text = f.read()
    texts = [text]
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("tests"):
            for name in [node.module] + [f"{node.module}.{a.name}" for a in node.names]:
                module = os.path.join(ROOT, *name.split(".")) + ".py"
                if os.path.exists(module):
                    with open(module) as f:
                        texts.append(f.read())
    return "\n".join(texts)


def test_every_command_shown_has_a_row_and_every_row_is_shown():
    shown = _all_shown()
    assert [f"{page}: {c}" for c, page in shown.items() if c not in COMMANDS] == [], \
        "a command shown in the docs has no row in tests/test_docs.py COMMANDS"
    assert [c for c in COMMANDS if c not in shown] == [], "a row's command is shown nowhere"


@pytest.mark.parametrize("command", sorted(COMMANDS), ids=lambda c: c[:60])
def test_each_command_shown_is_run_by_its_test(command):
    kind, where, *note = COMMANDS[command]
    if kind == "not run":
        assert where in NOT_RUN_REASONS
        return
    if kind == "ci":
        with open(os.path.join(ROOT, where)) as f:
            ci = f.read()
        assert command.replace(".venv/bin/", "").split(" -m \"")[0] in ci
        return
    assert kind == "test"
    path, name = where.split("::")
    with open(os.path.join(ROOT, path)) as f:
        tree = ast.parse(f.read())
    assert name in {n.name for n in tree.body if isinstance(n, ast.FunctionDef)}, where
    if path == "tests/test_docs.py":
        return  # those tests take the command from the page itself
    sources = _test_sources(path)
    missing = [w for w in _words(command) if f'"{w}' not in sources and f"'{w}" not in sources]
    assert missing == [], f"{where} does not spell out {missing}"


# ---- the commands this file runs itself, taken from the page that shows them ---------------
def _output_after(prefix):
    """What the docs show a command printing: the lines after it in a block of `$ `
    prompts, else the whole next fenced block."""
    for page in PAGES:
        with open(page, encoding="utf-8") as f:
            blocks = [b.group(1) for b in re.finditer(r"^```\w*\n(.*?)^```", f.read(), re.S | re.M)]
        for i, block in enumerate(blocks):
            lines = block.rstrip("\n").split("\n")
            for j, line in enumerate(lines):
                if line.lstrip("$ ").startswith(prefix):
                    if line.startswith("$ "):
                        rest = lines[j + 1:]
                        return rest[:next((k for k, l in enumerate(rest) if l.startswith("$ ")),
                                          len(rest))]
                    return blocks[i + 1].rstrip("\n").split("\n")
    raise AssertionError(f"no command starting {prefix!r} is shown")


def _run_shown(prefix, tmp_path, monkeypatch, *extra, cwd=ROOT, workdir=None):
    """Runs the command shown in the docs that starts with `prefix` in this process, with
    its --workdir and --out in tmp_path and `extra` appended.

    Args:
      prefix: how the command starts.
      tmp_path: where its outputs go.
      monkeypatch: to run it in `cwd`.
      *extra: arguments appended (settings that make it quick).
      cwd: where it runs: the repository root, where its configs/ are.
      workdir: its --workdir instead, under tmp_path (another command's run).

    Returns:
      The exit code.
    """
    from tfllm.cli.main import main
    argv = _shown(prefix)[1:]
    for i, arg in enumerate(argv[:-1]):
        if arg in ("--workdir", "--out"):
            name = workdir if arg == "--workdir" and workdir else argv[i + 1]
            argv[i + 1] = str(tmp_path / name.strip("/"))
    monkeypatch.chdir(cwd)
    return main(argv + list(extra))


#: a few quick steps, no sample, no compile cache: what a command shown needs to run here
SHORT = ["--set", "train.steps=2", "--set", "train.log_every=1", "--set", "train.eval_every=0",
         "--set", "train.eval_steps=1", "--set", "train.sample_tokens=0",
         "--set", "train.xla_cache=off"]


#: a model small enough to train in seconds, on the byte tokenizer
TINY = ["--set", "data.tokenizer=byte", "--set", "model.vocab_size=257",
        "--set", "model.hidden_dim=32", "--set", "model.num_layers=1",
        "--set", "model.num_query_heads=2", "--set", "model.intermediate_dim=64",
        "--set", "model.max_sequence_length=32", "--set", "data.sequence_length=16",
        "--set", "train.global_batch_size=4", "--set", "mesh.axes=data=2"]


def test_the_unknown_key_error_shown_is_what_tfllm_prints(tmp_path, monkeypatch, capsys):
    assert _run_shown("tfllm train --set model.hiden_dim=64", tmp_path, monkeypatch) == 2
    assert capsys.readouterr().err.strip().splitlines() == _output_after(
        "tfllm train --set model.hiden_dim=64")


def test_the_llama_70b_layouts_shown_are_what_tfllm_prints(tmp_path, monkeypatch, capsys):
    assert _run_shown("tfllm layouts --config configs/llama-70b.yaml", tmp_path, monkeypatch) == 0
    printed = [" ".join(line.split()) for line in capsys.readouterr().out.splitlines()]
    shown = [" ".join(line.split()) for line in _output_after("tfllm layouts --config")]
    assert [line for line in shown if line != "..." and line not in printed] == []


@pytest.mark.slow  # trains through the command line (in this process): ~20 s
def test_the_chat_example_command_trains(tmp_path, monkeypatch, capsys):
    assert _run_shown("tfllm train --config configs/tiny.yaml --workdir runs/sft", tmp_path,
                      monkeypatch, *SHORT) == 0
    assert "step 2/2" in capsys.readouterr().out


@pytest.mark.slow  # trains through the command line (in this process), then exports: ~25 s
def test_the_text_recipe_trains_and_its_run_exports(tmp_path, monkeypatch):
    books = tmp_path / "books"
    books.mkdir()
    for i in range(16):  # the recipe's data.paths, books/*.txt, relative to where it runs
        (books / f"{i}.txt").write_text(f"Chapter {i}. " + "The cat sat on the mat. " * 40)
    assert _run_shown("tfllm train --workdir runs/mine", tmp_path, monkeypatch, *SHORT, *TINY,
                      cwd=tmp_path) == 0
    assert _run_shown("tfllm export --workdir runs/default", tmp_path, monkeypatch,
                      workdir="runs/mine") == 0
    assert (tmp_path / "exported" / "saved_model").is_dir()


def test_the_demo_preset_command_prints_what_the_page_shows(tmp_path, monkeypatch, capsys):
    from tfllm.pretrained import demo
    argv = _shown("python -m tfllm.pretrained.demo")
    assert argv[:3] == ["python", "-m", "tfllm.pretrained.demo"]
    monkeypatch.chdir(tmp_path)  # it writes into presets/ here
    demo.main(argv[3:])
    assert capsys.readouterr().out.strip().splitlines() == _output_after(
        "python -m tfllm.pretrained.demo")


# ---- a figure quoted as measured names what measured it and when ---------------------------
#: a figure: a number with a unit, a decimal, or a before -> after count
FIGURE = re.compile(r"\d[\d,.]*\s?(GiB|MiB|KiB|GB|MB|KB|ms\b|s\b|min\b|minutes|seconds|%|x\b|"
                    r"tokens/s)|\d+\.\d+|\d+ -> \d+")
#: what measured it: a benchmark, a test, or the command that was run
SOURCE = re.compile(r"benchmarks/|tests/|`tfllm |`python |`pytest ")
DATE = re.compile(r"\b20\d\d-\d\d-\d\d\b")


def _paragraphs(page):
    """A page's paragraphs and list items outside code blocks; a table is part of the
    paragraph before it (which usually says what the table measured)."""
    with open(page, encoding="utf-8") as f:
        text = re.sub(r"^```.*?^```", "", f.read(), flags=re.S | re.M)
    units = []
    for chunk in re.split(r"\n\s*\n", text):
        if chunk.startswith("|") and units:
            units[-1] += "\n" + chunk
            continue
        units += re.split(r"\n(?=[-*] )", chunk)
    return units


# docs/configuration.md is left out: it is generated from the schema's help texts.
@pytest.mark.parametrize("page", [p for p in PAGES if not p.endswith("configuration.md")],
                         ids=lambda p: os.path.relpath(p, ROOT))
def test_every_figure_quoted_as_measured_names_its_benchmark_and_date(page):
    unsourced = []
    for paragraph in _paragraphs(page):
        prose = re.sub(r"`[^`]*`", "", paragraph)  # code spans: names and settings, not figures
        if (re.search(r"\bmeasured\b", prose, re.I) and FIGURE.search(prose)
                and not (SOURCE.search(paragraph) and DATE.search(paragraph))):
            unsourced.append(" ".join(paragraph.split())[:160])
    assert unsourced == [], (
        "a paragraph quotes a figure as measured without naming the benchmark, test or "
        "command that measured it and the date (YYYY-MM-DD)")


def test_the_api_page_describes_exactly_the_public_names_with_their_signatures():
    import inspect

    import tfllm
    with open(os.path.join(ROOT, "docs", "api.md")) as f:
        page = f.read()
    described = re.findall(r"^### `tfllm\.(\w+)`$", page, re.M)
    assert sorted(described) == tfllm.__all__, "docs/api.md and tfllm.__all__ differ"
    stale = [f"tfllm.{name}{inspect.signature(getattr(tfllm, name))}" for name in described
             if f"\ntfllm.{name}{inspect.signature(getattr(tfllm, name))}\n" not in page]
    assert stale == [], f"docs/api.md shows other signatures than these: {stale}"


def test_importing_tfllm_loads_no_subpackage():
    # The CLI and the launcher import tfllm without TensorFlow: the public names load on
    # first use (tfllm.__getattr__), so tfllm/__init__.py imports nothing of tfllm.
    with open(os.path.join(ROOT, "tfllm", "__init__.py")) as f:
        tree = ast.parse(f.read())
    imported = {a.name for n in tree.body if isinstance(n, ast.Import) for a in n.names}
    imported |= {n.module for n in tree.body if isinstance(n, ast.ImportFrom)}
    assert imported <= {"importlib", "os"}, imported
