"""Direct preference optimization: the loss of one micro-batch of preference pairs.

TRL's DPOTrainer is the reference (tests/train/test_dpo_trl.py holds tfllm to it): a
sequence's log-probability is the sum of its completion tokens' log-probabilities (the
targets the loss mask marks, `tfllm.data.preference`); with chosen y_w and rejected y_l
of prompt x,

    delta = (log pi(y_w|x) - log pi_ref(y_w|x)) - (log pi(y_l|x) - log pi_ref(y_l|x))

and, per pair (`dpo.loss`; the micro-batch's loss is the mean over its pairs):
    sigmoid: -(1 - e) log sigmoid(beta delta) - e log sigmoid(-beta delta)  (e:
             dpo.label_smoothing; 0 is DPO, e > 0 conservative DPO)
    hinge:   max(0, 1 - beta delta)                                         (SLiC)
    ipo:     (delta' - 1 / (2 beta))^2, delta' with each log-ratio divided by its
             completion's token count                                      (IPO, as TRL)
plus dpo.rpo_alpha times the chosen completions' mean token NLL (RPO). ORPO
(dpo.loss=orpo, reference-free, as TRL's ORPOTrainer): with each completion's MEAN
token log-probability l and log-odds l - log(1 - exp(l)),
    orpo:    NLL(chosen) - beta log sigmoid(log-odds(y_w) - log-odds(y_l))
where NLL(chosen) is the mean over every token of the chosen sequences, prompt
included (TRL's), and beta is ORPO's lambda; its rewards are beta l and logps/ the mean
token log-probabilities, as TRL logs them. No reference pass is run.

Chosen and rejected run through ONE forward pass: a micro-batch's rows 2p and 2p + 1
are pair p's two sequences, concatenated along the batch, so the rows split over the
mesh's batch axis keep each pair (and its reference terms) on one device. The
reference pi_ref is, with LoRA, the same weights with the adapters off (`adapters_off`:
no second copy of the model); in full fine-tuning a frozen copy of the initial weights
laid out by the same rules (`reference`: no optimizer state, no gradients). Either way
one more forward pass of the same rows, which the step runs outside its gradient tape
(`reference_logps`), so nothing of it is kept for the backward pass. With
dpo.precompute_reference that pass runs once over the data before training
(`tfllm.train.reference`), and each micro-batch carries its rows' stored values as a
fourth part: no reference forward pass in the step, and no frozen copy.

A mixture of experts adds model.router_aux_loss_coef times the load-balancing loss of
the policy pass (and model.router_z_loss_coef times its z-loss), as TRL's DPOTrainer
and ORPOTrainer add `router_aux_loss_coef * outputs.aux_loss` when the model config has
`output_router_logits`: one forward pass over chosen and rejected rows together, padding
not counted (TRL passes the attention mask), the reference pass adding nothing (TRL
drops output_router_logits from it). The router metrics (moe_aux_loss, ...) join the
step's as in SFT.

Metrics carry TRL's names: rewards/chosen, rewards/rejected (beta times the
log-ratios), rewards/accuracies (chosen reward > rejected), rewards/margins,
logps/chosen, logps/rejected (policy log-probabilities), each a mean over pairs.
"""

from __future__ import annotations

from typing import Dict, Tuple

import numpy as np
import tensorflow as tf

from tfllm.models.common.adapters import adapters_off
from tfllm.models.common.moe import collecting_router_stats
from tfllm.models.common.noise import noise_seed
from tfllm.models.loss import token_nll

#: the metrics a DPO step reports, TRL's names
METRICS = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins",
           "logps/chosen", "logps/rejected")


def reference_summary(model, reference, loss: str = "sigmoid", stored=None) -> str:
    """The line a DPO run prints: which reference, and what it costs.

    Args:
      model: the policy; reference: the frozen copy (full fine-tuning), or None.
      loss: dpo.loss.
      stored: the precomputed reference (`tfllm.train.reference.StoredReference`), or None.
    """
    if loss == "orpo":
        return "tfllm: ORPO: no reference model (no second forward pass)"
    if stored is not None:
        return "tfllm: DPO reference: " + stored.summary()
    if reference is None:
        return ("tfllm: DPO reference: the model with its LoRA adapters off (no copy; one "
                "more forward pass per micro-batch, outside the gradient tape)")
    count = sum(int(np.prod(v.shape)) for v in reference.variables)
    size = sum(int(np.prod(v.shape)) * np.dtype(v.dtype).itemsize
               for v in reference.variables)
    return (f"tfllm: DPO reference: a frozen copy of the first weights ({count:,} weights, "
            f"{size / 2 ** 30:.3g} GiB in all, sharded as the model's; no optimizer state "
            "or gradient; saved with each checkpoint; one more forward pass per "
            "micro-batch)")


def pairs_of(per_row):
    """(chosen, rejected), each (P,), of a per-row vector (2P,) whose rows 2p, 2p + 1 are
    pair p's."""
    pairs = tf.reshape(per_row, [-1, 2])  # (P, 2)
    return pairs[:, 0], pairs[:, 1]


