"""tfllm: train Keras 3 language models on TensorFlow DTensor meshes with XLA.

The names a notebook or a script needs are here (docs/api.md describes each):

    import tfllm
    tfllm.start_notebook()                       # first cell: 8 logical CPU devices
    config = tfllm.load_config("configs/tiny.yaml", ["train.steps=20"])
    tfllm.run_training(config, "runs/tiny")     # what `tfllm train` does
    plan = tfllm.make_plan(config)               # what `tfllm plan` does

They load on first use: `import tfllm` itself imports no TensorFlow (the CLI and the
launcher rely on that), and `tfllm.<subpackage>` stays the package of that name.
"""

import importlib
import os

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
#: TF_CPP_MIN_LOG_LEVEL as the user set it (None: not set; see tfllm.quiet)
USER_TF_LOG_LEVEL = os.environ.get("TF_CPP_MIN_LOG_LEVEL")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

__version__ = "0.1.0"

#: public name -> "module:attribute" it is loaded from on first use
_PUBLIC = {
    # configure, build, lay out
    "load_config": "tfllm.config:load_config",
    "build_model": "tfllm.models:build_model",
    "make_parallel": "tfllm.parallel:make_parallel",
    "layout_rows": "tfllm.parallel.layouts:layout_rows",
    "format_table": "tfllm.parallel.layouts:format_table",
    "to_numpy": "tfllm.parallel.placement:to_numpy",
    # train, and what a run leaves
    "run_training": "tfllm.train.loop:train",
    "Run": "tfllm.train.run:Run",
    "saved_config": "tfllm.train.saved_run:saved_config",
    "restored_run": "tfllm.train.saved_run:restored_run",
    # generate and score
    "Generator": "tfllm.generate:Generator",
    "evaluate_tasks": "tfllm.evals.benchmark:evaluate_tasks",
    # Hugging Face and keras-hub, in and out
    "from_preset": "tfllm.pretrained:from_preset",
    "import_preset": "tfllm.pretrained:import_preset",
    "export_preset": "tfllm.pretrained.exporter:export_preset",
    "export_hf": "tfllm.pretrained.hf_export:export_hf",
    "export_peft": "tfllm.pretrained.hf_export:export_peft",
    # plan a GPU run without a GPU
    "make_plan": "tfllm.plan.planner:plan",
    "format_plan": "tfllm.plan.planner:format_plan",
    # notebooks
    "start_notebook": "tfllm.notebook:start",
}

__all__ = sorted(_PUBLIC)


def __getattr__(name):
    if name not in _PUBLIC:
        raise AttributeError(f"module 'tfllm' has no attribute {name!r}")
    module, attribute = _PUBLIC[name].split(":")
    value = getattr(importlib.import_module(module), attribute)
    globals()[name] = value  # once loaded, a plain attribute
    return value


def __dir__():
    return sorted(set(globals()) | set(_PUBLIC))
