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
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # runnable as a plain script

import torch
from tqdm import tqdm

from dschat import config as C
from dschat import trainer as T
from dschat.data.collate import SFTCollator
from dschat.data.pipeline import prepare_sft_data
from dschat.engine import core as engine_core
from dschat.engine.checkpoint import export_hf_model
from dschat.lm import evaluate_perplexity, target_logits
from dschat.losses import mean_token_nll
from dschat.models.loading import count_parameters, load_causal_lm
from dschat.tasks.accuracy import task_accuracy
from dschat.utils import dist
from dschat.utils.errors import run_cli
from dschat.utils.run import (
    Stopwatch,
    write_summary,
)

GROUPS = (C.ModelArgs, C.DataArgs, C.LoraArgs, C.OptimArgs, C.DeepSpeedArgs, C.RunArgs)


def main(argv: list[str] | None = None) -> int:
    args = C.parse_groups("step1_supervised_finetuning", __doc__.split("\n\n")[0], GROUPS, argv)
    model_args, data_args, lora_args, optim, ds_args, run = args

    # ---------------------------------------------------------------- 1. setup
    setup = T.setup_step(model_args, run, data_args)
    log, dtype, world, model_path, tokenizer = setup.log, setup.dtype, setup.world, setup.model_path, setup.tokenizer  # fmt: skip

    # ---------------------------------------------------------------- 2. data
    data = prepare_sft_data(data_args, tokenizer, seed=run.seed, phase=1)
    collate = SFTCollator(tokenizer.pad_token_id)
    batches = T.make_batches(data, optim, collate, run.seed, data_args.group_by_length)
    loader, evals, total_steps, global_batch = (
        batches.loader,
        batches.evals,
        batches.total_steps,
        batches.global_batch,
    )

    T.begin_outputs(run)
    resolved = T.save_step_config(1, args, run, setup, batches, data)
    log.info(
        "data: %d train / %d eval samples (dropped %d longer than --max_seq_len), %d steps",
        len(data.train), len(data.eval), data.stats["train"]["dropped_too_long"], total_steps,
    )  # fmt: skip

    # ---------------------------------------------------------------- 3. model and engine
    ds_config = T.train_ds_config(optim, ds_args, dtype)
    with engine_core.zero3_loading(ds_config):
        model = load_causal_lm(
            model_path,
            tokenizer=tokenizer,
            dropout=model_args.dropout,
            trust_remote_code=model_args.trust_remote_code,
        )
    model = T.set_trainable(model, lora_args, trainable_layers=model_args.trainable_layers)
    n_params = count_parameters(model)
    engine = T.build_engine(
        model, optim=optim, ds=ds_args, lora=lora_args, ds_config=ds_config, total_steps=total_steps,
        gradient_checkpointing=model_args.gradient_checkpointing,
    )  # fmt: skip
    log.info(
        "model: %s, %.2fM parameters, dtype %s, ZeRO-%d, %d rank(s)",
        model_path,
        n_params / 1e6,
        dtype,
        ds_args.zero_stage,
        world,
    )

    # ---------------------------------------------------------------- 4. resume or start; first evaluation
    state = T.resume_state(engine, run, global_batch)
    start_step = state.step
    metrics = T.open_metrics(run, resolved)
    sw = Stopwatch()

    def evaluate(step: int, with_accuracy: bool = False) -> tuple[dict[str, float], dict[str, float] | None]:
        """Eval-set perplexity, and (at start and end) the verifier's true accuracy of greedy answers."""
        acc = None
        if with_accuracy and run.eval_generation_samples:
            with sw("generation_eval"):
                acc = task_accuracy(
                    engine.module, tokenizer, data.eval_prompts[: run.eval_generation_samples],
                    device=engine.device, synced_gpus=ds_args.zero_stage == 3, fmt=setup.fmt,
                )  # fmt: skip
        ev = evaluate_perplexity(engine, evals)
        metrics.log(
            {"loss": ev["loss"], "perplexity": ev["perplexity"], **(acc or {})}, step=step, split="eval"
        )
        log.info("eval at step %d: loss %.4f, perplexity %.3f%s", step, ev["loss"], ev["perplexity"],
                 f", true {fmt_acc(acc)}" if acc else "")  # fmt: skip
        return ev, acc

    eval_start, acc_start = evaluate(state.step, with_accuracy=True)

    # ---------------------------------------------------------------- 5. training loop
    window = T.MetricWindow()
    bar = tqdm(total=total_steps, initial=state.step, disable=not dist.is_main(), desc="step 1 (SFT)",
               dynamic_ncols=True, mininterval=1.0 if sys.stdout.isatty() else 30.0)  # fmt: skip
    engine.train()
    for batch in T.micro_batches(loader, state, optim.num_train_epochs):
        t0 = clock()
        batch = {k: v.to(engine.device) for k, v in batch.items()}
        # 5a. forward: mean NLL over this micro-batch's target (response) tokens; the LM head runs only on
        # the positions that predict one
        logits, labels = target_logits(engine, batch["input_ids"], batch["attention_mask"], batch["labels"])
        loss, _ = mean_token_nll(logits, labels)
        # 5b. backward and step; DeepSpeed scales by 1/accumulation and steps the optimizer at the boundary
        engine.backward(loss)
        engine.step()
        window.add(loss=loss, micro=1, tokens=batch["attention_mask"].sum(), positions=batch["attention_mask"].numel(),
                   seconds=clock() - t0)  # fmt: skip
        if state.batch_in_epoch % optim.gradient_accumulation_steps:
            continue
        state.step += 1
        bar.update(1)
        # 5c. log: loss averaged over the window's micro-batches and ranks; real (non-pad) tokens/s
        if T.should_log(state.step, run.log_interval, total_steps):
            w = window.reduce()
            state.tokens += w["tokens"]
            state.positions += w["positions"]
            state.train_seconds += w["seconds"] / world
            row = {"loss": w["loss"] / w["micro"], "lr": engine.get_lr()[0], "epoch": state.epoch,
                   "tokens_per_sec": w["tokens"] / max(w["seconds"] / world, 1e-9), "tokens": state.tokens}  # fmt: skip
            metrics.log(row, step=state.step, split="train")
            bar.set_postfix(
                loss=f"{row['loss']:.4f}", lr=f"{row['lr']:.2e}", tok_s=f"{row['tokens_per_sec']:,.0f}"
            )
            if not sys.stdout.isatty():
                log.info("step %d/%d loss %.4f lr %.2e tokens/s %.0f", state.step, total_steps, row["loss"], row["lr"],
                         row["tokens_per_sec"])  # fmt: skip
        # 5d. evaluate
        if run.eval_interval and state.step % run.eval_interval == 0 and state.step < total_steps:
            evaluate(state.step)
        # 5e. checkpoint (atomic; a resume continues at exactly this batch)
        with sw("checkpoint"):
            T.maybe_checkpoint(engine, run, state, total_steps)
        if state.step >= total_steps:
            break
    bar.close()

    # ---------------------------------------------------------------- 6. final evaluation and save
    eval_end, acc_end = evaluate(state.step, with_accuracy=True)
    with sw("export"):
        export_hf_model(engine.module, tokenizer, run.output_dir)
    summary = {
        "step": 1,
        "steps": state.step,
        "eval_loss_start": eval_start["loss"],
        "eval_loss_end": eval_end["loss"],
        "eval_perplexity_start": eval_start["perplexity"],
        "eval_perplexity_end": eval_end["perplexity"],
        "train_tokens": state.tokens,
        "padding_fraction": 1 - state.tokens / max(state.positions, 1.0),
        "train_tokens_per_sec": state.tokens / max(state.train_seconds, 1e-9),
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
    if acc_start and acc_end:
        summary.update(
            {"true_accuracy_start": acc_start["accuracy"], "true_accuracy_end": acc_end["accuracy"]}
        )
        summary.update({f"true_accuracy_{k.split('/')[1]}_end": v for k, v in acc_end.items() if "/" in k})
    metrics.close()
    write_summary(run.output_dir, summary)
    log.info("done: eval perplexity %.3f -> %.3f, %.0f tokens/s, model saved to %s",
             eval_start["perplexity"], eval_end["perplexity"], summary["train_tokens_per_sec"], run.output_dir)  # fmt: skip
    return 0


def fmt_acc(acc: dict[str, float]) -> str:
    return ", ".join(f"{k} {v:.3f}" for k, v in acc.items())


def clock() -> float:
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    import time

    return time.perf_counter()


if __name__ == "__main__":
    run_cli(main)
