"""DPO judged by TRL: token ids, loss, rewards and log-probabilities against DPOTrainer.

A tiny random Llama written by transformers (`tests.pretrained.transformers_reference`)
gets a random peft LoRA adapter; TRL's DPOTrainer takes the PeftModel (its reference is
the same model with the adapter disabled, as tfllm's) and `tfllm import --adapter`
takes the same folders. The same JSONL pairs go to both: TRL tokenizes them with its own
preprocessing (`DPOTrainer.train_dataset`) and evaluates one batch of all of them
(`DPOTrainer.evaluate`), tfllm reads them through data.format=preference and computes
the DPO loss of one micro-batch. Everything is float32 on CPU.
"""

import json
import math
import os
import shutil

import numpy as np
import pytest

from tests.pretrained import transformers_reference as ref
from tfllm.cli.main import main

# Each test builds TRL's trainer and a tfllm model (~4 s; the module's fixture ~15 s).
pytestmark = pytest.mark.slow

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXAMPLE = os.path.join(ROOT, "tfllm", "data", "preference_example.jsonl")
CHATML = os.path.join(ROOT, "tfllm", "data", "templates", "chatml.jinja")
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
#: rows of data.sequence_length + 1 = 90 tokens, TRL's max_length: of the first eight
#: example pairs (prompts of 58 to 115 tokens here) two are dropped (prompt >= 90) and
#: two sequences cut, so both length rules are compared with TRL's
SEQUENCE_LENGTH = 89
BETA = 0.3

# Tolerance: float32 on both sides. A sequence's log-probability sums ~30 token
# log-probs of magnitude ~5-10, each a log-softmax over 288 logits computed in a
# different order (torch vs TensorFlow, eager attention vs tfllm's): relative error
# ~1e-6 per token, so ~1e-5 absolute on a sum of ~150. Rewards are beta (0.3) times
# differences of such sums; the losses are smooth functions of them with slopes <= 1
# (sigmoid, hinge) or divided by the completion length (IPO).
LOGP_ATOL, LOGP_RTOL = 1e-4, 1e-5
LOSS_ATOL = 1e-5


def _records(layout):
    """Eight pairs of the example set in `layout`: conversations with their explicit
    prompt, whole conversations (implicit prompt), or strings."""
    records = [json.loads(line) for line in open(EXAMPLE)][:8]
    if layout == "implicit":
        return [{"chosen": r["prompt"] + r["chosen"], "rejected": r["prompt"] + r["rejected"]}
                for r in records]
    if layout == "strings":
        return [{"prompt": f"Question: {r['prompt'][-1]['content']}\nAnswer:",
                 "chosen": " " + r["chosen"][0]["content"],
                 "rejected": " " + r["rejected"][0]["content"]} for r in records]
    return records


def _gemma_tokenizer(folder):
    """Replaces the tiny Gemma 3's tokenizer files in `folder` by a SentencePiece model
    made as Gemma's own is: the identity normalizer (no NFKC, no dummy prefix, spaces
    kept), "\n" and the turn markers as pieces, every character of the example pairs
    covered (Gemma's byte fallback leaves no <unk> either).

    The shared tiny proto (`ref.sentencepiece_proto("gemma")`) keeps SentencePiece's
    default nmt_nfkc normalizer, which maps "\n" to a space, and has no byte fallback:
    SentencePiece itself (the `sentencepiece` package, and keras-hub through it, which
    tfllm loads) encodes "capital\nof" as 'l', '▁', 'o' (ids 178, 164, 172), while
    transformers' GemmaConverter ignores the proto's normalizer (it hard-codes Gemma's:
    spaces to "▁" only) and fuses unknown characters, so its ids were 178, 3 ('<unk>'),
    172, and "user\nWhat" 171, 3 against 171, 164, 3: the "▁" kept apart. With Gemma's
    own settings both give the same ids for every pair here, as plain text, through
    ChatML and through Gemma's <start_of_turn> template (measured: the 64 sequences of
    the example pairs, each in the three forms, 192 of 192)."""
    import io

    import keras_hub
    import sentencepiece as spm
    from keras_hub.src.utils.transformers.export.hf_exporter import export_tokenizer
    texts = [m["content"] for line in open(EXAMPLE) for key, messages in
             json.loads(line).items() if key in ("prompt", "chosen", "rejected")
             for m in messages]
    out = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(texts), model_writer=out, vocab_size=288, model_type="bpe",
        num_threads=1, minloglevel=2, pad_id=0, eos_id=1, bos_id=2, unk_id=3,
        pad_piece="<pad>", eos_piece="<eos>", bos_piece="<bos>", unk_piece="<unk>",
        normalization_rule_name="identity", add_dummy_prefix=False,
        remove_extra_whitespaces=False, split_digits=True, allow_whitespace_only_pieces=True,
        character_coverage=1.0, user_defined_symbols=["<start_of_turn>", "<end_of_turn>",
                                                      "\n"])
    export_tokenizer(keras_hub.models.Gemma3Tokenizer(proto=out.getvalue(),
                                                      has_vision_tokens=False), str(folder))


