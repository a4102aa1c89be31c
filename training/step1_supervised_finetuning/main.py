#!/usr/bin/env python
"""Step 1: supervised fine-tuning of a causal LM on prompt -> response demonstrations.

Run alone (one process, or several through a launcher)::

    python training/step1_supervised_finetuning/main.py --output_dir output/step1
    deepspeed --num_gpus 2 training/step1_supervised_finetuning/main.py --zero_stage 3 ...

or through the orchestrator: ``python train.py --step 1``. With no model or data flags it trains
the built-in tiny Llama on the built-in verifiable tasks. Outputs in ``--output_dir``: the model in
Hugging Face format, ``dschat_config.json``, ``metrics.jsonl``, ``summary.json``, ``training.log``,
``checkpoints/``.
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
from dschat.data.collate import SFTCollator
from dschat.data.pipeline import prepare_sft_data
from dschat.inputs import check_inputs
from dschat.lm import evaluate_perplexity, sft_loss, target_count
from dschat.models.attention import causal_only
from dschat.models.loading import load_causal_lm
from dschat.tasks.accuracy import true_accuracy_columns
from dschat.utils.errors import run_cli
from dschat.utils.run import (
    Stopwatch,
    write_summary,
)

GROUPS = (C.ModelArgs, C.DataArgs, C.LoraArgs, C.OptimArgs, C.DeepSpeedArgs, C.RunArgs)


def main(argv: list[str] | None = None) -> int:
    args = C.parse_groups("step1_supervised_finetuning", __doc__.split("\n\n")[0], GROUPS, argv)
    check_inputs(GROUPS, args)  # models and data named, before any slow start-up
    model_args, data_args, lora_args, optim, ds_args, run = args

    # ---------------------------------------------------------------- 1. setup
    C.check_resume(GROUPS, args, run.output_dir, run.resume)  # the interrupted run's options
    setup = S.setup_step(model_args, run, data_args)
    log, dtype, world, model_path, tokenizer = setup.log, setup.dtype, setup.world, setup.model_path, setup.tokenizer  # fmt: skip

    # ---------------------------------------------------------------- 2. data
    data = prepare_sft_data(data_args, tokenizer, phase=1)
    collate = SFTCollator(tokenizer.pad_token_id)
    batches = S.make_batches(data, optim, collate, run.seed, data_args.group_by_length)
    loader, evals, total_steps, global_batch = batches

    # ---------------------------------------------------------------- 3. model and engine
    load = partial(
        load_causal_lm, model_path, tokenizer=tokenizer, trust_remote_code=model_args.trust_remote_code
    )
    engine, n_params = T.build_step_engine(load, model_args=model_args, lora=lora_args,
                                           optim=optim, ds=ds_args, dtype=dtype, total_steps=total_steps)  # fmt: skip
    # the outputs begin (a finished run is cleared under --overwrite) only once the model has taken every
    # flag checked against it (--trainable_layers, --lora_module_name)
    resolved = S.begin_step(1, args, run, setup, batches, data)
    log.info(
        "data: %d train / %d eval samples (dropped %d longer than --max_seq_len), %d steps",
        len(data.train), len(data.eval), data.stats["train"]["dropped_too_long"], total_steps,
    )  # fmt: skip
    log.info("model: %s, %.2fM parameters, dtype %s, ZeRO-%d, %d rank(s)", model_path, n_params / 1e6, dtype,
             ds_args.zero_stage, world)  # fmt: skip

    # ---------------------------------------------------------------- 4. resume or start; first evaluation
    state, start_step, metrics = T.open_run(engine, run, global_batch, resolved, loader)
    sw = Stopwatch()

    def evaluate(step: int, with_accuracy: bool = False) -> tuple[dict[str, float], dict[str, float] | None]:
        """Eval-set perplexity, and (at start and end) the verifier's true accuracy of greedy answers."""
        acc = T.true_accuracy(engine, setup, data.eval_prompts, run, ds_args.zero_stage == 3, sw) if with_accuracy else None  # fmt: skip
        ev = evaluate_perplexity(engine, evals)
        metrics.log({"loss": ev["loss"], "perplexity": ev["perplexity"], **true_accuracy_columns(acc)}, step=step, split="eval")  # fmt: skip
        log.info("eval at step %d: loss %.4f, perplexity %.3f%s", step, ev["loss"], ev["perplexity"],
                 f", true {fmt_acc(acc)}" if acc else "")  # fmt: skip
        return ev, acc

    eval_start, acc_start = T.start_of_run(state, "eval", lambda: evaluate(state.step, with_accuracy=True))

    # ---------------------------------------------------------------- 5. training loop
    shown = (("loss", "loss", ".4f"), ("lr", "lr", ".2e"), ("tokens/s", "tokens_per_sec", ".0f"))
    spec = T.LoopSpec("step 1 (SFT)", partial(sft_micro_step, engine), columns=sft_columns, shown=shown,
                      targets=step_targets)  # fmt: skip
    skipped = T.train_loop(engine, loader, state, spec, optim=optim, run=run, total_steps=total_steps, metrics=metrics,
                 timer=sw, evaluate=evaluate)  # fmt: skip

    # ---------------------------------------------------------------- 6. final evaluation and save
    eval_end, acc_end = evaluate(state.step, with_accuracy=True)
    T.export_model(engine.module, tokenizer, run.output_dir, sw)
    run_info = T.run_summary(state, sw, parameters=n_params, dtype=dtype, zero_stage=ds_args.zero_stage,
                             lora_dim=lora_args.lora_dim, run=run, start_step=start_step,
                             skipped_steps=skipped)  # fmt: skip
    summary = {
        "step": 1,
        "steps": state.step,
        "eval_loss_start": eval_start["loss"],
        "eval_loss_end": eval_end["loss"],
        "eval_perplexity_start": eval_start["perplexity"],
        "eval_perplexity_end": eval_end["perplexity"],
        "train_tokens": state.tokens,
        **run_info,
    }
    summary.update(T.accuracy_summary(acc_start, acc_end))
    metrics.close()
    write_summary(run.output_dir, summary)
    log.info("done: eval perplexity %.3f -> %.3f, %.0f tokens/s, model saved to %s",
             eval_start["perplexity"], eval_end["perplexity"], summary["train_tokens_per_sec"], run.output_dir)  # fmt: skip
    return 0


