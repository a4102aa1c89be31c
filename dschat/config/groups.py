"""The option groups of steps 1 and 2 and of every run: model, prompt format, data, LoRA, optimizer,
DeepSpeed, run, reward model, on-policy pairs, DPO."""

from __future__ import annotations

from dataclasses import dataclass, fields

from dschat.config.fields import (
    DEFAULT_MODEL,
    DTYPES,
    SCHEDULERS,
    check_zero_stage,
    flag_name,
    opt,
    parse_data_split,
    refuse_without_mode,
    share_prompt_opt,
)
from dschat.utils.errors import UserError


@dataclass
class ModelArgs:
    model_name_or_path: str = opt(
        DEFAULT_MODEL,
        "Hugging Face model name, local directory, or builtin:NAME (built in code, no download)",
        input="model",
    )
    dtype: str = opt(
        "auto",
        "training dtype; auto = bf16 where the hardware computes in bf16 (a bf16 GPU; a CPU with "
        "AVX512-BF16 or AMX), else fp32",
        choices=DTYPES,
    )
    dropout: float | None = opt(None, "override every dropout probability in the model config", type=float)
    gradient_checkpointing: bool = opt(
        False, "recompute activations in the backward pass to save memory", resumable=True
    )
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
class InferenceArgs:
    """Where and in what precision the inference tools (chat, prompt_eval, rw_eval) run a model."""

    device: str = opt(
        "auto", "auto = cuda where a GPU is available, else cpu", choices=("auto", "cpu", "cuda")
    )
    dtype: str = opt(
        "auto",
        "auto = bf16 (fp16 without bf16) on a GPU; on CPU bf16 where it runs in hardware (AVX512-BF16, AMX), else fp32",
        choices=DTYPES,
    )
    trust_remote_code: bool = opt(
        False, "allow model code from the model repository to run (off: safe default)"
    )

    def validate(self, prefix: str = "", shared: frozenset[str] = frozenset()) -> None:
        import torch  # here, not at import: the option groups load without torch

        if self.device == "auto":  # resolved once, so every later use names a real device
            self.device = "cuda" if torch.cuda.is_available() else "cpu"
        if self.device == "cuda" and not torch.cuda.is_available():
            raise UserError(f"--{prefix}device cuda: no CUDA device is available")


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
        input="data",
    )
    data_split: str = opt("2,4,4", "relative shares of every source for steps 1, 2 and 3 (disjoint)")
    sft_only_data_path: list[str] = opt([], "sources used only by step 1, in full", nargs="*", input="data")
    max_seq_len: int = opt(512, "longest prompt + response in tokens; longer samples are dropped and counted")
    data_output_path: str = opt(
        "",
        "cache directory for tokenized data (default: $DSCHAT_CACHE/data, ~/.cache/dschat/data)",
        resumable=True,
    )
    train_on_prompt: bool = opt(False, "SFT loss on the whole sequence, not only on the response tokens")
    group_by_length: bool = opt(
        True,
        "batch samples of similar length (sorted within groups of 50 batches, batch order shuffled): far less "
        "padding on data of mixed lengths such as HH-RLHF, so more real tokens per second",
    )
    max_eval_samples: int = opt(1000, "cap on evaluation samples (0 = all)")
    data_seed: int = opt(
        1234,
        "seed of the data's splits (train/eval, the three steps' disjoint shares, the held-out prompts); keep it "
        "the same for every step of a job (--seed, the training order's, may differ per step)",
    )

    # what only step 1 (SFT) reads: the later steps refuse them given (:meth:`step1_only_given`), and
    # train.py passes them to step 1 alone
    STEP1_ONLY = ("sft_only_data_path", "train_on_prompt")

    def step1_only_given(self) -> list[str]:
        """The flags of :attr:`STEP1_ONLY` set away from their defaults (read by nothing outside step 1)."""
        defaults = DataArgs()
        return [f"--{f}" for f in self.STEP1_ONLY if getattr(self, f) != getattr(defaults, f)]

    def refuse_step1_only(self, step: str) -> None:
        """One line where ``step`` (not step 1) was given a flag only step 1 reads."""
        if given := self.step1_only_given():
            raise UserError(f"{', '.join(given)}: only step 1 (SFT) reads {'it' if len(given) == 1 else 'them'}, "
                            f"not {step}; drop {'it' if len(given) == 1 else 'them'} here (train.py gives such "
                            "flags to step 1 alone)")  # fmt: skip

    def validate(self, prefix: str = "", shared: frozenset[str] = frozenset()) -> None:
        parse_data_split(self.data_split, flag=f"--{prefix}data_split")
        from dschat.data.sources import check_named_once  # the data layer knows what a source spec names

        check_named_once({f"--{prefix}{f}": getattr(self, f) for f in ("data_path", "sft_only_data_path")})
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
        # an adapter's options without an adapter would be accepted and unused
        refuse_without_mode(self, "lora_dim", self.lora_dim > 0, prefix, ("only_optimize_lora",), " > 0")
        # a negative rate ascends the loss, a negative alpha flips the adapter's sign, and a dropout
        # outside [0, 1) fails inside torch only after the data and the model have loaded
        checks = [
            (self.lora_learning_rate is None or self.lora_learning_rate > 0, "lora_learning_rate", "must be > 0"),
            (self.lora_alpha >= 0, "lora_alpha", "must be >= 0 (0: the same as --lora_dim)"),
            (0.0 <= self.lora_dropout < 1.0, "lora_dropout", "must be in [0, 1)"),
        ]  # fmt: skip
        for ok, name, rule in checks:
            if not ok:
                raise UserError(f"--{prefix}{name} {rule}, got {getattr(self, name)}")


