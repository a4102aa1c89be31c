"""The models of step 3 and how they are built: the actor (trained), the reference (frozen copy, or
the actor with its LoRA adapter disabled), the critic (trained, per-token values; none for the
critic-free estimators), the reward model (frozen) and the judge (frozen, scored beside the reward),
each a DeepSpeed engine; then the generator over the actor and the PPO trainer over all of them.

    o = RLHFOptions(*parsed_groups)
    check_options(o)
    paths, tokenizer, fmt = resolve_models(o)          # checked before any engine starts
    models = build_models(o, paths, tokenizer, fmt, dtype, actor_updates=..., critic_updates=...)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from dschat import config as C
from dschat import trainer as T
from dschat.data.prompt_format import PromptFormat, prompt_format
from dschat.engine import core as engine_core
from dschat.engine import ds_config as dsc
from dschat.generation.decoding import context_length
from dschat.generation.hybrid import HybridGenerator
from dschat.generation.plain import PlainGenerator
from dschat.generation.sampling import SamplingConfig
from dschat.inputs import check_model, check_output_apart
from dschat.models.loading import (
    check_same_tokenizer,
    has_value_head,
    load_causal_lm,
    load_config,
    load_tokenizer,
    resolve,
)
from dschat.models.reward import ScalarHeadModel, ScoreNormalization, load_reward_model
from dschat.rlhf import ppo_math as M
from dschat.rlhf.ppo import PPOHyper, PPOTrainer
from dschat.rlhf.rewards import FunctionSource, RewardModelSource, SumSource
from dschat.utils.errors import UserError


@dataclass
class RLHFOptions:
    """The parsed option groups of step 3."""

    actor: C.ModelArgs
    critic: C.ModelArgs
    actor_lora: C.LoraArgs
    critic_lora: C.LoraArgs
    actor_optim: C.OptimizerArgs
    critic_optim: C.OptimizerArgs
    actor_ds: C.DeepSpeedArgs
    critic_ds: C.DeepSpeedArgs
    engine: C.RLHFEngineArgs
    ppo: C.PPOArgs
    data: C.DataArgs
    run: C.RunArgs

    @property
    def held(self) -> C.Step3Models:
        """Which models the step holds (the memory planner counts the same description)."""
        return C.step3_models(self.engine, self.ppo)

    @property
    def use_critic(self) -> bool:
        """Only ``gae`` has a critic; rloo, group_norm and dr_grpo need no value model."""
        return self.held.critic


@dataclass
class ModelPaths:
    """Where each model comes from, resolved (hub name, local directory or GGUF cache entry)."""

    actor: str
    critic: str | None  # None: no critic (critic-free estimators)
    reward: str | None  # None: no reward model (--reward_fn ... --reward_fn_mode replace)
    judge: str | None  # scored beside the reward, never optimised
    # --normalize_reward: the reward model's saved score mean and std (read before any slow start-up)
    reward_normalization: ScoreNormalization | None = None


@dataclass
class Models:
    actor: Any  # DeepSpeed engine
    reference: Any  # frozen engine, or None: the actor with its LoRA adapter disabled
    critic: Any  # DeepSpeed engine over a ScalarHeadModel, or None (critic-free estimators)
    reward: Any  # reward source: the frozen reward model, --reward_fn, or their sum
    judge: Any  # a second frozen reward model (--judge_reward_model), or None
    ema: Any  # EMA of the actor's weights (--enable_ema), or None

    def engines(self) -> dict[str, Any]:
        """The trained engines, saved in checkpoints."""
        return {"actor": self.actor, **({"critic": self.critic} if self.critic is not None else {})}


def check_options(o: RLHFOptions) -> None:
    """The rules that span several groups (each group checked its own options when parsed)."""
    only_lora = o.actor_lora.only_optimize_lora
    if only_lora and not (o.actor_lora.lora_dim or o.critic_lora.lora_dim):
        raise UserError("--only_optimize_lora needs --actor_lora_dim or --critic_lora_dim > 0")
    if o.ppo.normalize_reward and not o.held.reward_model:
        raise UserError(f"--normalize_reward standardises a reward model's scores, and --reward_fn {o.ppo.reward_fn} "
                        "--reward_fn_mode replace uses none: drop one of them")  # fmt: skip
    if o.engine.share_reference_with_actor and not (o.actor_lora.lora_dim and only_lora):
        raise UserError("--share_reference_with_actor needs --actor_lora_dim > 0 and --only_optimize_lora "
                        "(otherwise the base weights move and are no longer the reference)")  # fmt: skip


def held_model_specs(o: RLHFOptions) -> dict[str, tuple[str, str]]:
    """``role -> (model spec as given, the flag that gave it)`` for every model the step holds
    (:attr:`RLHFOptions.held`): the one place that knows the reward model defaults to the critic's path,
    and that no critic or reward model is read with ``--reward_fn ... --reward_fn_mode replace`` and a
    critic-free estimator."""
    held, critic = o.held, (o.critic.model_name_or_path, "--critic_model_name_or_path")
    specs = {"actor": (o.actor.model_name_or_path, "--actor_model_name_or_path")}
    if held.critic:
        specs["critic"] = critic
    if held.reward_model:
        given = o.engine.reward_model_name_or_path
        specs["reward"] = (given, "--reward_model_name_or_path") if given else critic
    if held.judge:
        specs["judge"] = (o.engine.judge_reward_model, "--judge_reward_model")
    return specs


def check_model_paths(o: RLHFOptions) -> None:
    """Every model the step holds names something that can exist, checked before the process group
    starts (:func:`dschat.inputs.check_model`)."""
    held = held_model_specs(o).values()
    for spec, flag in held:
        check_model(spec, flag)
    check_output_apart(o.run.output_dir, held)


def resolve_models(o: RLHFOptions) -> tuple[ModelPaths, Any, PromptFormat]:
    """The models' locations, the actor's tokenizer (left padding, for generation) and prompt format.
    Every model that scores the actor's token ids is checked here, before minutes of engine start-up."""
    specs = held_model_specs(o)
    where = {role: resolve(spec, flag) for role, (spec, flag) in specs.items()}
    paths = ModelPaths(where["actor"], where.get("critic"), where.get("reward"), where.get("judge"))
    tokenizer = load_tokenizer(paths.actor, trust_remote_code=o.actor.trust_remote_code, padding_side="left",
                               flag="--actor_model_name_or_path")  # fmt: skip
    # the critic reads the actor's token ids as the reward model does (each model checked once)
    checked = {paths.actor}
    for role in ("critic", "reward"):
        if role in specs and where[role] not in checked:
            checked.add(where[role])
            check_same_tokenizer(where[role], specs[role][1], tokenizer, owner="actor", owner_path=paths.actor,
                                 trust_remote_code=o.actor.trust_remote_code)  # fmt: skip
    if paths.reward and o.ppo.normalize_reward:
        paths.reward_normalization = ScoreNormalization.read(paths.reward, specs["reward"][1])
    if paths.judge:
        if not has_value_head(paths.judge):
            raise UserError(f"--judge_reward_model {o.engine.judge_reward_model}: not a trained reward model (no "
                            "1-label sequence-classification config.json; pass a step-2 output directory)")  # fmt: skip
        check_same_tokenizer(paths.judge, "--judge_reward_model", tokenizer, owner="actor", owner_path=paths.actor,
                             trust_remote_code=o.critic.trust_remote_code)  # fmt: skip
    check_context(o, paths, specs, tokenizer)
    return paths, tokenizer, prompt_format(tokenizer, o.data.chat_template)


