"""Token sources for training."""
from tfllm.data.synthetic import SyntheticTokens
