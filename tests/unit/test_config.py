"""dschat.config: option groups as dataclasses, the parser built from them, and validation."""

from __future__ import annotations

import dataclasses
import re

import pytest

from dschat import config as C
from dschat.config import (
    DataArgs,
    DeepSpeedArgs,
    DPOArgs,
    LoraArgs,
    ModelArgs,
    OptimArgs,
    OptimizerArgs,
    PolicyPairsArgs,
    PPOArgs,
    RewardArgs,
    RunArgs,
    parse_data_split,
)
from dschat.utils.errors import UserError

GROUPS = (ModelArgs, DataArgs, LoraArgs, OptimArgs, DeepSpeedArgs, RunArgs)


def make_parser(*groups, prefix: str = "") -> C.ArgumentParser:
    parser = C.ArgumentParser(prog="prog")
    for g in groups:
        C.add_group(parser, g, prefix=prefix)
    return parser


# ---------------------------------------------------------------- defaults and parsing
@pytest.mark.parametrize("cls", GROUPS)
def test_no_flags_gives_the_dataclass_defaults(cls):
    ns = make_parser(cls).parse_args([])
    assert C.from_namespace(cls, ns) == cls()


@pytest.mark.parametrize("cls", GROUPS)
def test_defaults_validate(cls):
    cls().validate()


def test_every_group_together_builds_a_help_text():
    text = make_parser(*GROUPS).format_help()
    for cls in GROUPS:
        for f in dataclasses.fields(cls):
            assert f"--{f.name}" in text


def test_the_help_says_each_default_once():
    """'(default: --learning_rate) (default: None)' and '(default: $DSCHAT_CACHE/data, ...) (default: )':
    a help text that says its default in words got argparse's value appended too."""
    import re

    text = re.sub(r"\s+", " ", make_parser(*GROUPS).format_help())
    assert "(default: None)" not in text and "(default: )" not in text
    assert "(default: 512)" in text  # --max_seq_len: a value still says itself


def test_flags_are_parsed_with_their_types():
    parser = make_parser(ModelArgs, DataArgs, LoraArgs, OptimArgs)
    ns = parser.parse_args(
        [
            "--per_device_train_batch_size", "4",
            "--learning_rate", "5e-4",
            "--lr_scheduler_type", "linear",
            "--dropout", "0.25",
            "--gradient_checkpointing",
            "--data_path", "a.jsonl", "b.jsonl",
            "--sft_only_data_path",
            "--lora_dim", "8",
            "--lora_learning_rate", "1e-4",
            "--dtype", "bf16",
        ]
    )  # fmt: skip
    optim = C.from_namespace(OptimArgs, ns)
    model = C.from_namespace(ModelArgs, ns)
    data = C.from_namespace(DataArgs, ns)
    lora = C.from_namespace(LoraArgs, ns)
    assert optim.per_device_train_batch_size == 4 and type(optim.per_device_train_batch_size) is int
    assert optim.learning_rate == 5e-4 and type(optim.learning_rate) is float
    assert optim.lr_scheduler_type == "linear"
    assert model.dropout == 0.25
    assert model.gradient_checkpointing is True
    assert model.trust_remote_code is False
    assert model.dtype == "bf16"
    assert data.data_path == ["a.jsonl", "b.jsonl"]
    assert data.sft_only_data_path == []
    assert lora.lora_dim == 8
    assert lora.lora_learning_rate == 1e-4


def test_list_defaults_are_not_shared_between_instances():
    a, b = DataArgs(), DataArgs()
    a.data_path.append("x.jsonl")
    assert b.data_path == ["builtin"]
    ns = make_parser(DataArgs).parse_args([])
    ns.data_path.append("y.jsonl")
    assert make_parser(DataArgs).parse_args([]).data_path == ["builtin"]


