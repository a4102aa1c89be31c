"""train.py chains each step's model from the earlier steps' outputs: a model flag after -- (which reaches
every step) must not silently replace that chain."""

from __future__ import annotations

import argparse

import pytest

from dschat.launch.steps import check_conflicts
from dschat.utils.errors import UserError


def ns(**kw) -> argparse.Namespace:
    base = {
        "algorithm": "ppo",
        "actor_zero_stage": None,
        "reward_zero_stage": None,
        "actor_model": None,
        "data_path": None,
    }
    return argparse.Namespace(**{**base, **kw})


@pytest.mark.parametrize(
    "algorithm, steps, extra, needle",
    [
        ("ppo", [1, 2], ["--model_name_or_path", "x"], "step 2's model"),
        ("ppo", [2], ["--model_name_or_path=x"], "step 2's model"),
        ("dpo", [1, 2], ["--model_name_or_path", "x"], "DPO's policy"),
        ("ppo", [1, 2, 3], ["--actor_model_name_or_path", "x"], "step 3's model"),
        ("ppo", [3], ["--critic_model_name_or_path", "x"], "step 3's critic"),
    ],
)
def test_a_chained_model_flag_after_the_separator_is_one_line(algorithm, steps, extra, needle):
    with pytest.raises(
        UserError, match=rf"{extra[0].split('=')[0]} after -- would replace {needle}.*--actor-model"
    ):
        check_conflicts(ns(algorithm=algorithm), extra, steps)


def test_step_1_alone_takes_its_model_after_the_separator():
    """Step 1's model is not chained: -- --model_name_or_path is its own flag (as --actor-model)."""
    check_conflicts(ns(), ["--model_name_or_path", "x"], [1])


def test_output_dir_after_the_separator_is_one_line():
    """It reaches every step: all of them would write into one directory."""
    with pytest.raises(UserError, match="--output_dir after -- would send every step to one directory"):
        check_conflicts(ns(data_path=None), ["--output_dir", "/tmp/shared"], [1, 2, 3])


def test_data_path_given_twice_is_a_conflict():
    with pytest.raises(
        UserError, match="conflicting flags: --data-path builtin:sort and --data_path after --"
    ):
        check_conflicts(ns(data_path=["builtin:sort"]), ["--data_path", "builtin:reverse_words"], [1])
    check_conflicts(ns(data_path=None), ["--data_path", "builtin:reverse_words"], [1])  # one of them: fine


def test_a_resumed_step_keeps_its_placement_when_no_plan_can_be_made(tmp_path, monkeypatch, capsys):
    """--resume took the interrupted run's ZeRO stages only after a plan was made: where planning failed (a
    model config not readable offline) the step started on its own defaults, a ZeRO-3 checkpoint in a
    ZeRO-0 engine. The interrupted run's placement comes first."""
    import argparse
    import json

    import train
    from dschat import planning as P
    from dschat.launch.steps import STEPS

    (tmp_path / "step1").mkdir()
    (tmp_path / "step1" / "dschat_config.json").write_text(
        json.dumps({"zero_stage": 3, "offload": False, "gradient_checkpointing": True})
    )

    def no_plan(*a, **k):
        raise train.UserError("no config for that model offline")

    monkeypatch.setattr(P, "make_plan", no_plan)
    line = argparse.Namespace(step=STEPS[1], argv=[], groups=())
    args = argparse.Namespace(estimate_memory=False, resume=True, output_dir=str(tmp_path), algorithm="ppo")
    assert train.memory_plan(line, args, [], {}) == ["--zero_stage", "3", "--gradient_checkpointing"]
    assert "resuming with the interrupted run's" in capsys.readouterr().out
