"""Every command-line option, defined once as typed dataclass fields and shared by all steps.

A step builds its parser from the groups it needs; later steps reuse a group under a prefix
(``--actor_zero_stage`` is :class:`DeepSpeedArgs` with prefix ``actor_``). Validation raises
:class:`UserError` naming the exact flag, and nothing is silently corrected.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import sys
from dataclasses import dataclass, field
from typing import Any, TypeVar

from dschat.generation.sampling import SamplingConfig
from dschat.utils.errors import UserError

T = TypeVar("T")

DTYPES = ("auto", "fp32", "fp16", "bf16")
SCHEDULERS = ("linear", "cosine", "constant", "constant_with_warmup", "cosine_with_restarts", "polynomial")
DEFAULT_MODEL = "builtin:tiny-llama"


def opt(default: Any, help: str, *, type: Any = None, choices: tuple | None = None, nargs: str | None = None):
    """A dataclass field that is also a command-line option."""
    meta = {"help": help, "type": type, "choices": choices, "nargs": nargs}
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata=meta)
    return field(default=default, metadata=meta)


@dataclass
class ModelArgs:
    model_name_or_path: str = opt(
        DEFAULT_MODEL,
        "Hugging Face model name, local directory, or builtin:NAME (built in code, no download)",
    )
    dtype: str = opt(
        "auto", "training dtype; auto = bf16 where the hardware supports it, else fp32", choices=DTYPES
    )
    dropout: float | None = opt(None, "override every dropout probability in the model config", type=float)
    gradient_checkpointing: bool = opt(False, "recompute activations in the backward pass to save memory")
    trainable_layers: int = opt(
        0,
        "train only the top K decoder layers (with the final norm and a reward/value head; LoRA goes into "
        "those K layers only): the embeddings and the layers below are frozen, so the backward pass stops "
        "at the first trainable layer (0 = train every layer)",
    )
    trust_remote_code: bool = opt(
        False, "allow model code from the model repository to run (off: safe default)"
    )

    def validate(self, prefix: str = "", shared: frozenset[str] = frozenset()) -> None:
        if self.dropout is not None and not 0.0 <= self.dropout < 1.0:
            raise UserError(f"--{prefix}dropout must be in [0, 1), got {self.dropout}")
        if self.trainable_layers < 0:
            raise UserError(f"--{prefix}trainable_layers must be >= 0, got {self.trainable_layers}")


@dataclass
class FormatArgs:
    chat_template: str = opt(
        "auto",
        "prompt format: 'on' renders every dialogue with the tokenizer's chat template (an error if it has "
        "none), 'off' uses the Human/Assistant text form, 'auto' the template when there is one",
        choices=("auto", "on", "off"),
    )


@dataclass
class DataArgs(FormatArgs):
    """Data sources and their processing; the prompt format (:class:`FormatArgs`) is part of it."""

    data_path: list[str] = opt(
        ["builtin"],
        "data sources, blended: builtin[:TASK], local .json/.jsonl files or directories, or registered hub names",
        nargs="+",
    )
    data_split: str = opt("2,4,4", "relative shares of every source for steps 1, 2 and 3 (disjoint)")
    sft_only_data_path: list[str] = opt([], "sources used only by step 1, in full", nargs="*")
    max_seq_len: int = opt(512, "longest prompt + response in tokens; longer samples are dropped and counted")
    data_output_path: str = opt(
        "", "cache directory for tokenized data (default: $DSCHAT_CACHE/data, ~/.cache/dschat/data)"
    )
    train_on_prompt: bool = opt(False, "SFT loss on the whole sequence, not only on the response tokens")
    group_by_length: bool = opt(
        False,
        "batch samples of similar length (sorted within groups of 50 batches, batch order shuffled): far less "
        "padding on data of mixed lengths such as HH-RLHF",
    )
    max_eval_samples: int = opt(1000, "cap on evaluation samples (0 = all)")

    def validate(self, prefix: str = "", shared: frozenset[str] = frozenset()) -> None:
        parse_data_split(self.data_split, flag=f"--{prefix}data_split")
        if self.max_seq_len < 8:
            raise UserError(f"--{prefix}max_seq_len must be at least 8, got {self.max_seq_len}")
        if self.max_eval_samples < 0:
            raise UserError(f"--{prefix}max_eval_samples must be >= 0, got {self.max_eval_samples}")


@dataclass
class LoraArgs:
    lora_dim: int = opt(0, "LoRA rank; 0 disables LoRA")
    lora_alpha: float = opt(0.0, "LoRA scaling alpha (0 = same as --lora_dim, i.e. scale 1)")
    lora_dropout: float = opt(0.0, "dropout on the LoRA path")
    lora_module_name: str = opt("layers.", "LoRA is applied to every Linear whose module name contains this")
    only_optimize_lora: bool = opt(False, "freeze the base weights and train only the LoRA matrices")
    lora_learning_rate: float | None = opt(
        None, "learning rate of the LoRA matrices (default: --learning_rate)", type=float
    )

    def validate(self, prefix: str = "", shared: frozenset[str] = frozenset()) -> None:
        if self.lora_dim < 0:
            raise UserError(f"--{prefix}lora_dim must be >= 0, got {self.lora_dim}")
        # A shared --only_optimize_lora (step 3) is checked by the step: it needs LoRA on some model.
        if self.only_optimize_lora and self.lora_dim == 0 and "only_optimize_lora" not in shared:
            raise UserError(
                f"--{prefix}only_optimize_lora needs --{prefix}lora_dim > 0 (there is no LoRA to optimize)"
            )
        if self.lora_learning_rate is not None and self.lora_dim == 0:
            raise UserError(f"--{prefix}lora_learning_rate needs --{prefix}lora_dim > 0")


@dataclass
class OptimArgs:
    per_device_train_batch_size: int = opt(16, "micro-batch size per device for training")
    per_device_eval_batch_size: int = opt(16, "batch size per device for evaluation")
    learning_rate: float = opt(1e-3, "peak learning rate")
    weight_decay: float = opt(0.0, "AdamW weight decay (not applied to biases and norms)")
    adam_beta1: float = opt(0.9, "AdamW beta1")
    adam_beta2: float = opt(0.95, "AdamW beta2")
    num_train_epochs: int = opt(1, "passes over the training data")
    max_steps: int = opt(0, "stop after this many optimizer steps (0 = run all epochs)")
    gradient_accumulation_steps: int = opt(1, "micro-batches per optimizer step")
    lr_scheduler_type: str = opt("cosine", "learning-rate schedule", choices=SCHEDULERS)
    num_warmup_steps: int = opt(0, "linear warm-up steps")
    max_grad_norm: float = opt(1.0, "gradient clipping norm (0 = off)")

    def validate(self, prefix: str = "", shared: frozenset[str] = frozenset()) -> None:
        for name in ("per_device_train_batch_size", "per_device_eval_batch_size", "num_train_epochs",
                     "gradient_accumulation_steps"):  # fmt: skip
            if getattr(self, name) < 1:
                raise UserError(f"--{prefix}{name} must be >= 1, got {getattr(self, name)}")
        for name in ("max_steps", "num_warmup_steps"):
            if getattr(self, name) < 0:
                raise UserError(f"--{prefix}{name} must be >= 0, got {getattr(self, name)}")
        if self.learning_rate <= 0:
            raise UserError(f"--{prefix}learning_rate must be > 0, got {self.learning_rate}")


ZERO_STAGES = (0, 1, 2, 3)


def check_zero_stage(flag: str, value: int) -> None:
    """One clear line for a ZeRO stage outside 0-3 (``flag`` as the user wrote it, e.g. ``--zero_stage``)."""
    if value not in ZERO_STAGES:
        raise UserError(f"{flag} must be 0, 1, 2 or 3, got {value}")


@dataclass
class DeepSpeedArgs:
    zero_stage: int = opt(0, "ZeRO stage: 0, 1, 2 or 3")
    offload: bool = opt(False, "offload optimizer states (and, with ZeRO-3, parameters) to CPU memory")

    def validate(self, prefix: str = "", shared: frozenset[str] = frozenset()) -> None:
        check_zero_stage(f"--{prefix}zero_stage", self.zero_stage)
        if self.offload and self.zero_stage == 0:
            raise UserError(f"--{prefix}offload needs --{prefix}zero_stage 1, 2 or 3 (ZeRO-0 cannot offload)")


@dataclass
class RunArgs:
    output_dir: str = opt("output/step1", "where the model, metrics, logs and checkpoints go")
    seed: int = opt(1234, "random seed (data order, initialisation, dropout)")
    eval_interval: int = opt(100, "evaluate every N optimizer steps (0 = only at start and end)")
    eval_generation_samples: int = opt(
        300, "built-in task prompts answered greedily at start and end to measure true accuracy (0 = off)"
    )
    log_interval: int = opt(10, "write a train line to metrics.jsonl every N optimizer steps")
    save_steps: int = opt(200, "save a resumable checkpoint every N optimizer steps (0 = never)")
    keep_checkpoints: int = opt(2, "how many recent checkpoints to keep")
    resume: bool = opt(False, "continue from the latest checkpoint in OUTPUT_DIR/checkpoints")
    overwrite: bool = opt(False, "replace a finished run in OUTPUT_DIR")
    enable_tensorboard: bool = opt(False, "write TensorBoard scalars")
    tensorboard_path: str | None = opt(
        None, "TensorBoard directory (default OUTPUT_DIR/tensorboard)", type=str
    )
    enable_wandb: bool = opt(False, "log to Weights & Biases (WANDB_MODE=offline works without network)")
    wandb_project: str = opt("dschat", "W&B project name")
    node_local_storage: bool = opt(
        False,
        "no shared filesystem: every node writes its ranks' checkpoint shards, the exported model and "
        "summary.json to its own OUTPUT_DIR (DeepSpeed's use_node_local_storage)",
    )

    def validate(self, prefix: str = "", shared: frozenset[str] = frozenset()) -> None:
        for name in ("eval_interval", "save_steps", "log_interval", "eval_generation_samples"):
            if getattr(self, name) < 0:
                raise UserError(f"--{prefix}{name} must be >= 0, got {getattr(self, name)}")
        if self.keep_checkpoints < 1:
            raise UserError(f"--{prefix}keep_checkpoints must be >= 1, got {self.keep_checkpoints}")
        if self.resume and self.overwrite:
            raise UserError("--resume and --overwrite contradict each other: pick one")


@dataclass
class RewardArgs:
    margin: float = opt(0.0, "ranking margin m in -log sigmoid(r_chosen - r_rejected - m)")
    ranking_loss: str = opt(
        "last_token",
        "last_token = compare the scores at each answer's last token; divergence = compare the running scores at "
        "every position from where the two answers part to the end of the longer one (DeepSpeed-Chat's loss)",
        choices=("last_token", "divergence"),
    )
    length_expert: bool = opt(
        False,
        "debias the reward model against answer length (product of experts): a length-only expert "
        "P(chosen wins) = sigmoid(w * log(len_chosen / len_rejected)) is fitted on the training pairs first, and "
        "the reward model learns only what it does not explain; the saved reward model is used without it, so "
        "PPO is not paid for length alone (w is logged and saved in summary.json)",
    )

    def validate(self, prefix: str = "", shared: frozenset[str] = frozenset()) -> None:
        if self.margin < 0:
            raise UserError(f"--{prefix}margin must be >= 0, got {self.margin}")
        if self.length_expert and self.ranking_loss != "last_token":
            raise UserError(
                f"--{prefix}length_expert compares the final scores: it needs --{prefix}ranking_loss last_token, "
                f"got {self.ranking_loss}"
            )


@dataclass
class PolicyPairsArgs:
    """On-policy pairs for step 2 (reward model or DPO): a policy's own wrong answers as rejected ones."""

    policy_negatives_from: str | None = opt(
        None,
        "a causal LM (e.g. the step-1 model) whose own wrong answers to the built-in tasks' prompts become extra "
        "rejected responses next to the right answer (on-policy pairs, as InstructGPT compared samples of its SFT "
        "model): the reward model (or DPO) then learns from the mistakes the policy makes, not only synthetic ones",
        type=str,
    )
    policy_negatives_per_prompt: int = opt(4, "answers sampled per prompt for --policy_negatives_from")
    policy_negatives_max_prompts: int = opt(
        0, "sample answers to at most this many of the step's training prompts (0 = all)"
    )
    policy_negatives_temperature: float = opt(1.0, "sampling temperature for --policy_negatives_from")
    policy_negatives_max_new_tokens: int = opt(32, "longest sampled answer for --policy_negatives_from")

    def validate(self, prefix: str = "", shared: frozenset[str] = frozenset()) -> None:
        if self.policy_negatives_max_prompts < 0:
            raise UserError(
                f"--{prefix}policy_negatives_max_prompts must be >= 0, got {self.policy_negatives_max_prompts}"
            )
        for name in ("policy_negatives_per_prompt", "policy_negatives_max_new_tokens"):
            if getattr(self, name) < 1:
                raise UserError(f"--{prefix}{name} must be >= 1, got {getattr(self, name)}")
        if self.policy_negatives_temperature <= 0:
            raise UserError(
                f"--{prefix}policy_negatives_temperature must be > 0, got {self.policy_negatives_temperature}"
            )


