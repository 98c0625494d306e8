"""tfllm: train Keras 3 language models on TensorFlow DTensor meshes with XLA."""

from setuptools import find_packages, setup

setup(
    name="tfllm",
    version="0.1.0",
    description="Train Keras 3 transformer LMs on TensorFlow DTensor meshes with XLA.",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.11",  # keras >= 3.13.2 needs it
    packages=find_packages(include=["tfllm", "tfllm.*"]),
    # The default chat template and the example chat set (data.format=messages).
    package_data={"tfllm.data": ["templates/*.jinja", "chat_example.jsonl"],
                  # the small local lm-eval tasks of `tfllm eval --tasks` and their data
                  "tfllm.evals": ["tasks/*.yaml", "tasks/*.jsonl", "tasks/*.py"]},
    install_requires=[
        "tensorflow>=2.16,<2.22",
        # tfllm.internals fences the private APIs used; these bounds are the versions
        # its table (WRITTEN_FOR) says they were written for.
        # keras >= 3.13.2: the first release past every known deserialization advisory
        # (safe_mode bypasses CVE-2025-1550 < 3.9, CVE-2025-8747/9906 < 3.11,
        # CVE-2025-9905 < 3.11.3, CVE-2026-1462 < 3.12.1 and 3.13.0-3.13.1; file access
        # CVE-2025-12058/12060 < 3.12; HDF5 DoS CVE-2026-0897 < 3.12.1 and 3.13.0). It needs
        # Python >= 3.11. tfllm loads preset tokenizers in safe mode (tfllm.data.tokenizer).
        "keras>=3.13.2,<4",
        "keras-hub>=0.20,<1",
        "safetensors",  # Hugging Face checkpoints (tfllm import)
        "h5py",  # keras-hub preset weights, read block by block
        "tensorflow-datasets",
        "tensorboard",
        "absl-py",
        "pyyaml",
        # Chat templates (data.format=messages), rendered in jinja2's sandbox as transformers
        # does; 3.1.6 is the first release without the known sandbox escapes.
        "jinja2>=3.1.6",
        "numpy",
        "matplotlib",
    ],
    extras_require={
        "and-cuda": ["tensorflow[and-cuda]>=2.16,<2.22"],
        # The notebooks' tests run them through a real Jupyter kernel.
        # transformers (with a CPU build of torch) is the reference of every Hugging Face
        # test: import and `export --format hf` are checked against transformers itself.
        # torch is pinned to the CPU wheel this project's machines carry; elsewhere pip
        # takes it from https://download.pytorch.org/whl/cpu (README, "Tests").
        "test": ["pytest>=7", "pytest-timeout", "pytest-xdist", "nbclient", "nbformat", "ipykernel",
                 "transformers>=5.0,<6", "torch==2.13.0",
                 # the reference of LoRA adapters (tfllm export --format peft / --adapter)
                 "peft>=0.14,<1",
                 # the reference of DPO (tests/train/test_dpo_trl.py): TRL's DPOTrainer
                 # (1.x: loss_type lists with loss_weights, the fused log-prob head)
                 "trl>=1.16,<2",
                 # tests/evals: lm-eval (its Hugging Face backend is the judge of tfllm eval)
                 "lm-eval>=0.4.13,<0.5",
                 # tests/test_docs.py builds the documentation site in strict mode
                 "mkdocs>=1.6,<2",
                 # tests/data/test_hf.py: data.source=hf on sets datasets itself writes
                 "datasets>=4,<6",
                 # tests/train/test_trackers.py: the trackers themselves, offline
                 "mlflow>=3,<4", "wandb>=0.21,<1"],
        # Experiment trackers (tracking.loggers; tested with mlflow 3.17.2, wandb 0.31.0).
        # wandb >= 0.21: wandb.init's reinit="create_new" (no other run of the process ended).
        "trackers": ["mlflow>=3,<4", "wandb>=0.21,<1"],
        # data.source=hf: Hugging Face datasets (parquet, JSON, CSV, arrow, save_to_disk
        # folders, the hub and its cache, streaming); tested with datasets 5.2.0.
        "hf-data": ["datasets>=4,<6"],
        # `tfllm eval --tasks`: the lm-evaluation-harness (tested with lm-eval 0.4.13; its
        # TaskManager.load dict API and TemplateLM hooks as tfllm.evals uses them).
        "eval": ["lm-eval>=0.4.13,<0.5"],
        # The documentation site (mkdocs.yml): `mkdocs serve`, `mkdocs build --strict`.
        # 1.6: the first with anchor validation and docs-relative absolute links.
        "docs": ["mkdocs>=1.6,<2"],
        # Opening the notebooks (`jupyter lab notebooks/`); 03 and 06 also need `plan`.
        "notebooks": ["jupyterlab", "ipykernel"],
        # `tfllm plan`: jaxlib's compile-only CUDA client (no NVIDIA wheels, no driver).
        # Pinned: tfllm.plan.gpu_compile uses jax internals checked for this release.
        "plan": ["jax==0.10.2", "jaxlib==0.10.2", "jax-cuda12-plugin==0.10.2",
                 "jax-cuda12-pjrt==0.10.2"],
    },
    entry_points={"console_scripts": ["tfllm=tfllm.cli.main:command"]},
)