def _family(folder, name):
    """(folder, tokenizer, PeftModel) of transformers' tiny `name` with a random adapter,
    imported into folder/run (as `setup`, for another family)."""
    import peft
    from transformers import AutoTokenizer
    torch, _ = ref.load_torch_transformers()
    ref.save(name, folder / "hf")
    if name == "gemma3":
        _gemma_tokenizer(folder / "hf")
    tokenizer = AutoTokenizer.from_pretrained(str(folder / "hf"))
    tokenizer.chat_template = open(CHATML).read()
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS,
                             init_lora_weights=False, task_type="CAUSAL_LM")
    torch.manual_seed(5)
    model = peft.get_peft_model(ref.load(folder / "hf"), config)
    with torch.no_grad():
        for key, p in model.named_parameters():
            if "lora_" in key:
                p.copy_(torch.randn(p.shape) * 0.1)
    model.save_pretrained(str(folder / "adapter"))
    extra = []
    if name == "qwen3":  # keras-hub reads Qwen's tokenizer only with Qwen's specials
        ref.keras_hub_tokenizer(ref.MODELS[name][2]).save_to_preset(str(folder / "tok"))
        extra = ["--tokenizer", str(folder / "tok")]
    assert main(["import", "--preset", str(folder / "hf"), "--workdir", str(folder / "run"),
                 "--adapter", str(folder / "adapter"), *extra]) == 0
    return folder, tokenizer, model.eval()


# Gemma 3 with a tokenizer made as Gemma's (`_gemma_tokenizer`, which says why the
# shared tiny one cannot be compared with transformers')
@pytest.mark.parametrize("name", ["qwen3", "gemma3"])
def test_other_families_tokenize_and_score_as_trl(name, tmp_path):
    """Qwen3 (query/key norms, its own head_dim, a GPT-2 style BPE) and Gemma 3 (local and
    global layers, a SentencePiece BPE): TRL's token ids and its sigmoid DPO loss,
    rewards and log-probs."""
    family = _family(tmp_path, name)
    records = _records("conversations")
    trainer = _trl(family, records, ["sigmoid"])
    loss, metrics, pairs = _tfllm(family, records, tmp_path)
    assert [p.chosen.tolist() for p in pairs] == [
        (t["prompt_ids"] + t["chosen_ids"])[:SEQUENCE_LENGTH + 1]
        for t in trainer.train_dataset]
    theirs = trainer.evaluate()
    for key in ("logps/chosen", "logps/rejected", "rewards/margins"):
        np.testing.assert_allclose(metrics[key], theirs[f"eval_{key}"], rtol=LOGP_RTOL,
                                   atol=LOGP_ATOL, err_msg=key)
    assert metrics["rewards/accuracies"] == theirs["eval_rewards/accuracies"]
    np.testing.assert_allclose(loss, theirs["eval_loss"], rtol=1e-5, atol=LOSS_ATOL)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """(folder, the transformers tokenizer, the PeftModel): a tiny Llama with a random
    adapter (A and B random: the policy is not the reference), imported into a tfllm
    run at folder/run."""
    import peft
    from transformers import AutoTokenizer
    torch, _ = ref.load_torch_transformers()
    folder = tmp_path_factory.mktemp("dpo")
    ref.save("llama3", folder / "hf")
    tokenizer = AutoTokenizer.from_pretrained(str(folder / "hf"))
    tokenizer.chat_template = open(CHATML).read()
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS,
                             init_lora_weights=False, task_type="CAUSAL_LM")
    torch.manual_seed(5)
    model = peft.get_peft_model(ref.load(folder / "hf"), config)
    with torch.no_grad():  # small random A and B: the policy differs from the base
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape) * 0.1)
    model.save_pretrained(str(folder / "adapter"))
    assert main(["import", "--preset", str(folder / "hf"), "--workdir", str(folder / "run"),
                 "--adapter", str(folder / "adapter")]) == 0
    # Full fine-tuning: the adapted weights merged into a plain folder (the policy) and
    # the base (the reference), each imported without adapters.
    merged = peft.PeftModel.from_pretrained(ref.load(folder / "hf"), str(folder / "adapter"))
    merged.merge_and_unload().save_pretrained(str(folder / "merged"))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(folder / "hf" / name, folder / "merged" / name)
    for preset, run in (("merged", "policy_run"), ("hf", "base_run")):
        assert main(["import", "--preset", str(folder / preset), "--workdir",
                     str(folder / run)]) == 0
    return folder, tokenizer, model.eval()


