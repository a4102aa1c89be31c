#!/usr/bin/env python
"""Step 2 with --algorithm dpo: direct preference optimisation of the step-1 policy on preference pairs.

    python training/step2_dpo_finetuning/main.py --model_name_or_path output/step1 --output_dir output/step2_dpo
    deepspeed --num_gpus 2 training/step2_dpo_finetuning/main.py --zero_stage 3 ...

or ``python train.py --step 1 2 --algorithm dpo``. No reward model and no step 3: the policy learns from
the pairs of step 2 directly, with the loss of :func:`dschat.losses.dpo_loss` against a frozen reference
(the starting policy unless --ref_model_name_or_path), whose log-probs of every pair are computed once
before training and saved with the run (``reference_logps.safetensors``, so --resume needs no reference
model). The output directory holds the policy in Hugging Face format (chat.py and prompt_eval.py take it),
``summary.json`` with implicit-reward accuracy and margins at start and end, ``metrics.jsonl``,
``training.log`` and ``checkpoints/``.
"""

from __future__ import annotations

import sys
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # runnable as a plain script


import torch

from dschat import config as C
from dschat import step_setup as S
from dschat import trainer as T
from dschat.data.collate import PreferenceLMCollator
from dschat.data.packing import pair_token_counts
from dschat.data.pipeline import prepare_pair_data
from dschat.dpo import (
    chosen_targets,
    evaluate_pairs,
    pair_data_args,
    pair_loss,
    pairs_fingerprint,
    read_table,
    reference_collate,
    reference_table,
    response_logps,
    save_table,
    settle_share_prompt,
    table_matches,
)
from dschat.inputs import check_inputs
from dschat.lm import eval_batches
from dschat.models.loading import (
    check_same_tokenizer,
    inference_dtype,
    load_causal_lm,
    resolve,
)
from dschat.models.reward import require_reward_model
from dschat.policy_pairs import mine_step_pairs
from dschat.tasks.accuracy import true_accuracy_columns
from dschat.utils import dist
from dschat.utils.errors import UserError, run_cli
from dschat.utils.run import Stopwatch, write_summary

GROUPS = (
    C.ModelArgs,
    C.DataArgs,
    C.LoraArgs,
    C.OptimArgs,
    C.DeepSpeedArgs,
    C.RunArgs,
    C.DPOArgs,
    C.PolicyPairsArgs,
)
STEP_DEFAULTS = {
    # No dropout (as TRL's default): at the first update the policy's log-probs equal the reference's.
    C.ModelArgs: {"dropout": 0.0},
    C.RunArgs: {"output_dir": "output/step2_dpo", "eval_interval": 50},
    C.OptimArgs: {"learning_rate": 5e-6, "num_train_epochs": 1},
}