def test_prefixed_groups_are_independent():
    parser = C.ArgumentParser(prog="prog")
    C.add_group(parser, DeepSpeedArgs, prefix="actor_")
    C.add_group(parser, DeepSpeedArgs, prefix="critic_")
    ns = parser.parse_args(["--actor_zero_stage", "3", "--critic_zero_stage", "2", "--critic_offload"])
    assert C.from_namespace(DeepSpeedArgs, ns, "actor_") == DeepSpeedArgs(zero_stage=3, offload=False)
    assert C.from_namespace(DeepSpeedArgs, ns, "critic_") == DeepSpeedArgs(zero_stage=2, offload=True)
    assert not hasattr(ns, "zero_stage")


def test_prefixed_validation_names_the_prefixed_flags():
    parser = C.ArgumentParser(prog="prog")
    C.add_group(parser, DeepSpeedArgs, prefix="actor_")
    ns = parser.parse_args(["--actor_offload"])
    with pytest.raises(UserError, match=re.escape("--actor_offload needs --actor_zero_stage 1, 2 or 3")):
        C.from_namespace(DeepSpeedArgs, ns, "actor_")


def test_from_namespace_validates():
    ns = make_parser(LoraArgs).parse_args(["--only_optimize_lora"])
    with pytest.raises(UserError, match=re.escape("--only_optimize_lora needs --lora_dim")):
        C.from_namespace(LoraArgs, ns)


def test_to_dict_merges_groups():
    d = C.to_dict(DeepSpeedArgs(zero_stage=2), LoraArgs(lora_dim=4))
    assert d["zero_stage"] == 2 and d["offload"] is False and d["lora_dim"] == 4
    assert set(d) == {f.name for f in dataclasses.fields(DeepSpeedArgs)} | {
        f.name for f in dataclasses.fields(LoraArgs)
    }


# ---------------------------------------------------------------- argparse errors: one line, exit 2
@pytest.mark.parametrize(
    ("argv", "fragment"),
    [
        (["--dtype", "fp8"], "argument --dtype: invalid choice: 'fp8'"),
        (["--zero_stage", "two"], "argument --zero_stage: invalid int value: 'two'"),
        (["--no_such_flag"], "unrecognized arguments: --no_such_flag"),
        # a prefix of a flag is not that flag: train.py's planner and checks match flags as spelt
        (["--zero", "0"], "unrecognized arguments: --zero"),
    ],
)
def test_bad_flag_is_one_line_and_exit_2(argv, fragment, capsys):
    parser = make_parser(ModelArgs, DeepSpeedArgs)
    with pytest.raises(SystemExit) as exc:
        parser.parse_args(argv)
    assert exc.value.code == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1, captured.err
    assert lines[0].startswith("error: ")
    assert fragment in lines[0]
    assert lines[0].endswith("(see prog --help)")
    assert "usage" not in captured.err


def test_bad_flag_prints_nothing_on_other_ranks(capsys, monkeypatch):
    monkeypatch.setenv("RANK", "1")
    with pytest.raises(SystemExit) as exc:
        make_parser(DeepSpeedArgs).parse_args(["--zero_stage", "x"])
    assert exc.value.code == 2
    assert capsys.readouterr().err == ""


# ---------------------------------------------------------------- --data_split
@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("2,4,4", [0.2, 0.4, 0.4]),
        ("1,1,2", [0.25, 0.25, 0.5]),
        ("1,0,0", [1.0, 0.0, 0.0]),
        ("0,0,3", [0.0, 0.0, 1.0]),
        (" 1, 1 ,2", [0.25, 0.25, 0.5]),
        ("10,30,60", [0.1, 0.3, 0.6]),
    ],
)
def test_parse_data_split(text, expected):
    assert parse_data_split(text) == expected


@pytest.mark.parametrize("text", ["2,4", "1,2,3,4", "a,b,c", "", "1,-1,1", "0,0,0", "2;4;4", "2,4,"])
def test_parse_data_split_rejects(text):
    with pytest.raises(UserError, match=re.escape("--data_split")):
        parse_data_split(text)


def test_parse_data_split_names_the_given_flag():
    with pytest.raises(UserError, match=re.escape("--actor_data_split '1,2'")):
        parse_data_split("1,2", flag="--actor_data_split")


