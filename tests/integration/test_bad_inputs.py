"""Bad input is the user's to fix: exit code 2, one ``error: ...`` line on stderr that names the file,
line, field or flag, no traceback, and no run marked finished (no summary.json)."""

from __future__ import annotations

import json
import os

import pytest

from tests.integration.helpers import FAST, RUN_FLAGS, error_line, step1, train_py


def run_bad(tmp_path, *flags: str, env: dict | None = None, in_process: bool = False):
    """Step 1 stopped by a bad input; ``in_process`` where it must stop before the process group (flags and
    named inputs), a subprocess where it is found later by design (file contents, the tokenizer, the hub)."""
    out = tmp_path / "out"
    proc = step1(out, *FAST, "--max_steps", "5", *flags, env=env, in_process=in_process)
    assert not (out / "summary.json").exists()
    return proc


def test_missing_data_file(tmp_path):
    error_line(
        run_bad(tmp_path, "--data_path", "/nonexistent.jsonl", in_process=True),
        "/nonexistent.jsonl",
        "not found",
    )


def test_malformed_json_line_names_file_and_line(tmp_path):
    data = tmp_path / "data.jsonl"
    good = json.dumps({"prompt": "Human: hi\n\nAssistant:", "response": " hello"})
    data.write_text(f"{good}\n{good}\n{{'prompt': broken\n{good}\n")
    line = error_line(run_bad(tmp_path, "--data_path", str(data)), f"{data}:3:")
    assert "JSON" in line


def test_required_field_missing_names_the_field_and_line(tmp_path):
    data = tmp_path / "data.jsonl"
    rows = [
        {"prompt": "a", "response": "b"},
        {"prompt": "c", "answer": "d"},
        {"prompt": "e", "response": "f"},
    ]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    error_line(
        run_bad(tmp_path, "--data_path", str(data)), f"{data}:2", "missing field", "'chosen'", "response"
    )


def test_everything_filtered_out_by_max_seq_len(tmp_path):
    error_line(run_bad(tmp_path, "--data_path", "builtin:add", "--max_seq_len", "8"), "--max_seq_len 8")


def test_max_seq_len_beyond_the_models_context_is_one_line(tmp_path):
    """micro-llama attends to 1024 positions: --max_seq_len 99999 trained and saved a model on short data,
    and on long data would index past a learned position table mid-run."""
    error_line(run_bad(tmp_path, "--max_seq_len", "99999"), "--max_seq_len 99999: beyond the 1024 tokens")


def test_unknown_model_name_offline(tmp_path):
    proc = run_bad(tmp_path, "--model_name_or_path", "no-such-org/no-such-model", env={"HF_HUB_OFFLINE": "1"})
    error_line(proc, "no-such-org/no-such-model")


@pytest.mark.parametrize(
    ("flags", "needles"),
    [
        (["--only_optimize_lora"], ["--only_optimize_lora", "--lora_dim"]),
        (["--zero_stage", "5"], ["--zero_stage", "5"]),
        (["--no_such_flag"], ["--no_such_flag"]),
    ],
    ids=["only-optimize-lora-without-lora", "zero-stage-5", "unknown-flag"],
)
def test_bad_flags(tmp_path, flags, needles):
    proc = run_bad(tmp_path, *flags, in_process=True)
    error_line(proc, *needles)


def test_output_dir_holding_a_finished_run_needs_overwrite(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "summary.json").write_text('{"step": 1}\n')
    error_line(step1(out, *FAST, "--max_steps", "5"), str(out), "--overwrite")
    assert (out / "summary.json").read_text() == '{"step": 1}\n'
    assert sorted(p.name for p in out.iterdir()) == ["summary.json"]


def test_overwrite_keeps_the_finished_run_when_the_model_refuses_a_flag(tmp_path):
    """Flags checked against the model (its layer count, LoRA's module names) are found when the model
    loads, after start-up; --overwrite must not have removed the finished run by then."""
    out = tmp_path / "out"
    out.mkdir()
    (out / "summary.json").write_text('{"step": 1}\n')
    (out / "metrics.jsonl").write_text('{"step": 1}\n')
    error_line(
        step1(out, *FAST, "--max_steps", "1", "--overwrite", "--trainable_layers", "99"),
        "--trainable_layers 99",
    )
    assert (out / "summary.json").read_text() == '{"step": 1}\n'
    assert sorted(p.name for p in out.iterdir()) == ["metrics.jsonl", "summary.json"]


def test_train_py_overwrite_keeps_the_finished_runs_log_when_the_step_refuses_a_flag(tmp_path):
    """train.py started the step's training.log afresh before the step had checked its flags: a refused
    --overwrite kept the finished run but replaced its log with the refused attempt's. The earlier log stays
    until the step's outputs begin; the attempt's output is kept beside it."""
    step = tmp_path / "out" / "step1"
    step.mkdir(parents=True)
    (step / "summary.json").write_text('{"step": 1}\n')
    (step / "training.log").write_text("the finished run's log\n")
    proc = train_py("--step", "1", "--actor-model", "builtin:micro-llama", "--output-dir", str(tmp_path / "out"),
                    "--overwrite", "--", "--trainable_layers", "99")  # fmt: skip
    line = error_line(proc, "step 1", "training.attempt.log (training.log keeps the earlier run's)")
    assert "--trainable_layers 99" in proc.stdout and "--trainable_layers" not in line
    assert (step / "training.log").read_text() == "the finished run's log\n"
    assert "--trainable_layers 99" in (step / "training.attempt.log").read_text()
    assert (step / "summary.json").exists()
    # an attempt that begins its outputs takes the log's name (and train.py goes on writing to it)
    proc = train_py("--step", "1", "--actor-model", "builtin:micro-llama", "--output-dir", str(tmp_path / "out"),
                    "--overwrite", "--", *RUN_FLAGS, "--max_steps", "1")  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    log = (step / "training.log").read_text()
    assert "--max_steps 1" in log and "the finished run's log" not in log and "model saved to" in log
    assert not (step / "training.attempt.log").exists()