def _trl(setup, records, loss_type, **kwargs):
    """TRL's DPOTrainer over `records` (train and eval datasets): the base model with a new
    adapter (peft_config), whose reference is the adapter disabled, then given the random
    adapter's values."""
    import datasets
    import peft
    import trl
    torch, _ = ref.load_torch_transformers()
    folder, tokenizer, adapted = setup
    dataset = datasets.Dataset.from_list(records)
    # bf16=False: DPOConfig turns bf16 autocast on by default, which moves these
    # log-probs by ~1e-2; the comparison is float32 against float32.
    args = trl.DPOConfig(output_dir=str(folder / "trl"), report_to=[], use_cpu=True,
                         bf16=False, max_length=SEQUENCE_LENGTH + 1, beta=BETA, loss_type=loss_type,
                         per_device_eval_batch_size=len(records), **kwargs)
    trainer = trl.DPOTrainer(model=ref.load(folder / "hf"), args=args, train_dataset=dataset,
                             eval_dataset=dataset, processing_class=tokenizer,
                             peft_config=adapted.peft_config["default"])
    values = dict(adapted.named_parameters())
    with torch.no_grad():
        for name, p in trainer.model.named_parameters():
            if "lora_" in name:
                p.copy_(values[name])
    assert isinstance(trainer.model, peft.PeftModel)
    assert "ref" not in trainer.model.peft_config  # the reference: adapters disabled
    return trainer


def _tfllm(setup, records, tmp_path, full=False, **dpo):
    """tfllm's (loss, metrics, pair samples) of `records` as one micro-batch; `full`:
    the merged policy against a frozen copy of the base (lora.rank=0)."""
    from tfllm.checkpoint.workdir import Workdir
    from tfllm.config import load_config
    from tfllm.data import feed
    from tfllm.data.pipeline import Batches
    from tfllm.data.samples import prepare_samples
    from tfllm.data.tokenizer import load_tokenizer
    from tfllm.models import build_model
    from tfllm.train.dpo import DpoLoss
    from tfllm.train.state import build_train_state
    from tfllm.train.step import lm_forward
    folder = setup[0]
    path = tmp_path / "pairs.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    overrides = ["data.format=preference", "train.objective=dpo", "data.source=text",
                 f"data.paths=[{path}]", f"data.eval_paths=[{path}]",
                 f"data.chat_template={CHATML}",
                 f"data.sequence_length={SEQUENCE_LENGTH}", "data.validation_fraction=0",
                 f"dpo.beta={BETA}", "model.max_sequence_length=96"]
    overrides += [f"dpo.{k}={v}" for k, v in dpo.items()]
    run = folder / ("policy_run" if full else "run")
    config = load_config(str(run / "config.yaml"), overrides)
    model = build_model(config.model, config.precision, config.lora, seed=config.train.seed)
    Workdir(str(run)).restore_weights(model)
    reference = None
    if full:  # the reference copy a full fine-tuning run builds, with the base's weights
        reference = build_train_state(config, None, False, optimizer=False).reference
        if reference is not None:  # none for ORPO
            Workdir(str(folder / "base_run")).restore_weights(reference, fp8_state=False)
    tokenizer = load_tokenizer(config.data, config.model.vocab_size, str(folder / "run"))
    # The validation split (data.eval_paths) reads the pairs in file order: pair p is
    # rows 2p (chosen) and 2p + 1 (rejected) of the one micro-batch.
    pairs = prepare_samples(config.data, tokenizer, "validation", config.train.loss_on)
    batch = next(Batches(config.data, tokenizer, "validation", micro_batches=1,
                         micro_batch_rows=2 * len(pairs), max_batches=1))
    micro = feed.to_device(None, batch["tokens"], batch["segment_ids"],
                           batch["loss_mask"])[0]
    loss, metrics = DpoLoss(config.dpo, reference)(model, micro,
                                                   lambda m, x: lm_forward(m, x, False))
    return float(loss), {k: float(v) for k, v in metrics.items()}, pairs