# ---------------------------------------------------------------- validation
@pytest.mark.parametrize(
    ("obj", "message"),
    [
        (LoraArgs(only_optimize_lora=True), "--only_optimize_lora needs --lora_dim > 0"),
        (LoraArgs(lora_dim=-1), "--lora_dim must be >= 0, got -1"),
        (LoraArgs(lora_learning_rate=1e-4), "--lora_learning_rate needs --lora_dim > 0"),
        # an adapter's or a sampler's options without it were accepted and unused
        (LoraArgs(lora_alpha=16), "--lora_alpha needs --lora_dim > 0"),
        (
            OptimizerArgs(lr_scheduler_type="constant", num_warmup_steps=10),
            "--num_warmup_steps 10 with --lr_scheduler_type constant: that schedule has no warm-up",
        ),
        (LoraArgs(lora_module_name="decoder.layers."), "--lora_module_name needs --lora_dim > 0"),
        (
            PolicyPairsArgs(policy_negatives_per_prompt=8),
            "--policy_negatives_per_prompt needs --policy_negatives_from",
        ),
        (LoraArgs(lora_dim=8, lora_learning_rate=-1e-4), "--lora_learning_rate must be > 0, got -0.0001"),
        (
            LoraArgs(lora_dim=8, lora_alpha=-16),
            "--lora_alpha must be >= 0 (0: the same as --lora_dim), got -16",
        ),
        (LoraArgs(lora_dim=8, lora_dropout=1.0), "--lora_dropout must be in [0, 1), got 1.0"),
        (DeepSpeedArgs(zero_stage=4), "--zero_stage must be 0, 1, 2 or 3, got 4"),
        (DeepSpeedArgs(zero_stage=-1), "--zero_stage must be 0, 1, 2 or 3, got -1"),
        (DeepSpeedArgs(zero_stage=0, offload=True), "--offload needs --zero_stage 1, 2 or 3"),
        (RunArgs(resume=True, overwrite=True), "--resume and --overwrite contradict each other"),
        (RunArgs(keep_checkpoints=0), "--keep_checkpoints must be >= 1, got 0"),
        (RunArgs(save_steps=-1), "--save_steps must be >= 0, got -1"),
        # accepted and unused: no dashboard was written to
        (RunArgs(tensorboard_path="tb"), "--tensorboard_path needs --enable_tensorboard"),
        (RunArgs(wandb_project="p"), "--wandb_project needs --enable_wandb"),
        (RunArgs(eval_interval=-5), "--eval_interval must be >= 0, got -5"),
        (ModelArgs(dropout=1.0), "--dropout must be in [0, 1), got 1.0"),
        (ModelArgs(dropout=-0.1), "--dropout must be in [0, 1), got -0.1"),
        (DataArgs(max_seq_len=7), "--max_seq_len must be at least 8, got 7"),
        (DataArgs(max_eval_samples=-1), "--max_eval_samples must be >= 0, got -1"),
        (DataArgs(data_split="1,2"), "--data_split '1,2'"),
        (OptimArgs(per_device_train_batch_size=0), "--per_device_train_batch_size must be >= 1, got 0"),
        (OptimArgs(per_device_eval_batch_size=0), "--per_device_eval_batch_size must be >= 1, got 0"),
        (OptimArgs(gradient_accumulation_steps=0), "--gradient_accumulation_steps must be >= 1, got 0"),
        (OptimArgs(num_train_epochs=0), "--num_train_epochs must be >= 1, got 0"),
        (OptimArgs(max_steps=-1), "--max_steps must be >= 0, got -1"),
        (OptimArgs(num_warmup_steps=-1), "--num_warmup_steps must be >= 0, got -1"),
        (OptimArgs(learning_rate=0.0), "--learning_rate must be > 0, got 0.0"),
        (OptimArgs(adam_beta2=1.0), "--adam_beta2 must be in [0, 1), got 1.0"),
        (OptimArgs(weight_decay=-0.1), "--weight_decay must be >= 0, got -0.1"),
        (OptimArgs(max_grad_norm=-1.0), "--max_grad_norm must be >= 0, got -1.0"),
        (PPOArgs(n_samples_per_prompt=0), "--n_samples_per_prompt must be >= 1, got 0"),
        # the adaptive controller divides by it (0: ZeroDivisionError after start-up; < 0: runs backwards)
        (PPOArgs(kl_horizon=0), "--kl_horizon must be >= 1, got 0"),
        # 0 clamped every score to 0, so the policy learned from the KL penalty alone
        (PPOArgs(clip_reward_value=0.0), "--clip_reward_value must be > 0 (inf: no clipping), got 0.0"),
        (PolicyPairsArgs(policy_negatives_per_prompt=0), "--policy_negatives_per_prompt must be >= 1, got 0"),
        (
            PolicyPairsArgs(policy_negatives_max_prompts=-1),
            "--policy_negatives_max_prompts must be >= 0, got -1",
        ),
        (
            PolicyPairsArgs(policy_negatives_temperature=0.0),
            "--policy_negatives_temperature must be > 0, got 0.0",
        ),
        (
            PolicyPairsArgs(policy_negatives_reward_model="rm"),
            "--policy_negatives_reward_model needs --policy_negatives_from (the policy that answers)",
        ),
        (
            PolicyPairsArgs(policy_negatives_only=True),
            "--policy_negatives_only needs --policy_negatives_from (the policy that answers)",
        ),
        (
            PolicyPairsArgs(
                policy_negatives_from="p", policy_negatives_reward_model="rm", policy_negatives_min_margin=-1
            ),
            "--policy_negatives_min_margin must be >= 0, got -1",
        ),
        (
            PolicyPairsArgs(
                policy_negatives_from="p", policy_negatives_reward_model="rm", policy_negatives_per_prompt=1
            ),
            "--policy_negatives_per_prompt must be >= 2 with --policy_negatives_reward_model",
        ),
        (
            PolicyPairsArgs(policy_negatives_from="p", policy_negatives_min_margin=0.5),
            "--policy_negatives_min_margin needs --policy_negatives_reward_model",
        ),
        (RewardArgs(margin=-1.0), "--margin must be >= 0, got -1.0"),
        (
            RewardArgs(length_expert=True, ranking_loss="divergence"),
            "--length_expert compares the final scores: it needs --ranking_loss last_token, got divergence",
        ),
        (DPOArgs(beta=0.0), "--beta must be > 0, got 0.0"),
        (
            DPOArgs(label_smoothing=0.1, dpo_loss="ipo"),
            "--label_smoothing applies to --dpo_loss sigmoid only",
        ),
        (DPOArgs(sft_coef=-1.0), "--sft_coef must be >= 0, got -1.0"),
        (PPOArgs(advantage_estimator="rloo"), "--advantage_estimator rloo compares each prompt's responses"),
        # top-k / top-p sampling is refused in step 3: PPO's log-probs would not be of the filtered sampler
        (PPOArgs(top_k=50), "--top_k 50: step 3 samples from softmax(logits / --temperature) only"),
        (PPOArgs(top_p=0.9), "--top_p 0.9: step 3 samples from softmax(logits / --temperature) only"),
        (
            PPOArgs(advantage_estimator="group_norm", n_samples_per_prompt=4, freezing_actor_steps=3),
            "--freezing_actor_steps trains the critic alone, and --advantage_estimator group_norm has no critic",
        ),
        (
            PPOArgs(filter_uniform_groups=True),
            "--filter_uniform_groups drops prompts whose responses all score alike, which needs a group baseline",
        ),
        (PPOArgs(cliprange_high=0.0), "--cliprange_high must be > 0, got 0.0"),
        (PPOArgs(kl_in="loss"), "--kl_in loss with --kl_estimator k1: the gradient of k1"),
        (PPOArgs(truncation_penalty=-1.0), "--truncation_penalty must be >= 0, got -1.0"),
        # 16 prompts x 3 responses = 48 rows: 32 does not divide them
        (
            PPOArgs(
                per_device_generation_batch_size=16, n_samples_per_prompt=3, per_device_training_batch_size=32
            ),
            "--per_device_training_batch_size 32 must divide the generated batch (--per_device_generation_batch_size "
            "x --n_samples_per_prompt x --generation_batches = 48)",
        ),
    ],
)
def test_validation_names_the_flag(obj, message):
    with pytest.raises(UserError, match=re.escape(message)):
        obj.validate()


