"""Launching and supervising multi-client jobs: `tfllm launch` / `launch/multiworker.sh`.

`topology` plans who runs where (pure functions), `supervisor` runs and watches the
workers, `main` parses the options. Nothing here imports TensorFlow.
"""
