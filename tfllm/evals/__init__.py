"""Benchmarks through the lm-evaluation-harness (`tfllm eval --tasks`).

`TfllmLM` (lm.py) is a restored run as lm-eval's model "tfllm"; `Scorer` (scorer.py) the
compiled log-probabilities it scores with, on the run's mesh; `evaluate_tasks`
(benchmark.py) runs lm-eval's tasks on it and writes the results into the run; tasks/
holds small local tasks. lm-eval is an optional dependency (pip install 'tfllm[eval]'):
nothing here is imported unless a command asks for tasks.
"""