@dataclass
class DPOArgs:
    """Direct preference optimisation (step 2 with --algorithm dpo): the policy learns from pairs directly."""

    beta: float = opt(0.1, "DPO beta: strength of the implicit KL to the reference (higher = closer to it)")
    dpo_loss: str = opt(
        "sigmoid",
        "sigmoid = DPO's logistic loss; ipo = squared distance of the token-averaged log-ratio margin to "
        "1 / (2 beta) (IPO)",
        choices=("sigmoid", "ipo"),
    )
    label_smoothing: float = opt(
        0.0, "conservative DPO: the share of labels assumed flipped, in [0, 0.5) (sigmoid loss only)"
    )
    sft_coef: float = opt(
        0.0, "weight of the NLL of the chosen answer (per token) added to the loss; 0 = pure DPO"
    )
    ref_model_name_or_path: str | None = opt(
        None,
        "frozen reference model (default: the starting policy, --model_name_or_path); its log-probs of every "
        "pair are computed once before training and kept with the run",
        type=str,
    )

    def validate(self, prefix: str = "", shared: frozenset[str] = frozenset()) -> None:
        if self.beta <= 0:
            raise UserError(f"--{prefix}beta must be > 0, got {self.beta}")
        if not 0 <= self.label_smoothing < 0.5:
            raise UserError(f"--{prefix}label_smoothing must be in [0, 0.5), got {self.label_smoothing}")
        if self.label_smoothing and self.dpo_loss != "sigmoid":
            raise UserError(
                f"--{prefix}label_smoothing applies to --{prefix}dpo_loss sigmoid only, not {self.dpo_loss}"
            )
        if self.sft_coef < 0:
            raise UserError(f"--{prefix}sft_coef must be >= 0, got {self.sft_coef}")


