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

The recipe, top to bottom: :func:`main` checks the options and resolves the models
(:mod:`dschat.rlhf.models`), plans the rounds (:func:`plan_rounds`), builds the models, the generator
and the trainer, evaluates (:class:`~dschat.rlhf.held_out.HeldOutEval`), runs :func:`ppo_round` until
the last round, evaluates again and saves.
"""

from __future__ import annotations

import dataclasses
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # runnable as a plain script

import torch
from tqdm import tqdm

from dschat import config as C
from dschat import step_setup as S
from dschat import trainer as T
from dschat.config.fields import flag_name
from dschat.data.collate import PromptCollator, SFTCollator
from dschat.data.pipeline import prepare_prompt_data, prepare_sft_data
from dschat.engine import core as engine_core
from dschat.engine.checkpoint import export_hf_model
from dschat.engine.ema import CHECKPOINT_NAME as EMA_NAME
from dschat.inputs import DATA, FUNCTION, check_inputs
from dschat.lm import train_loader
from dschat.models.loading import count_parameters
from dschat.rlhf import ppo_math as M
from dschat.rlhf.experience import Experience
from dschat.rlhf.held_out import HeldOutEval
from dschat.rlhf.models import (
    ModelPaths,
    Models,
    RLHFOptions,
    build_models,
    check_model_paths,
    check_options,
    make_generator,
    make_trainer,
    resolve_models,
)
from dschat.rlhf.ppo import PPOTrainer, update_batch
from dschat.tasks.accuracy import answers_cut_by_budget
from dschat.utils import dist
from dschat.utils.errors import UserError, run_cli
from dschat.utils.metrics import setup_logging
from dschat.utils.run import (
    STEP3_MODEL_DIRS,
    Stopwatch,
    check_output_dir,
    input_runs,
    save_resolved_config,
    write_summary,
)

SHARED_MODEL = ("dtype", "trust_remote_code")
# learning rate and weight decay per model; one schedule, one clipping norm and one Adam for both
SHARED_OPTIMIZER = ("adam_beta1", "adam_beta2", "lr_scheduler_type", "num_warmup_steps", "max_grad_norm")
GROUPS = (
    (C.ModelArgs, "actor_", SHARED_MODEL),
    (C.ModelArgs, "critic_", SHARED_MODEL),
    (C.LoraArgs, "actor_", ("only_optimize_lora",)),
    (C.LoraArgs, "critic_", ("only_optimize_lora",)),
    (C.OptimizerArgs, "actor_", SHARED_OPTIMIZER),
    (C.OptimizerArgs, "critic_", SHARED_OPTIMIZER),
    (C.DeepSpeedArgs, "actor_", ("offload",)),  # the reference follows the actor's stage
    (C.DeepSpeedArgs, "critic_", ("offload",)),  # the reward model and the judge follow the critic's
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
    # DeepSpeed-Chat's PPO learning rates: the critic, fresh value head on a reward model, moves slower
    (C.OptimizerArgs, "actor_"): {"learning_rate": 9.65e-6},
    (C.OptimizerArgs, "critic_"): {"learning_rate": 5e-6},
}


@dataclass
class Rounds:
    """The PPO schedule: prompt batches, their count and the optimizer steps they lead to."""

    loader: Any  # batches of prompts: input_ids (B, P) left-padded, attention_mask (B, P), prompts
    total: int  # generation rounds of the run
    actor_updates: int  # optimizer steps, the lengths of the learning-rate schedules
    critic_updates: int
    unsup: Any  # an endless iterator of SFT micro-batches (--unsupervised_dataset_name) or None
    # where ``unsup`` stands (epoch, micro-batch): saved with every checkpoint, so a resumed run goes on
    # with the SFT batches the uninterrupted one would read, not from the first again
    unsup_position: T.TrainState | None = None

    def save_unsup_position(self, state: T.TrainState) -> None:
        if self.unsup_position is not None:  # every field the loader's TrainState has, but its own extra
            saved = self.unsup_position.to_client_state()
            state.extra[PTX_POSITION] = {k: v for k, v in saved.items() if k != "extra"}

    def restore_unsup_position(self, state: T.TrainState) -> None:
        """Before the iterator's first batch (a generator reads its position when it starts). The position
        is one in the PTX set the checkpoint read: another set (another size: a traceback from the sampler
        before; as many other rows: another order, silently) is refused."""
        if self.unsup_position is None or PTX_POSITION not in state.extra:
            return
        saved, now = state.extra[PTX_POSITION], self.unsup_position
        if changed := T.changed_set(saved, now.train_examples, now.train_fingerprint):
            raise UserError(
                f"--resume: the --unsupervised_dataset_name data is not the checkpoint's (it had "
                f"{saved['train_examples']} examples, this run has {now.train_examples}"
                + (", as many but other ones" if changed == "content" else "")
                + "): resume on the same data, or start over with --overwrite"
            )
        for k, v in saved.items():
            setattr(now, k, v)


PTX_POSITION = "ptx_position"
PPO_PROGRESS = "ppo_progress"  # seconds per phase and generated tokens (PPOTrainer.progress)


def ptx_data_args(o: RLHFOptions) -> C.DataArgs:
    """The PTX term's SFT data (``--unsupervised_dataset_name``, all of it for training), tokenized as the
    prompts are: the same prompt format (``--chat_template``), length limit and cache."""
    return C.DataArgs(data_path=[o.ppo.unsupervised_dataset_name], data_split="1,0,0", chat_template=o.data.chat_template,
                      data_output_path=o.data.data_output_path, max_seq_len=o.data.max_seq_len,
                      data_seed=o.data.data_seed)  # fmt: skip


def plan_rounds(o: RLHFOptions, prompts, tokenizer) -> Rounds:
    ppo, seed = o.ppo, o.run.seed
    loader = train_loader(prompts.train, batch_size=ppo.per_device_generation_batch_size, seed=seed,
                          collate=PromptCollator(tokenizer.pad_token_id), accumulation=ppo.generation_batches)  # fmt: skip
    per_epoch = loader.sampler.batches_per_epoch()
    if per_epoch == 0:
        raise UserError(f"{len(prompts.train)} prompts are fewer than one generation batch "
                        f"(--per_device_generation_batch_size {ppo.per_device_generation_batch_size} x "
                        f"{dist.world_size()} ranks)")  # fmt: skip
    total = per_epoch * ppo.num_train_epochs
    total = min(total, ppo.max_steps) if ppo.max_steps else total
    # the schedules' lengths: the optimizer steps the loop will take (the actor's skip the frozen rounds)
    actor_updates, critic_updates = M.ppo_optimizer_steps(
        total, rows_per_round=ppo.rows_per_round,
        generation_batches=ppo.generation_batches, micro_batch=ppo.per_device_training_batch_size,
        ppo_epochs=ppo.ppo_epochs, freezing_actor_steps=ppo.freezing_actor_steps,
    )  # fmt: skip
    if ppo.unsupervised_dataset_name:
        sft = prepare_sft_data(ptx_data_args(o), tokenizer, phase=1)
        sft_loader = train_loader(sft.train, batch_size=ppo.per_device_training_batch_size, seed=seed,
                                  collate=SFTCollator(tokenizer.pad_token_id))  # fmt: skip
        examples, fingerprint = T.training_set(sft_loader)
        position = T.TrainState(train_examples=examples, train_fingerprint=fingerprint)
        return Rounds(loader, total, actor_updates, critic_updates,
                      T.micro_batches(sft_loader, position, num_epochs=10**9), position)  # fmt: skip
    return Rounds(loader, total, actor_updates, critic_updates, unsup=None)


def ppo_round(o: RLHFOptions, trainer: PPOTrainer, m: Models, batch: dict, buffer: list[Experience], rounds: Rounds,
              state: T.TrainState, window: T.MetricWindow, pad_id: int) -> tuple[float, int]:  # fmt: skip
    """One generation round: experience (generate, then log-probs of actor and reference, values,
    scores, rewards, advantages); once ``--generation_batches`` rounds are collected, ``--ppo_epochs``
    over them in minibatches. Returns the round's mean KL per sequence over all ranks and the sequence
    count, for the KL controller."""
    ppo, device = o.ppo, m.actor.device
    train_actor = state.step + 1 > ppo.freezing_actor_steps  # this round's, counted from 1
    exp, stats = trainer.make_experience(batch["input_ids"].to(device), batch["attention_mask"].to(device),
                                         batch["prompts"], train_actor=train_actor)  # fmt: skip
    window.add(**stats)
    # this round's mean KL per sequence over all ranks: the adaptive controller takes it at the update
    round_kl, round_rows = dist.all_reduce_sum([stats["kl_sum"], stats["rows"]])
    buffer.append(exp)
    state.step += 1
    if len(buffer) == ppo.generation_batches:
        collected = update_batch(buffer, pad_id, ppo.whiten_advantages)
        buffer.clear()
        mb = ppo.per_device_training_batch_size
        for _ in range(ppo.ppo_epochs):
            for s in range(0, len(collected), mb):
                # the PTX term trains the actor only: a frozen round reads no SFT batch (the run's PTX data
                # starts where the actor starts learning)
                ptx = rounds.unsup is not None and train_actor
                unsup = {k: v.to(device) for k, v in next(rounds.unsup).items()} if ptx else None
                stats = trainer.train(collected.slice(s, s + mb), unsup, train_actor=train_actor)
                window.add(updates=1, actor_updates=float("policy_loss" in stats), **stats)
    return round_kl / max(round_rows, 1.0), int(round_rows)


def ends(keys: dict[str, str], start: dict, end: dict) -> dict[str, Any]:
    """``{name_start: start[key], name_end: end[key]}`` for each ``name: key`` of ``keys``."""
    return {
        f"{name}_{when}": r.get(key)
        for name, key in keys.items()
        for when, r in (("start", start), ("end", end))
    }


def summarize(first: dict, last: dict, eval_start: dict, eval_end: dict, trainer: PPOTrainer, o: RLHFOptions,
              state: T.TrainState, start_step: int, sw: Stopwatch, dtype: str) -> dict[str, Any]:  # fmt: skip
    """summary.json: start and end of the train rows and of the held-out evaluation, time and engines."""
    timing = trainer.timing
    # the rollouts' reward and scores; and the signs of collapse or of gaming the length: sampled
    # answers' entropy, length and cut-off share
    train = {"reward": "reward_mean", "score": "score_mean", "judge_score": "judge_score_mean", "entropy": "entropy",
             "response_length": "response_length", "truncated_fraction": "truncated_fraction",
             "clipped_score_fraction": "clipped_score_fraction"}  # fmt: skip
    held_out = ("held_out_reward", "held_out_judge_score", "true_accuracy", "true_accuracy_sampled")
    (generated,) = dist.all_reduce_sum([trainer.generated_tokens])  # collective: every rank summarizes
    per_task = {  # each task's, at start and end (the names steps 1 and DPO write too)
        f"{k}_{when}": v
        for when, r in (("start", eval_start), ("end", eval_end))
        for k, v in r.items()
        if k.startswith(("true_accuracy/", "true_accuracy_sampled/"))
    }
    return {
        "step": 3, "steps": state.step, **ends(train, first, last), "kl_end": last.get("kl_to_reference"),
        **ends({k: k for k in held_out}, eval_start, eval_end), **per_task,
        "generated_tokens": generated,  # every rank's
        "generation_tokens_per_sec": generated / max(timing["generation"], 1e-9),
        **{f"{k}_seconds": v for k, v in timing.items()}, "wall_seconds": sw.wall(),
        "seconds_by_phase": {**sw.totals, **timing}, "dtype": dtype, "world_size": dist.world_size(),
        "actor_zero_stage": o.actor_ds.zero_stage, "critic_zero_stage": o.critic_ds.zero_stage,
        "kl_coef_end": trainer.kl_ctl.value, "resumed_from_step": start_step if o.run.resume else None,
        # optimizer steps DeepSpeed skipped (inf/NaN gradients; in fp16 also the loss scale's search)
        **{f"{name}_skipped_steps": watch.count for name, watch in trainer.skipped.items()},
        **trainer.generator.stats(),  # hybrid engine: switches, memory, generation/training log-prob check
        # evaluations where the held-out reward rose while truth or the judge fell beyond noise
        "reward_hacking_signs": state.extra.get("reward_hacking_signs", []),
    }  # fmt: skip


def describe(o: RLHFOptions, m: Models, paths: ModelPaths, dtype: str) -> str:
    """One log line naming the four models, their sizes and ZeRO stages."""
    ppo = o.ppo
    critic = (f"{paths.critic} ({count_parameters(m.critic.module) / 1e6:.2f}M, ZeRO-{o.critic_ds.zero_stage})"
              if m.critic is not None else f"none ({ppo.advantage_estimator}, {ppo.n_samples_per_prompt} samples per prompt)")  # fmt: skip
    reward = (paths.reward or "-") + (f" + {ppo.reward_fn}" if ppo.reward_fn else "")
    reference = "actor without adapter" if m.reference is None else "frozen copy"
    return (f"actor {paths.actor} ({count_parameters(m.actor.module) / 1e6:.2f}M, ZeRO-{o.actor_ds.zero_stage}), "
            f"critic {critic}, reward {reward}, reference {reference}, dtype {dtype}, {dist.world_size()} rank(s)")  # fmt: skip


def resume(m: Models, trainer: PPOTrainer, run: C.RunArgs, global_batch: int, loader) -> T.TrainState:
    """The run's state: fresh, or (``--resume``) the latest checkpoint's (on ``loader``'s prompts), with the
    KL controller's."""
    state = T.resume_state(m.engines(), run, global_batch, *T.training_set(loader))
    if m.ema is not None and run.resume:
        m.ema.restore(lambda: T.resumed_tensors(run, EMA_NAME), f"checkpoint step{state.step}")
    if PPO_PROGRESS in state.extra:
        trainer.load_progress(state.extra[PPO_PROGRESS])
    if "kl_controller" in state.extra:
        trainer.kl_ctl.load_state_dict(state.extra["kl_controller"])
    elif "kl_coef" in state.extra:  # a checkpoint written before the controller saved its own state
        trainer.kl_ctl.load_state_dict({"value": state.extra["kl_coef"]})
    return state


def export(m: Models, tokenizer, out: Path) -> None:
    """The actor, the critic and the actor's EMA in Hugging Face format."""
    export_hf_model(m.actor.module, tokenizer, out / "actor")
    if m.critic is not None:
        export_hf_model(m.critic.module.model, tokenizer, out / "critic")
    if m.ema is not None:
        m.ema.export(m.actor.module, tokenizer, out / "actor_ema")


def critic_only_flags() -> frozenset[str]:
    """The flags only a trained critic reads (``--advantage_estimator gae``): its model options but its
    path (the reward model's default) and the shared ones, its LoRA, learning rate and weight decay,
    GAE's lambda, the value clip and the critic-alone warm-up. Its ZeRO stage is the reward model's too."""
    out = {"--lam", "--cliprange_value", "--freezing_actor_steps"}
    for spec in GROUPS:
        if isinstance(spec, tuple) and spec[1] == "critic_" and spec[0] is not C.DeepSpeedArgs:
            cls, prefix, shared = spec
            out |= {flag_name(f.name, prefix, frozenset(shared)) for f in dataclasses.fields(cls)
                    if f.name not in shared and f.name != "model_name_or_path"}  # fmt: skip
    return frozenset(out)


def check_groups(groups: tuple) -> None:
    """The rules across this step's option groups (:func:`check_options`): train.py runs them on the step's
    command line before a job's first step, so a three-step job does not fail after steps 1 and 2. A
    critic-free estimator refuses the critic's options (given, they would be read by nothing)."""
    o = RLHFOptions(*groups)
    check_options(o)
    o.data.refuse_step1_only("step 3")
    if o.use_critic:
        return
    defaults = C.parse_groups("step3_rlhf_finetuning", "", GROUPS, [], STEP_DEFAULTS)
    only = critic_only_flags()
    for spec, group, default in zip(GROUPS, groups, defaults, strict=True):
        _, prefix, shared = (spec, "", ()) if isinstance(spec, type) else spec
        for f in dataclasses.fields(group):
            flag = flag_name(f.name, prefix, frozenset(shared))
            if flag in only and getattr(group, f.name) != getattr(default, f.name):
                raise UserError(f"{flag} is the critic's, and --advantage_estimator {o.ppo.advantage_estimator} "
                                "trains none (only gae has a critic)")  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    groups = C.parse_groups("step3_rlhf_finetuning", __doc__.split("\n\n")[0], GROUPS, argv, STEP_DEFAULTS)
    o = RLHFOptions(*groups)
    ppo, run = o.ppo, o.run
    # 1. setup: checks across groups, the inputs named, then every model and the data, before any engine starts
    check_groups(groups)
    check_inputs(GROUPS, groups, kinds=(DATA, FUNCTION))
    C.check_resume(GROUPS, groups, run.output_dir, run.resume)  # the interrupted run's options
    check_model_paths(o)
    log = setup_logging(None)
    check_output_dir(run.output_dir, overwrite=run.overwrite, resume=run.resume)
    engine_core.init_distributed()
    dist.set_node_local_storage(run.node_local_storage)  # which ranks write files, the DeepSpeed config
    dtype = engine_core.resolve_dtype(o.actor.dtype, "--dtype")
    world = dist.world_size()
    torch.manual_seed(run.seed)
    paths, tokenizer, fmt = resolve_models(o)
    norm = asdict(paths.reward_normalization) if paths.reward_normalization else None
    if norm:
        log.info("--normalize_reward: the reward model's scores become (score - %.3f) / %.3f (step 2 measured them "
                 "on %s)", norm["mean"], norm["std"], norm["source"])  # fmt: skip
    prompts = prepare_prompt_data(o.data, tokenizer, max_prompt_len=ppo.max_prompt_seq_len, phase=3)  # fmt: skip
    rounds = plan_rounds(o, prompts, tokenizer)
    # 2. the four models, the generator and the trainer
    m = build_models(o, paths, tokenizer, fmt, dtype, actor_updates=rounds.actor_updates,
                     critic_updates=rounds.critic_updates)  # fmt: skip
    # the outputs begin (a finished run is cleared under --overwrite) only once the models have taken every
    # flag checked against them (--actor_trainable_layers, --actor_lora_module_name ...)
    S.begin_outputs(run, STEP3_MODEL_DIRS)
    global_batch = ppo.per_device_generation_batch_size * world
    resolved = {
        "step": 3, "actor": C.to_dict(o.actor, o.actor_lora, o.actor_optim, o.actor_ds),
        "critic": C.to_dict(o.critic, o.critic_lora, o.critic_optim, o.critic_ds), **C.to_dict(o.engine, ppo, o.data, run), "resolved_actor_path": paths.actor, "resolved_critic_path": paths.critic,
        "resolved_reward_path": paths.reward, "input_runs": input_runs(paths.actor, paths.critic, paths.reward), "reward_normalization": norm, "resolved_dtype": dtype, "world_size": world, "global_batch_size": global_batch,
        "total_steps": rounds.total, "actor_optimizer_steps": rounds.actor_updates,
        "critic_optimizer_steps": rounds.critic_updates, "data": prompts.stats, "data_cache_hit": prompts.cache_hit,
    }  # fmt: skip
    save_resolved_config(run.output_dir, resolved, resume=run.resume)
    log.info("prompts: %d (dropped %d longer than --max_prompt_seq_len), %d generation rounds of %d prompts",
             len(prompts.train), prompts.stats["train"]["dropped_too_long"], rounds.total, global_batch)  # fmt: skip
    dist.seed_per_rank(run.seed)  # each rank's rollouts its own draws (a resume restores each rank's RNG)
    sampling = ppo.sampling()
    generator = make_generator(o, m.actor, tokenizer, sampling, fmt)
    trainer = make_trainer(o, m, generator, tokenizer)
    log.info(describe(o, m, paths, dtype))

    # 3. resume or start; held-out evaluation
    state = resume(m, trainer, run, global_batch, rounds.loader)
    rounds.restore_unsup_position(state)
    start_step = state.step
    metrics = T.open_metrics(run, resolved, state)
    sw = Stopwatch()
    held_out = prompts.eval_prompts[: ppo.eval_prompts]
    cut, longest = answers_cut_by_budget(tokenizer, held_out, ppo.max_answer_seq_len, fmt)
    if cut:
        log.warning("--max_answer_seq_len %d cuts the right answers of %d of %d held-out prompts (the longest needs %d "
                    "tokens with EOS): they cannot be answered in full", ppo.max_answer_seq_len, cut, len(held_out), longest)  # fmt: skip
    evaluate = HeldOutEval(m.actor, generator, m.reward, m.judge, tokenizer, fmt, held_out, sampling,
                           zero3=o.actor_ds.zero_stage == 3, seed=run.seed, metrics=metrics, timer=sw,
                           batch_rows=min(32, ppo.rows_per_round))  # fmt: skip
    eval_start = T.start_of_run(state, "eval", lambda: evaluate(state.step))
    # later evaluations are compared with the first: reward up while truth or the judge falls (warned)
    evaluate.start, evaluate.signs = eval_start, state.extra.setdefault("reward_hacking_signs", [])

    # 4. PPO rounds: experience, updates, log, KL coefficient, evaluation, checkpoint
    buffer: list[Experience] = []
    window = T.MetricWindow()
    first: dict[str, float] = state.extra.get("first_log_row", {})  # a resumed run's: see T.start_of_run
    last: dict[str, float] = {}
    bar = tqdm(total=rounds.total, initial=state.step, disable=not dist.is_main(), desc="step 3 (PPO)",
               dynamic_ncols=True, mininterval=1.0 if sys.stdout.isatty() else 30.0)  # fmt: skip
    collected_kl: list[tuple[float, int]] = []  # per round in the buffer: its mean KL, its sequences
    for batch in T.micro_batches(rounds.loader, state, ppo.num_train_epochs):
        t0 = time.perf_counter()
        round_kl, round_rows = ppo_round(o, trainer, m, batch, buffer, rounds, state, window, tokenizer.pad_token_id)  # fmt: skip
        collected_kl.append((round_kl, round_rows))
        bar.update(1)
        window.add(round_seconds=time.perf_counter() - t0)
        if T.should_log(state.step, run.log_interval, rounds.total):
            last = trainer.log_row(window.reduce())
            first = T.start_of_run(state, "first_log_row", lambda row=last: row)
            metrics.log(last, step=state.step, split="train")
            bar.set_postfix(reward=f"{last['reward_mean']:.3f}", kl=f"{last['kl_to_reference']:.3f}")
            if not sys.stdout.isatty():
                log.info("step %d/%d reward %.3f score %.3f kl %.4f len %.1f policy %.4f%s", state.step,
                         rounds.total, last["reward_mean"], last["score_mean"], last["kl_to_reference"],
                         last["response_length"], last.get("policy_loss", float("nan")),
                         f" value {last['value_loss']:.4f}" if "value_loss" in last else "")  # fmt: skip
        if not buffer:  # an update: every row of it carried one coefficient; it moves now, by each round
            # in turn, compounded (one linear step over G rounds' rows could cross zero)
            for kl, rows in collected_kl:
                trainer.kl_ctl.update(kl, n_steps=rows)
            collected_kl = []  # after the log line, which shows the coefficient the rows carried
        if run.eval_interval and state.step % run.eval_interval == 0 and state.step < rounds.total:
            evaluate(state.step)
        if not buffer:  # checkpoint only between PPO updates: the buffer is empty every G-th round
            state.extra["kl_controller"] = trainer.kl_ctl.state_dict()
            state.extra[PPO_PROGRESS] = trainer.progress()
            rounds.save_unsup_position(state)
            with sw("checkpoint"):
                T.maybe_checkpoint(m.engines(), run, state, rounds.total,
                                   tensors={EMA_NAME: m.ema.state} if m.ema is not None else None,
                                   since=state.step - ppo.generation_batches)  # fmt: skip
        if state.step >= rounds.total:
            break
    bar.close()

    # 5. final evaluation and save
    eval_end = evaluate(state.step)
    out = Path(run.output_dir)
    with sw("export"):
        export(m, tokenizer, out)
    summary = summarize(first, last, eval_start, eval_end, trainer, o, state, start_step, sw, dtype)
    summary["reward_normalization"] = norm
    metrics.close()
    write_summary(run.output_dir, summary)
    log.info("done: reward %s -> %s, true accuracy %s -> %s, KL %s; actor saved to %s", summary["reward_start"],
             summary["reward_end"], summary["true_accuracy_start"], summary["true_accuracy_end"], summary["kl_end"],
             out / "actor")  # fmt: skip
    return 0


if __name__ == "__main__":
    run_cli(main)