def test_validation_uses_the_prefix():
    with pytest.raises(UserError, match=re.escape("--critic_only_optimize_lora needs --critic_lora_dim > 0")):
        LoraArgs(only_optimize_lora=True).validate("critic_")
    with pytest.raises(UserError, match=re.escape("--actor_data_split")):
        DataArgs(data_split="x").validate("actor_")


@pytest.mark.parametrize(
    "obj",
    [
        LoraArgs(lora_dim=8, only_optimize_lora=True, lora_learning_rate=1e-4),
        DeepSpeedArgs(zero_stage=1, offload=True),
        DeepSpeedArgs(zero_stage=2, offload=True),
        DeepSpeedArgs(zero_stage=3, offload=True),
        ModelArgs(dropout=0.0),
        ModelArgs(dropout=0.99),
        DataArgs(max_seq_len=8, max_eval_samples=0, data_split="1,0,0"),
        OptimArgs(max_steps=0, num_warmup_steps=0),
        RunArgs(resume=True),
        RunArgs(overwrite=True, save_steps=0, eval_interval=0),
        # 16 prompts x 4 responses = 64 rows, 2 updates of 32
        PPOArgs(advantage_estimator="rloo", n_samples_per_prompt=4, per_device_training_batch_size=32),
        PPOArgs(n_samples_per_prompt=2),  # GAE with two responses per prompt is allowed
        PPOArgs(temperature=0.5, top_k=0, top_p=1.0),
        # the RLVR stabilisers together (DAPO + Dr. GRPO + GRPO's KL loss)
        PPOArgs(
            advantage_estimator="dr_grpo",
            n_samples_per_prompt=4,
            filter_uniform_groups=True,
            cliprange_high=0.28,
            loss_agg="seq_mean_token_sum_norm",
            kl_in="loss",
            kl_estimator="k3",
            truncation_penalty=1.0,
        ),
        PPOArgs(kl_estimator="k2"),  # any estimator in the reward
    ],
)
def test_valid_edge_values_are_accepted(obj):
    obj.validate()