def check_context(o: RLHFOptions, paths: ModelPaths, specs: dict[str, tuple[str, str]], tokenizer) -> None:
    """A rollout (the longest prompt and every new token) must fit every model that reads it: past a
    learned position table (GPT-2, OPT) the first long rollout is an IndexError rounds into the run, and a
    RoPE model runs past the context it was trained on unwarned."""
    need = o.ppo.max_prompt_seq_len + o.ppo.max_answer_seq_len
    for role, path in (("actor", paths.actor), ("critic", paths.critic), ("reward model", paths.reward),
                       ("judge", paths.judge)):  # fmt: skip
        if not path:
            continue
        flag = specs[role.split()[0]][1]
        limit = context_length(
            load_config(path, trust_remote_code=o.actor.trust_remote_code, flag=flag), tokenizer
        )
        if need > limit:
            raise UserError(f"--max_prompt_seq_len {o.ppo.max_prompt_seq_len} + --max_answer_seq_len "
                            f"{o.ppo.max_answer_seq_len} = {need}: more than the {role} ({path}) attends to "
                            f"({limit} positions)")  # fmt: skip


def optim_for(o: RLHFOptions, optimizer: C.OptimizerArgs) -> C.OptimArgs:
    """The engine-level optimizer options of actor or critic (micro-batch = the PPO minibatch)."""
    return C.OptimArgs.of(optimizer, per_device_train_batch_size=o.ppo.per_device_training_batch_size)


