"""The option groups of step 3: the engines (stages, offload, hybrid engine, EMA, judge) and PPO."""

from __future__ import annotations

from dataclasses import dataclass

from dschat.config.fields import opt, refuse_without_mode, share_prompt_opt
from dschat.config.groups import LoraArgs, ModelArgs
from dschat.generation.sampling import DRAWS, SamplingConfig
from dschat.utils.errors import UserError


@dataclass
class RLHFEngineArgs:
    """How step 3 places its models beyond each trained model's own ZeRO stage (``--actor_zero_stage``,
    ``--critic_zero_stage`` and the shared ``--offload`` are :class:`DeepSpeedArgs` under a prefix; the
    reference follows the actor's stage, the reward model and the judge the critic's)."""

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
    offload_reference_model: bool = opt(
        False, "keep the reference model's ZeRO-3 parameters in CPU memory", resumable=True
    )
    offload_reward_model: bool = opt(
        False, "keep the reward model's ZeRO-3 parameters in CPU memory", resumable=True
    )
    share_reference_with_actor: bool = opt(
        False,
        "reference = the LoRA actor with its adapter disabled (needs --actor_lora_dim and --only_optimize_lora)",
    )
    enable_ema: bool = opt(
        False,
        "keep an exponential moving average of the actor, saved as OUTPUT_DIR/actor_ema (with LoRA, of each "
        "factor, as DeepSpeed-Chat: the export merges EMA(B) @ EMA(A), not EMA(B @ A), which would hold a "
        "dense copy of every adapted weight)",
    )
    ema_decay: float = opt(0.992, "EMA decay per PPO step")
    enable_hybrid_engine: bool = opt(
        False,
        "generate from an inference copy of the actor gathered once per round (LoRA merged, KV cache) "
        "instead of Hugging Face generate on the training module",
        resumable=True,
    )
    inference_tp_size: int = opt(
        1,
        "hybrid engine: K ranks split every attention/MLP matrix and generate together (K divides the ranks)",
        resumable=True,
    )
    tp_gather_partition_size: int = opt(
        0,
        "hybrid engine: gather this many decoder layers at a time into the inference copy (0 = all at once)",
        resumable=True,
    )
    release_inference_cache: bool = opt(
        False,
        "hybrid engine: free the inference copy and KV cache after each round (re-allocated next round)",
        resumable=True,
    )
    unpin_actor_parameters: bool = opt(
        False,
        "hybrid engine: no inference copy, generate on the training module (ZeRO-3 gathers per token)",
        resumable=True,
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
        if not 0.0 < self.ema_decay < 1.0:
            raise UserError(f"--ema_decay must be in (0, 1), got {self.ema_decay}")
        refuse_without_mode(self, "enable_ema", self.enable_ema, only=("ema_decay",))  # accepted and unused


@dataclass
class PPOArgs:
    """PPO: batch geometry, length of the run and every constant of the algorithm (DeepSpeed-Chat's
    defaults). The optimizers are :class:`OptimizerArgs` under ``actor_`` / ``critic_``."""

    per_device_generation_batch_size: int = opt(16, "prompts per device per generation round")
    per_device_training_batch_size: int = opt(
        16, "experiences per device per PPO update (must divide the generated batch)"
    )
    n_samples_per_prompt: int = opt(
        1, "responses sampled per prompt (rows per round = prompts x this); rloo/group_norm compare them"
    )
    share_prompt: bool = share_prompt_opt(
        "--n_samples_per_prompt answers in the experience passes and the actor's update (the built-in tasks' "
        "prompts are most of every row)"
    )
    share_frozen_trunk: bool = opt(
        True,
        "where the actor's embeddings and bottom blocks are frozen (--actor_trainable_layers) and the reference or "
        "reward model holds the same ones, the experience pass computes them once: the actor's hidden states "
        "after them feed the others' top blocks (checked against the full pass on the first batch)",
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
        "baseline gives them zero advantage, so they only dilute the loss (rloo / group_norm / dr_grpo only); "
        "their KL penalty leaves the update with them (DAPO has none), while kl_to_reference still counts them",
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
    kl_coef: float = opt(0.1, "KL penalty coefficient beta in r_t = -beta (log pi - log pi_ref)")
    kl_target: float | None = opt(
        None,
        "adaptive KL controller target (None: fixed --kl_coef); it moves after every update, on the KL of the update's rounds",
        type=float,
    )
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
    normalize_reward: bool = opt(
        False,
        "standardise the reward model's scores with the mean and std that step 2 measured on the step-1 policy's "
        "own answers (saved in its config.json), before --clip_reward_value: a pairwise-trained reward model's "
        "offset and scale are arbitrary, standardised scores make the clip and --kl_coef mean the same with any "
        "(Ziegler et al. 2019; OpenRLHF's --normalize_reward)",
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
    sampling_draw: str = opt(
        "inverse_cdf",
        "how a rollout token is drawn from that distribution: one uniform per row against the cumulative "
        "probabilities, or torch.multinomial (Hugging Face generate's draw and tokens; an exponential per "
        "vocabulary entry, about 20x slower for a 49152-token vocabulary on CPU)",
        choices=DRAWS,
    )
    reward_fn: str | None = opt(
        None,
        "module:function (prompts, responses) -> scores, e.g. dschat.tasks:verifier_reward",
        type=str,
        input="function",
    )
    reward_fn_mode: str = opt(
        "replace", "the function replaces the reward model or is added to it", choices=("replace", "add")
    )
    unsupervised_dataset_name: str | None = opt(
        None,
        "PTX: SFT data source for a language-modelling loss (builtin, file, hub)",
        type=str,
        input="data",
    )
    unsup_coef: float = opt(27.8, "PTX loss weight")
    eval_prompts: int = opt(
        300, "held-out prompts answered greedily at start, every --eval_interval, and at the end"
    )

    def sampling(self) -> SamplingConfig:
        """The rollouts' sampling distribution and draw (checked by :meth:`validate`)."""
        return SamplingConfig(max_new_tokens=self.max_answer_seq_len, temperature=self.temperature, top_p=self.top_p,
                              top_k=self.top_k, draw=self.sampling_draw)  # fmt: skip

    @property
    def rows_per_round(self) -> int:
        """Sequences generated per rank per round: prompts x --n_samples_per_prompt."""
        return self.per_device_generation_batch_size * self.n_samples_per_prompt

    def validate(self, prefix: str = "", shared: frozenset[str] = frozenset()) -> None:
        for name in ("per_device_generation_batch_size", "per_device_training_batch_size", "generation_batches",
                     "ppo_epochs", "num_train_epochs", "max_prompt_seq_len", "max_answer_seq_len", "kl_horizon"):  # fmt: skip
            if getattr(self, name) < 1:
                raise UserError(f"--{name} must be >= 1, got {getattr(self, name)}")
        if self.n_samples_per_prompt < 1:
            raise UserError(f"--n_samples_per_prompt must be >= 1, got {self.n_samples_per_prompt}")
        collected = self.rows_per_round * self.generation_batches
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
        if not self.clip_reward_value > 0:  # 0 would clamp every score to 0: no reward at all
            raise UserError(
                f"--clip_reward_value must be > 0 (inf: no clipping), got {self.clip_reward_value}"
            )
        for name in (
            "kl_coef",
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
        if self.kl_target is not None and self.kl_coef == 0:
            # the controller scales the coefficient by a factor per round: from 0 it stays 0
            raise UserError(f"--kl_target {self.kl_target} with --kl_coef 0: the adaptive controller scales the "
                            "coefficient, so it would stay 0; give --kl_coef its starting value (> 0)")  # fmt: skip
        self.sampling().validate({"max_new_tokens": "--max_answer_seq_len", "draw": "--sampling_draw"})
        # A filtered sampler draws from a distribution the old, new and reference log-probs do not model
        # (tokens outside the filter keep their probability there): the ratio and the KL would be wrong.
        for name, value, off in (("top_k", self.top_k, 0), ("top_p", self.top_p, 1.0)):
            if value != off:
                raise UserError(f"--{name} {value}: step 3 samples from softmax(logits / --temperature) only, the "
                                f"distribution PPO's log-probs and KL are taken of; leave --{name} at {off}")  # fmt: skip
        if self.reward_fn and ":" not in self.reward_fn:  # "" = none (to undo a preset's)
            raise UserError(f"--reward_fn {self.reward_fn}: expected module:function")


@dataclass(frozen=True)
class Step3Models:
    """Which models step 3 holds and how much it generates, from its options: the one description that
    the step builds from (:func:`dschat.rlhf.models.build_models`) and the memory planner counts."""

    critic: bool  # a trained value model: --advantage_estimator gae only
    reference: bool  # a frozen copy of the actor; none with --share_reference_with_actor
    reward_model: bool  # a frozen reward model; none with --reward_fn ... --reward_fn_mode replace
    judge: bool  # a second frozen reward model scored beside the reward (--judge_reward_model)
    inference_copy: bool  # the hybrid engine's plain copy of the actor (not with --unpin_actor_parameters)
    inference_tp_size: int  # ranks that share one inference copy
    rollouts_per_round: int  # sequences generated per rank per round: prompts x --n_samples_per_prompt
    # the hybrid engine keeps its generation cache between rounds (a StaticCache, on GPUs) unless
    # --release_inference_cache frees it
    kept_kv_cache: bool = False


def step3_models(engine: RLHFEngineArgs, ppo: PPOArgs) -> Step3Models:
    return Step3Models(
        critic=ppo.advantage_estimator == "gae",
        reference=not engine.share_reference_with_actor,
        reward_model=not (ppo.reward_fn and ppo.reward_fn_mode == "replace"),
        judge=bool(engine.judge_reward_model),
        inference_copy=engine.enable_hybrid_engine and not engine.unpin_actor_parameters,
        inference_tp_size=engine.inference_tp_size,
        rollouts_per_round=ppo.rows_per_round,
        kept_kv_cache=engine.enable_hybrid_engine and not engine.release_inference_cache,
    )


def one_update_per_round(ppo: PPOArgs, model: ModelArgs, lora: LoraArgs, zero_stage: int) -> bool:
    """Whether step 3's experience pass is also the update forward of the actor (or the critic: pass
    its own model, LoRA and ZeRO stage) (``PPOHyper.one_update_per_round``,
    ``PPOHyper.critic_one_update_per_round``): each round's rows make exactly one update from the weights
    that scored them (one round per update, one PPO epoch, the round in one training batch;
    DeepSpeed-Chat's own geometry) and the forward is deterministic (no dropout: that pass runs in train
    mode). Then the forward runs once and its graph is kept through the other models' passes. Not under
    ZeRO-3: there the gathered weights could stay live across those passes too, and ZeRO-3 is chosen to
    save memory."""
    no_dropout = model.dropout == 0.0 and (lora.lora_dim == 0 or lora.lora_dropout == 0.0)
    one_update = (
        ppo.generation_batches == 1
        and ppo.ppo_epochs == 1
        and ppo.rows_per_round == ppo.per_device_training_batch_size
    )
    return one_update and no_dropout and zero_stage < 3
