#!/usr/bin/env python
"""Step 3: RLHF with PPO. Actor (from step 1, trained), reference (frozen step-1 copy), critic (from
step 2, trained, per-token values) and reward model (frozen step 2), each a DeepSpeed engine.

    python training/step3_rlhf_finetuning/main.py --actor_model_name_or_path output/step1 \\
        --critic_model_name_or_path output/step2 --output_dir output/step3
    deepspeed --num_gpus 8 training/step3_rlhf_finetuning/main.py --actor_zero_stage 3 --critic_zero_stage 3 ...

or ``python train.py --step 3`` (reads OUTPUT/step1 and OUTPUT/step2). Per round: generate
responses to a prompt batch, score them (reward model and/or ``--reward_fn``), compute KL-shaped
rewards and GAE, then ``--ppo_epochs`` of clipped policy and value updates. For built-in tasks the
verifier's true accuracy on held-out prompts is logged beside the reward, so reward hacking shows.
Outputs: ``actor/`` and ``critic/`` (Hugging Face format), ``actor_ema/`` with ``--enable_ema``,
``metrics.jsonl``, ``summary.json``, ``dschat_config.json``, ``training.log``, ``checkpoints/``.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # runnable as a plain script

import torch
from tqdm import tqdm

from dschat import config as C
from dschat import trainer as T
from dschat.data.collate import PromptCollator, SFTCollator, pad_right
from dschat.data.pipeline import prepare_prompt_data, prepare_sft_data
from dschat.data.prompt_format import prompt_format
from dschat.engine import core as engine_core
from dschat.engine import ds_config as dsc
from dschat.engine.checkpoint import export_hf_model
from dschat.generation.hybrid import HybridGenerator
from dschat.generation.plain import PlainGenerator
from dschat.generation.sampling import SamplingConfig
from dschat.generation.texts import generate_texts
from dschat.lm import train_loader
from dschat.models.loading import count_parameters, load_causal_lm, load_tokenizer, resolve
from dschat.models.reward import ScalarHeadModel, has_value_head, load_reward_model
from dschat.rlhf import ppo_math as M
from dschat.rlhf.experience import Experience
from dschat.rlhf.ppo import PPOHyper, PPOTrainer
from dschat.rlhf.rewards import FunctionSource, RewardModelSource, SumSource
from dschat.tasks.accuracy import answers_cut_by_budget, rank_slice, task_accuracy, verifier_accuracy
from dschat.utils import dist
from dschat.utils.errors import UserError, run_cli
from dschat.utils.metrics import setup_logging
from dschat.utils.run import (
    Stopwatch,
    check_output_dir,
    save_resolved_config,
    write_summary,
)

SHARED_MODEL = ("dtype", "trust_remote_code")
GROUPS = (
    (C.ModelArgs, "actor_", SHARED_MODEL),
    (C.ModelArgs, "critic_", SHARED_MODEL),
    (C.LoraArgs, "actor_", ("only_optimize_lora",)),
    (C.LoraArgs, "critic_", ("only_optimize_lora",)),
    C.RLHFEngineArgs,
    C.PPOArgs,
    C.DataArgs,
    C.RunArgs,
)
STEP_DEFAULTS = {
    C.RunArgs: {"output_dir": "output/step3", "eval_interval": 20, "log_interval": 1, "save_steps": 50},
    # No dropout in actor and critic (DeepSpeed-Chat's --disable_actor_dropout): experience is taken in
    # eval mode and the update runs in train mode, so with dropout every update would start from a ratio
    # away from 1 and clip against noise. --actor_dropout / --critic_dropout turn it back on.
    C.ModelArgs: {"dropout": 0.0},
}


def optim_for(ppo: C.PPOArgs, lr: float, wd: float) -> C.OptimArgs:
    """The engine-level optimizer options of actor or critic (micro-batch = the PPO minibatch)."""
    return C.OptimArgs(
        per_device_train_batch_size=ppo.per_device_training_batch_size,
        learning_rate=lr,
        weight_decay=wd,
        lr_scheduler_type=ppo.lr_scheduler_type,
        num_warmup_steps=ppo.num_warmup_steps,
        max_grad_norm=ppo.max_grad_norm,
    )


def frozen_engine(model: torch.nn.Module, zero_stage: int, offload: bool, dtype: str, micro_batch: int):
    """A DeepSpeed engine without optimizer for the reference and reward models."""
    cfg = dsc.eval_ds_config(zero_stage=zero_stage, dtype=dtype, micro_batch_size=micro_batch,
                             world_size=dist.world_size(), offload=offload)  # fmt: skip
    model.eval()
    for p in model.parameters():
        p.requires_grad_(False)
    return engine_core.initialize_engine(model, ds_config=cfg), cfg


def frozen_reward_source(path: str, flag: str, *, tokenizer, trust_remote_code: bool, zero_stage: int,
                         offload: bool, dtype: str, micro_batch: int) -> RewardModelSource:  # fmt: skip
    """A trained reward model at ``path`` as a frozen engine behind the reward-source call (the reward
    model, or the judge scored beside it)."""
    cfg = dsc.eval_ds_config(zero_stage=zero_stage, dtype=dtype, micro_batch_size=micro_batch,
                             world_size=dist.world_size(), offload=offload)  # fmt: skip
    with engine_core.zero3_loading(cfg):
        model = load_reward_model(path, tokenizer=tokenizer, trust_remote_code=trust_remote_code,
                                  require_trained_head=True, flag=flag)  # fmt: skip
    engine, _ = frozen_engine(model, zero_stage, offload, dtype, micro_batch)
    return RewardModelSource(engine)


def check_same_vocabulary(path: str, flag: str, tokenizer, actor_path: str, trust_remote_code: bool) -> None:
    """Step 3 hands the rollouts' token ids to every scoring model: each must share the actor's tokenizer."""
    other = load_tokenizer(path, trust_remote_code=trust_remote_code, flag=flag)
    if other.get_vocab() != tokenizer.get_vocab():
        raise UserError(f"{flag} {path}: its tokenizer differs from the actor's ({actor_path}); step 3 scores "
                        "token ids directly, so both must share one tokenizer")  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    args = C.parse_groups("step3_rlhf_finetuning", __doc__.split("\n\n")[0], GROUPS, argv, STEP_DEFAULTS)
    actor_args, critic_args, actor_lora, critic_lora, eng_args, ppo, data_args, run = args

    # ---------------------------------------------------------------- 1. setup and checks across groups
    only_lora = actor_lora.only_optimize_lora
    if only_lora and not (actor_lora.lora_dim or critic_lora.lora_dim):
        raise UserError("--only_optimize_lora needs --actor_lora_dim or --critic_lora_dim > 0")
    use_critic = ppo.advantage_estimator == "gae"
    if not use_critic and critic_lora.lora_dim:
        raise UserError(
            f"--critic_lora_dim needs a critic, and --advantage_estimator {ppo.advantage_estimator} has none"
        )
    if eng_args.share_reference_with_actor and not (actor_lora.lora_dim and only_lora):
        raise UserError("--share_reference_with_actor needs --actor_lora_dim > 0 and --only_optimize_lora "
                        "(otherwise the base weights move and are no longer the reference)")  # fmt: skip
    log = setup_logging(None)
    check_output_dir(run.output_dir, overwrite=run.overwrite, resume=run.resume)
    engine_core.init_distributed()
    dtype = engine_core.resolve_dtype(actor_args.dtype, "--dtype")
    world = dist.world_size()
    torch.manual_seed(run.seed)
    actor_path = resolve(actor_args.model_name_or_path, "--actor_model_name_or_path")
    critic_path = resolve(critic_args.model_name_or_path, "--critic_model_name_or_path")
    reward_path = resolve(
        eng_args.reward_model_name_or_path or critic_args.model_name_or_path, "--reward_model_name_or_path"
    )
    tokenizer = load_tokenizer(
        actor_path,
        trust_remote_code=actor_args.trust_remote_code,
        padding_side="left",
        flag="--actor_model_name_or_path",
    )
    fmt = prompt_format(tokenizer, data_args.chat_template)
    check_same_vocabulary(
        reward_path, "--reward_model_name_or_path", tokenizer, actor_path, actor_args.trust_remote_code
    )
    judge_path = None
    if eng_args.judge_reward_model:  # checked here, before minutes of engine start-up
        judge_path = resolve(eng_args.judge_reward_model, "--judge_reward_model")
        if not has_value_head(judge_path):
            raise UserError(f"--judge_reward_model {eng_args.judge_reward_model}: not a trained reward model (no "
                            "1-label sequence-classification config.json; pass a step-2 output directory)")  # fmt: skip
        check_same_vocabulary(
            judge_path, "--judge_reward_model", tokenizer, actor_path, critic_args.trust_remote_code
        )

    # ---------------------------------------------------------------- 2. data: prompts (and PTX examples)
    prompts = prepare_prompt_data(
        data_args, tokenizer, seed=run.seed, max_prompt_len=ppo.max_prompt_seq_len, phase=3
    )
    loader = train_loader(prompts.train, batch_size=ppo.per_device_generation_batch_size, seed=run.seed,
                          collate=PromptCollator(tokenizer.pad_token_id), accumulation=ppo.generation_batches)  # fmt: skip
    rounds_per_epoch = loader.sampler.batches_per_epoch()
    if rounds_per_epoch == 0:
        raise UserError(f"{len(prompts.train)} prompts are fewer than one generation batch "
                        f"(--per_device_generation_batch_size {ppo.per_device_generation_batch_size} x {world} ranks)")  # fmt: skip
    total_steps = rounds_per_epoch * ppo.num_train_epochs
    total_steps = min(total_steps, ppo.max_steps) if ppo.max_steps else total_steps
    # the schedules' lengths: the optimizer steps the loop below will take (the actor's skip the frozen rounds)
    actor_updates, critic_updates = M.ppo_optimizer_steps(
        total_steps, rows_per_round=ppo.per_device_generation_batch_size * ppo.n_samples_per_prompt,
        generation_batches=ppo.generation_batches, micro_batch=ppo.per_device_training_batch_size,
        ppo_epochs=ppo.ppo_epochs, freezing_actor_steps=ppo.freezing_actor_steps,
    )  # fmt: skip
    unsup_iter = None
    if ppo.unsupervised_dataset_name:
        unsup_data = prepare_sft_data(
            C.DataArgs(data_path=[ppo.unsupervised_dataset_name], data_split="1,0,0",
                       data_output_path=data_args.data_output_path, max_seq_len=data_args.max_seq_len),
            tokenizer, seed=run.seed, phase=1,
        )  # fmt: skip
        unsup_loader = train_loader(unsup_data.train, batch_size=ppo.per_device_training_batch_size, seed=run.seed,
                                    collate=SFTCollator(tokenizer.pad_token_id))  # fmt: skip
        unsup_iter = T.micro_batches(unsup_loader, T.TrainState(), num_epochs=10**9)

    T.begin_outputs(run)
    global_batch = ppo.per_device_generation_batch_size * world
    resolved = {
        "step": 3, "actor": C.to_dict(actor_args, actor_lora), "critic": C.to_dict(critic_args, critic_lora),
        **C.to_dict(eng_args, ppo, data_args, run), "resolved_actor_path": actor_path, "resolved_critic_path": critic_path,
        "resolved_reward_path": reward_path, "resolved_dtype": dtype, "world_size": world, "global_batch_size": global_batch,
        "total_steps": total_steps, "actor_optimizer_steps": actor_updates, "critic_optimizer_steps": critic_updates,
        "data": prompts.stats, "data_cache_hit": prompts.cache_hit,
    }  # fmt: skip
    save_resolved_config(run.output_dir, resolved)
    log.info("prompts: %d (dropped %d longer than --max_prompt_seq_len), %d generation rounds of %d prompts",
             len(prompts.train), prompts.stats["train"]["dropped_too_long"], total_steps, global_batch)  # fmt: skip

    # ---------------------------------------------------------------- 3. the four models
    actor_optim = optim_for(ppo, ppo.actor_learning_rate, ppo.actor_weight_decay)
    actor_ds = C.DeepSpeedArgs(zero_stage=eng_args.actor_zero_stage, offload=eng_args.offload)
    actor_cfg = T.train_ds_config(actor_optim, actor_ds, dtype)
    with engine_core.zero3_loading(actor_cfg):
        actor_model = load_causal_lm(actor_path, tokenizer=tokenizer, dropout=actor_args.dropout,
                                     trust_remote_code=actor_args.trust_remote_code, flag="--actor_model_name_or_path")  # fmt: skip
    actor_model = T.set_trainable(
        actor_model, actor_lora, prefix="actor_", trainable_layers=actor_args.trainable_layers
    )
    actor = T.build_engine(actor_model, optim=actor_optim, ds=actor_ds, lora=actor_lora, ds_config=actor_cfg,
                           total_steps=actor_updates, gradient_checkpointing=actor_args.gradient_checkpointing)  # fmt: skip

    reference = None
    if not eng_args.share_reference_with_actor:
        ref_stage = dsc.frozen_stage(eng_args.actor_zero_stage)
        ref_cfg = dsc.eval_ds_config(zero_stage=ref_stage, dtype=dtype, micro_batch_size=ppo.per_device_generation_batch_size,
                                     world_size=world, offload=eng_args.offload_reference_model)  # fmt: skip
        with engine_core.zero3_loading(ref_cfg):
            ref_model = load_causal_lm(actor_path, tokenizer=tokenizer, trust_remote_code=actor_args.trust_remote_code,
                                       flag="--actor_model_name_or_path")  # fmt: skip
        reference, _ = frozen_engine(ref_model, ref_stage, eng_args.offload_reference_model, dtype,
                                     ppo.per_device_generation_batch_size)  # fmt: skip

    critic = None  # the critic-free estimators (rloo, group_norm, dr_grpo) need no value model
    if use_critic:
        critic_optim = optim_for(ppo, ppo.critic_learning_rate, ppo.critic_weight_decay)
        critic_ds = C.DeepSpeedArgs(zero_stage=eng_args.critic_zero_stage, offload=eng_args.offload)
        critic_cfg = T.train_ds_config(critic_optim, critic_ds, dtype)
        with engine_core.zero3_loading(critic_cfg):
            critic_hf = load_reward_model(critic_path, tokenizer=tokenizer, dropout=critic_args.dropout,
                                          trust_remote_code=critic_args.trust_remote_code, flag="--critic_model_name_or_path").model  # fmt: skip
        critic_hf = T.set_trainable(critic_hf, critic_lora, prefix="critic_", keep_trainable=("score.",),
                                    trainable_layers=critic_args.trainable_layers)  # fmt: skip
        critic = T.build_engine(ScalarHeadModel(critic_hf), optim=critic_optim, ds=critic_ds, lora=critic_lora,
                                ds_config=critic_cfg, total_steps=critic_updates,
                                gradient_checkpointing=critic_args.gradient_checkpointing)  # fmt: skip

    # the reward model and the judge: frozen, at ZeRO-3 when the critic is, else unpartitioned
    scorer = dict(tokenizer=tokenizer, trust_remote_code=critic_args.trust_remote_code,
                  zero_stage=dsc.frozen_stage(eng_args.critic_zero_stage), offload=eng_args.offload_reward_model,
                  dtype=dtype, micro_batch=ppo.per_device_generation_batch_size)  # fmt: skip
    sources = []
    if not (ppo.reward_fn and ppo.reward_fn_mode == "replace"):
        sources.append(frozen_reward_source(reward_path, "--reward_model_name_or_path", **scorer))
    if ppo.reward_fn:
        sources.append(FunctionSource(ppo.reward_fn))
    reward_source = sources[0] if len(sources) == 1 else SumSource(*sources)
    # scored beside the reward, never optimised
    judge_source = frozen_reward_source(judge_path, "--judge_reward_model", **scorer) if judge_path else None

    ema = None
    if eng_args.enable_ema:
        from dschat.engine.ema import EMA

        ema = EMA(actor.module, eng_args.ema_decay)

    kl_ctl = (M.AdaptiveKLController(ppo.kl_coef, ppo.kl_target, ppo.kl_horizon) if ppo.kl_target
              else M.FixedKLController(ppo.kl_coef))  # fmt: skip
    sampling = SamplingConfig(
        max_new_tokens=ppo.max_answer_seq_len, temperature=ppo.temperature, top_p=ppo.top_p, top_k=ppo.top_k
    )
    if eng_args.enable_hybrid_engine:
        generator = HybridGenerator(actor, tokenizer, sampling, zero3=eng_args.actor_zero_stage == 3,
                                    gather=engine_core.gather_zero3, tp_size=eng_args.inference_tp_size, gather_layers=eng_args.tp_gather_partition_size,
                                    release_cache=eng_args.release_inference_cache,
                                    unpin=eng_args.unpin_actor_parameters)  # fmt: skip
    else:
        generator = PlainGenerator(actor, tokenizer, sampling, zero3=eng_args.actor_zero_stage == 3)
    hyper = PPOHyper(clip_reward_value=ppo.clip_reward_value, cliprange=ppo.cliprange,
                     cliprange_value=ppo.cliprange_value, gamma=ppo.gamma, lam=ppo.lam,
                     whiten_advantages=ppo.whiten_advantages, unsup_coef=ppo.unsup_coef,
                     n_samples_per_prompt=ppo.n_samples_per_prompt, advantage_estimator=ppo.advantage_estimator,
                     temperature=ppo.temperature, filter_uniform_groups=ppo.filter_uniform_groups,
                     cliprange_high=ppo.cliprange_high, loss_agg=ppo.loss_agg, max_answer_len=ppo.max_answer_seq_len,
                     kl_estimator=ppo.kl_estimator, kl_in=ppo.kl_in, truncation_penalty=ppo.truncation_penalty)  # fmt: skip
    trainer = PPOTrainer(actor=actor, reference=reference, critic=critic, reward_source=reward_source,
                         generator=generator, tokenizer=tokenizer, hyper=hyper, kl_ctl=kl_ctl, judge=judge_source)  # fmt: skip
    critic_desc = (f"{critic_path} ({count_parameters(critic.module) / 1e6:.2f}M, ZeRO-{eng_args.critic_zero_stage})"
                   if critic is not None else f"none ({ppo.advantage_estimator}, {ppo.n_samples_per_prompt} samples per prompt)")  # fmt: skip
    log.info("actor %s (%.2fM, ZeRO-%d), critic %s, reward %s%s, reference %s, dtype %s, %d rank(s)",
             actor_path, count_parameters(actor.module) / 1e6, eng_args.actor_zero_stage, critic_desc, reward_path if sources and
             isinstance(sources[0], RewardModelSource) else "-", f" + {ppo.reward_fn}" if ppo.reward_fn else "",
             "actor without adapter" if reference is None else "frozen copy", dtype, world)  # fmt: skip

    # ---------------------------------------------------------------- 4. resume or start; held-out evaluation
    engines = {"actor": actor, **({"critic": critic} if critic is not None else {})}
    state = T.resume_state(engines, run, global_batch)
    if "kl_controller" in state.extra:
        kl_ctl.load_state_dict(state.extra["kl_controller"])
    elif "kl_coef" in state.extra:  # a checkpoint written before the controller saved its own state
        kl_ctl.load_state_dict({"value": state.extra["kl_coef"]})
    start_step = state.step
    metrics = T.open_metrics(run, resolved)
    sw = Stopwatch()
    held_out = prompts.eval_prompts[: ppo.eval_prompts]
    cut, longest = answers_cut_by_budget(tokenizer, held_out, ppo.max_answer_seq_len, fmt)
    if cut:
        log.warning("--max_answer_seq_len %d cuts the right answers of %d of %d held-out prompts (the longest needs %d "
                    "tokens with EOS): they cannot be answered in full", ppo.max_answer_seq_len, cut, len(held_out), longest)  # fmt: skip

    @torch.no_grad()
    def evaluate(step: int) -> dict[str, float]:
        """Greedy answers to held-out prompts: the reward they get and (built-in tasks) true accuracy, also of
        answers sampled as in training (``true_accuracy_sampled``: the policy PPO optimises, not only its mode)."""
        out: dict[str, float] = {}
        if not held_out:
            return out
        with sw("eval"):
            zero3 = eng_args.actor_zero_stage == 3
            # greedy answers to this rank's slice of the held-out prompts: their reward and true accuracy
            mine, weights = rank_slice(held_out)
            with generator.generation_mode() as gen:  # the hybrid engine's fast path, or plain generate
                answers = generate_texts(actor.module, tokenizer, mine, device=actor.device, synced_gpus=zero3,
                                         max_new_tokens=ppo.max_answer_seq_len, generator=gen, fmt=fmt)  # fmt: skip
                acc = verifier_accuracy(mine, answers, weights)
                if acc:
                    # The same seed at every evaluation (start and end compare like with like), in a forked
                    # RNG so that evaluating never changes the training run's samples.
                    with torch.random.fork_rng(devices=[actor.device] if actor.device.type == "cuda" else []):
                        torch.manual_seed(run.seed + 1 + dist.rank())
                        sampled = task_accuracy(actor.module, tokenizer, held_out, device=actor.device,
                                                synced_gpus=zero3, generator=gen, sampling=sampling, fmt=fmt)  # fmt: skip
                    out.update({f"true_{k}": v for k, v in acc.items()})
                    out.update(
                        {f"true_{k.replace('accuracy', 'accuracy_sampled')}": v for k, v in sampled.items()}
                    )
            # prompt + answer tokenized as step 2 trained the reward model (no end token)
            rows = [p + a for p, a in zip(fmt.encode_prompts(mine), fmt.encode_responses(answers))]
            enc = {k: v.to(actor.device) for k, v in pad_right(rows, tokenizer.pad_token_id).items()}
            scores = reward_source.score(mine, answers, enc["input_ids"], enc["attention_mask"]).float().cpu()
            judged = (judge_source.score(mine, answers, enc["input_ids"], enc["attention_mask"]).float().cpu()
                      if judge_source is not None else torch.zeros_like(scores))  # fmt: skip
            w = torch.tensor(weights)
            total, judge_total, n = dist.all_reduce_sum(
                [float((scores * w).sum()), float((judged * w).sum()), float(w.sum())]
            )
            out["held_out_reward"] = total / n
            if judge_source is not None:
                out["held_out_judge_score"] = judge_total / n
        metrics.log(out, step=step, split="eval")
        log.info("eval at step %d: %s", step, ", ".join(f"{k} {v:.3f}" for k, v in out.items()))
        return out

    eval_start = evaluate(state.step)

    # ---------------------------------------------------------------- 5. PPO loop
    buffer: list[Experience] = []
    window = T.MetricWindow()
    first_round: dict[str, float] | None = None
    last_round: dict[str, float] = {}
    bar = tqdm(total=total_steps, initial=state.step, disable=not dist.is_main(), desc="step 3 (PPO)",
               dynamic_ncols=True, mininterval=1.0 if sys.stdout.isatty() else 30.0)  # fmt: skip
    for batch in T.micro_batches(loader, state, ppo.num_train_epochs):
        t0 = time.perf_counter()
        # 5a. experience: generate, then log-probs (actor, reference), values (critic), scores, rewards, GAE
        exp, stats = trainer.make_experience(
            batch["input_ids"].to(actor.device), batch["attention_mask"].to(actor.device), batch["prompts"]
        )
        window.add(**stats)
        # this round's mean KL per sequence over all ranks: the adaptive controller follows every round
        round_kl, round_rows = dist.all_reduce_sum([stats["kl_sum"], stats["rows"]])
        buffer.append(exp)
        state.step += 1
        bar.update(1)
        # 5b. PPO epochs over the collected experience, in minibatches
        if len(buffer) == ppo.generation_batches:
            collected = Experience.cat(buffer, tokenizer.pad_token_id)
            buffer.clear()
            mb = ppo.per_device_training_batch_size
            for _ in range(ppo.ppo_epochs):
                for s in range(0, len(collected), mb):
                    unsup = None
                    if unsup_iter is not None:
                        unsup = {k: v.to(actor.device) for k, v in next(unsup_iter).items()}
                    train_actor = state.step > ppo.freezing_actor_steps
                    stats = trainer.train(collected.slice(s, s + mb), unsup, train_actor=train_actor)
                    window.add(updates=1, actor_updates=float(train_actor), **stats)
                    if ema is not None:
                        ema.update(actor.module)
        window.add(round_seconds=time.perf_counter() - t0)
        # 5c. log: per-sequence means over the window's rollouts (all ranks), per-update means of the losses
        if T.should_log(state.step, run.log_interval, total_steps):
            w = window.reduce()
            rows = max(w["rows"], 1.0)
            score_mean = w["score_sum"] / rows
            row = {
                "reward_mean": w["reward_sum"] / rows, "score_mean": score_mean,
                "score_std": max(w["score_sq_sum"] / rows - score_mean**2, 0.0) ** 0.5,
                **({"judge_score_mean": w["judge_score_sum"] / rows} if "judge_score_sum" in w else {}),
                "kl_to_reference": w["kl_sum"] / rows, "kl_coef": kl_ctl.value, "entropy": w["entropy_sum"] / rows,
                "response_length": w["length_sum"] / rows, "truncated_fraction": w["truncated_rows"] / rows,
                "uniform_group_fraction": w["uniform_group_rows"] / rows,
                "generation_seconds": trainer.timing["generation"], "experience_seconds": trainer.timing["experience"],
                "train_seconds": trainer.timing["train"], "actor_lr": actor.get_lr()[0],
            }  # fmt: skip
            if critic is not None:
                row["critic_lr"] = critic.get_lr()[0]
            if w.get("updates"):
                u, ua = w["updates"], max(w.get("actor_updates", 0.0), 1.0)
                for k in ("value_loss", "value_clip_fraction"):  # critic updates (none without a critic)
                    if k in w:
                        row[k] = w[k] / u
                for k in (
                    "policy_loss",
                    "clip_fraction",
                    "approx_kl",
                    "ptx_loss",
                    "kl_loss",
                ):  # actor updates only
                    if k in w:
                        row[k] = w[k] / ua
            first_round = first_round or row
            last_round = row
            metrics.log(row, step=state.step, split="train")
            bar.set_postfix(reward=f"{row['reward_mean']:.3f}", kl=f"{row['kl_to_reference']:.3f}")
            if not sys.stdout.isatty():
                log.info("step %d/%d reward %.3f score %.3f kl %.4f len %.1f policy %.4f%s", state.step,
                         total_steps, row["reward_mean"], row["score_mean"], row["kl_to_reference"],
                         row["response_length"], row.get("policy_loss", float("nan")),
                         f" value {row['value_loss']:.4f}" if "value_loss" in row else "")  # fmt: skip
        # 5d. the KL coefficient for the next round (after the log line, which shows the one used in this round)
        kl_ctl.update(round_kl / max(round_rows, 1.0), n_steps=int(round_rows))
        # 5e. evaluate on held-out prompts
        if run.eval_interval and state.step % run.eval_interval == 0 and state.step < total_steps:
            evaluate(state.step)
        # 5f. checkpoint actor + critic + state (only between PPO rounds: the buffer is empty there)
        if not buffer:
            state.extra = {"kl_controller": kl_ctl.state_dict()}
            with sw("checkpoint"):
                T.maybe_checkpoint(engines, run, state, total_steps)
        if state.step >= total_steps:
            break
    bar.close()

    # ---------------------------------------------------------------- 6. final evaluation and save
    eval_end = evaluate(state.step)
    out = Path(run.output_dir)
    with sw("export"):
        export_hf_model(actor.module, tokenizer, out / "actor")
        if critic is not None:
            export_hf_model(critic.module.model, tokenizer, out / "critic")
        if ema is not None:
            ema.export(actor.module, tokenizer, out / "actor_ema")
    timing = trainer.timing
    summary = {
        "step": 3,
        "steps": state.step,
        "reward_start": (first_round or {}).get("reward_mean"),
        "reward_end": last_round.get("reward_mean"),
        "score_start": (first_round or {}).get("score_mean"),
        "score_end": last_round.get("score_mean"),
        "kl_end": last_round.get("kl_to_reference"),
        # the signs of collapse or of gaming the length: sampled answers' entropy, length and cut-off share
        **{
            f"{k}_{when}": r.get(k)
            for k in ("entropy", "response_length", "truncated_fraction")
            for when, r in (("start", first_round or {}), ("end", last_round))
        },
        "held_out_reward_start": eval_start.get("held_out_reward"),
        "held_out_reward_end": eval_end.get("held_out_reward"),
        "held_out_judge_score_start": eval_start.get("held_out_judge_score"),
        "held_out_judge_score_end": eval_end.get("held_out_judge_score"),
        "judge_score_start": (first_round or {}).get("judge_score_mean"),
        "judge_score_end": last_round.get("judge_score_mean"),
        "true_accuracy_start": eval_start.get("true_accuracy"),
        "true_accuracy_end": eval_end.get("true_accuracy"),
        "true_accuracy_sampled_start": eval_start.get("true_accuracy_sampled"),
        "true_accuracy_sampled_end": eval_end.get("true_accuracy_sampled"),
        "generation_tokens_per_sec": trainer.generated_tokens / max(timing["generation"], 1e-9),
        "generation_seconds": timing["generation"],
        "experience_seconds": timing["experience"],
        "train_seconds": timing["train"],
        "wall_seconds": sw.wall(),
        "seconds_by_phase": {**sw.totals, **timing},
        "dtype": dtype,
        "world_size": world,
        "actor_zero_stage": eng_args.actor_zero_stage,
        "critic_zero_stage": eng_args.critic_zero_stage,
        "kl_coef_end": kl_ctl.value,
        "resumed_from_step": start_step if run.resume else None,
    }
    summary.update(
        {
            f"{k}_end": v
            for k, v in eval_end.items()
            if k.startswith(("true_accuracy/", "true_accuracy_sampled/"))
        }
    )
    summary.update(generator.stats())  # hybrid engine: switches, memory, generation/training log-prob check
    metrics.close()
    write_summary(run.output_dir, summary)
    log.info("done: reward %s -> %s, true accuracy %s -> %s, KL %s; actor saved to %s", summary["reward_start"],
             summary["reward_end"], summary["true_accuracy_start"], summary["true_accuracy_end"], summary["kl_end"],
             out / "actor")  # fmt: skip
    return 0


if __name__ == "__main__":
    run_cli(main)
