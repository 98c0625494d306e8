"""Text generation: a KV-cached, XLA-compiled decode loop with greedy and sampled decoding.

Floor 9: computes on models; its inputs come from `tfllm.data.feed`, its compiled
functions from `tfllm.compiler.jit`.
"""

from tfllm.generate.generator import Generator
from tfllm.generate.sampling import filter_logits, next_token