def row_sums(logits, targets, trained):
    """(summed log-probability (N,), summed NLL (N,)) of each row's trained targets.

    Args:
      logits: (N, T, V) float32; targets: (N, T) ids; trained: (N, T) float32 0/1.
    """
    nll = token_nll(logits, targets) * trained  # (N, T)
    summed = tf.reduce_sum(nll, axis=1)  # (N,)
    return -summed, summed


def real_pairs(micro):
    """(P,) float32: 1 for a pair, 0 for padding (a validation stream past its end has
    rows with no completion token)."""
    chosen_tokens, _ = pairs_of(tf.reduce_sum(tf.cast(micro[2], tf.float32), axis=1))
    return tf.cast(chosen_tokens > 0, tf.float32)


def _mean(values, weights):
    """The mean of `values` (P,) over the pairs `weights` marks (all of them in training)."""
    return tf.reduce_sum(values * weights) / tf.maximum(tf.reduce_sum(weights), 1.0)


def _pair_metrics(chosen_reward, rejected_reward, chosen_logps, rejected_logps, real):
    """TRL's rewards/* and logps/* metrics of (P,) per-pair values, over the real pairs."""
    return {
        "rewards/chosen": _mean(chosen_reward, real),
        "rewards/rejected": _mean(rejected_reward, real),
        "rewards/accuracies": _mean(tf.cast(chosen_reward > rejected_reward, tf.float32),
                                    real),
        "rewards/margins": _mean(chosen_reward - rejected_reward, real),
        "logps/chosen": _mean(tf.stop_gradient(chosen_logps), real),
        "logps/rejected": _mean(tf.stop_gradient(rejected_logps), real),
    }


def log1mexp(x):
    """log(1 - exp(x)) for x < 0, stable at both ends (Maechler's switch at -log 2, as
    TRL's). Each branch sees only inputs it is finite for, so the gradient of the branch
    not taken is never 0 * inf = NaN (a mean log-probability of exactly 0 would be)."""
    near = x > -0.6931471805599453
    x = tf.minimum(x, -1e-7)  # a probability of 1 has infinite odds: kept just below
    near_x, far_x = tf.where(near, x, -1.0), tf.where(near, -1.0, x)
    return tf.where(near, tf.math.log(-tf.math.expm1(near_x)),
                    tf.math.log1p(-tf.exp(far_x)))


def pair_losses(chosen_logratio, rejected_logratio, chosen_tokens, rejected_tokens, dpo):
    """The loss of each pair (P,) by dpo.loss, from the policy-minus-reference
    log-ratios (P,) and the completions' token counts (P,) float32 (IPO's normalization).
    """
    beta = dpo.beta
    delta = chosen_logratio - rejected_logratio  # (P,)
    if dpo.loss == "sigmoid":
        e = dpo.label_smoothing
        return (-(1.0 - e) * tf.math.log_sigmoid(beta * delta)
                - e * tf.math.log_sigmoid(-beta * delta))
    if dpo.loss == "hinge":
        return tf.nn.relu(1.0 - beta * delta)
    if dpo.loss == "ipo":
        normalized = (chosen_logratio / tf.maximum(chosen_tokens, 1.0)
                      - rejected_logratio / tf.maximum(rejected_tokens, 1.0))
        return tf.square(normalized - 1.0 / (2.0 * beta))
    raise ValueError(f"dpo.loss={dpo.loss!r}: use sigmoid, hinge or ipo.")