def frozen_reward_model(path: str, flag: str, o: RLHFOptions, tokenizer, dtype: str,
                        normalization: ScoreNormalization | None = None) -> RewardModelSource:  # fmt: skip
    """A trained reward model (the reward, or the judge) as a frozen engine behind the reward-source
    call: at ZeRO-3 when the critic is, else unpartitioned; its scores standardised by ``normalization``."""
    frozen = dict(zero_stage=dsc.frozen_stage(o.critic_ds.zero_stage), offload=o.engine.offload_reward_model,
                  dtype=dtype, micro_batch=o.ppo.per_device_generation_batch_size)  # fmt: skip
    with engine_core.zero3_loading(T.frozen_ds_config(**frozen)):
        model = load_reward_model(path, tokenizer=tokenizer, trust_remote_code=o.critic.trust_remote_code,
                                  require_trained_head=True, flag=flag)  # fmt: skip
    return RewardModelSource(T.build_frozen_engine(model, **frozen), normalization)


def build_models(
    o: RLHFOptions,
    paths: ModelPaths,
    tokenizer,
    fmt: PromptFormat,
    dtype: str,
    *,
    actor_updates: int,
    critic_updates: int,
) -> Models:
    """The engines; ``actor_updates`` and ``critic_updates`` (optimizer steps) size the learning-rate
    schedules. ``fmt``: the actor's prompt format (where a ``--reward_fn`` cuts a reply in text)."""
    eng, ppo = o.engine, o.ppo
    actor_optim, actor_ds = optim_for(o, o.actor_optim), o.actor_ds
    actor_cfg = T.train_ds_config(actor_optim, actor_ds, dtype)
    with engine_core.zero3_loading(actor_cfg):
        actor_model = load_causal_lm(paths.actor, tokenizer=tokenizer, dropout=o.actor.dropout,
                                     trust_remote_code=o.actor.trust_remote_code, flag="--actor_model_name_or_path")  # fmt: skip
    actor_model = T.set_trainable(
        actor_model, o.actor_lora, prefix="actor_", trainable_layers=o.actor.trainable_layers
    )
    actor = T.build_engine(actor_model, optim=actor_optim, ds=actor_ds, lora=o.actor_lora, ds_config=actor_cfg,
                           total_steps=actor_updates, gradient_checkpointing=o.actor.gradient_checkpointing)  # fmt: skip

    reference = None
    if o.held.reference:
        frozen = dict(zero_stage=dsc.frozen_stage(actor_ds.zero_stage), offload=eng.offload_reference_model,
                      dtype=dtype, micro_batch=ppo.per_device_generation_batch_size)  # fmt: skip
        with engine_core.zero3_loading(T.frozen_ds_config(**frozen)):
            ref_model = load_causal_lm(paths.actor, tokenizer=tokenizer, trust_remote_code=o.actor.trust_remote_code,
                                       flag="--actor_model_name_or_path")  # fmt: skip
        reference = T.build_frozen_engine(ref_model, **frozen)

    critic = None
    if o.use_critic:
        critic_optim, critic_ds = optim_for(o, o.critic_optim), o.critic_ds
        critic_cfg = T.train_ds_config(critic_optim, critic_ds, dtype)
        with engine_core.zero3_loading(critic_cfg):
            critic_hf = load_reward_model(paths.critic, tokenizer=tokenizer, dropout=o.critic.dropout,
                                          trust_remote_code=o.critic.trust_remote_code, flag="--critic_model_name_or_path").model  # fmt: skip
        # the critic starts from the reward model, whose score statistics will not describe its values
        ScoreNormalization.clear(critic_hf.config)
        critic_hf = T.set_trainable(critic_hf, o.critic_lora, prefix="critic_", keep_trainable=("score.",),
                                    trainable_layers=o.critic.trainable_layers)  # fmt: skip
        critic = T.build_engine(ScalarHeadModel(critic_hf), optim=critic_optim, ds=critic_ds, lora=o.critic_lora,
                                ds_config=critic_cfg, total_steps=critic_updates,
                                gradient_checkpointing=o.critic.gradient_checkpointing)  # fmt: skip

    sources = []
    if o.held.reward_model:
        sources.append(frozen_reward_model(paths.reward, "--reward_model_name_or_path", o, tokenizer, dtype,
                                           paths.reward_normalization))  # fmt: skip
    if ppo.reward_fn:
        sources.append(FunctionSource(ppo.reward_fn, stop_strings=fmt.stop_strings))
    reward = sources[0] if len(sources) == 1 else SumSource(*sources)
    judge = (
        frozen_reward_model(paths.judge, "--judge_reward_model", o, tokenizer, dtype) if paths.judge else None
    )
    ema = None
    if eng.enable_ema:
        from dschat.engine.ema import EMA

        ema = EMA(actor.module, eng.ema_decay)
    return Models(actor, reference, critic, reward, judge, ema)


