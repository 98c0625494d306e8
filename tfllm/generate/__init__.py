"""Text generation: a KV-cached, XLA-compiled decode loop with greedy and sampled decoding."""

from tfllm.generate.generator import Generator, batch_multiple
from tfllm.generate.sampling import filter_logits, next_token