def main(argv: list[str] | None = None) -> int:
    args = C.parse_groups("step2_dpo_finetuning", __doc__.split("\n\n")[0], GROUPS, argv, STEP_DEFAULTS)
    check_inputs(GROUPS, args)  # models and data named, before any slow start-up
    model_args, data_args, lora_args, optim, ds_args, run, hp, pairs_args = args
    data_args.refuse_step1_only("DPO")

    # ---------------------------------------------------------------- 1. setup (the reference is checked
    # before any slow work: it must read text as the policy does)
    C.check_resume(GROUPS, args, run.output_dir, run.resume)  # the interrupted run's options
    setup = S.setup_step(model_args, run, data_args)
    log, dtype, world, model_path, tokenizer = setup.log, setup.dtype, setup.world, setup.model_path, setup.tokenizer  # fmt: skip
    ref_path = resolve(hp.ref_model_name_or_path, "--ref_model_name_or_path") if hp.ref_model_name_or_path else None  # fmt: skip
    if ref_path:
        check_same_tokenizer(ref_path, "--ref_model_name_or_path", tokenizer, owner="policy",
                             trust_remote_code=model_args.trust_remote_code)  # fmt: skip
    if pairs_args.policy_negatives_reward_model:  # it scores the policy's answers in the policy's tokens
        flag = "--policy_negatives_reward_model"
        labeller = resolve(pairs_args.policy_negatives_reward_model, flag)
        require_reward_model(labeller, flag)
        check_same_tokenizer(
            labeller, flag, tokenizer, owner="policy", trust_remote_code=model_args.trust_remote_code
        )

    # ---------------------------------------------------------------- 2. data: this step's pairs, indexed
    data, mined = dpo_pairs(data_args, pairs_args, setup, run.seed, dtype, model_args.trust_remote_code)
    collate = PreferenceLMCollator(tokenizer.pad_token_id, setup.fmt.end_id, share_prompt=hp.share_prompt)
    batches = S.make_batches(data, optim, collate, run.seed, data_args.group_by_length)
    loader, evals, total_steps, global_batch = batches
    # the held-out prompts' on-policy pairs (the policy's own mistakes): a second evaluation set, as in step 2
    policy_rows = mined.eval if mined else []
    policy_evals = eval_batches(policy_rows, batch_size=optim.per_device_eval_batch_size, collate=collate)

    # ---------------------------------------------------------------- 3. policy and engine
    load = partial(
        load_causal_lm, model_path, tokenizer=tokenizer, trust_remote_code=model_args.trust_remote_code
    )
    engine, n_params = T.build_step_engine(load, model_args=model_args, lora=lora_args,
                                           optim=optim, ds=ds_args, dtype=dtype, total_steps=total_steps)  # fmt: skip
    # the outputs begin once the model has taken every flag checked against it (see step 1)
    resolved = S.begin_step(2, args, run, setup, batches, data, mined)
    log.info(S.describe_pairs(data, total_steps))
    log.info("policy: %s, %.2fM parameters, dtype %s, ZeRO-%d, %d rank(s); beta %g, loss %s", model_path,
             n_params / 1e6, dtype, ds_args.zero_stage, world, hp.beta, hp.dpo_loss)  # fmt: skip

    if collate.share_prompt:  # before the reference pass, which already runs packed rows
        settle_share_prompt(engine, collate, data.train, [evals, policy_evals], engine.device)

    # ---------------------------------------------------------------- 4. reference log-probs (once), resume
    sw = Stopwatch()
    with sw("reference"):
        # only the pairs this run reads (a --max_steps run over a large set reads a fraction of it)
        used = loader.sampler.indices_of_run(total_steps * optim.gradient_accumulation_steps)
        ref_train, ref_eval, ref_policy, reused = reference_tables(engine, ref_path, data, policy_rows, used, optim,
                                                                   collate, run, model_args, dtype)  # fmt: skip
    log.info("reference log-probs of %d train + %d eval + %d on-policy eval pairs %s (%s)", len(used), len(data.eval),
             len(policy_rows), "read from the run" if reused else "computed", ref_path or "the starting policy")  # fmt: skip
    state, start_step, metrics = T.open_run(engine, run, global_batch, resolved, loader)

    def evaluate(step: int, with_accuracy: bool = False) -> tuple[dict, dict | None]:
        """Implicit-reward accuracy on held-out pairs; at start and end the verifier's true accuracy."""
        acc = T.true_accuracy(engine, setup, data.eval_prompts, run, ds_args.zero_stage == 3, sw) if with_accuracy else None  # fmt: skip
        with sw("eval"):
            ev = evaluate_pairs(engine, evals, ref_eval, hp, engine.device)
            if policy_evals:  # held-out pairs whose rejected answer the starting policy itself wrote
                ev["policy_negatives_accuracy"] = evaluate_pairs(engine, policy_evals, ref_policy, hp,
                                                                 engine.device)["accuracy"]  # fmt: skip
        metrics.log({**ev, **true_accuracy_columns(acc)}, step=step, split="eval")
        own = f", on the policy's own mistakes {ev['policy_negatives_accuracy']:.4f}" if policy_evals else ""
        log.info("eval at step %d: implicit-reward accuracy %.4f%s, margin %.4f, loss %.4f%s", step, ev["accuracy"],
                 own, ev["margin"], ev["loss"], f", true accuracy {acc['accuracy']:.3f}" if acc else "")  # fmt: skip
        return ev, acc

    eval_start, acc_start = T.start_of_run(state, "eval", lambda: evaluate(state.step, with_accuracy=True))

    # ---------------------------------------------------------------- 5. training loop
    shown = (("loss", "loss", ".4f"), ("accuracy", "accuracy", ".3f"), ("margin", "margin", ".4f"), ("lr", "lr", ".2e"))  # fmt: skip
    spec = T.LoopSpec("step 2 (DPO)", partial(dpo_micro_step, engine, ref_train, hp), dpo_columns, shown,
                      targets=chosen_targets if hp.sft_coef else None)  # fmt: skip
    skipped = T.train_loop(engine, loader, state, spec, optim=optim, run=run, total_steps=total_steps, metrics=metrics,
                 timer=sw, evaluate=evaluate)  # fmt: skip

    # ---------------------------------------------------------------- 6. final evaluation and save
    eval_end, acc_end = evaluate(state.step, with_accuracy=True)
    T.export_model(engine.module, tokenizer, run.output_dir, sw)
    run_info = T.run_summary(state, sw, parameters=n_params, dtype=dtype, zero_stage=ds_args.zero_stage,
                             lora_dim=lora_args.lora_dim, run=run, start_step=start_step,
                             skipped_steps=skipped)  # fmt: skip
    summary = summarize(hp, state, eval_start, eval_end, ref_path, mined, run_info)
    summary.update(T.accuracy_summary(acc_start, acc_end))
    summary["share_prompt"] = collate.share_prompt  # what ran: off where the start-up check fell back
    metrics.close()
    write_summary(run.output_dir, summary)
    log.info("done: implicit-reward accuracy %.4f -> %.4f, margin %.4f -> %.4f, policy saved to %s",
             eval_start["accuracy"], eval_end["accuracy"], eval_start["margin"], eval_end["margin"],
             run.output_dir)  # fmt: skip
    return 0


