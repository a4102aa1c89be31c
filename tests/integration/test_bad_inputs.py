"""Bad input is the user's to fix: exit code 2, one ``error: ...`` line on stderr that names the file,
line, field or flag, no traceback, and no run marked finished (no summary.json)."""

from __future__ import annotations

import json

import pytest

from tests.integration.helpers import FAST, error_line, step1, train_py


def run_bad(tmp_path, *flags: str, env: dict | None = None):
    out = tmp_path / "out"
    proc = step1(out, *FAST, "--max_steps", "5", *flags, env=env)
    assert not (out / "summary.json").exists()
    return proc


def test_missing_data_file(tmp_path):
    error_line(run_bad(tmp_path, "--data_path", "/nonexistent.jsonl"), "/nonexistent.jsonl", "not found")


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
    proc = run_bad(tmp_path, *flags)
    error_line(proc, *needles)


def test_output_dir_holding_a_finished_run_needs_overwrite(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "summary.json").write_text('{"step": 1}\n')
    error_line(step1(out, *FAST, "--max_steps", "5"), str(out), "--overwrite")
    assert (out / "summary.json").read_text() == '{"step": 1}\n'
    assert sorted(p.name for p in out.iterdir()) == ["summary.json"]


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
