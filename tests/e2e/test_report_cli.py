"""``inference/report.py``: a finished run (summaries, step 3's metrics, models with known answers) ->
one Markdown report with PNG plots, per-task accuracy before and after, and answers side by side."""

from __future__ import annotations

import json
import shutil

from tests.conftest import ROOT, run_cmd
from tests.integration.helpers import assert_ok, error_line

REPORT = str(ROOT / "inference" / "report.py")


def fake_run(root, tiny):
    """step1 = the " 578" model, step2 = the sign reward model, step3/actor = the " 579" model."""
    shutil.copytree(tiny.wrong, root / "step1")
    shutil.copytree(tiny.reward, root / "step2")
    shutil.copytree(tiny.right, root / "step3" / "actor")
    summaries = {
        "step1": {"true_accuracy_start": 0.0, "true_accuracy_end": 0.66, "wall_seconds": 120.0},
        "step2": {"eval_accuracy_start": 0.5, "eval_accuracy_end": 0.97, "wall_seconds": 600.0},
        "step3": {
            "true_accuracy_start": 0.7,
            "true_accuracy_end": 0.8,
            "wall_seconds": 900.0,
            "reward_normalization": {"mean": -2.7, "std": 8.67, "source": "policy_samples", "n": 800.0},
        },
    }
    for step, s in summaries.items():
        (root / step / "summary.json").write_text(json.dumps(s))
    # the tasks and prompt format the run trained on: the answers are asked on those
    (root / "step3" / "dschat_config.json").write_text(
        json.dumps({"data_path": ["builtin:sort,reverse"], "chat_template": "auto"})
    )
    rows = [{"step": 0, "split": "eval", "true_accuracy": 0.7, "true_accuracy/sort": 0.75, "true_accuracy/add": 0.65,
             "true_accuracy_sampled": 0.5, "held_out_reward": 1.0}]  # fmt: skip
    for r in range(1, 21):
        rows.append({"step": r, "split": "train", "score_mean": r / 10, "reward_mean": r / 10 - 0.01,
                     "kl_to_reference": r / 100, "response_length": 6.0, "entropy": 0.4, "truncated_fraction": 0.0})  # fmt: skip
    rows.append({"step": 20, "split": "eval", "true_accuracy": 0.8, "true_accuracy/sort": 0.9, "true_accuracy/add": 0.7,
                 "true_accuracy_sampled": 0.6, "held_out_reward": 2.0})  # fmt: skip
    lines = [json.dumps(r) for r in rows] + ['{"step": 21, "split": "tr']  # a line cut short by a kill
    (root / "step3" / "metrics.jsonl").write_text("\n".join(lines) + "\n")


def test_report_of_a_finished_run(tiny, tmp_path):
    fake_run(tmp_path, tiny)
    assert_ok(run_cmd([REPORT, str(tmp_path), "--num_prompts", "3", "--max_new_tokens", "8"]))
    out = tmp_path / "report"
    md = (out / "report.md").read_text()
    assert "| step1 | true accuracy (greedy) | 0.000 | 0.660 | 2.0 |" in md
    assert "| step2 | held-out pairwise accuracy | 0.500 | 0.970 | 10.0 |" in md
    assert "| step3 | KL to the reference (round 1, last) | 0.010 | 0.200 | |" in md
    # --normalize_reward: the score row says the scores were standardised, and with what
    assert (
        "| step3 | reward-model score, standardised (raw - -2.7) / 8.67, (round 1, last) | 0.100 | 2.000 | |"
        in md
    )
    assert "| sort | 0.750 | 0.900 |" in md and "| add | 0.650 | 0.700 |" in md
    for png in ("step3_training.png", "step3_evaluation.png"):
        assert f"]({png})" in md
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # the answers of both models, side by side, scored by the step-2 reward model
    answers = md.split("## Answers side by side")[1]
    assert answers.count("578") >= 3 and answers.count("579") >= 3
    assert "win_rate" in answers
    rows = [json.loads(x) for x in (out / "answers.jsonl").read_text().splitlines()]
    assert [r["task"] for r in rows] == ["sort", "reverse", "sort"]  # not every built-in task in turn
    # a second report replaces the first only with --overwrite (it did silently)
    error_line(run_cmd([REPORT, str(tmp_path), "--num_prompts", "0"]), "report.md exists", "--overwrite")
    assert (out / "report.md").read_text() == md
    assert_ok(run_cmd([REPORT, str(tmp_path), "--num_prompts", "3", "--max_new_tokens", "8", "--overwrite"]))


def test_bad_flags_are_refused_before_anything_is_written(tiny, tmp_path):
    """--device foo failed inside prompt_eval after the plots were written, leaving no report.md; a
    step-1-only run accepted it and --max_new_tokens 0 without a word."""
    fake_run(tmp_path, tiny)
    for flags, needle in ((["--device", "foo"], "invalid choice: 'foo'"),
                          (["--max_new_tokens", "0"], "--max_new_tokens must be >= 1, got 0")):  # fmt: skip
        proc = run_cmd([REPORT, str(tmp_path), *flags])
        assert proc.returncode != 0 and needle in proc.stderr, proc.stderr[-500:]
        assert not (tmp_path / "report").exists()


def test_no_finished_step_is_one_line(tmp_path):
    error_line(run_cmd([REPORT, str(tmp_path)]), f"{tmp_path}: no finished step there")


def test_an_unfinished_step_3_is_said_so_not_reported_as_before_and_after(tiny, tmp_path):
    """A step 3 stopped midway (metrics.jsonl, no summary.json) was reported as finished: its last logged
    evaluation filled the 'before and after step 3' table. And a DPO run's true accuracy was left out."""
    fake_run(tmp_path, tiny)
    (tmp_path / "step3" / "summary.json").unlink()
    shutil.move(tmp_path / "step2", tmp_path / "step2_dpo")
    (tmp_path / "step2_dpo" / "summary.json").write_text(json.dumps({
        "implicit_reward_accuracy_start": 0.0, "implicit_reward_accuracy_end": 0.97, "true_accuracy_start": 0.71,
        "true_accuracy_end": 0.82, "wall_seconds": 300.0}))  # fmt: skip
    assert_ok(run_cmd([REPORT, str(tmp_path), "--num_prompts", "0"]))
    md = (tmp_path / "report" / "report.md").read_text()
    assert "step 3 did not finish" in md
    assert "before and after step 3" not in md and "(round 1, last)" not in md
    assert "| step2_dpo | true accuracy (greedy) | 0.710 | 0.820 | 5.0 |" in md