def test_sampling_draw_flag_reaches_the_rollouts_sampling_config():
    """``--sampling_draw`` is parsed, validated against its choices and carried by ``PPOArgs.sampling()``,
    the one place the rollouts' SamplingConfig is built (with the answer budget and temperature)."""
    ppo = C.from_namespace(PPOArgs, make_parser(PPOArgs).parse_args(["--sampling_draw", "multinomial",
                                                                     "--temperature", "0.7"]))  # fmt: skip
    s = ppo.sampling()
    assert (s.draw, s.temperature, s.max_new_tokens) == ("multinomial", 0.7, ppo.max_answer_seq_len)
    assert PPOArgs().sampling().draw == "inverse_cdf"
    with pytest.raises(SystemExit):
        make_parser(PPOArgs).parse_args(["--sampling_draw", "gumbel"])


def test_step3_optimizers_one_definition_per_model_with_shared_schedule():
    """Step 3 adds OptimizerArgs under actor_ and critic_ (no copies in PPOArgs): each model has its own
    learning rate and weight decay with DeepSpeed-Chat's defaults, the schedule and Adam are shared, and the
    engine-level options add the PPO minibatch as the micro-batch."""
    from dschat.config import OptimizerArgs
    from training.step3_rlhf_finetuning.main import GROUPS, STEP_DEFAULTS

    groups = [g for g in GROUPS if not isinstance(g, type) and g[0] is OptimizerArgs]
    defaults = {k: v for k, v in STEP_DEFAULTS.items() if isinstance(k, tuple)}
    actor, critic = C.parse_groups("step3", "d", tuple(groups), argv=[], defaults=defaults)
    assert (actor.learning_rate, critic.learning_rate) == (9.65e-6, 5e-6)
    actor, critic = C.parse_groups(
        "step3", "d", tuple(groups), defaults=defaults,
        argv=["--critic_learning_rate", "1e-5", "--actor_weight_decay", "0.1", "--num_warmup_steps", "4",
              "--adam_beta2", "0.999"],
    )  # fmt: skip
    assert (actor.learning_rate, actor.weight_decay, critic.learning_rate, critic.weight_decay) == (
        9.65e-6, 0.1, 1e-5, 0.0)  # fmt: skip
    assert (
        actor.num_warmup_steps == critic.num_warmup_steps == 4
        and actor.adam_beta2 == critic.adam_beta2 == 0.999
    )
    with pytest.raises(UserError, match=re.escape("--actor_learning_rate must be > 0")):
        C.parse_groups("step3", "d", tuple(groups), argv=["--actor_learning_rate", "0"])
    with pytest.raises(UserError, match=re.escape("--num_warmup_steps must be >= 0")):  # shared: unprefixed
        C.parse_groups("step3", "d", tuple(groups), argv=["--num_warmup_steps", "-1"])
    engine_level = OptimArgs.of(actor, per_device_train_batch_size=8)
    assert engine_level.learning_rate == 9.65e-6 and engine_level.weight_decay == 0.1
    assert engine_level.per_device_train_batch_size == 8 and engine_level.gradient_accumulation_steps == 1