@dataclass
class OptimizerArgs:
    """The optimizer and its learning-rate schedule. Steps 1 and 2 take it inside :class:`OptimArgs`; step 3
    adds it once per trained model (``--actor_learning_rate``, ``--critic_weight_decay``), the schedule and
    Adam's betas shared by both."""

    learning_rate: float = opt(1e-3, "peak learning rate")
    weight_decay: float = opt(0.0, "AdamW weight decay (not applied to biases and norms)")
    adam_beta1: float = opt(0.9, "AdamW beta1")
    adam_beta2: float = opt(0.95, "AdamW beta2")
    lr_scheduler_type: str = opt("cosine", "learning-rate schedule", choices=SCHEDULERS)
    num_warmup_steps: int = opt(0, "linear warm-up steps")
    max_grad_norm: float = opt(1.0, "gradient clipping norm (0 = off)")

    def validate(self, prefix: str = "", shared: frozenset[str] = frozenset()) -> None:
        def flag(name: str) -> str:
            return flag_name(name, prefix, shared)

        if self.learning_rate <= 0:
            raise UserError(f"{flag('learning_rate')} must be > 0, got {self.learning_rate}")
        if self.num_warmup_steps < 0:
            raise UserError(f"{flag('num_warmup_steps')} must be >= 0, got {self.num_warmup_steps}")
        if self.lr_scheduler_type == "constant" and self.num_warmup_steps:  # the constant schedule ignores it
            raise UserError(f"{flag('num_warmup_steps')} {self.num_warmup_steps} with {flag('lr_scheduler_type')} "
                            "constant: that schedule has no warm-up; use constant_with_warmup")  # fmt: skip
        for name in ("adam_beta1", "adam_beta2"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise UserError(f"{flag(name)} must be in [0, 1), got {getattr(self, name)}")
        if self.weight_decay < 0 or self.max_grad_norm < 0:
            bad = "weight_decay" if self.weight_decay < 0 else "max_grad_norm"
            raise UserError(f"{flag(bad)} must be >= 0, got {getattr(self, bad)}")


@dataclass
class OptimArgs(OptimizerArgs):
    """Steps 1 and 2: the optimizer plus the batch geometry and length of the run (step 3's are PPO's)."""

    per_device_train_batch_size: int = opt(16, "micro-batch size per device for training", resumable=True)
    per_device_eval_batch_size: int = opt(16, "batch size per device for evaluation", resumable=True)
    num_train_epochs: int = opt(1, "passes over the training data")
    max_steps: int = opt(0, "stop after this many optimizer steps (0 = run all epochs)")
    gradient_accumulation_steps: int = opt(1, "micro-batches per optimizer step", resumable=True)

    def validate(self, prefix: str = "", shared: frozenset[str] = frozenset()) -> None:
        super().validate(prefix, shared)
        for name in ("per_device_train_batch_size", "per_device_eval_batch_size", "num_train_epochs",
                     "gradient_accumulation_steps"):  # fmt: skip
            if getattr(self, name) < 1:
                raise UserError(f"--{prefix}{name} must be >= 1, got {getattr(self, name)}")
        if self.max_steps < 0:
            raise UserError(f"--{prefix}max_steps must be >= 0, got {self.max_steps}")

    @classmethod
    def of(cls, optimizer: OptimizerArgs, **geometry) -> OptimArgs:
        """An optimizer's options with a batch geometry (step 3: the PPO minibatch as the micro-batch)."""
        return cls(**{f.name: getattr(optimizer, f.name) for f in fields(OptimizerArgs)}, **geometry)


@dataclass
class DeepSpeedArgs:
    zero_stage: int = opt(0, "ZeRO stage: 0, 1, 2 or 3")
    offload: bool = opt(
        False, "offload optimizer states (and, with ZeRO-3, parameters) to CPU memory", resumable=True
    )

    def validate(self, prefix: str = "", shared: frozenset[str] = frozenset()) -> None:
        check_zero_stage(f"--{prefix}zero_stage", self.zero_stage)
        offload = flag_name("offload", prefix, shared)
        if self.offload and self.zero_stage == 0:
            raise UserError(f"{offload} needs --{prefix}zero_stage 1, 2 or 3 (ZeRO-0 cannot offload)")


@dataclass
class RunArgs:
    output_dir: str = opt("output/step1", "where the model, metrics, logs and checkpoints go", resumable=True)
    seed: int = opt(1234, "random seed (data order, initialisation, dropout)")
    eval_interval: int = opt(
        100, "evaluate every N optimizer steps (step 3: generation rounds; 0 = only at start and end)"
    )
    eval_generation_samples: int = opt(
        300, "built-in task prompts answered greedily at start and end to measure true accuracy (0 = off)"
    )
    log_interval: int = opt(10, "write a train line to metrics.jsonl every N optimizer steps", resumable=True)
    save_steps: int = opt(
        200,
        "save a resumable checkpoint every N optimizer steps (step 3: generation rounds, at the first round that "
        "ends a --generation_batches group; 0 = never)",
        resumable=True,
    )
    keep_checkpoints: int = opt(2, "how many recent checkpoints to keep", resumable=True)
    resume: bool = opt(False, "continue from the latest checkpoint in OUTPUT_DIR/checkpoints", resumable=True)
    overwrite: bool = opt(False, "replace a finished run in OUTPUT_DIR", resumable=True)
    enable_tensorboard: bool = opt(False, "write TensorBoard scalars", resumable=True)
    tensorboard_path: str | None = opt(
        None,
        "TensorBoard directory: the step writes under PATH/<its output directory's name> (default "
        "OUTPUT_DIR/tensorboard)",
        type=str,
        resumable=True,
    )
    enable_wandb: bool = opt(
        False, "log to Weights & Biases (WANDB_MODE=offline works without network)", resumable=True
    )
    wandb_project: str = opt("dschat", "W&B project name", resumable=True)
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
        for name, mode in (("tensorboard_path", "enable_tensorboard"), ("wandb_project", "enable_wandb")):
            refuse_without_mode(self, mode, getattr(self, mode), prefix, only=(name,))  # accepted and unused


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

    share_prompt: bool = share_prompt_opt(
        "chosen and rejected answers (on HH-RLHF the prompt is about 40 percent of a pair's tokens)"
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
        input="model",
    )
    policy_negatives_per_prompt: int = opt(4, "answers sampled per prompt for --policy_negatives_from")
    policy_negatives_max_prompts: int = opt(
        0, "sample answers to at most this many of the step's training prompts (0 = all)"
    )
    policy_negatives_temperature: float = opt(1.0, "sampling temperature for --policy_negatives_from")
    policy_negatives_max_new_tokens: int = opt(32, "longest sampled answer for --policy_negatives_from")
    policy_negatives_reward_model: str | None = opt(
        None,
        "DPO only: label the sampled answers with this reward model instead of the verifier, for any prompt "
        "(human preferences): each prompt's highest-scored answer that ended is chosen, its lowest-scored "
        "rejected (online DPO); the policy must share its tokenizer",
        type=str,
        input="model",
    )
    policy_negatives_min_margin: float = opt(
        0.0,
        "with --policy_negatives_reward_model: keep a pair only where chosen outscores rejected by this much",
    )
    policy_negatives_only: bool = opt(
        False,
        "train on the on-policy pairs alone: the data's own training pairs give only the prompts (the "
        "held-out pairs are still evaluated)",
    )

    def validate(self, prefix: str = "", shared: frozenset[str] = frozenset()) -> None:
        if self.policy_negatives_reward_model and self.policy_negatives_per_prompt < 2:
            raise UserError(
                f"--{prefix}policy_negatives_per_prompt must be >= 2 with --{prefix}policy_negatives_reward_model "
                f"(a pair is two of a prompt's answers), got {self.policy_negatives_per_prompt}"
            )
        if self.policy_negatives_min_margin < 0:
            raise UserError(
                f"--{prefix}policy_negatives_min_margin must be >= 0, got {self.policy_negatives_min_margin}"
            )
        if self.policy_negatives_min_margin and not self.policy_negatives_reward_model:
            raise UserError(
                f"--{prefix}policy_negatives_min_margin needs --{prefix}policy_negatives_reward_model (a verifier's "
                "labels have no margin)"
            )
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
        # every other option of the group shapes the sampling of --policy_negatives_from: given without it, it
        # would be accepted and unused (checked after the ranges, which name the wrong value itself)
        refuse_without_mode(self, "policy_negatives_from", bool(self.policy_negatives_from), prefix,
                            needs=" (the policy that answers)")  # fmt: skip


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
        input="model",
    )
    share_prompt: bool = share_prompt_opt("chosen and rejected answers")

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
