"""The data of tfllm's shipped tasks: JSON-lines files beside this module, read by the
`datasets` json builder (what `dataset_path: json` with `data_files` reads). A task YAML
names its loader with `custom_dataset: !function local.NAME` so that the files are found
wherever tfllm is installed; a task of your own can name its files directly (README of
this folder).
"""

import os

HERE = os.path.dirname(os.path.abspath(__file__))


def _json(name: str):
    import datasets  # lm-eval's own dependency; imported when a task is loaded
    return datasets.load_dataset("json", data_files={
        "train": os.path.join(HERE, f"{name}_fewshot.jsonl"),
        "test": os.path.join(HERE, f"{name}.jsonl")})


def multiple_choice(**_):
    """tfllm_tiny_mc: questions with four choices."""
    return _json("tfllm_tiny_mc")


def generation(**_):
    """tfllm_tiny_gen: short questions with one-word answers."""
    return _json("tfllm_tiny_gen")


def perplexity(**_):
    """tfllm_tiny_ppl: short paragraphs."""
    return _json("tfllm_tiny_ppl")