def test_inference_tools_share_one_device_group():
    """chat.py, prompt_eval.py and rw_eval.py place their model through one InferenceArgs group: auto
    resolves to a real device once, and a missing GPU is one line naming the flag."""
    import torch

    from dschat.config import InferenceArgs

    ns = make_parser(InferenceArgs).parse_args([])
    where = C.from_namespace(InferenceArgs, ns)
    assert where.device == ("cuda" if torch.cuda.is_available() else "cpu") and where.dtype == "auto"
    assert where.trust_remote_code is False  # safe by default
    if not torch.cuda.is_available():
        with pytest.raises(UserError, match=re.escape("--device cuda: no CUDA device is available")):
            C.from_namespace(InferenceArgs, make_parser(InferenceArgs).parse_args(["--device", "cuda"]))


def test_a_switch_can_be_set_either_way():
    """--group_by_length is on by default; --no_group_by_length turns it off, and a switch that defaults
    off takes --no_ too (so a preset's false always has a flag to become)."""
    assert C.parse_groups("p", "d", (C.DataArgs,), [])[0].group_by_length is True
    assert C.parse_groups("p", "d", (C.DataArgs,), ["--no_group_by_length"])[0].group_by_length is False
    assert C.parse_groups("p", "d", (C.DataArgs,), ["--no_train_on_prompt"])[0].train_on_prompt is False
    assert C.parse_groups("p", "d", (C.DataArgs,), ["--train_on_prompt"])[0].train_on_prompt is True


def test_step3s_ptx_data_is_tokenized_as_its_prompts():
    """The PTX term's SFT data used a fresh DataArgs: --chat_template off left it on the template (the
    prompts in Human/Assistant text, the SFT data in ChatML)."""
    from training.step3_rlhf_finetuning.main import GROUPS, STEP_DEFAULTS, RLHFOptions, ptx_data_args

    argv = ["--actor_model_name_or_path", "a", "--critic_model_name_or_path", "c", "--chat_template", "off",
            "--unsupervised_dataset_name", "builtin:sort", "--max_seq_len", "77", "--data_output_path", "/tmp/x"]  # fmt: skip
    o = RLHFOptions(*C.parse_groups("step3", "d", GROUPS, argv, STEP_DEFAULTS))
    d = ptx_data_args(o)
    assert (d.data_path, d.data_split, d.chat_template, d.max_seq_len, d.data_output_path) == (
        ["builtin:sort"], "1,0,0", "off", 77, "/tmp/x")  # fmt: skip
