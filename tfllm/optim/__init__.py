"""tfllm's optimizer (AdamW on DTensor variables) and learning-rate schedules (floor 5)."""
from tfllm.optim.adamw import AdamW, global_norm
from tfllm.optim.schedules import warmup_cosine
