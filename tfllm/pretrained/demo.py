"""A small keras-hub preset with random weights, for trying `tfllm import` offline.

    python -m tfllm.pretrained.demo --out presets/small-llama3 [--family llama3|gpt2]

Writes a Llama 3.1-style (llama3 RoPE scaling, grouped-query attention) or GPT-2
CausalLM preset with a byte-level BPE tokenizer that covers every byte, exactly as
`save_to_preset` writes downloaded ones; `tfllm import`, the README and the notebooks
use it where nothing can be downloaded. Its weights are random: it generates noise until
fine-tuned.
"""

from __future__ import annotations

import argparse
import json

import tfllm  # noqa: F401  (sets KERAS_BACKEND)

SPECIAL_TOKENS = {
    "gpt2": ["<|endoftext|>"],
    "llama3": ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>",
               "<|end_header_id|>", "<|eot_id|>"],
}
_MERGES = ("Ġ t", "h e", "Ġt he", "Ġ c", "a t", "Ġc at", "Ġ s", "Ġs at", "Ġ o", "o n",
           "Ġo n", "Ġ a", "Ġ m", "Ġm at", "Ġ d", "o g", "Ġd og", "a n", "Ġa n", "Ġan d",
           "i n", "e r", "r e", "Ġ w", "o r", "e n", "Ġ f", "Ġ i", "Ġ b", "Ġ p")


def byte_alphabet():
    """The 256 printable stand-ins that byte-level BPE uses for the bytes (GPT-2's map)."""
    printable = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
                 + list(range(ord("®"), ord("ÿ") + 1)))
    extra = [b for b in range(256) if b not in printable]
    return [chr(b) for b in printable] + [chr(256 + i) for i in range(len(extra))]


def bpe_vocabulary(specials, size: int):
    """(vocabulary, merges) of at most `size` ids: specials, every byte, then merges."""
    vocab = {token: i for i, token in enumerate(specials)}
    for c in byte_alphabet():
        vocab[c] = len(vocab)
    merges = []
    for pair in _MERGES:
        merged = pair.replace(" ", "")
        if merged not in vocab and len(vocab) < size:
            vocab[merged] = len(vocab)
            merges.append(pair)
    if len(vocab) > size:
        raise ValueError(f"a byte-level vocabulary needs at least {len(vocab)} ids.")
    return vocab, merges


def small_causal_lm(family: str = "llama3", vocab_size: int = 288, hidden_dim: int = 64,
                    num_layers: int = 2, seed: int = 0):
    """A keras-hub CausalLM (random weights, BPE tokenizer) of the given family."""
    import keras
    import keras_hub
    keras.utils.set_random_seed(seed)
    if family == "llama3":
        backbone = keras_hub.models.Llama3Backbone(
            vocabulary_size=vocab_size, num_layers=num_layers, num_query_heads=8,
            num_key_value_heads=4, hidden_dim=hidden_dim, intermediate_dim=2 * hidden_dim,
            rope_max_wavelength=500000, rope_frequency_adjustment_factor=8.0,
            rope_low_freq_factor=1.0, rope_high_freq_factor=4.0,
            rope_pretraining_sequence_length=64, dtype="float32")
        base = "Llama3"
    elif family == "gpt2":
        backbone = keras_hub.models.GPT2Backbone(
            vocabulary_size=vocab_size, num_layers=num_layers, num_heads=8,
            hidden_dim=hidden_dim, intermediate_dim=4 * hidden_dim, max_sequence_length=256,
            dtype="float32")
        base = "GPT2"
    else:
        raise ValueError(f"--family {family!r}: use llama3 or gpt2.")
    vocab, merges = bpe_vocabulary(SPECIAL_TOKENS[family], vocab_size)
    tokenizer = getattr(keras_hub.models, base + "Tokenizer")(vocabulary=vocab, merges=merges)
    preprocessor = getattr(keras_hub.models, base + "CausalLMPreprocessor")(tokenizer=tokenizer)
    return getattr(keras_hub.models, base + "CausalLM")(backbone=backbone,
                                                        preprocessor=preprocessor)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="The preset directory to write.")
    parser.add_argument("--family", default="llama3", choices=("llama3", "gpt2"))
    parser.add_argument("--hidden-dim", type=int, default=64)
    parser.add_argument("--num-layers", type=int, default=2)
    args = parser.parse_args(argv)
    lm = small_causal_lm(args.family, hidden_dim=args.hidden_dim, num_layers=args.num_layers)
    lm.save_to_preset(args.out)
    print(json.dumps({"out": args.out, "backbone": type(lm.backbone).__name__,
                      "params": int(lm.backbone.count_params())}))


if __name__ == "__main__":
    main()
