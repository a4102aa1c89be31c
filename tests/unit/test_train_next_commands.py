"""The commands train.py prints after a finished job: chat with the result, compare it with its start."""

from __future__ import annotations

import importlib.util
import shlex
import sys
from pathlib import Path

import pytest

from dschat.launch.presets import preset_flags

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def train():
    spec = importlib.util.spec_from_file_location("dschat_train_py", ROOT / "train.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def commands(train, argv: list[str], preset: dict | None = None) -> tuple[list[str], list[str]]:
    args, _ = train.parse_args(argv)
    chat, cmp = train.next_commands(args, train.steps_of(args), preset)
    return shlex.split(chat.split(": ", 1)[1]), shlex.split(cmp.split(": ", 1)[1])


def flag(cmd: list[str], name: str) -> str | None:
    return cmd[cmd.index(name) + 1] if name in cmd else None


def test_after_all_three_steps(train, tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)
    out = tmp_path / "run"
    (out / "step2").mkdir(parents=True)
    (out / "step2" / "summary.json").write_text("{}")
    chat, cmp = commands(train, ["--output-dir", str(out)])
    assert chat == ["python", "inference/chat.py", "--path", str(out / "step3" / "actor")]
    assert cmp[:2] == ["python", "inference/prompt_eval.py"]
    assert flag(cmp, "--model_name_or_path_baseline") == str(out / "step1")
    assert flag(cmp, "--model_name_or_path_finetune") == str(out / "step3" / "actor")
    assert flag(cmp, "--reward_model") == str(out / "step2")


def test_after_step_one_only(train, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # elsewhere: the scripts are named by absolute path
    chat, cmp = commands(train, ["--step", "1", "--output-dir", "out", "--actor-model", "org/base-model"])
    assert chat == ["python", str(ROOT / "inference" / "chat.py"), "--path", "out/step1"]
    assert flag(cmp, "--model_name_or_path_baseline") == "org/base-model"
    assert flag(cmp, "--model_name_or_path_finetune") == "out/step1"
    assert flag(cmp, "--reward_model") is None  # no step-2 model in out/
    _, cmp = commands(train, ["--step", "1", "--output-dir", "out"], preset={"model": "builtin:tiny-llama"})
    assert flag(cmp, "--model_name_or_path_baseline") == "builtin:tiny-llama"


def test_nothing_to_talk_to_after_step_two_alone(train, tmp_path):
    args, _ = train.parse_args(["--step", "2", "--output-dir", str(tmp_path)])
    assert train.next_commands(args, train.steps_of(args), {}) == []


def test_preset_values_can_name_the_output_dir(train):
    preset = {
        "step2": {
            "--policy_negatives_from": "{output_dir}/step1",
            "--num_train_epochs": 2,
            "--flag": True,
            "--group_by_length": False,
        }
    }
    assert preset_flags(preset, 2, "runs/a") == [
        "--policy_negatives_from", "runs/a/step1", "--num_train_epochs", "2", "--flag", "--no_group_by_length",
    ]  # fmt: skip
    args, extra = train.parse_args(["--step", "2", "--output-dir", "runs/b"])
    assert "runs/b/step1" in train.step_args(2, args, extra, preset)


def test_the_comparison_uses_the_runs_own_built_in_tasks(train, tmp_path):
    preset = {"model": "m", "step1": {"--data_path": "builtin:sort,reverse_words"}}
    _, cmp = commands(train, ["--output-dir", str(tmp_path)], preset=preset)
    assert flag(cmp, "--tasks") == "sort,reverse_words"
    _, cmp = commands(train, ["--output-dir", str(tmp_path), "--data-path", "builtin:add"], preset=preset)
    assert flag(cmp, "--tasks") == "add"
    _, cmp = commands(train, ["--output-dir", str(tmp_path), "--data-path", "my.jsonl"], preset=preset)
    assert flag(cmp, "--tasks") is None


def test_the_comparison_follows_what_the_finished_run_recorded(train, tmp_path, monkeypatch):
    """The compare command judged with OUTPUT/step2 even where step 3 had trained against another reward
    model (--reward-model, a stale step2/ beside it), and read a preset's list of sources as the text of a
    Python list (no tasks). The finished step's dschat_config.json wins; a YAML list is a list."""
    import json

    monkeypatch.chdir(ROOT)
    out = tmp_path / "run"
    (out / "step2").mkdir(parents=True)
    (out / "step2" / "summary.json").write_text("{}")
    _, cmp = commands(train, ["--output-dir", str(out)], preset={"step1": {"--data_path": ["builtin:add"]}})
    assert flag(cmp, "--tasks") == "add"
    (out / "step3" / "actor").mkdir(parents=True)
    recorded = {"resolved_reward_path": "elsewhere/rm", "data_path": ["builtin:sort"]}
    (out / "step3" / "dschat_config.json").write_text(json.dumps(recorded))
    _, cmp = commands(train, ["--output-dir", str(out)], preset={"step1": {"--data_path": ["builtin:add"]}})
    assert flag(cmp, "--reward_model") == "elsewhere/rm" and flag(cmp, "--tasks") == "sort"


def test_the_compare_command_asks_the_default_tasks_of_a_run_on_builtin(train, tmp_path):
    """A preset without --data_path (builtin-tiny) or --data-path builtin trains on the default tasks: the
    comparison asks those, not every built-in task (add and reverse_words it never trained on)."""
    from dschat import tasks

    for argv, preset in (([], {"step1": {}}), (["--data-path", "builtin"], None)):
        _, cmp = commands(train, ["--output-dir", str(tmp_path), *argv], preset=preset)
        assert flag(cmp, "--tasks") == ",".join(tasks.DEFAULT_TASKS)


def test_after_dpo_the_result_is_step2_dpo(train, tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)
    out = tmp_path / "run"
    chat, cmp = commands(train, ["--algorithm", "dpo", "--output-dir", str(out)])
    assert chat[-1] == str(out / "step2_dpo")
    assert flag(cmp, "--model_name_or_path_baseline") == str(out / "step1")
    assert flag(cmp, "--model_name_or_path_finetune") == str(out / "step2_dpo")
    assert flag(cmp, "--reward_model") is None
    assert flag(cmp, "--output") == str(out / "prompt_eval_step2_dpo")


def test_dpo_step_command_line(train, tmp_path):
    args, extra = train.parse_args(
        ["--algorithm", "dpo", "--output-dir", str(tmp_path), "--actor-zero-stage", "3"]
    )
    assert train.steps_of(args) == [1, 2]  # no step 3 by default
    argv = train.step_args(2, args, extra, {"step2": {"--margin": 0.5}, "step2_dpo": {"--beta": 0.2}})
    assert train.step_of(2, args).entry.parent.name == "step2_dpo_finetuning"
    # the DPO section of the preset, not the reward model's; the policy starts from step 1; the actor's stage
    assert flag(argv, "--beta") == "0.2" and "--margin" not in argv
    assert flag(argv, "--output_dir") == str(tmp_path / "step2_dpo")
    assert flag(argv, "--model_name_or_path") == str(tmp_path / "step1")
    assert flag(argv, "--zero_stage") == "3"
    groups = train.parse_step(train.step_of(2, args), argv)
    assert any(getattr(g, "beta", None) == 0.2 for g in groups)


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["--algorithm", "dpo", "--step", "3"], "no step 3"),
        # the advice fits the flag (a model flag was told to use --actor-zero-stage)
        (
            ["--algorithm", "dpo", "--reward-model", "x"],
            r"--reward-model .*step 1's output, or --actor-model\)$",
        ),
        (["--algorithm", "dpo", "--reward-zero-stage", "3"], r"--reward-zero-stage .*--actor-zero-stage\)$"),
    ],
)
def test_dpo_refuses_what_it_does_not_have(train, argv, needle):
    from dschat.utils.errors import UserError

    args, _ = train.parse_args(argv)
    with pytest.raises(UserError, match=needle):
        train.check_dpo(args, train.steps_of(args))


