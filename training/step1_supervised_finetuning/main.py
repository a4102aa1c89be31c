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

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # runnable as a plain script

import torch
from tqdm import tqdm

from dschat import config as C
from dschat.data.pipeline import prepare_sft_data
from dschat.engine import core as engine_core
from dschat.engine import ds_config as dsc
from dschat.engine.checkpoint import export_hf_model, latest_tag, load_checkpoint, save_checkpoint
from dschat.generation import task_accuracy
from dschat.lm import eval_batches, evaluate_perplexity, train_loader
from dschat.losses import mean_token_nll
from dschat.models.loading import count_parameters, load_causal_lm, load_tokenizer, resolve
from dschat.models.lora import inject_lora
from dschat.utils import dist
from dschat.utils.errors import UserError, run_cli
from dschat.utils.metrics import MetricsLogger, setup_logging
from dschat.utils.run import (
    Stopwatch,
    check_output_dir,
    clear_previous_run,
    save_resolved_config,
    write_summary,
)

GROUPS = (C.ModelArgs, C.DataArgs, C.LoraArgs, C.OptimArgs, C.DeepSpeedArgs, C.RunArgs)


def parse_args(argv: list[str] | None = None):
    parser = C.ArgumentParser(prog="step1_supervised_finetuning", description=__doc__.split("\n\n")[0])
    for g in GROUPS:
        C.add_group(parser, g)
    parser.add_argument("--local_rank", type=int, default=-1, help="set by the DeepSpeed launcher")
    ns = parser.parse_args(argv)
    return tuple(C.from_namespace(g, ns) for g in GROUPS)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    model_args, data_args, lora_args, optim, ds_args, run = args

    # ---------------------------------------------------------------- 1. setup
    log = setup_logging(None)
    check_output_dir(run.output_dir, overwrite=run.overwrite, resume=run.resume)
    engine_core.init_distributed()
    dtype = engine_core.resolve_dtype(model_args.dtype)
    world = dist.world_size()
    torch.manual_seed(run.seed)
    model_path = resolve(model_args.model_name_or_path)
    tokenizer = load_tokenizer(model_path, trust_remote_code=model_args.trust_remote_code)

    # ---------------------------------------------------------------- 2. data
    data = prepare_sft_data(data_args, tokenizer, seed=run.seed, phase=1)
    loader = train_loader(
        data.train, batch_size=optim.per_device_train_batch_size, pad_id=tokenizer.pad_token_id, seed=run.seed
    )
    evals = eval_batches(
        data.eval, batch_size=optim.per_device_eval_batch_size, pad_id=tokenizer.pad_token_id
    )
    batches_per_epoch = loader.sampler.batches_per_epoch()
    if batches_per_epoch < optim.gradient_accumulation_steps:
        raise UserError(
            f"{len(data.train)} training samples make {batches_per_epoch} micro-batches per rank, fewer than "
            f"--gradient_accumulation_steps {optim.gradient_accumulation_steps}: lower the batch size or add data"
        )
    steps_per_epoch = batches_per_epoch // optim.gradient_accumulation_steps
    total_steps = steps_per_epoch * optim.num_train_epochs
    if optim.max_steps:
        total_steps = min(total_steps, optim.max_steps)

    if run.overwrite:
        clear_previous_run(run.output_dir)
    dist.barrier()
    setup_logging(run.output_dir)
    resolved = {
        "step": 1,
        **C.to_dict(*args),
        "resolved_model_path": model_path,
        "resolved_dtype": dtype,
        "world_size": world,
        "global_batch_size": optim.per_device_train_batch_size * optim.gradient_accumulation_steps * world,
        "total_steps": total_steps,
        "data": data.stats,
        "data_cache_hit": data.cache_hit,
    }
    save_resolved_config(run.output_dir, resolved)
    log.info(
        "data: %d train / %d eval samples (dropped %d longer than --max_seq_len), %d steps",
        len(data.train), len(data.eval), data.stats["train"]["dropped_too_long"], total_steps,
    )  # fmt: skip

    # ---------------------------------------------------------------- 3. model and engine
    ds_config = dsc.train_ds_config(
        zero_stage=ds_args.zero_stage,
        dtype=dtype,
        micro_batch_size=optim.per_device_train_batch_size,
        gradient_accumulation_steps=optim.gradient_accumulation_steps,
        world_size=world,
        offload=ds_args.offload,
        max_grad_norm=optim.max_grad_norm,
    )
    with engine_core.zero3_loading(ds_config):
        model = load_causal_lm(
            model_path,
            tokenizer=tokenizer,
            dropout=model_args.dropout,
            trust_remote_code=model_args.trust_remote_code,
        )
    if lora_args.lora_dim:
        model = inject_lora(
            model,
            dim=lora_args.lora_dim,
            alpha=lora_args.lora_alpha,
            dropout=lora_args.lora_dropout,
            module_name=lora_args.lora_module_name,
            only_optimize_lora=lora_args.only_optimize_lora,
        )
    if model_args.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if lora_args.only_optimize_lora:
            model.enable_input_require_grads()
    n_params = count_parameters(model)
    groups = engine_core.param_groups(
        model, optim.weight_decay, lora_args.lora_learning_rate, optim.learning_rate
    )
    optimizer = engine_core.make_optimizer(
        groups, lr=optim.learning_rate, betas=(optim.adam_beta1, optim.adam_beta2), offload=ds_args.offload
    )
    scheduler = engine_core.make_scheduler(
        optimizer, optim.lr_scheduler_type, optim.num_warmup_steps, total_steps
    )
    engine = engine_core.initialize_engine(
        model, optimizer=optimizer, lr_scheduler=scheduler, ds_config=ds_config
    )
    log.info(
        "model: %s, %.2fM parameters, dtype %s, ZeRO-%d, %d rank(s)",
        model_path,
        n_params / 1e6,
        dtype,
        ds_args.zero_stage,
        world,
    )

    # ---------------------------------------------------------------- 4. resume or start
    ckpt_root = Path(run.output_dir) / "checkpoints"
    start = {"step": 0, "epoch": 0, "batch_in_epoch": 0, "tokens": 0.0, "train_seconds": 0.0}
    if run.resume:
        tag = latest_tag(ckpt_root)
        if tag is None:
            raise UserError(f"--resume: {ckpt_root}/latest names no complete checkpoint")
        state = load_checkpoint(engine, ckpt_root, tag)
        if state.get("global_batch_size") != resolved["global_batch_size"]:
            raise UserError(
                f"--resume: checkpoint {tag} was trained with global batch {state.get('global_batch_size')}, "
                f"this run has {resolved['global_batch_size']} (same batch size, accumulation and ranks are needed to keep the data order)"
            )
        start.update({k: state[k] for k in start if k in state})
        log.info("resumed from %s/%s at step %d", ckpt_root, tag, start["step"])
    metrics = MetricsLogger(
        run.output_dir,
        config=resolved,
        enable_tensorboard=run.enable_tensorboard,
        tensorboard_path=run.tensorboard_path,
        enable_wandb=run.enable_wandb,
        wandb_project=run.wandb_project,
        run_name=Path(run.output_dir).name,
        append=run.resume,
    )
    sw = Stopwatch()

    def true_accuracy() -> dict[str, float] | None:
        """Greedy answers to built-in task prompts, checked by the task verifier (None for other data)."""
        if not run.eval_generation_samples:
            return None
        with sw("generation_eval"):
            return task_accuracy(
                engine.module, tokenizer, data.eval_prompts[: run.eval_generation_samples],
                device=engine.device, synced_gpus=ds_args.zero_stage == 3,
            )  # fmt: skip

    acc_start = true_accuracy()
    if acc_start:
        metrics.log(acc_start, step=start["step"], split="eval")
        log.info("true accuracy at step %d: %s", start["step"], fmt_acc(acc_start))
    eval_start = evaluate_perplexity(engine, evals)
    metrics.log(
        {"loss": eval_start["loss"], "perplexity": eval_start["perplexity"]}, step=start["step"], split="eval"
    )
    log.info(
        "eval at step %d: loss %.4f, perplexity %.3f",
        start["step"],
        eval_start["loss"],
        eval_start["perplexity"],
    )

    # ---------------------------------------------------------------- 5. training loop
    step, tokens, train_seconds = start["step"], start["tokens"], start["train_seconds"]
    window = {"loss": 0.0, "micro": 0, "tokens": 0.0, "seconds": 0.0}
    bar = tqdm(total=total_steps, initial=step, disable=not dist.is_main(), desc="step 1 (SFT)", dynamic_ncols=True,
               mininterval=1.0 if sys.stdout.isatty() else 30.0)  # fmt: skip
    crash_after = int(os.environ.get("DSCHAT_TEST_EXIT_AFTER_SAVE", "0"))  # test hook: simulate a kill
    epoch = start["epoch"]
    engine.train()
    while step < total_steps and epoch < optim.num_train_epochs:
        loader.sampler.set_epoch(epoch, start["batch_in_epoch"] if epoch == start["epoch"] else 0)
        batch_in_epoch = loader.sampler.start_batch
        for batch in loader:
            t0 = torch_time()
            batch = {k: v.to(engine.device) for k, v in batch.items()}
            # 5a. forward: mean NLL over this micro-batch's target tokens
            logits = engine(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
            loss, _ = mean_token_nll(logits, batch["labels"])
            # 5b. backward and step; DeepSpeed scales by 1/accumulation and steps at the boundary
            engine.backward(loss)
            engine.step()
            batch_in_epoch += 1
            window["loss"] += float(loss.detach())
            window["micro"] += 1
            window["tokens"] += float(batch["attention_mask"].sum())
            window["seconds"] += torch_time() - t0
            if batch_in_epoch % optim.gradient_accumulation_steps:
                continue
            step += 1
            bar.update(1)
            # 5c. log: loss averaged over the window's micro-batches and ranks; real (non-pad) tokens/s
            if step % max(run.log_interval, 1) == 0 or step == total_steps:
                loss_sum, micro, tok, secs = dist.all_reduce_sum(
                    [window["loss"], window["micro"], window["tokens"], window["seconds"]]
                )
                tokens += tok
                train_seconds += secs / world
                tps = tok / max(secs / world, 1e-9)
                lr = engine.get_lr()[0]
                row = {
                    "loss": loss_sum / micro,
                    "lr": lr,
                    "tokens_per_sec": tps,
                    "tokens": tokens,
                    "epoch": epoch,
                }
                metrics.log(row, step=step, split="train")
                bar.set_postfix(loss=f"{row['loss']:.4f}", lr=f"{lr:.2e}", tok_s=f"{tps:,.0f}")
                if not sys.stdout.isatty():
                    log.info(
                        "step %d/%d loss %.4f lr %.2e tokens/s %.0f", step, total_steps, row["loss"], lr, tps
                    )
                window = {"loss": 0.0, "micro": 0, "tokens": 0.0, "seconds": 0.0}
            # 5d. evaluate
            if run.eval_interval and step % run.eval_interval == 0 and step < total_steps:
                ev = evaluate_perplexity(engine, evals)
                metrics.log({"loss": ev["loss"], "perplexity": ev["perplexity"]}, step=step, split="eval")
                log.info("eval at step %d: loss %.4f, perplexity %.3f", step, ev["loss"], ev["perplexity"])
            # 5e. checkpoint (atomic; resumes at this exact batch)
            if run.save_steps and step % run.save_steps == 0 and step < total_steps:
                client = {"step": step, "epoch": epoch, "batch_in_epoch": batch_in_epoch, "tokens": tokens,
                          "train_seconds": train_seconds, "global_batch_size": resolved["global_batch_size"]}  # fmt: skip
                with sw("checkpoint"):
                    save_checkpoint(engine, ckpt_root, step, client, keep=run.keep_checkpoints)
                if crash_after and step >= crash_after:
                    os._exit(17)
            if step >= total_steps:
                break
        else:
            epoch += 1
            continue
        break
    bar.close()

    # ---------------------------------------------------------------- 6. final evaluation and save
    eval_end = evaluate_perplexity(engine, evals)
    metrics.log({"loss": eval_end["loss"], "perplexity": eval_end["perplexity"]}, step=step, split="eval")
    log.info("eval at step %d: loss %.4f, perplexity %.3f", step, eval_end["loss"], eval_end["perplexity"])
    acc_end = true_accuracy()
    if acc_end:
        metrics.log(acc_end, step=step, split="eval")
        log.info("true accuracy at step %d: %s", step, fmt_acc(acc_end))
    with sw("export"):
        export_hf_model(engine.module, tokenizer, run.output_dir)
    summary = {
        "step": 1,
        "steps": step,
        "eval_loss_start": eval_start["loss"],
        "eval_loss_end": eval_end["loss"],
        "eval_perplexity_start": eval_start["perplexity"],
        "eval_perplexity_end": eval_end["perplexity"],
        "train_tokens": tokens,
        "train_tokens_per_sec": tokens / max(train_seconds, 1e-9),
        "train_seconds": train_seconds,
        "wall_seconds": sw.wall(),
        "parameters": n_params,
        "dtype": dtype,
        "world_size": world,
        "zero_stage": ds_args.zero_stage,
        "lora_dim": lora_args.lora_dim,
        "resumed_from_step": start["step"] if run.resume else None,
    }
    if acc_start and acc_end:
        summary.update(
            {"true_accuracy_start": acc_start["accuracy"], "true_accuracy_end": acc_end["accuracy"]}
        )
        summary.update({f"true_{k}_end": v for k, v in acc_end.items() if "/" in k})
    metrics.close()
    write_summary(run.output_dir, summary)
    log.info("done: eval perplexity %.3f -> %.3f, %.0f tokens/s, model saved to %s",
             eval_start["perplexity"], eval_end["perplexity"], summary["train_tokens_per_sec"], run.output_dir)  # fmt: skip
    return 0


def fmt_acc(acc: dict[str, float]) -> str:
    return ", ".join(f"{k} {v:.3f}" for k, v in acc.items())


def torch_time() -> float:
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    import time

    return time.perf_counter()


if __name__ == "__main__":
    run_cli(main)