@pytest.mark.parametrize("layout", ["conversations", "implicit", "strings"])
def test_pairs_tokenize_to_trls_ids(setup, layout, tmp_path):
    """prompt / chosen / rejected ids equal TRL's preprocessing (its train_dataset) for
    every layout; the rows cut at max_length as TRL's collator cuts them."""
    records = _records(layout)
    trainer = _trl(setup, records, ["sigmoid"])
    _, _, pairs = _tfllm(setup, records, tmp_path)
    assert len(pairs) == len(trainer.train_dataset)
    dropped = len(records) - len(pairs)
    cut = 0
    for pair, theirs in zip(pairs, trainer.train_dataset):
        for name, tokens, mask in (("chosen", pair.chosen, pair.chosen_mask),
                                   ("rejected", pair.rejected, pair.rejected_mask)):
            whole = theirs["prompt_ids"] + theirs[f"{name}_ids"]
            want = whole[:SEQUENCE_LENGTH + 1]
            cut += len(whole) > len(want)
            assert tokens.tolist() == want, (pair.where, name)
            assert mask.tolist() == ([0] * len(theirs["prompt_ids"])
                                     + [1] * len(theirs[f"{name}_ids"]))[:len(want)]
    if layout != "strings":  # both length rules are exercised
        assert dropped == 2 and cut >= 2, (dropped, cut)


LOSSES = {  # name: (TRL's loss_type and loss_weights, tfllm's dpo settings)
    "sigmoid": (dict(loss_type=["sigmoid"]), {}),
    "hinge": (dict(loss_type=["hinge"]), {"loss": "hinge"}),
    "ipo": (dict(loss_type=["ipo"]), {"loss": "ipo"}),
    # RPO: TRL adds its "sft" loss (chosen tokens' mean NLL) with weight rpo_alpha
    "rpo": (dict(loss_type=["sigmoid", "sft"], loss_weights=[1.0, 0.5]), {"rpo_alpha": 0.5}),
    # Conservative DPO, -(1-e) log s(b d) - e log s(-b d): TRL 1.x has no such loss type,
    # but its robust loss, (-(1-e) log s(b d) + e log s(-b d)) / (1 - 2e), gives it as
    # 2(1-e) sigmoid - (1-2e) robust (the log s(b d) terms add to -(1-e), the log
    # s(-b d) terms to -e).
    "conservative": (dict(loss_type=["sigmoid", "robust"], loss_weights=[1.8, -0.8],
                          label_smoothing=0.1), {"label_smoothing": 0.1}),
}


@pytest.mark.parametrize("name", sorted(LOSSES))
def test_loss_rewards_and_logps_equal_trls(setup, name, tmp_path):
    """One batch of eight pairs: tfllm's loss and TRL-named metrics are DPOTrainer's
    (evaluate on the same weights and records; the reference is the adapter disabled)."""
    trl_args, dpo = LOSSES[name]
    records = _records("conversations")
    theirs = _trl(setup, records, **trl_args).evaluate()
    loss, metrics, _ = _tfllm(setup, records, tmp_path, **dpo)
    for key in ("logps/chosen", "logps/rejected"):
        np.testing.assert_allclose(metrics[key], theirs[f"eval_{key}"], rtol=LOGP_RTOL,
                                   atol=LOGP_ATOL, err_msg=key)
    for key in ("rewards/chosen", "rewards/rejected", "rewards/margins"):
        np.testing.assert_allclose(metrics[key], theirs[f"eval_{key}"], rtol=LOGP_RTOL,
                                   atol=BETA * LOGP_ATOL, err_msg=key)
    assert metrics["rewards/accuracies"] == theirs["eval_rewards/accuracies"]
    assert 0 < metrics["rewards/accuracies"] < 1  # the pairs' rewards differ both ways
    assert math.isfinite(loss) and loss > 0
    np.testing.assert_allclose(loss, theirs["eval_loss"], rtol=1e-5, atol=LOSS_ATOL)