def test_step_line_is_parsed_once_and_puts_the_plan_before_the_users_flags(train, tmp_path):
    """A step's command line is built and parsed once; the memory plan's flags go between the preset's /
    train.py's and the user's (after --), so the user's still win: argparse keeps the last value."""
    args, extra = train.parse_args(
        ["--step", "1", "--output-dir", str(tmp_path), "--", "--zero_stage", "2", "--learning_rate", "3e-4"]
    )
    line = train.StepLine.of(1, args, extra, {"step1": {"--learning_rate": 1e-4}})
    optim = next(g for g in line.groups if hasattr(g, "learning_rate"))
    assert optim.learning_rate == 3e-4  # the user's flag over the preset's
    cmd = line.command(["--zero_stage", "3", "--gradient_checkpointing"])
    assert cmd[-4:] == ["--zero_stage", "2", "--learning_rate", "3e-4"]
    assert cmd.index("--gradient_checkpointing") < cmd.index("--learning_rate", cmd.index("--output_dir"))
    (ds,) = [g for g in train.parse_step(line.step, cmd) if hasattr(g, "zero_stage")]
    assert ds.zero_stage == 2  # the plan's 3 is overridden by the user's 2


@pytest.mark.parametrize(
    ("argv", "hint"),
    [
        # a step's own spelling of one of train.py's flags
        (["--output_dir", "/tmp/x"], "train.py spells it --output-dir"),
        (["--Output_Dir=/tmp/x"], "train.py spells it --output-dir"),
        # a typo of train.py's own flag is not a step's flag
        (["--dry-runn"], "did you mean --dry-run?"),
        # a step's flag: it goes after --
        (["--learning_rate", "1e-4"], "a step's own flags go after --: train.py -- --learning_rate"),
    ],
)
def test_a_flag_spelt_the_steps_way_gets_the_fix_in_its_error(train, capsys, argv, hint):
    with pytest.raises(SystemExit) as stop:
        train.parse_args(argv)
    assert stop.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and argv[0] in err and hint in err, err


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["--step", "1", "--step", "2"], "--step given twice"),
        (["--data-path", "builtin:sort", "--data-path=builtin:reverse_words"], "--data-path given twice"),
        (["--actor-model", "a", "--actor-model", "b"], "--actor-model given twice"),
    ],
)
def test_a_flag_given_twice_is_one_line(train, capsys, argv, needle):
    """argparse kept the last of a repeated flag: '--step 1 --step 2' ran step 2 alone, and a second
    --data-path replaced the first, silently. A switch given twice changes nothing and is accepted."""
    with pytest.raises(SystemExit) as exc:
        train.parse_args(argv)
    assert exc.value.code == 2 and needle in capsys.readouterr().err
    args, _ = train.parse_args(["--dry-run", "--dry-run", "--step", "1", "2"])
    assert args.dry_run and args.step == [1, 2]


