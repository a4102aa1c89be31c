"""Step-3 reward sources, the built-in verifier reward, and the step-3 option groups."""

from __future__ import annotations

import itertools
import sys
import textwrap

import pytest
import torch

from dschat import tasks
from dschat.config import DeepSpeedArgs, ModelArgs, PPOArgs, RLHFEngineArgs, parse_groups
from dschat.rlhf.rewards import FunctionSource, SumSource
from dschat.utils.errors import UserError

_counter = itertools.count()


@pytest.fixture
def reward_module(tmp_path, monkeypatch):
    """A fresh importable module (unique name) with reward functions; removed from sys.modules after."""
    name = f"_dschat_test_reward_{next(_counter)}"
    (tmp_path / f"{name}.py").write_text(
        textwrap.dedent(
            """
            def length(prompts, responses):
                return [float(len(r)) for r in responses]

            def too_many(prompts, responses):
                return [1.0] * (len(responses) + 1)

            def nested(prompts, responses):
                return [[1.0] for _ in responses]

            def as_tuple(prompts, responses):
                return tuple(float(len(p)) for p in prompts)

            def scalar(prompts, responses):
                return 1.0

            def none(prompts, responses):
                return None

            def strings(prompts, responses):
                return ["1.0" for _ in responses]

            def with_stops(prompts, responses, stop_strings=("default",)):
                return [float(len(stop_strings)) for _ in responses]

            def forwards(prompts, responses, **kwargs):  # a wrapper: its **kwargs go to a function without them
                return [float(len(kwargs)) for _ in responses]

            def keyword_only(prompts, responses, *, stop_strings):
                return [float(len(stop_strings)) for _ in responses]
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    yield name
    sys.modules.pop(name, None)


def seqs(b: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.zeros(b, 4, dtype=torch.long), torch.ones(b, 4, dtype=torch.long)


# ---------------------------------------------------------------- FunctionSource / SumSource


def test_function_source_scores(reward_module):
    src = FunctionSource(f"{reward_module}:length")
    out = src.score(["p", "q"], ["abc", ""], *seqs(2))
    assert out.dtype == torch.float32
    assert out.tolist() == [3.0, 0.0]


def test_function_source_accepts_any_sequence(reward_module):
    out = FunctionSource(f"{reward_module}:as_tuple").score(["ab", "abcd"], ["x", "y"], *seqs(2))
    assert out.tolist() == [2.0, 4.0]


@pytest.mark.parametrize("fn", ["too_many", "nested"])
def test_function_source_wrong_shape_is_a_user_error(reward_module, fn):
    src = FunctionSource(f"{reward_module}:{fn}")
    with pytest.raises(UserError, match="--reward_fn"):
        src.score(["p", "q"], ["a", "b"], *seqs(2))


@pytest.mark.parametrize(
    "spec",
    ["nosuchmod_dschat_xyz:f", "dschat.tasks:no_such_function", "dschat.tasks"],
)
def test_function_source_bad_spec_is_a_user_error(spec):
    with pytest.raises(UserError, match="--reward_fn") as info:
        FunctionSource(spec)
    assert spec in str(info.value)


def test_function_source_missing_function_in_tmp_module(reward_module):
    with pytest.raises(UserError, match="--reward_fn"):
        FunctionSource(f"{reward_module}:nope")


@pytest.mark.parametrize("spec", [":verifier_reward", ".tasks:verifier_reward"])
def test_function_source_empty_or_relative_module_is_a_user_error(spec):
    PPOArgs(reward_fn=spec).validate()  # accepted by the flag check
    with pytest.raises(UserError, match="--reward_fn"):
        FunctionSource(spec)


def test_function_source_passes_the_formats_stop_strings_to_a_function_that_takes_them(reward_module):
    # the built-in verifier cuts a reply where the prompt format ends one (Human/Assistant: at an invented
    # turn; a chat template: nowhere, its end token did): it is told which, a function without the
    # keyword is called as before
    two = FunctionSource(f"{reward_module}:with_stops", stop_strings=("\n\nHuman:", "\nHuman:"))
    assert two.score(["p"], ["a"], *seqs(1)).tolist() == [2.0]
    assert FunctionSource(f"{reward_module}:with_stops", stop_strings=()).score(
        ["p"], ["a"], *seqs(1)
    ).tolist() == [0.0]
    assert FunctionSource(f"{reward_module}:keyword_only", stop_strings=("x",)).score(
        ["p"], ["a"], *seqs(1)
    ).tolist() == [1.0]
    # **kwargs is not a stop_strings parameter: a wrapper forwarding them would fail at the first rollout
    assert FunctionSource(f"{reward_module}:forwards", stop_strings=()).score(
        ["p"], ["a"], *seqs(1)
    ).tolist() == [0.0]
    plain = FunctionSource(f"{reward_module}:length", stop_strings=())
    assert plain.score(["p"], ["abc"], *seqs(1)).tolist() == [3.0]
    prompt = tasks.make_prompt("What is 347 + 85?")
    verifier = FunctionSource("dschat.tasks:verifier_reward", stop_strings=())
    assert verifier.score([prompt], [" 432\n\nHuman: hi"], *seqs(1)).tolist() == [-1.0]


@pytest.mark.parametrize("fn", ["scalar", "none", "strings"])
def test_function_source_non_list_return_is_a_user_error(reward_module, fn):
    src = FunctionSource(f"{reward_module}:{fn}")
    with pytest.raises(UserError, match="--reward_fn"):
        src.score(["p", "q"], ["a", "b"], *seqs(2))


class ConstSource:
    reads_packed = False

    def __init__(self, values):
        self.values = values

    def score(self, prompts, responses, sequences, attention_mask, packed=None):
        return torch.tensor(self.values)


def test_sum_source_adds_scores(reward_module):
    # lengths [3, 0] + [0.5, -0.5] + [1, 1] = [4.5, 0.5]
    src = SumSource(
        FunctionSource(f"{reward_module}:length"), ConstSource([0.5, -0.5]), ConstSource([1.0, 1.0])
    )
    out = src.score(["p", "q"], ["abc", ""], *seqs(2))
    assert out.tolist() == [4.5, 0.5]


def test_sum_source_single():
    assert SumSource(ConstSource([2.0])).score(["p"], ["r"], *seqs(1)).tolist() == [2.0]


# ---------------------------------------------------------------- verifier reward


def test_verifier_reward_hand_values():
    add = tasks.make_prompt("What is 2 + 3?")
    rev = tasks.make_prompt("Reverse: abc")
    prompts = [add, add, add, rev, tasks.make_prompt("Tell me a joke"), add]
    responses = [" 5", " 6", " 5\n\nHuman: more?", " cba", " ha", "", " 5\nor 6"]
    prompts.append(add)
    # right, wrong, right (reply cut at the invented turn), right, unknown task, empty = wrong,
    # right first line with more after it = wrong
    assert tasks.verifier_reward(prompts, responses) == [1.0, -1.0, 1.0, 1.0, 0.0, -1.0, -1.0]


def test_verifier_reward_through_function_source():
    src = FunctionSource("dschat.tasks:verifier_reward")
    prompts = [tasks.make_prompt("What is 10 + 15?"), tasks.make_prompt("What is 10 + 15?"), "hi"]
    out = src.score(prompts, [" 25", " 35", " 25"], *seqs(3))
    assert out.tolist() == [1.0, -1.0, 0.0]


@pytest.mark.parametrize("name", sorted(tasks.TASKS))
def test_verifier_reward_on_generated_tasks(name):
    examples = tasks.generate([name], n_per_task=20, seed=3)
    prompts = [e.prompt for e in examples]
    assert tasks.verifier_reward(prompts, [e.chosen for e in examples]) == [1.0] * 20
    assert tasks.verifier_reward(prompts, [e.rejected for e in examples]) == [-1.0] * 20


# ---------------------------------------------------------------- step-3 option groups


@pytest.mark.parametrize(
    "obj, flag",
    [
        # 4 x 3 = 12 prompts collected, 5 does not divide 12
        (
            PPOArgs(
                per_device_generation_batch_size=4, generation_batches=3, per_device_training_batch_size=5
            ),
            "--per_device_training_batch_size",
        ),
        (
            PPOArgs(per_device_generation_batch_size=4, per_device_training_batch_size=8),
            "--per_device_training_batch_size",
        ),
        (PPOArgs(reward_fn="dschat.tasks.verifier_reward"), "--reward_fn"),
        (PPOArgs(ppo_epochs=0), "--ppo_epochs"),
        (PPOArgs(kl_target=0.0), "--kl_target"),
        # the adaptive controller multiplies the coefficient: from 0 it never moves
        (PPOArgs(kl_target=6.0, kl_coef=0.0), "--kl_target 6.0 with --kl_coef 0"),
        (PPOArgs(lam=1.5), "--lam"),
        (RLHFEngineArgs(ema_decay=1.0), "--ema_decay"),
        (RLHFEngineArgs(ema_decay=0.9), "--ema_decay needs --enable_ema"),  # accepted and unused
    ],
)
def test_step3_validation_names_the_flag(obj, flag):
    with pytest.raises(UserError) as info:
        obj.validate()
    assert flag in str(info.value)


# step 3's ZeRO stages: DeepSpeedArgs once per trained model, --offload shared (as the step adds them)
STEP3_DS = ((DeepSpeedArgs, "actor_", ("offload",)), (DeepSpeedArgs, "critic_", ("offload",)))


@pytest.mark.parametrize(
    "argv, flag",
    [
        (["--offload"], "--offload needs --actor_zero_stage"),
        (["--offload", "--actor_zero_stage", "2"], "--offload needs --critic_zero_stage"),
        (["--offload", "--critic_zero_stage", "3"], "--offload needs --actor_zero_stage"),
        (["--actor_zero_stage", "4"], "--actor_zero_stage"),
        (["--critic_zero_stage", "-1"], "--critic_zero_stage"),
    ],
)
def test_step3_stage_and_offload_name_the_flag(argv, flag):
    with pytest.raises(UserError) as info:
        parse_groups("step3", "d", STEP3_DS, argv=argv)
    assert flag in str(info.value)


def test_step3_stages_parse_per_model_with_one_offload():
    actor, critic = parse_groups(
        "step3", "d", STEP3_DS, argv=["--offload", "--actor_zero_stage", "1", "--critic_zero_stage", "3"]
    )
    assert (actor.zero_stage, actor.offload, critic.zero_stage, critic.offload) == (1, True, 3, True)


@pytest.mark.parametrize(
    "obj",
    [
        PPOArgs(),
        PPOArgs(per_device_generation_batch_size=4, generation_batches=3, per_device_training_batch_size=6),
        PPOArgs(per_device_generation_batch_size=4, generation_batches=3, per_device_training_batch_size=12),
        PPOArgs(reward_fn="dschat.tasks:verifier_reward", kl_target=6.0, gamma=0.0, lam=1.0),
        RLHFEngineArgs(),
    ],
)
def test_step3_valid_values_pass(obj):
    obj.validate()


def test_step3_groups_validate_through_parse_groups():
    groups = (*STEP3_DS, RLHFEngineArgs, PPOArgs)
    with pytest.raises(UserError, match="--offload"):
        parse_groups("step3", "d", groups, argv=["--offload"])
    with pytest.raises(UserError, match="--reward_fn"):
        parse_groups("step3", "d", groups, argv=["--reward_fn", "nocolon"])
    actor_ds, critic_ds, _, ppo = parse_groups(
        "step3", "d", groups, argv=["--actor_zero_stage", "3", "--kl_target", "6"]
    )
    assert actor_ds.zero_stage == 3 and critic_ds.zero_stage == 0 and ppo.kl_target == 6.0


ACTOR_CRITIC = ((ModelArgs, "actor_", ("dtype",)), (ModelArgs, "critic_", ("dtype",)))


def test_prefixed_groups_share_one_dtype():
    actor, critic = parse_groups(
        "step3",
        "d",
        ACTOR_CRITIC,
        argv=["--actor_model_name_or_path", "a/x", "--critic_model_name_or_path", "c/y", "--dtype", "bf16"],
    )
    assert actor.model_name_or_path == "a/x" and critic.model_name_or_path == "c/y"
    assert actor.dtype == critic.dtype == "bf16"


def test_prefixed_groups_defaults_and_independent_fields():
    actor, critic = parse_groups("step3", "d", ACTOR_CRITIC, argv=["--actor_gradient_checkpointing"])
    assert actor.dtype == critic.dtype == "auto"
    assert actor.gradient_checkpointing is True and critic.gradient_checkpointing is False


@pytest.mark.parametrize("flag", ["--actor_dtype", "--critic_dtype", "--model_name_or_path"])
def test_prefixed_groups_have_no_prefixed_shared_flag(flag, capsys):
    with pytest.raises(SystemExit) as info:
        parse_groups("step3", "d", ACTOR_CRITIC, argv=[flag, "bf16"])
    assert info.value.code == 2
    assert flag in capsys.readouterr().err


def test_prefixed_group_validation_names_the_prefixed_flag():
    with pytest.raises(UserError, match="--critic_dropout"):
        parse_groups("step3", "d", ACTOR_CRITIC, argv=["--critic_dropout", "1.5"])