def test_full_fine_tuning_s_frozen_reference_equals_trls_ref_model(setup, tmp_path):
    """lora.rank=0: tfllm's frozen reference copy against TRL's ref_model (a frozen
    model): the merged policy and the base, the same loss and metrics."""
    import datasets
    import trl
    folder, tokenizer, _ = setup
    records = _records("conversations")
    dataset = datasets.Dataset.from_list(records)
    args = trl.DPOConfig(output_dir=str(folder / "trl"), report_to=[], use_cpu=True,
                         bf16=False, max_length=SEQUENCE_LENGTH + 1, beta=BETA,
                         per_device_eval_batch_size=len(records))
    theirs = trl.DPOTrainer(model=ref.load(folder / "merged"), ref_model=ref.load(
        folder / "hf"), args=args, train_dataset=dataset, eval_dataset=dataset,
        processing_class=tokenizer).evaluate()
    loss, metrics, _ = _tfllm(setup, records, tmp_path, full=True)  # lora.rank=0
    for key in ("logps/chosen", "logps/rejected"):
        np.testing.assert_allclose(metrics[key], theirs[f"eval_{key}"], rtol=LOGP_RTOL,
                                   atol=LOGP_ATOL, err_msg=key)
    for key in ("rewards/chosen", "rewards/rejected", "rewards/margins"):
        np.testing.assert_allclose(metrics[key], theirs[f"eval_{key}"], rtol=LOGP_RTOL,
                                   atol=BETA * LOGP_ATOL, err_msg=key)
    assert metrics["rewards/accuracies"] == theirs["eval_rewards/accuracies"]
    assert abs(metrics["rewards/margins"]) > 1e-3  # the policy is not the reference
    np.testing.assert_allclose(loss, theirs["eval_loss"], rtol=1e-5, atol=LOSS_ATOL)


def test_orpo_equals_trls_orpo_trainer_on_the_same_tokens(setup, tmp_path):
    """dpo.loss=orpo (reference-free) against TRL's ORPOTrainer.get_batch_loss_metrics on
    the token rows tfllm built (TRL's ORPO still tokenizes with its older rules, adding
    BOS and EOS around the chat template's text, so the batch is given to it): loss,
    rewards, log-probs, NLL and log odds."""
    import datasets
    from trl.experimental.orpo import ORPOConfig, ORPOTrainer
    torch, _ = ref.load_torch_transformers()
    folder, tokenizer, _ = setup
    records = _records("conversations")
    loss, metrics, pairs = _tfllm(setup, records, tmp_path, full=True, loss="orpo")
    args = ORPOConfig(output_dir=str(folder / "orpo"), report_to=[], use_cpu=True,
                      bf16=False, beta=BETA, padding_value=0, max_length=SEQUENCE_LENGTH + 1)
    trainer = ORPOTrainer(model=ref.load(folder / "merged"), args=args,
                          train_dataset=datasets.Dataset.from_list(records),
                          processing_class=tokenizer)
    batch = {}
    width = max(max(len(p.chosen), len(p.rejected)) for p in pairs)
    for name in ("chosen", "rejected"):
        ids = np.zeros((len(pairs), width), np.int64)
        attention = np.zeros_like(ids)
        labels = np.full_like(ids, -100)
        for i, p in enumerate(pairs):
            tokens, mask = getattr(p, name), getattr(p, f"{name}_mask")
            ids[i, :len(tokens)], attention[i, :len(tokens)] = tokens, 1
            labels[i, :len(tokens)] = np.where(mask == 1, tokens, -100)
        batch.update({f"{name}_input_ids": torch.tensor(ids),
                      f"{name}_attention_mask": torch.tensor(attention),
                      f"{name}_labels": torch.tensor(labels)})
    with torch.no_grad():
        theirs_loss, theirs = trainer.get_batch_loss_metrics(trainer.model.eval(), batch,
                                                             "train")
    theirs = {k: float(v) for k, v in theirs.items()}
    # per-token means (~5) and NLLs of float32 sums: rounding ~1e-6 (see the top)
    for key in ("rewards/chosen", "rewards/rejected", "rewards/margins", "logps/chosen",
                "logps/rejected", "nll_loss", "log_odds_ratio", "log_odds_chosen"):
        np.testing.assert_allclose(metrics[key], theirs[key], rtol=1e-5, atol=1e-5,
                                   err_msg=key)
    assert metrics["rewards/accuracies"] == theirs["rewards/accuracies"]
    np.testing.assert_allclose(loss, float(theirs_loss), rtol=1e-5, atol=LOSS_ATOL)