@pytest.mark.parametrize("name", ["overwrite", "resume", "node_local_storage"])
def test_a_negated_train_py_switch_after_the_separator_is_one_line(train, name):
    """'--node-local-storage -- --no_node_local_storage' ran with the last of the two (off), and
    '--overwrite -- --no_overwrite' passed train.py's directory checks and was refused by a later step."""
    from dschat.launch.steps import check_conflicts
    from dschat.utils.errors import UserError

    args, extra = train.parse_args([f"--{name.replace('_', '-')}", "--", f"--no_{name}"])
    with pytest.raises(UserError, match=f"--no_{name} after -- would undo"):
        check_conflicts(args, extra, train.steps_of(args))


def test_an_actor_model_no_step_reads_is_one_line(train, tmp_path):
    """--step 3 --actor-model X (steps 1 and 2 finished) ran step 3 on step 1's output and only took X's
    preset; --step 2 with a finished step 1 started from that output too. Both ignored X silently."""
    from dschat.utils.errors import UserError

    (tmp_path / "step1").mkdir()
    (tmp_path / "step1" / "summary.json").write_text("{}")
    for argv in (["--step", "3"], ["--step", "2"], ["--step", "2", "--algorithm", "dpo"]):
        args, _ = train.parse_args(
            [*argv, "--actor-model", "builtin:tiny-llama", "--output-dir", str(tmp_path)]
        )
        with pytest.raises(
            UserError,
            match=r"--actor-model builtin:tiny-llama: the steps of this job .* start from .*step1, a finished step 1",
        ):
            train.check_actor_model_is_read(args, train.steps_of(args))
    # read: step 1 runs, or step 2 starts from it (no step 1 to chain), or a memory estimate plans with it
    for argv, out in ((["--step", "1", "2"], tmp_path), (["--step", "2"], tmp_path / "fresh"),
                      (["--step", "3", "--estimate-memory"], tmp_path / "fresh")):  # fmt: skip
        args, _ = train.parse_args([*argv, "--actor-model", "builtin:tiny-llama", "--output-dir", str(out)])
        train.check_actor_model_is_read(args, train.steps_of(args))