def test_train_py_more_processes_than_devices(tmp_path):
    proc = train_py(
        "--step", "1", "--deployment-type", "single_node", "--num-gpus", "64", "--output-dir", str(tmp_path),
    )  # fmt: skip
    error_line(proc, "--num-gpus 64")
    assert not (tmp_path / "step1").exists()


def test_train_py_missing_local_model_is_caught_before_any_step_starts(tmp_path):
    out = tmp_path / "out"
    proc = train_py("--actor-model", str(tmp_path / "no-such-model"), "--output-dir", str(out))
    error_line(proc, "--actor-model", "no such local file or directory")
    assert "==> step" not in proc.stdout and not out.exists()


def test_train_py_uncached_hub_model_offline_is_caught_before_any_step_starts(tmp_path):
    """A hub name that is not cached, with the hub off (HF_HUB_OFFLINE, as every test runs): transformers
    retried it for over a minute inside step 1 (measured 75 s on this machine without a network)."""
    out = tmp_path / "out"
    proc = train_py("--actor-model", "no-such-org/no-such-model", "--output-dir", str(out))
    error_line(proc, "--actor-model no-such-org/no-such-model", "not in the Hugging Face cache")
    assert "==> step" not in proc.stdout and not out.exists()


@pytest.mark.parametrize(
    ("flags", "needle"),
    [
        (["--data-path", "builtin:sort,nope"], "--data-path builtin:sort,nope: unknown built-in task 'nope'"),
        (["--step", "2", "--", "--data_path", "gone.jsonl"], "--data_path gone.jsonl: data file not found"),
    ],
    ids=["train.py-flag", "a-step's-flag"],
)
def test_train_py_bad_data_is_caught_before_any_step_starts(tmp_path, flags, needle):
    out = tmp_path / "out"
    proc = train_py("--output-dir", str(out), *flags)
    error_line(proc, needle)
    assert "==> step" not in proc.stdout and not out.exists()


def test_train_py_malformed_data_is_caught_before_any_step_starts(tmp_path):
    """A broken line in a data file was found only when the step that reads it loaded its data: for step
    2's or 3's data, after the steps before it had run (minutes to hours)."""
    data = tmp_path / "pairs.jsonl"
    good = json.dumps({"prompt": "Human: hi\n\nAssistant:", "chosen": " hello", "rejected": " go"})
    data.write_text(f"{good}\n{{'prompt': broken\n")
    out = tmp_path / "out"
    proc = train_py("--output-dir", str(out), "--step", "1", "2", "--", "--data_path", str(data))
    error_line(proc, f"{data}:2: malformed JSON line")
    assert "==> step" not in proc.stdout and not out.exists()


@pytest.mark.parametrize(
    ("recipe", "flags", "needle"),
    [
        ("step1_supervised_finetuning", ["--data_path", "builtin:sort,nope"],
         "--data_path builtin:sort,nope: unknown built-in task 'nope'"),
        ("step2_reward_model_finetuning", ["--model_name_or_path", "./no_step1"],
         "--model_name_or_path ./no_step1: no such local file or directory"),
        ("step2_dpo_finetuning", ["--model_name_or_path", "builtin:micro-llama", "--ref_model_name_or_path",
                                  "/no/reference"], "--ref_model_name_or_path /no/reference: no such local"),
        ("step3_rlhf_finetuning", ["--actor_model_name_or_path", "builtin:micro-llama", "--judge_reward_model",
                                   "/no/judge"], "--judge_reward_model /no/judge: no such local"),
    ],
    ids=["step1-data", "step2-model", "dpo-reference", "step3-judge"],
)  # fmt: skip
def test_a_named_input_that_is_not_there_stops_the_step_before_its_process_group(
    tmp_path, recipe, flags, needle
):
    """Rank 0 of a world of 2 whose peer never comes: a step that started its process group before
    checking would wait for the peer (then time out) instead of failing at once with the one line."""
    import socket
    import subprocess
    import sys

    from tests.conftest import ROOT

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(port), "DSCHAT_DIST_TIMEOUT": "30", "CUDA_VISIBLE_DEVICES": ""}  # fmt: skip
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, str(ROOT / "training" / recipe / "main.py"), "--output_dir", str(out),
                           *flags], capture_output=True, text=True, timeout=300, env=env)  # fmt: skip
    error_line(proc, needle)
    assert not out.exists()


@pytest.mark.parametrize(
    ("recipe", "name"),
    [
        ("step2_reward_model_finetuning", "step 2"),
        ("step2_dpo_finetuning", "DPO"),
        ("step3_rlhf_finetuning", "step 3"),
    ],
)
def test_later_steps_refuse_flags_only_step_1_reads(tmp_path, recipe, name):
    """--train_on_prompt and --sft_only_data_path were accepted by steps 2, DPO and 3 and read by nothing."""
    from tests.conftest import ROOT, run_entry

    out = tmp_path / "out"
    proc = run_entry(ROOT / "training" / recipe / "main.py", ["--output_dir", str(out), "--train_on_prompt"],
                     in_process=True)  # fmt: skip
    error_line(proc, "--train_on_prompt: only step 1 (SFT) reads it", f"not {name};")
    assert not out.exists()
