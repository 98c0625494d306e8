"""Token sources and the device feed (floor 5: imports parallel and the floors below).

Owns the data: embedded corpus, text/TFRecord/TFDS/Hugging Face pipelines, tokenizers,
synthetic tokens; and, in `feed`, everything about how token rows reach the devices
(which rows a client reads, sharded device batches for training, evaluation and
generation, the first-batch peek, the iterator's position as bytes).

Entry points take the config's sections, not the whole config:
`feed.DeviceFeed(config.data, config.train, vocab_size, parallel, tokenizer)` for a run's
batches; `load_tokenizer(config.data, vocab_size, workdir)`; `Batches(config.data,
tokenizer, split, rows=..., micro_batches=A, micro_batch_rows=M)` for host arrays;
`SyntheticTokens` for the synthetic source; `DataError` for bad input.
"""
from tfllm.data.errors import DataError
from tfllm.data.synthetic import SyntheticTokens