def test_the_first_steps_models_are_checked_before_it_starts(train, tmp_path, capsys):
    """--step 2 alone on the default preset passed train.py (and its --dry-run) with the preset's
    --policy_negatives_from {output_dir}/step1 absent, and failed in the launched step."""
    from dschat.utils.errors import UserError

    with pytest.raises(UserError, match=r"--policy_negatives_from .*step1: no such local file or directory"):
        train.main(["--step", "2", "--dry-run", "--output-dir", str(tmp_path / "run")])


def test_the_comparison_starts_from_the_model_step_1_recorded(train, tmp_path):
    """'--step 1 -- --model_name_or_path builtin:tiny-llama' trained tiny-llama, and the printed comparison
    named the preset's model as the baseline."""
    import json

    (tmp_path / "step1").mkdir()
    (tmp_path / "step1" / "summary.json").write_text("{}")
    (tmp_path / "step1" / "dschat_config.json").write_text(
        json.dumps({"model_name_or_path": "builtin:tiny-llama"})
    )
    _, cmp = commands(train, ["--step", "1", "--output-dir", str(tmp_path)], {"model": "org/Preset-Model"})
    assert flag(cmp, "--model_name_or_path_baseline") == "builtin:tiny-llama"


def test_a_reward_model_of_another_vocabulary_is_refused_before_step_1(train, tmp_path):
    """--actor-model and --reward-model of different tokenizers ran steps 1 and 2 and failed when step 3
    started; the two are compared before any step."""
    import shutil

    from transformers import AutoTokenizer

    from dschat.models.builtin import materialize
    from dschat.utils.errors import UserError

    other = tmp_path / "other"
    shutil.copytree(materialize("builtin:micro-llama"), other)
    tok = AutoTokenizer.from_pretrained(other)
    tok.add_tokens(["<extra>"])
    tok.save_pretrained(other)
    argv = ["--actor-model", "builtin:micro-llama", "--output-dir", str(tmp_path / "run")]
    args, _ = train.parse_args([*argv, "--reward-model", str(other)])
    with pytest.raises(UserError, match=r"--reward-model .*other: its tokenizer differs from the actor's"):
        train.check_reward_reads_the_actors_tokens(args, train.steps_of(args), [])
    train.check_reward_reads_the_actors_tokens(
        args, train.steps_of(args), ["--trust_remote_code"]
    )  # steps judge
    args, _ = train.parse_args([*argv, "--reward-model", "builtin:micro-llama"])
    train.check_reward_reads_the_actors_tokens(args, train.steps_of(args), [])