def test_precomputed_references_equal_trls_precompute_ref_log_probs(setup, tmp_path):
    """dpo.precompute_reference against TRL's precompute_ref_log_probs=True in full
    fine-tuning (no ref_model): both score every pair with the weights they start from
    (the base) before training, then the policy (the merged weights) is evaluated
    against those stored values: the same loss and metrics."""
    import datasets
    import trl
    from tfllm.checkpoint.workdir import Workdir
    from tfllm.config import load_config
    from tfllm.train import reference
    from tfllm.train.run import Run
    torch, _ = ref.load_torch_transformers()
    folder, tokenizer, _ = setup
    records = _records("conversations")
    dataset = datasets.Dataset.from_list(records)
    args = trl.DPOConfig(output_dir=str(folder / "trl-pre"), report_to=[], use_cpu=True,
                         bf16=False, max_length=SEQUENCE_LENGTH + 1, beta=BETA,
                         per_device_eval_batch_size=len(records),
                         precompute_ref_log_probs=True)
    trainer = trl.DPOTrainer(model=ref.load(folder / "hf"), args=args,
                             train_dataset=dataset, eval_dataset=dataset,
                             processing_class=tokenizer)
    assert trainer.ref_model is None  # scored at __init__, then the policy's weights
    trainer.model.load_state_dict(ref.load(folder / "merged").state_dict())
    theirs = trainer.evaluate()
    path = tmp_path / "pairs.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    config = load_config(str(folder / "base_run" / "config.yaml"), [
        "data.format=preference", "train.objective=dpo", "data.source=text",
        f"data.paths=[{path}]", f"data.eval_paths=[{path}]", f"data.chat_template={CHATML}",
        f"data.sequence_length={SEQUENCE_LENGTH}", "model.max_sequence_length=96",
        f"dpo.beta={BETA}", "dpo.precompute_reference=true", "lora.rank=0",
        "train.global_batch_size=2", "train.eval_steps=3", "mesh.axes=data=1"])
    run = Run(config, workdir=str(folder / "base_run"))
    Workdir(str(folder / "base_run")).restore_weights(run.model, run.parallel)
    run.feed.references = reference.compute(run, str(tmp_path)).tables
    Workdir(str(folder / "policy_run")).restore_weights(run.model, run.parallel)
    ours = run.evaluate()
    assert ours["eval_pairs"] == len(trainer.eval_dataset) == 6  # two prompts too long
    for key in ("logps/chosen", "logps/rejected"):
        np.testing.assert_allclose(ours[f"eval_{key}"], theirs[f"eval_{key}"],
                                   rtol=LOGP_RTOL, atol=LOGP_ATOL, err_msg=key)
    for key in ("rewards/chosen", "rewards/rejected", "rewards/margins"):
        np.testing.assert_allclose(ours[f"eval_{key}"], theirs[f"eval_{key}"],
                                   rtol=LOGP_RTOL, atol=BETA * LOGP_ATOL, err_msg=key)
    assert ours["eval_rewards/accuracies"] == theirs["eval_rewards/accuracies"]
    assert abs(ours["eval_rewards/margins"]) > 1e-3  # the policy is not the reference
    np.testing.assert_allclose(ours["eval_loss"], theirs["eval_loss"], rtol=1e-5,
                               atol=LOSS_ATOL)