@dataclass
class RLHFEngineArgs:
    """How step 3 places its four models (actor, reference, critic, reward)."""

    reward_model_name_or_path: str | None = opt(
        None, "frozen reward model (default: --critic_model_name_or_path)", type=str
    )
    judge_reward_model: str | None = opt(
        None,
        "a second reward model, trained on other pairs, that scores every rollout and held-out answer beside the "
        "reward but is never optimised: where the reward keeps rising and the judge's score stops, the policy has "
        "started to please its reward model rather than to get better",
        type=str,
    )
    actor_zero_stage: int = opt(0, "ZeRO stage of the actor (the reference uses 3 if this is 3, else 0)")
    critic_zero_stage: int = opt(0, "ZeRO stage of the critic (the reward model uses 3 if this is 3, else 0)")
    offload: bool = opt(False, "offload actor and critic optimizer states (and ZeRO-3 parameters) to CPU")
    offload_reference_model: bool = opt(False, "keep the reference model's ZeRO-3 parameters in CPU memory")
    offload_reward_model: bool = opt(False, "keep the reward model's ZeRO-3 parameters in CPU memory")
    share_reference_with_actor: bool = opt(
        False,
        "reference = the LoRA actor with its adapter disabled (needs --actor_lora_dim and --only_optimize_lora)",
    )
    enable_ema: bool = opt(
        False, "keep an exponential moving average of the actor, saved as OUTPUT_DIR/actor_ema"
    )
    ema_decay: float = opt(0.992, "EMA decay per PPO step")
    enable_hybrid_engine: bool = opt(
        False,
        "generate from an inference copy of the actor gathered once per round (LoRA merged, KV cache) "
        "instead of Hugging Face generate on the training module",
    )
    inference_tp_size: int = opt(
        1,
        "hybrid engine: K ranks split every attention/MLP matrix and generate together (K divides the ranks)",
    )
    tp_gather_partition_size: int = opt(
        0,
        "hybrid engine: gather this many decoder layers at a time into the inference copy (0 = all at once)",
    )
    release_inference_cache: bool = opt(
        False,
        "hybrid engine: free the inference copy and KV cache after each round (re-allocated next round)",
    )
    unpin_actor_parameters: bool = opt(
        False, "hybrid engine: no inference copy, generate on the training module (ZeRO-3 gathers per token)"
    )

    def validate(self, prefix: str = "", shared: frozenset[str] = frozenset()) -> None:
        if self.inference_tp_size < 1:
            raise UserError(f"--inference_tp_size must be >= 1, got {self.inference_tp_size}")
        if self.tp_gather_partition_size < 0:
            raise UserError(f"--tp_gather_partition_size must be >= 0, got {self.tp_gather_partition_size}")
        if not self.enable_hybrid_engine:
            for name, used in (("inference_tp_size", self.inference_tp_size > 1),
                               ("tp_gather_partition_size", self.tp_gather_partition_size > 0),
                               ("release_inference_cache", self.release_inference_cache),
                               ("unpin_actor_parameters", self.unpin_actor_parameters)):  # fmt: skip
                if used:
                    raise UserError(f"--{name} needs --enable_hybrid_engine")
        if self.unpin_actor_parameters and self.inference_tp_size > 1:
            raise UserError("--inference_tp_size > 1 needs the inference copy: drop --unpin_actor_parameters")
        for name in ("actor_zero_stage", "critic_zero_stage"):
            check_zero_stage(f"--{name}", getattr(self, name))
        if self.offload and 0 in (self.actor_zero_stage, self.critic_zero_stage):
            raise UserError(
                "--offload needs --actor_zero_stage and --critic_zero_stage of 1, 2 or 3 (ZeRO-0 cannot offload)"
            )
        if not 0.0 < self.ema_decay < 1.0:
            raise UserError(f"--ema_decay must be in (0, 1), got {self.ema_decay}")


