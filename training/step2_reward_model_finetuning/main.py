#!/usr/bin/env python
"""Step 2: reward-model training on preference pairs (prompt, chosen, rejected).

    python training/step2_reward_model_finetuning/main.py --model_name_or_path output/step1 --output_dir output/step2
    deepspeed --num_gpus 2 training/step2_reward_model_finetuning/main.py --zero_stage 3 ...

or ``python train.py --step 2``. The model is a transformer body with a scalar head
(``AutoModelForSequenceClassification``, one label) scored at the last real token of
``prompt + response``; the loss is ``-log sigmoid(r_chosen - r_rejected - margin)`` with chosen and
rejected batched together. ``--length_expert`` debiases it against answer length: a length-only
expert fitted on the training pairs first is added to the score difference (product of experts), so the
model learns what length does not explain. The output directory loads with
``AutoModelForSequenceClassification.from_pretrained`` and gives the same scores.
"""

from __future__ import annotations

import logging
import sys
import time
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # runnable as a plain script


from dschat import config as C
from dschat import step_setup as S
from dschat import trainer as T
from dschat.data.collate import PairCollator, response_lengths
from dschat.data.packing import pair_token_counts
from dschat.data.pipeline import prepare_pair_data
from dschat.inputs import check_inputs
from dschat.lm import eval_batches
from dschat.losses import (
    divergence_pairwise_loss,
    fit_length_expert,
    gather_last,
    length_expert_logits,
    length_log_ratio,
    pairwise_loss,
)
from dschat.models.reward import (
    ScalarHeadModel,
    ScoreNormalization,
    load_reward_model,
    pair_values,
    settle_share_prompt,
)
from dschat.models.trunk import EvalMemo
from dschat.policy_pairs import PolicySamples, evaluate_selection, mine_step_pairs
from dschat.ranking import evaluate_ranking
from dschat.utils.errors import UserError, run_cli
from dschat.utils.run import (
    Stopwatch,
    write_summary,
)

GROUPS = (
    C.ModelArgs,
    C.DataArgs,
    C.LoraArgs,
    C.OptimArgs,
    C.DeepSpeedArgs,
    C.RunArgs,
    C.RewardArgs,
    C.PolicyPairsArgs,
)
LOG = logging.getLogger("dschat")
STEP_DEFAULTS = {
    C.RunArgs: {"output_dir": "output/step2", "eval_interval": 50},
    C.OptimArgs: {"learning_rate": 5e-4, "weight_decay": 0.1, "num_train_epochs": 1},
}