class DpoLoss:
    """The DPO loss and metrics of a micro-batch of pairs, beside the SFT loss of
    `tfllm.train.step.TrainStep`.

    Args:
      dpo: the config's `DpoConfig` (loss, beta, label_smoothing, rpo_alpha,
        precompute_reference).
      reference: the frozen reference model (full fine-tuning), or None: the policy with
        its LoRA adapters off (or, with dpo.precompute_reference, the values each
        micro-batch carries).
    """

    def __init__(self, dpo, reference=None):
        self.dpo, self.reference = dpo, reference
        #: the reference log-probs come with the micro-batches (dpo.precompute_reference)
        self.stored = bool(getattr(dpo, "precompute_reference", False))

    def reference_logps(self, model, micro, forward):
        """(2P,) the reference's summed completion log-probabilities of each row, without
        gradients: the stored ones the micro-batch carries (dpo.precompute_reference),
        else computed (`live_reference_logps`)."""
        if self.dpo.loss == "orpo":
            return None  # reference-free
        if self.stored:
            if len(micro) < 4:  # never the live model in their place: it is no reference
                raise ValueError("dpo.precompute_reference=true, but this micro-batch "
                                 "carries no stored reference log-probabilities; run the "
                                 "reference pass first (tfllm.train.reference).")
            return tf.stop_gradient(tf.cast(micro[3], tf.float32))
        return self.live_reference_logps(model, micro, forward)

    def live_reference_logps(self, model, micro, forward):
        """(2P,) the reference's summed completion log-probabilities of each row, computed
        without gradients: the policy `model` with adapters off (with no adapters: the
        model itself, as the precomputing pass uses it), or the frozen copy."""
        trained = tf.cast(micro[2][:, 1:], tf.float32)  # (2P, T)
        if self.reference is not None:
            logits, targets, _ = forward(self.reference, micro)
        else:
            with adapters_off():  # the same weights, adapters off, no dropout
                logits, targets, _ = forward(model, micro)
        return tf.stop_gradient(row_sums(logits, targets, trained)[0])

    def __call__(self, model, micro, forward, seed=None,
                 reference_logps=None) -> Tuple[tf.Tensor, Dict]:
        """(loss, metrics) of one micro-batch.

        Args:
          model: the CausalLM (with LoRA adapters: the reference switches them off).
          micro: (tokens, segment_ids, loss_mask), each (2P, T+1): pair p in rows 2p
            (chosen) and 2p + 1 (rejected), the loss mask on their completions.
          forward: forward(model, micro) -> (logits (2P, T, V), targets (2P, T), _)
            (`tfllm.train.step.lm_forward` with the run's packing setting).
          seed: the step's noise seed (LoRA dropout of the policy pass), or None.
          reference_logps: `reference_logps` of this micro-batch, computed by the caller
            outside its gradient tape; None: computed here.
        """
        trained = tf.cast(micro[2][:, 1:], tf.float32)  # (2P, T): completion targets
        # the policy: adapters on, dropout in training; a mixture of experts' statistics
        with noise_seed(seed), collecting_router_stats() as router_stats:
            logits, targets, _ = forward(model, micro)
        loss, metrics = self._pair_loss(model, micro, forward, logits, targets, trained,
                                        reference_logps)
        if router_stats:
            router_loss, router_metrics = model.router_losses(router_stats)
            loss, metrics = loss + router_loss, {**metrics, **router_metrics}
        return loss, metrics

    def _pair_loss(self, model, micro, forward, logits, targets, trained, reference_logps):
        """(loss, metrics) of the pairs from the policy's logits (no router terms)."""
        logps, nll = row_sums(logits, targets, trained)  # (2P,) each
        if self.dpo.loss == "orpo":
            return self._orpo(micro, logits, targets, trained, logps)
        ref_logps = (self.reference_logps(model, micro, forward)
                     if reference_logps is None else reference_logps)  # (2P,)
        chosen, rejected = pairs_of(logps)
        ref_chosen, ref_rejected = pairs_of(ref_logps)
        # Completion tokens of each sequence, counted over the whole row as TRL's IPO
        # counts its completion_mask.
        chosen_tokens, rejected_tokens = pairs_of(
            tf.reduce_sum(tf.cast(micro[2], tf.float32), axis=1))
        chosen_ratio, rejected_ratio = chosen - ref_chosen, rejected - ref_rejected
        real = real_pairs(micro)  # (P,): every pair but padding (validation's end)
        loss = _mean(pair_losses(chosen_ratio, rejected_ratio, chosen_tokens,
                                 rejected_tokens, self.dpo), real)
        if self.dpo.rpo_alpha:
            chosen_nll, _ = pairs_of(nll)
            chosen_targets, _ = pairs_of(tf.reduce_sum(trained, axis=1))
            loss = loss + self.dpo.rpo_alpha * (tf.reduce_sum(chosen_nll)
                                                / tf.maximum(tf.reduce_sum(chosen_targets), 1.0))
        return loss, _pair_metrics(self.dpo.beta * tf.stop_gradient(chosen_ratio),
                                   self.dpo.beta * tf.stop_gradient(rejected_ratio),
                                   chosen, rejected, real)

    def _orpo(self, micro, logits, targets, trained, logps):
        """ORPO's (loss, metrics): the chosen NLL over all its tokens minus beta times the
        mean log sigmoid of the log odds ratio of mean token log-probabilities."""
        real = real_pairs(micro)  # (P,)
        counts = tf.maximum(tf.reduce_sum(trained, axis=1), 1.0)  # (2P,) completion targets
        chosen, rejected = pairs_of(logps / counts)  # (P,) mean token log-probs
        log_odds = (chosen - rejected) - (log1mexp(chosen) - log1mexp(rejected))  # (P,)
        # every target inside a sequence (prompt included), as TRL's ORPO NLL
        whole = tf.cast(micro[1][:, 1:] > 0, tf.float32)  # (2P, T)
        _, whole_nll = row_sums(logits, targets, whole)
        chosen_nll, _ = pairs_of(whole_nll)
        chosen_targets, _ = pairs_of(tf.reduce_sum(whole, axis=1))
        nll = tf.reduce_sum(chosen_nll) / tf.maximum(tf.reduce_sum(chosen_targets), 1.0)
        loss = nll - self.dpo.beta * _mean(tf.math.log_sigmoid(log_odds), real)
        metrics = {
            **_pair_metrics(self.dpo.beta * tf.stop_gradient(chosen),
                            self.dpo.beta * tf.stop_gradient(rejected), chosen, rejected,
                            real),
            "nll_loss": tf.stop_gradient(nll),
            "log_odds_ratio": _mean(tf.stop_gradient(tf.math.log_sigmoid(log_odds)), real),
            "log_odds_chosen": _mean(tf.stop_gradient(log_odds), real),
        }
        return loss, metrics