def make_generator(
    o: RLHFOptions, actor, tokenizer, sampling: SamplingConfig, fmt: PromptFormat
) -> HybridGenerator | PlainGenerator:
    """The hybrid engine (fast generation from the training weights), or plain ``generate``; either stops
    a rollout at the prompt format's stop tokens (a chat template's end of turn as well as the EOS), where
    step 1 taught the policy to end its answers."""
    eng, zero3 = o.engine, o.actor_ds.zero_stage == 3
    if not eng.enable_hybrid_engine:
        return PlainGenerator(actor, tokenizer, sampling, zero3=zero3, stop_ids=fmt.stop_ids)
    return HybridGenerator(actor, tokenizer, sampling, zero3=zero3, gather=engine_core.gather_zero3, stop_ids=fmt.stop_ids,
                           tp_size=eng.inference_tp_size, gather_layers=eng.tp_gather_partition_size,
                           release_cache=eng.release_inference_cache, unpin=eng.unpin_actor_parameters)  # fmt: skip


def make_trainer(o: RLHFOptions, m: Models, generator, tokenizer) -> PPOTrainer:
    ppo = o.ppo
    kl_ctl = (M.AdaptiveKLController(ppo.kl_coef, ppo.kl_target, ppo.kl_horizon) if ppo.kl_target
              else M.FixedKLController(ppo.kl_coef))  # fmt: skip
    hyper = PPOHyper(clip_reward_value=ppo.clip_reward_value, cliprange=ppo.cliprange,
                     cliprange_value=ppo.cliprange_value, gamma=ppo.gamma, lam=ppo.lam,
                     whiten_advantages=ppo.whiten_advantages, unsup_coef=ppo.unsup_coef,
                     n_samples_per_prompt=ppo.n_samples_per_prompt, advantage_estimator=ppo.advantage_estimator,
                     temperature=ppo.temperature, filter_uniform_groups=ppo.filter_uniform_groups,
                     cliprange_high=ppo.cliprange_high, loss_agg=ppo.loss_agg, max_answer_len=ppo.max_answer_seq_len,
                     kl_estimator=ppo.kl_estimator, kl_in=ppo.kl_in, truncation_penalty=ppo.truncation_penalty,
                     share_prompt=ppo.share_prompt, share_frozen_trunk=ppo.share_frozen_trunk,
                     generation_batches=ppo.generation_batches, one_update_per_round=C.one_update_per_round(o.ppo, o.actor, o.actor_lora, o.actor_ds.zero_stage),
                     critic_one_update_per_round=C.one_update_per_round(o.ppo, o.critic, o.critic_lora, o.critic_ds.zero_stage))  # fmt: skip
    return PPOTrainer(actor=m.actor, reference=m.reference, critic=m.critic, reward_source=m.reward,
                      generator=generator, tokenizer=tokenizer, hyper=hyper, kl_ctl=kl_ctl, judge=m.judge,
                      after_actor_step=(lambda: m.ema.update(m.actor.module)) if m.ema is not None else None)  # fmt: skip