def dpo_pairs(data_args: C.DataArgs, pairs_args: C.PolicyPairsArgs, setup: S.StepSetup, seed: int, dtype: str,
              trust_remote_code: bool):  # fmt: skip
    """This step's pairs (``data.train``, ``data.eval``), each with ``index``: its row in the reference
    tables; plus the mined on-policy pairs (or None)."""
    data_args = pair_data_args(data_args, setup.fmt)  # room for the end token after each answer
    data = prepare_pair_data(data_args, setup.tokenizer, phase=2)
    # Step 2's reward model drops and counts such pairs; DPO refuses them: the user meant a preference
    # there, and the pair's preference term is a constant that no update can move.
    identical = sum(data.stats[split]["dropped_identical"] for split in ("train", "eval"))
    if identical:
        raise UserError(
            f"--data_path {' '.join(data_args.data_path)}: {identical} pair(s) have the same chosen and "
            "rejected answer; DPO has nothing to prefer in them: remove them"
        )
    # on-policy pairs (--policy_negatives_from output/step1): the right answer over the policy's own
    # wrong ones, so DPO pushes down the mistakes this policy makes rather than only synthetic ones
    mined = mine_step_pairs(pairs_args, data_args=data_args, phase=2, tokenizer=setup.tokenizer, fmt=setup.fmt,
                            seed=seed, dtype=dtype, trust_remote_code=trust_remote_code)  # fmt: skip
    if mined:
        data.train = mined.training_set(data.train, pairs_args.policy_negatives_only)
    for split in (data.train, data.eval, mined.eval if mined else []):
        for i, ex in enumerate(split):
            ex["index"] = i  # the row of its reference log-probs
    return data, mined


def summarize(hp, state: T.TrainState, eval_start: dict, eval_end: dict, ref_path: str | None, mined,
              run_info: dict) -> dict:  # fmt: skip
    """summary.json of DPO: implicit-reward accuracy and margins at start and end."""
    return {
        "step": 2,
        "algorithm": "dpo",
        "steps": state.step,
        "beta": hp.beta,
        "dpo_loss": hp.dpo_loss,
        "implicit_reward_accuracy_start": eval_start["accuracy"],
        "implicit_reward_accuracy_end": eval_end["accuracy"],
        # as the reward model reports it: does the policy prefer the human's pick beyond its length?
        **{
            f"implicit_reward_accuracy_{side}_{when}": ev[f"accuracy_{side}"]
            for when, ev in (("start", eval_start), ("end", eval_end))
            for side in ("chosen_longer", "chosen_shorter")
            if f"accuracy_{side}" in ev
        },
        "longer_response_baseline": eval_end.get("longer_response_baseline"),
        "implicit_reward_accuracy_policy_negatives_start": eval_start.get("policy_negatives_accuracy"),
        "implicit_reward_accuracy_policy_negatives_end": eval_end.get("policy_negatives_accuracy"),
        "eval_margin_start": eval_start["margin"],
        "eval_margin_end": eval_end["margin"],
        "eval_chosen_reward_end": eval_end["chosen_reward"],
        "eval_rejected_reward_end": eval_end["rejected_reward"],
        "eval_loss_start": eval_start["loss"],
        "eval_loss_end": eval_end["loss"],
        "reference": ref_path or "starting policy",
        "policy_negatives": mined.stats if mined else None,
        **run_info,
    }