@dataclass
class PPOArgs:
    """PPO: batch geometry, learning rates, and every constant of the algorithm (DeepSpeed-Chat's defaults)."""

    per_device_generation_batch_size: int = opt(16, "prompts per device per generation round")
    per_device_training_batch_size: int = opt(
        16, "experiences per device per PPO update (must divide the generated batch)"
    )
    n_samples_per_prompt: int = opt(
        1, "responses sampled per prompt (rows per round = prompts x this); rloo/group_norm compare them"
    )
    advantage_estimator: str = opt(
        "gae",
        "gae: critic values and GAE (DeepSpeed-Chat); rloo / group_norm / dr_grpo: no critic, the score minus the "
        "mean of the prompt's other responses (RLOO), normalised within the prompt's group (GRPO), or minus the "
        "group mean without the division by the std (Dr. GRPO)",
        choices=("gae", "rloo", "group_norm", "dr_grpo"),
    )
    filter_uniform_groups: bool = opt(
        False,
        "drop from the update every prompt whose responses all score the same (DAPO's dynamic sampling): a group "
        "baseline gives them zero advantage, so they only dilute the loss (rloo / group_norm / dr_grpo only)",
    )
    loss_agg: str = opt(
        "token_mean",
        "how the policy loss (and a KL loss) averages tokens: token_mean = every token of the batch alike (DAPO); "
        "seq_mean_token_mean = per answer, then over answers (GRPO); seq_mean_token_sum_norm = each answer's sum "
        "over --max_answer_seq_len, then over answers (Dr. GRPO)",
        choices=("token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"),
    )
    generation_batches: int = opt(1, "generation rounds collected before the PPO epochs over them")
    ppo_epochs: int = opt(1, "passes of PPO updates over each collected batch")
    freezing_actor_steps: int = opt(
        0,
        "first generation rounds in which only the critic learns, so its values settle before they steer the actor",
    )
    num_train_epochs: int = opt(1, "passes over the prompt set")
    max_steps: int = opt(0, "stop after this many generation rounds (0 = all epochs)")
    max_prompt_seq_len: int = opt(256, "longest prompt in tokens; longer prompts are dropped and counted")
    max_answer_seq_len: int = opt(256, "most new tokens generated per prompt")
    actor_learning_rate: float = opt(9.65e-6, "actor learning rate")
    critic_learning_rate: float = opt(5e-6, "critic learning rate")
    actor_weight_decay: float = opt(0.0, "actor AdamW weight decay")
    critic_weight_decay: float = opt(0.0, "critic AdamW weight decay")
    lr_scheduler_type: str = opt("cosine", "learning-rate schedule of actor and critic", choices=SCHEDULERS)
    num_warmup_steps: int = opt(0, "linear warm-up steps (PPO updates)")
    max_grad_norm: float = opt(1.0, "gradient clipping norm (0 = off)")
    kl_coef: float = opt(0.1, "KL penalty coefficient beta in r_t = -beta (log pi - log pi_ref)")
    kl_target: float | None = opt(None, "adaptive KL controller target (None: fixed --kl_coef)", type=float)
    kl_horizon: int = opt(10000, "adaptive KL controller horizon")
    kl_estimator: str = opt(
        "k1",
        "per-token estimate of KL to the reference, d = log pi - log pi_ref: k1 = d, k2 = d^2/2, "
        "k3 = exp(-d) - 1 + d (Schulman's estimators)",
        choices=("k1", "k2", "k3"),
    )
    kl_in: str = opt(
        "reward",
        "where the KL penalty acts: reward = -kl_coef * KL on every token's reward (InstructGPT, DeepSpeed-Chat); "
        "loss = kl_coef * KL added to the actor's loss with its gradient (GRPO; use k2 or k3)",
        choices=("reward", "loss"),
    )
    clip_reward_value: float = opt(5.0, "reward-model score clipped to +-this before it enters the reward")
    truncation_penalty: float = opt(
        0.0,
        "subtracted from the (clipped) score of every answer cut off at --max_answer_seq_len without an EOS, so "
        "that running out of budget never pays (DAPO's overlong penalty, in its simplest form)",
    )
    cliprange: float = opt(0.2, "policy ratio clip epsilon")
    cliprange_high: float | None = opt(
        None,
        "upper clip epsilon of the ratio, 1 + this (DAPO's clip-higher, e.g. 0.28; None: --cliprange): lets "
        "unlikely tokens with a positive advantage grow, against entropy collapse",
        type=float,
    )
    cliprange_value: float = opt(0.2, "value clip epsilon")
    gamma: float = opt(1.0, "discount")
    lam: float = opt(0.95, "GAE lambda")
    whiten_advantages: bool = opt(False, "normalise advantages over the batch's response tokens")
    temperature: float = opt(
        1.0, "sampling temperature of generation; every PPO log-prob, the KL and the entropy use it too"
    )
    top_p: float = opt(1.0, "nucleus sampling p; only 1.0 (off): PPO's log-probs would not follow the filter")
    top_k: int = opt(0, "top-k sampling; only 0 (off): PPO's log-probs would not follow the filter")
    reward_fn: str | None = opt(
        None, "module:function (prompts, responses) -> scores, e.g. dschat.tasks:verifier_reward", type=str
    )
    reward_fn_mode: str = opt(
        "replace", "the function replaces the reward model or is added to it", choices=("replace", "add")
    )
    unsupervised_dataset_name: str | None = opt(
        None, "PTX: SFT data source for a language-modelling loss (builtin, file, hub)", type=str
    )
    unsup_coef: float = opt(27.8, "PTX loss weight")
    eval_prompts: int = opt(
        300, "held-out prompts answered greedily at start, every --eval_interval, and at the end"
    )

    def validate(self, prefix: str = "", shared: frozenset[str] = frozenset()) -> None:
        for name in ("per_device_generation_batch_size", "per_device_training_batch_size", "generation_batches",
                     "ppo_epochs", "num_train_epochs", "max_prompt_seq_len", "max_answer_seq_len"):  # fmt: skip
            if getattr(self, name) < 1:
                raise UserError(f"--{name} must be >= 1, got {getattr(self, name)}")
        if self.n_samples_per_prompt < 1:
            raise UserError(f"--n_samples_per_prompt must be >= 1, got {self.n_samples_per_prompt}")
        collected = (
            self.per_device_generation_batch_size * self.n_samples_per_prompt * self.generation_batches
        )
        if collected % self.per_device_training_batch_size:
            raise UserError(
                f"--per_device_training_batch_size {self.per_device_training_batch_size} must divide the generated batch "
                f"(--per_device_generation_batch_size x --n_samples_per_prompt x --generation_batches = {collected})"
            )
        if self.advantage_estimator != "gae":
            if self.n_samples_per_prompt < 2:
                raise UserError(f"--advantage_estimator {self.advantage_estimator} compares each prompt's responses "
                                f"with each other: it needs --n_samples_per_prompt >= 2")  # fmt: skip
            if self.freezing_actor_steps:
                raise UserError(f"--freezing_actor_steps trains the critic alone, and --advantage_estimator "
                                f"{self.advantage_estimator} has no critic: use one or the other")  # fmt: skip
        elif self.filter_uniform_groups:
            raise UserError("--filter_uniform_groups drops prompts whose responses all score alike, which needs a group "
                            "baseline: use --advantage_estimator rloo, group_norm or dr_grpo")  # fmt: skip
        if self.cliprange_high is not None and self.cliprange_high <= 0:
            raise UserError(f"--cliprange_high must be > 0, got {self.cliprange_high}")
        if self.kl_in == "loss" and self.kl_estimator == "k1":
            raise UserError("--kl_in loss with --kl_estimator k1: the gradient of k1 = log pi - log pi_ref is zero in "
                            "expectation, so the penalty would not hold the policy back; use k2 or k3")  # fmt: skip
        for name in (
            "kl_coef",
            "clip_reward_value",
            "cliprange",
            "cliprange_value",
            "unsup_coef",
            "freezing_actor_steps",
            "truncation_penalty",
        ):
            if getattr(self, name) < 0:
                raise UserError(f"--{name} must be >= 0, got {getattr(self, name)}")
        if not 0.0 <= self.gamma <= 1.0 or not 0.0 <= self.lam <= 1.0:
            raise UserError(f"--gamma and --lam must be in [0, 1], got {self.gamma} and {self.lam}")
        if self.kl_target is not None and self.kl_target <= 0:
            raise UserError(f"--kl_target must be > 0, got {self.kl_target}")
        SamplingConfig(max_new_tokens=self.max_answer_seq_len, temperature=self.temperature, top_p=self.top_p,
                       top_k=self.top_k).validate({"max_new_tokens": "--max_answer_seq_len"})  # fmt: skip
        # A filtered sampler draws from a distribution the old, new and reference log-probs do not model
        # (tokens outside the filter keep their probability there): the ratio and the KL would be wrong.
        for name, value, off in (("top_k", self.top_k, 0), ("top_p", self.top_p, 1.0)):
            if value != off:
                raise UserError(f"--{name} {value}: step 3 samples from softmax(logits / --temperature) only, the "
                                f"distribution PPO's log-probs and KL are taken of; leave --{name} at {off}")  # fmt: skip
        if self.reward_fn and ":" not in self.reward_fn:  # "" = none (to undo a preset's)
            raise UserError(f"--reward_fn {self.reward_fn}: expected module:function")