def test_resume_refuses_a_finished_step_built_from_a_step_trained_again_since(train, tmp_path):
    """An --overwrite job that stopped in step 3's start-up left the old step 3 beside a new step 1: --resume
    kept it and named its actor, built from the earlier step 1, as the result. Each step records the
    summaries of the finished steps it starts from (input_runs), which a run of that step rewrites."""
    import json

    from dschat.utils.errors import UserError
    from dschat.utils.run import input_runs

    for n in (1, 3):
        (tmp_path / f"step{n}").mkdir()
        (tmp_path / f"step{n}" / "summary.json").write_text(json.dumps({"run": "first"}))
    step1 = tmp_path / "step1"
    (tmp_path / "step3" / "dschat_config.json").write_text(json.dumps({"input_runs": input_runs(step1)}))
    args, _ = train.parse_args(["--output-dir", str(tmp_path), "--resume", "--step", "1", "3"])
    assert set(train.resume_actions(args, [1, 3]).values()) == {"keep"}
    (step1 / "summary.json").write_text(json.dumps({"run": "second"}))  # step 1 trained again
    with pytest.raises(
        UserError, match=r"step 3 is finished, but .*step1, which it was built from, was trained"
    ):
        train.resume_actions(args, [1, 3])
    # a recorded input no longer there (the output directory was moved or copied) is not compared
    (tmp_path / "step3" / "dschat_config.json").write_text(
        json.dumps({"input_runs": {"/gone/step1": "0123"}})
    )
    assert set(train.resume_actions(args, [1, 3]).values()) == {"keep"}


@pytest.mark.parametrize("flag", ["--actor-model", "--reward-model", "--output-dir"])
def test_an_empty_model_or_output_dir_is_one_line(train, flag):
    """--actor-model '' was ignored (the preset's model trained) and --output-dir '' wrote ./step1."""
    from dschat.utils.errors import UserError

    args, _ = train.parse_args([flag, ""])
    with pytest.raises(UserError, match=rf"^{flag} is empty$"):
        train.check_models(args)


def test_flags_only_step_1_reads_reach_step_1_alone(train, tmp_path, capsys):
    """--train_on_prompt and --sft_only_data_path after -- (which goes to every step) reach step 1; the
    later steps, which refuse them as read by nothing, get the rest of the user's flags."""
    args, extra = train.parse_args(["--step", "1", "2", "3", "--output-dir", str(tmp_path), "--", "--train_on_prompt",
                                    "--sft_only_data_path", "extra.jsonl", "--seed", "7"])  # fmt: skip
    one = train.StepLine.of(1, args, extra, {})
    (data,) = [g for g in one.groups if hasattr(g, "train_on_prompt")]
    assert data.train_on_prompt and data.sft_only_data_path == ["extra.jsonl"]
    for n in (2, 3):
        line = train.StepLine.of(n, args, extra, {})
        assert line.user == ["--seed", "7"], line.user
    out = capsys.readouterr().out
    assert "==> step 2: --train_on_prompt --sft_only_data_path extra.jsonl read by step 1 only" in out


def test_dropped_flags_take_all_their_values_and_their_no_forms(train):
    names = {"--sft_only_data_path", "--train_on_prompt"}
    argv = ["--a", "1", "--sft_only_data_path", "x", "y", "--no_train_on_prompt", "--b=-2", "--train_on_prompt",
            "--c", "-1", "--train_on_prompt", "-h"]  # fmt: skip
    kept, dropped = train.drop_flags(argv, names)
    assert kept == ["--a", "1", "--b=-2", "--c", "-1", "-h"]
    assert dropped == [
        "--sft_only_data_path",
        "x",
        "y",
        "--no_train_on_prompt",
        "--train_on_prompt",
        "--train_on_prompt",
    ]


@pytest.mark.parametrize("flags", [["--train_on_prompt"], ["--sft_only_data_path", "extra.jsonl"]])
def test_later_steps_refuse_what_only_step_1_reads(flags):
    from dschat import config as C
    from dschat.utils.errors import UserError

    data = C.parse_groups("p", "d", (C.DataArgs,), flags)[0]
    with pytest.raises(UserError, match=rf"^{flags[0]}: only step 1 \(SFT\) reads it, not step 3"):
        data.refuse_step1_only("step 3")
    C.parse_groups("p", "d", (C.DataArgs,), [])[0].refuse_step1_only("step 3")  # defaults: nothing given
