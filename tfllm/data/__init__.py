"""Token sources for training: embedded corpus, text/TFRecord/TFDS pipelines, tokenizers.

Entry points: `load_tokenizer(config, workdir)` then `Batches(config, tokenizer, split,
rows=...)`; `SyntheticTokens` for the synthetic source; `DataError` for bad input.
"""
from tfllm.data.errors import DataError
from tfllm.data.synthetic import SyntheticTokens