def parse_data_split(text: str, flag: str = "--data_split") -> list[float]:
    """``"2,4,4"`` -> ``[0.2, 0.4, 0.4]``; exactly three non-negative numbers with a positive sum."""
    try:
        parts = [float(x) for x in text.split(",")]
    except ValueError:
        raise UserError(f"{flag} {text!r}: expected three comma-separated numbers such as 2,4,4") from None
    if len(parts) != 3 or any(not math.isfinite(p) or p < 0 for p in parts) or sum(parts) <= 0:
        raise UserError(
            f"{flag} {text!r}: expected three non-negative numbers with a positive sum, such as 2,4,4"
        )
    total = sum(parts)
    return [p / total for p in parts]


class ArgumentParser(argparse.ArgumentParser):
    """argparse that reports a bad flag as one line instead of usage + message."""

    def error(self, message: str):  # type: ignore[override]
        if int(os.environ.get("RANK", "0")) == 0:
            print(f"error: {message} (see {self.prog} --help)", file=sys.stderr)
        sys.exit(2)


def add_group(
    parser: argparse.ArgumentParser,
    cls: type,
    prefix: str = "",
    title: str | None = None,
    defaults: dict[str, Any] | None = None,
    shared: frozenset[str] = frozenset(),
) -> None:
    """Add every field of dataclass ``cls`` as ``--{prefix}{name}``.

    ``defaults`` overrides a field's default for one step (step 2's output directory, say) while the
    option itself, its type, help and validation stay defined once. Fields in ``shared`` keep their
    unprefixed name and are added once even when the group is added under several prefixes (step 3's
    ``--dtype`` serves actor and critic).
    """
    group = parser.add_argument_group(title or f"{cls.__name__} {prefix}".strip())
    defaults = defaults or {}
    unknown = set(defaults) - {f.name for f in dataclasses.fields(cls)}
    if unknown:
        raise ValueError(f"defaults for unknown fields of {cls.__name__}: {sorted(unknown)}")
    for f in dataclasses.fields(cls):
        meta = f.metadata
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        default = defaults.get(f.name, default)
        flag = f"--{f.name}" if f.name in shared else f"--{prefix}{f.name}"
        if flag in parser._option_string_actions:
            continue
        if isinstance(default, bool):
            group.add_argument(flag, action="store_true", default=default, help=meta["help"])
            continue
        kind = meta.get("type") or (type(default) if default is not None else str)
        kwargs: dict[str, Any] = {"default": default, "help": meta["help"] + f" (default: {default})"}
        if isinstance(default, list) or meta.get("nargs"):
            kwargs["nargs"] = meta.get("nargs") or "+"
            kind = meta.get("type") or str
        if meta.get("choices"):
            kwargs["choices"] = meta["choices"]
        group.add_argument(flag, type=kind, **kwargs)