def main(argv: list[str] | None = None) -> int:
    args = C.parse_groups("step2_reward_model_finetuning", __doc__.split("\n\n")[0], GROUPS, argv, STEP_DEFAULTS)  # fmt: skip
    model_args, data_args, lora_args, optim, ds_args, run, reward, pairs_args = args
    data_args.refuse_step1_only("step 2")
    if pairs_args.policy_negatives_reward_model:  # before any slow work
        raise UserError("--policy_negatives_reward_model is for DPO (--algorithm dpo): a reward model trained "
                        "on another reward model's labels would only copy it")  # fmt: skip
    check_inputs(GROUPS, args)  # models and data named, before any slow start-up

    # ---------------------------------------------------------------- 1. setup
    C.check_resume(GROUPS, args, run.output_dir, run.resume)  # the interrupted run's options
    setup = S.setup_step(model_args, run, data_args)
    log, dtype, world, model_path, tokenizer = setup.log, setup.dtype, setup.world, setup.model_path, setup.tokenizer  # fmt: skip

    # ---------------------------------------------------------------- 2. data: this step's share of the pairs
    data = prepare_pair_data(data_args, tokenizer, phase=2)
    collate = PairCollator(tokenizer.pad_token_id, share_prompt=reward.share_prompt)
    # 2b. on-policy pairs (--policy_negatives_from): the policy's own wrong answers to this step's built-in
    # prompts join the training pairs; those to held-out prompts are a second evaluation set, the one
    # that says whether PPO's actor will be able to fool this reward model.
    mined = mine_step_pairs(pairs_args, data_args=data_args, phase=2, tokenizer=tokenizer, fmt=setup.fmt,
                            seed=run.seed, dtype=dtype, trust_remote_code=model_args.trust_remote_code)  # fmt: skip
    policy_evals: list = []
    # the held-out prompts' sampled answers: can the reward model pick the right one?
    policy_samples: PolicySamples | None = None
    if mined:
        data.train = mined.training_set(data.train, pairs_args.policy_negatives_only)
        policy_evals = eval_batches(mined.eval, batch_size=optim.per_device_eval_batch_size, collate=collate)
        policy_samples = mined.eval_samples
    # 2c. the length-only expert (--length_expert), fitted on all training pairs (the same on every rank)
    length_w, length_w_accuracy = length_expert(data.train) if reward.length_expert else (None, None)
    batches = S.make_batches(data, optim, collate, run.seed, data_args.group_by_length)
    loader, evals, total_steps, global_batch = batches

    # ---------------------------------------------------------------- 3. model (body + scalar head) and engine
    def load(dropout: float | None):  # the body with its score head, as a transformers model
        return load_reward_model(model_path, tokenizer=tokenizer, dropout=dropout,
                                 trust_remote_code=model_args.trust_remote_code).model  # fmt: skip

    engine, n_params = T.build_step_engine(load, model_args=model_args, lora=lora_args, optim=optim, ds=ds_args,
                                           dtype=dtype, total_steps=total_steps, keep_trainable=("score.",),
                                           wrap=ScalarHeadModel)  # fmt: skip
    # the outputs begin once the model has taken every flag checked against it (see step 1)
    resolved = S.begin_step(2, args, run, setup, batches, data, mined)
    log.info(S.describe_pairs(data, total_steps))
    if length_w is not None:
        log.info("length expert: P(chosen wins) = sigmoid(%.3f * log(len_chosen / len_rejected)); alone it ranks %.3f "
                 "of the training pairs right; the reward model learns the rest", length_w, length_w_accuracy)  # fmt: skip
    log.info("reward model: %s, %.2fM parameters, dtype %s, ZeRO-%d, %d rank(s)", model_path, n_params / 1e6, dtype,
             ds_args.zero_stage, world)  # fmt: skip
    if collate.share_prompt:
        settle_share_prompt(engine.module, collate, data.train, [evals, policy_evals], engine.device)

    # ---------------------------------------------------------------- 4. resume or start; first evaluation
    state, start_step, metrics = T.open_run(engine, run, global_batch, resolved, loader)
    sw = Stopwatch()

    # every evaluation scores the same batches: their frozen bottom is computed once (trunk.EvalMemo)
    memo = EvalMemo(engine, "step 2's evaluation")
    evaluate = RankingEval(memo, tokenizer, setup.fmt, evals, policy_evals, policy_samples, optim, data_args,
                           pairs_args, metrics, sw)  # fmt: skip
    eval_start = T.start_of_run(state, "eval", lambda: evaluate(state.step))

    # ---------------------------------------------------------------- 5. training loop
    shown = (("loss", "loss", ".4f"), ("accuracy", "accuracy", ".3f"), ("lr", "lr", ".2e"),
             ("samples/s", "samples_per_sec", ".1f"))  # fmt: skip
    spec = T.LoopSpec("step 2 (reward)", partial(ranking_micro_step, engine, reward, length_w), pair_columns, shown)  # fmt: skip
    skipped = T.train_loop(engine, loader, state, spec, optim=optim, run=run, total_steps=total_steps, metrics=metrics,
                 timer=sw, evaluate=evaluate)  # fmt: skip

    # ---------------------------------------------------------------- 6. final evaluation and save
    eval_end = evaluate(state.step)
    norm = save_score_normalization(engine.module.hf_model.config, eval_end)
    T.export_model(engine.module.model, tokenizer, run.output_dir, sw)
    run_info = T.run_summary(state, sw, parameters=n_params, dtype=dtype, zero_stage=ds_args.zero_stage,
                             lora_dim=lora_args.lora_dim, run=run, start_step=start_step,
                             skipped_steps=skipped)  # fmt: skip
    train_pairs = state.step * global_batch  # the whole run's, as state.train_seconds (kept by a resume)
    summary = summarize(
        eval_start, eval_end, state, mined, length_w, length_w_accuracy, train_pairs, run_info
    )
    summary["share_prompt"] = collate.share_prompt  # what ran: off where the start-up check fell back
    summary["score_normalization"] = asdict(norm) if norm else None
    metrics.close()
    write_summary(run.output_dir, summary)
    log.info("done: eval accuracy %.4f -> %.4f, reward model saved to %s", eval_start["accuracy"], eval_end["accuracy"],
             run.output_dir)  # fmt: skip
    return 0