def dpo_micro_step(
    engine, ref_train: torch.Tensor, hp, batch: dict, token_share: float | None = None
) -> dict:
    """Forward, DPO loss, backward and step on one micro-batch of pairs: the log-probs of both answers
    in one forward (the LM head on the response positions only), against the reference's stored
    log-probs ``ref_train[batch["index"]]`` (B, 2). With ``--sft_coef``, ``token_share`` is the optimizer
    step's chosen-token count over ranks x accumulation (:attr:`dschat.trainer.LoopSpec.targets`; see
    :func:`dschat.dpo.pair_loss`)."""
    lp = response_logps(engine, batch, engine.device)
    loss, out = pair_loss(lp, ref_train[batch["index"]], hp, sft_tokens=token_share)
    engine.backward(loss)
    engine.step()
    margin = out.chosen_rewards - out.rejected_rewards
    tokens, computed, positions = pair_token_counts(batch)  # packed or not, the pairs' tokens count
    return {"loss": loss, "pairs": margin.numel(), "right": (margin > 0).sum(), "margin": margin.sum(),
            "chosen_reward": out.chosen_rewards.sum(), "rejected_reward": out.rejected_rewards.sum(),
            "tokens": tokens, "positions": positions, "computed": computed}  # fmt: skip


def dpo_columns(w: dict[str, float], seconds: float) -> dict[str, float]:
    """Implicit-reward accuracy, margin and the two answers' implicit rewards over the window's pairs;
    tokens the model computed per second (fewer than the pairs' tokens with ``--share_prompt``)."""
    n = max(w["pairs"], 1.0)
    out = {k: w[s] / n for k, s in (("accuracy", "right"), ("margin", "margin"), ("chosen_reward", "chosen_reward"),
                                    ("rejected_reward", "rejected_reward"))}  # fmt: skip
    return out | {"computed_tokens_per_sec": w["computed"] / seconds}


def three_tables(tables) -> tuple:
    """Train, eval and on-policy eval tables, the last None where there are no on-policy pairs."""
    return (*tables, None, None)[:3]


def reference_tables(engine, ref_path, data, policy_rows, used, optim, collate, run, model_args, dtype):
    """(train table (N, 2), eval table (M, 2), on-policy eval table (P, 2) or None without on-policy pairs,
    whether they were read from the run). Computed before the first update (and before a resumed checkpoint
    is loaded), so the policy is still the starting model; a separate reference is a plain frozen copy on
    each rank, forward only, freed afterwards."""
    out = Path(run.output_dir)
    sets = {"": data.train, "_eval": data.eval, **({"_policy_eval": policy_rows} if policy_rows else {})}
    paths = {k: out / f"reference_logps{k}.safetensors" for k in sets}
    prints = {k: pairs_fingerprint(rows) for k, rows in sets.items()}
    if run.resume and all(table_matches(paths[k], prints[k]) for k in sets):
        return (*three_tables(read_table(paths[k]) for k in sets), True)
    device = engine.device
    model = engine
    if ref_path is not None:
        model = load_causal_lm(ref_path, trust_remote_code=model_args.trust_remote_code, flag="--ref_model_name_or_path",
                               dtype=inference_dtype(dtype, str(dist.default_device()))).to(dist.default_device())  # fmt: skip
        device = dist.default_device()
        collate = reference_collate(model, collate, data.train, device)
    kw = {"batch_size": optim.per_device_eval_batch_size, "collate": collate, "device": device}
    tables = {
        k: reference_table(model, rows, only=used if k == "" else None, **kw) for k, rows in sets.items()
    }
    del model
    for k in sets:
        save_table(paths[k], tables[k], prints[k])
    return (*three_tables(tables.values()), False)


if __name__ == "__main__":
    run_cli(main)