GroupSpec = type | tuple  # a dataclass, or (dataclass, prefix, shared field names)


def parse_groups(
    prog: str,
    description: str,
    groups: tuple[GroupSpec, ...],
    argv: list[str] | None = None,
    defaults: dict[type, dict[str, Any]] | None = None,
) -> tuple:
    """One parser from option groups; returns one validated dataclass instance per group.

    A group is a dataclass, or ``(dataclass, prefix, shared)`` to add it under a prefix (step 3 adds
    :class:`ModelArgs` as ``actor_`` and ``critic_``) with some fields left unprefixed and shared.
    """
    specs = [(g, "", frozenset()) if isinstance(g, type) else (g[0], g[1], frozenset(g[2])) for g in groups]
    parser = ArgumentParser(prog=prog, description=description)
    for cls, prefix, shared in specs:
        add_group(parser, cls, prefix=prefix, defaults=(defaults or {}).get(cls), shared=shared)
    parser.add_argument("--local_rank", type=int, default=-1, help="set by the DeepSpeed launcher")
    ns = parser.parse_args(argv)
    return tuple(from_namespace(cls, ns, prefix, shared) for cls, prefix, shared in specs)


def from_namespace(
    cls: type[T], ns: argparse.Namespace, prefix: str = "", shared: frozenset[str] = frozenset()
) -> T:
    values = {
        f.name: getattr(ns, f.name if f.name in shared else f"{prefix}{f.name}")
        for f in dataclasses.fields(cls)
    }
    obj = cls(**values)
    if hasattr(obj, "validate"):
        obj.validate(prefix, shared)
    return obj


def to_dict(*groups: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for g in groups:
        out.update(dataclasses.asdict(g))
    return out