def save_score_normalization(config, ev: dict[str, float]) -> ScoreNormalization | None:
    """Record the scores' mean and std on the model's config (saved in config.json), where step 3's
    ``--normalize_reward`` reads them: the step-1 policy's sampled answers where step 2 scored some
    (``--policy_negatives_from``), else both answers of the evaluation pairs."""
    norm = ScoreNormalization.from_eval(ev)
    ScoreNormalization.clear(config)  # a step-2 output as the starting model carries its own
    if norm is None:
        LOG.warning("no score spread measured (no evaluation pairs or policy samples): the reward model is saved "
                    "without a score normalisation, and step 3's --normalize_reward will refuse it")  # fmt: skip
        return None
    norm.to_config(config)
    LOG.info("scores on %s: mean %.3f, std %.3f over %d answers (saved for --normalize_reward)", norm.source,
             norm.mean, norm.std, norm.n)  # fmt: skip
    return norm


def length_expert(train: list) -> tuple[float, float]:
    """The length-only expert (``--length_expert``) fitted on all training pairs (the same on every
    rank): its coefficient w in ``sigmoid(w * log(len_chosen / len_rejected))`` and its own accuracy."""
    x = length_log_ratio(response_lengths(train))  # (N,)
    w = fit_length_expert(x)
    return w, float(((w * x) > 0).float().mean())


@dataclass
class RankingEval:
    """``evaluate(step)``: accuracy, scores and margin on the held-out pairs (by chosen longer/shorter);
    with ``--policy_negatives_from`` also on pairs whose rejected answer the policy wrote, and the
    reward model's pick among the policy's K answers to held-out prompts. Logged to the eval split."""

    engine: Any
    tokenizer: Any
    fmt: Any
    evals: list
    policy_evals: list
    policy_samples: PolicySamples | None
    optim: C.OptimArgs
    data_args: C.DataArgs
    pairs_args: C.PolicyPairsArgs
    metrics: Any
    timer: Any

    def __call__(self, step: int) -> dict[str, float]:
        t = time.perf_counter()
        with self.timer("eval"), self.engine.evaluation():
            ev = evaluate_ranking(self.engine, self.evals)
            ev["scoring_samples_per_sec"] = 2 * ev["pairs"] / max(time.perf_counter() - t, 1e-9)
            if self.policy_evals:  # held-out pairs whose rejected answer the policy itself wrote
                ev["policy_negatives_accuracy"] = evaluate_ranking(self.engine, self.policy_evals)["accuracy"]
            if (
                self.policy_samples is not None
            ):  # the reward model picks one of the policy's K answers per prompt
                sel = evaluate_selection(
                    self.engine, self.tokenizer, self.policy_samples, batch_size=self.optim.per_device_eval_batch_size,
                    max_len=self.data_args.max_seq_len, fmt=self.fmt)  # fmt: skip
                ev["policy_best_of_k_accuracy"] = sel["best_of_k_accuracy"]
                # the step-1 policy's score distribution: what step 3's --normalize_reward standardises with
                ev.update({f"policy_{k}": sel[k] for k in ("score_mean", "score_std", "answers")})
                if "advantage_correlation" in sel:
                    ev["policy_advantage_correlation"] = sel["advantage_correlation"]
        self.metrics.log(ev, step=step, split="eval")
        LOG.info("eval at step %d: accuracy %.4f, chosen %.3f, rejected %.3f, margin %.3f%s%s%s", step, ev["accuracy"],
                 ev["chosen_mean"], ev["rejected_mean"], ev["margin"],
                 f", on the policy's own mistakes {ev['policy_negatives_accuracy']:.4f}" if self.policy_evals else "",
                 f", its pick of the policy's {self.pairs_args.policy_negatives_per_prompt} answers right "
                 f"{ev['policy_best_of_k_accuracy']:.4f}" if self.policy_samples is not None else "",
                 f", its advantages' correlation with the verifier's {ev['policy_advantage_correlation']:.3f}"
                 if "policy_advantage_correlation" in ev else "")  # fmt: skip
        return ev