def sft_columns(w: dict[str, float], seconds: float) -> dict[str, float]:
    """The share of the window's real tokens that are answer tokens (the loss's targets: the only rows
    the LM head runs on), so that model FLOPs per token can be counted from the log."""
    return {"target_fraction": w["loss_weight"] / max(w["tokens"], 1.0)}


def step_targets(batch: dict[str, torch.Tensor]) -> int:
    """The tokens a micro-batch's loss is taken over (:func:`dschat.lm.target_count` of its labels)."""
    return int(target_count(batch["labels"]))


def sft_micro_step(
    engine, batch: dict[str, torch.Tensor], token_share: float
) -> dict[str, torch.Tensor | int]:
    """Forward, loss, backward and step on one micro-batch (input_ids, attention_mask, labels: (B, T)).

    The optimizer step's loss is the mean NLL over all its target tokens on every micro-batch and rank
    together, not the mean of the micro-batches' means (under ``--group_by_length`` the last micro-batch
    of every step holds the shortest answers): the micro-batch's NLL sum over ``token_share``, the step's
    count over ranks x accumulation (:attr:`dschat.trainer.LoopSpec.targets`). The LM head runs only on
    the positions that predict a target."""
    right_padded = causal_only(batch["attention_mask"]) is None  # decided on the host: no device sync
    batch = {k: v.to(engine.device) for k, v in batch.items()}
    mask = None if right_padded else batch["attention_mask"]
    loss, n = sft_loss(engine, batch["input_ids"], mask, batch["labels"])
    engine.backward(loss * (n / token_share))
    engine.step()
    return {
        "loss": loss.detach() * n,  # summed over its targets; the log divides by loss_weight
        "loss_weight": n,
        "tokens": batch["attention_mask"].sum(),
        "positions": batch["attention_mask"].numel(),
    }


def fmt_acc(acc: dict[str, float]) -> str:
    return ", ".join(f"{k} {v:.3f}" for k, v in acc.items())


if __name__ == "__main__":
    run_cli(main)
