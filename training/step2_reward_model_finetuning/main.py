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

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # runnable as a plain script

from tqdm import tqdm

from dschat import config as C
from dschat import trainer as T
from dschat.data.collate import PairCollator, response_lengths
from dschat.data.pipeline import prepare_pair_data
from dschat.engine import core as engine_core
from dschat.engine.checkpoint import export_hf_model
from dschat.lm import eval_batches
from dschat.losses import (
    divergence_pairwise_loss,
    fit_length_expert,
    gather_last,
    length_expert_logits,
    length_log_ratio,
    pairwise_loss,
)
from dschat.models.loading import count_parameters
from dschat.models.reward import ScalarHeadModel, load_reward_model
from dschat.policy_pairs import PolicySamples, evaluate_selection, mine_step_pairs
from dschat.ranking import evaluate_ranking
from dschat.utils import dist
from dschat.utils.errors import run_cli
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
STEP_DEFAULTS = {
    C.RunArgs: {"output_dir": "output/step2", "eval_interval": 50},
    C.OptimArgs: {"learning_rate": 5e-4, "weight_decay": 0.1, "num_train_epochs": 1},
}


def main(argv: list[str] | None = None) -> int:
    args = C.parse_groups(
        "step2_reward_model_finetuning", __doc__.split("\n\n")[0], GROUPS, argv, STEP_DEFAULTS
    )
    model_args, data_args, lora_args, optim, ds_args, run, reward, pairs_args = args

    # ---------------------------------------------------------------- 1. setup
    setup = T.setup_step(model_args, run, data_args)
    log, dtype, world, model_path, tokenizer = setup.log, setup.dtype, setup.world, setup.model_path, setup.tokenizer  # fmt: skip

    # ---------------------------------------------------------------- 2. data: this step's share of the pairs
    data = prepare_pair_data(data_args, tokenizer, seed=run.seed, phase=2)
    collate = PairCollator(tokenizer.pad_token_id)
    # 2b. on-policy pairs (--policy_negatives_from): the policy's own wrong answers to this step's built-in
    # prompts join the training pairs; those to held-out prompts are a second evaluation set, the one
    # that says whether PPO's actor will be able to fool this reward model.
    mined = mine_step_pairs(pairs_args, data_args=data_args, phase=2, tokenizer=tokenizer, fmt=setup.fmt,
                            seed=run.seed, dtype=dtype, trust_remote_code=model_args.trust_remote_code)  # fmt: skip
    policy_evals: list = []
    # the held-out prompts' sampled answers: can the reward model pick the right one?
    policy_samples: PolicySamples | None = None
    if mined:
        data.train = data.train + mined.train
        policy_evals = eval_batches(mined.eval, batch_size=optim.per_device_eval_batch_size, collate=collate)
        policy_samples = mined.eval_samples
    # 2c. the length-only expert (--length_expert), fitted on all training pairs (the same on every rank)
    length_w = length_w_accuracy = None
    if reward.length_expert:
        x = length_log_ratio(response_lengths(data.train))  # (N,)
        length_w = fit_length_expert(x)
        length_w_accuracy = float(((length_w * x) > 0).float().mean())
    batches = T.make_batches(data, optim, collate, run.seed, data_args.group_by_length)
    loader, evals, total_steps, global_batch = (
        batches.loader,
        batches.evals,
        batches.total_steps,
        batches.global_batch,
    )

    T.begin_outputs(run)
    resolved = T.save_step_config(2, args, run, setup, batches, data)
    if mined:
        mined.write(run.output_dir)
    st = data.stats["train"]
    log.info(
        "data: %d train / %d eval pairs; dropped %d identical, %d empty, %d too long; %d prompts truncated; %d steps",
        len(data.train), len(data.eval), st["dropped_identical"], st["dropped_empty_response"], st["dropped_too_long"],
        st["prompt_truncated"], total_steps,
    )  # fmt: skip
    if length_w is not None:
        log.info("length expert: P(chosen wins) = sigmoid(%.3f * log(len_chosen / len_rejected)); alone it ranks %.3f "
                 "of the training pairs right; the reward model learns the rest", length_w, length_w_accuracy)  # fmt: skip

    # ---------------------------------------------------------------- 3. model (body + scalar head) and engine
    ds_config = T.train_ds_config(optim, ds_args, dtype)
    with engine_core.zero3_loading(ds_config):
        hf_model = load_reward_model(
            model_path,
            tokenizer=tokenizer,
            dropout=model_args.dropout,
            trust_remote_code=model_args.trust_remote_code,
        ).model
    hf_model = T.set_trainable(
        hf_model, lora_args, keep_trainable=("score.",), trainable_layers=model_args.trainable_layers
    )
    model = ScalarHeadModel(hf_model)
    n_params = count_parameters(model)
    engine = T.build_engine(
        model, optim=optim, ds=ds_args, lora=lora_args, ds_config=ds_config, total_steps=total_steps,
        gradient_checkpointing=model_args.gradient_checkpointing,
    )  # fmt: skip
    log.info("reward model: %s, %.2fM parameters, dtype %s, ZeRO-%d, %d rank(s)", model_path, n_params / 1e6, dtype,
             ds_args.zero_stage, world)  # fmt: skip

    # ---------------------------------------------------------------- 4. resume or start; first evaluation
    state = T.resume_state(engine, run, global_batch)
    start_step = state.step
    metrics = T.open_metrics(run, resolved)
    sw = Stopwatch()

    def evaluate(step: int) -> dict[str, float]:
        t = time.perf_counter()
        with sw("eval"):
            ev = evaluate_ranking(engine, evals)
        ev["scoring_samples_per_sec"] = 2 * ev["pairs"] / max(time.perf_counter() - t, 1e-9)
        if policy_evals:  # held-out pairs whose rejected answer the policy itself wrote
            with sw("eval"):
                ev["policy_negatives_accuracy"] = evaluate_ranking(engine, policy_evals)["accuracy"]
        if policy_samples is not None:  # the reward model picks one of the policy's K answers per prompt
            with sw("eval"):
                ev["policy_best_of_k_accuracy"] = evaluate_selection(
                    engine,
                    tokenizer,
                    policy_samples,
                    batch_size=optim.per_device_eval_batch_size,
                    max_len=data_args.max_seq_len,
                    fmt=setup.fmt,
                )["best_of_k_accuracy"]
        metrics.log(ev, step=step, split="eval")
        log.info("eval at step %d: accuracy %.4f, chosen %.3f, rejected %.3f, margin %.3f%s%s", step, ev["accuracy"],
                 ev["chosen_mean"], ev["rejected_mean"], ev["margin"],
                 f", on the policy's own mistakes {ev['policy_negatives_accuracy']:.4f}" if policy_evals else "",
                 f", its pick of the policy's {pairs_args.policy_negatives_per_prompt} answers right "
                 f"{ev['policy_best_of_k_accuracy']:.4f}" if policy_samples is not None else "")  # fmt: skip
        return ev

    eval_start = evaluate(state.step)

    # ---------------------------------------------------------------- 5. training loop
    window = T.MetricWindow()
    bar = tqdm(total=total_steps, initial=state.step, disable=not dist.is_main(), desc="step 2 (reward)",
               dynamic_ncols=True, mininterval=1.0 if sys.stdout.isatty() else 30.0)  # fmt: skip
    engine.train()
    for batch in T.micro_batches(loader, state, optim.num_train_epochs):
        t0 = time.perf_counter()
        ids = batch["input_ids"].to(engine.device)
        mask = batch["attention_mask"].to(engine.device)
        b = ids.shape[0] // 2
        # 5a. score chosen and rejected in one forward: the value at each sequence's last real token
        values = engine(ids, mask)  # (2B, T)
        scores = gather_last(values, mask)
        chosen, rejected = scores[:b], scores[b:]
        # 5b. ranking loss, backward, step
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
        window.add(loss=loss, micro=1, pairs=b, right=(chosen > rejected).sum(), margin=(chosen - rejected).sum(),
                   tokens=mask.sum(), positions=mask.numel(), seconds=time.perf_counter() - t0)  # fmt: skip
        if state.batch_in_epoch % optim.gradient_accumulation_steps:
            continue
        state.step += 1
        bar.update(1)
        # 5c. log (averaged over micro-batches and ranks)
        if T.should_log(state.step, run.log_interval, total_steps):
            w = window.reduce()
            state.tokens += w["tokens"]
            state.positions += w["positions"]
            state.train_seconds += w["seconds"] / world
            row = {"loss": w["loss"] / w["micro"], "accuracy": w["right"] / w["pairs"], "margin": w["margin"] / w["pairs"],
                   "lr": engine.get_lr()[0], "samples_per_sec": 2 * w["pairs"] / max(w["seconds"] / world, 1e-9),
                   "tokens_per_sec": w["tokens"] / max(w["seconds"] / world, 1e-9), "epoch": state.epoch}  # fmt: skip
            metrics.log(row, step=state.step, split="train")
            bar.set_postfix(loss=f"{row['loss']:.4f}", acc=f"{row['accuracy']:.3f}", lr=f"{row['lr']:.2e}")
            if not sys.stdout.isatty():
                log.info("step %d/%d loss %.4f accuracy %.3f lr %.2e samples/s %.1f", state.step, total_steps,
                         row["loss"], row["accuracy"], row["lr"], row["samples_per_sec"])  # fmt: skip
        # 5d. evaluate
        if run.eval_interval and state.step % run.eval_interval == 0 and state.step < total_steps:
            evaluate(state.step)
        # 5e. checkpoint
        with sw("checkpoint"):
            T.maybe_checkpoint(engine, run, state, total_steps)
        if state.step >= total_steps:
            break
    bar.close()

    # ---------------------------------------------------------------- 6. final evaluation and save
    eval_end = evaluate(state.step)
    with sw("export"):
        export_hf_model(engine.module.model, tokenizer, run.output_dir)
    train_pairs = state.step * global_batch - start_step * global_batch
    summary = {
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
        "policy_negatives": mined.stats if mined else None,
        # --length_expert: the length-only expert's coefficient and its own training-pair accuracy (the
        # evaluation above scores the reward model alone, as PPO uses it)
        "length_expert_coef": length_w,
        "length_expert_train_accuracy": length_w_accuracy,
        "train_samples_per_sec": 2 * train_pairs / max(state.train_seconds, 1e-9) if train_pairs else None,
        "scoring_samples_per_sec": eval_end["scoring_samples_per_sec"],
        "train_tokens_per_sec": state.tokens / max(state.train_seconds, 1e-9),
        "padding_fraction": 1 - state.tokens / max(state.positions, 1.0),
        "train_seconds": state.train_seconds,
        "wall_seconds": sw.wall(),
        "seconds_by_phase": sw.totals,
        "parameters": n_params,
        "dtype": dtype,
        "world_size": world,
        "zero_stage": ds_args.zero_stage,
        "lora_dim": lora_args.lora_dim,
        "resumed_from_step": start_step if run.resume else None,
    }
    metrics.close()
    write_summary(run.output_dir, summary)
    log.info("done: eval accuracy %.4f -> %.4f, reward model saved to %s", eval_start["accuracy"], eval_end["accuracy"],
             run.output_dir)  # fmt: skip
    return 0


if __name__ == "__main__":
    run_cli(main)