def summarize(eval_start: dict, eval_end: dict, state: T.TrainState, mined, length_w: float | None,
              length_w_accuracy: float | None, train_pairs: int, run_info: dict) -> dict:  # fmt: skip
    """summary.json of the reward model: accuracy at start and end and where it comes from."""
    return {
        "step": 2,
        "steps": state.step,
        "eval_accuracy_start": eval_start["accuracy"],
        "eval_accuracy_end": eval_end["accuracy"],
        "eval_chosen_mean": eval_end["chosen_mean"],
        "eval_rejected_mean": eval_end["rejected_mean"],
        "eval_margin": eval_end["margin"],
        "eval_accuracy_chosen_longer": eval_end.get("accuracy_chosen_longer"),
        "eval_accuracy_chosen_shorter": eval_end.get("accuracy_chosen_shorter"),
        "eval_longer_response_baseline": eval_end["longer_response_baseline"],
        "eval_policy_negatives_accuracy_start": eval_start.get("policy_negatives_accuracy"),
        "eval_policy_negatives_accuracy_end": eval_end.get("policy_negatives_accuracy"),
        # Picking the best of the policy's K answers to held-out prompts: if the reward model's pick is no
        # more often right than a random one (policy_negatives.eval.sampled_accuracy), PPO against it can
        # raise its score but not the truth.
        "eval_policy_best_of_k_accuracy_start": eval_start.get("policy_best_of_k_accuracy"),
        "eval_policy_best_of_k_accuracy_end": eval_end.get("policy_best_of_k_accuracy"),
        # How well the reward model's RLOO advantages among those K answers follow the verifier's: what
        # group-baseline RL against it will follow (policy_pairs.advantage_correlation).
        "eval_policy_advantage_correlation_start": eval_start.get("policy_advantage_correlation"),
        "eval_policy_advantage_correlation_end": eval_end.get("policy_advantage_correlation"),
        "policy_negatives": mined.stats if mined else None,
        # --length_expert: the length-only expert's coefficient and its own training-pair accuracy (the
        # evaluation above scores the reward model alone, as PPO uses it)
        "length_expert_coef": length_w,
        "length_expert_train_accuracy": length_w_accuracy,
        "train_samples_per_sec": 2 * train_pairs / max(state.train_seconds, 1e-9) if train_pairs else None,
        # the first evaluation's: a later one reuses the frozen bottom layers' states it cached (3.4x faster
        # on the main job), which new answers (step 3, rw_eval.py) never get
        "scoring_samples_per_sec": eval_start.get(
            "scoring_samples_per_sec", eval_end["scoring_samples_per_sec"]
        ),
        **run_info,
    }


def ranking_micro_step(engine, reward: C.RewardArgs, length_w: float | None, batch: dict) -> dict:
    """Forward, ranking loss, backward and step on one micro-batch of pairs: input_ids and
    attention_mask (2B, T), the B chosen sequences first. Chosen and rejected are scored in one forward
    (the value at each sequence's last real token); ``length_w`` adds the length expert's log-odds."""
    ids, mask = batch["input_ids"].to(engine.device), batch["attention_mask"].to(engine.device)
    b = ids.shape[0] // 2
    values = pair_values(engine, batch, engine.device)  # (2B, T)
    scores = gather_last(values, mask)  # (2B,)
    chosen, rejected = scores[:b], scores[b:]
    if reward.ranking_loss == "divergence":
        loss = divergence_pairwise_loss(values, ids, mask, reward.margin)
    else:
        offset = (
            None
            if length_w is None
            else length_expert_logits(length_w, batch["response_len"]).to(engine.device)
        )
        loss = pairwise_loss(chosen, rejected, reward.margin, offset)
    engine.backward(loss)
    engine.step()
    tokens, computed, positions = pair_token_counts(batch)  # packed or not, the pairs' tokens count
    return {"loss": loss, "pairs": b, "right": (chosen > rejected).sum(), "margin": (chosen - rejected).sum(),
            "tokens": tokens, "positions": positions, "computed": computed}  # fmt: skip


def pair_columns(w: dict[str, float], seconds: float) -> dict[str, float]:
    """Training accuracy and mean margin over the window's pairs; scored sequences per second; tokens the
    model computed per second (fewer than the pairs' tokens with ``--share_prompt``)."""
    return {"accuracy": w["right"] / w["pairs"], "margin": w["margin"] / w["pairs"],
            "samples_per_sec": 2 * w["pairs"] / seconds, "computed_tokens_per_sec": w["computed"] / seconds}  # fmt: skip


if __name__ == "__main__":
    run_cli(main)
