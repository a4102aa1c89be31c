"""``inference/prompt_eval.py``: two models with known answers, a reward model with known scores.

``wrong`` answers " 578" and ``right`` " 579" to everything; the reward model gives +8 to a text ending
in 9 and -8 to one ending in 8. So on "What is 500 + 79?" only the fine-tuned (``right``) model is
correct, it wins every prompt on reward, and the reported numbers can be written down by hand.
"""

from __future__ import annotations

import json
import os

import pytest

from dschat.utils.errors import UserError
from tests.conftest import ROOT, run_cmd
from tests.e2e.conftest import load_entry_main
from tests.integration.helpers import assert_ok, error_line, read_jsonl

PROMPT_EVAL = str(ROOT / "inference" / "prompt_eval.py")
QUESTIONS = ["What is 500 + 79?", "Sort: cat dog fox", "Tell me a joke | with a pipe"]


def test_side_by_side_reports_and_win_rate(tiny, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": q}) + "\n" for q in QUESTIONS))
    out = tmp_path / "reports" / "cmp"
    proc = run_cmd([PROMPT_EVAL, "--model_name_or_path_baseline", str(tiny.wrong), "--model_name_or_path_finetune",
                    str(tiny.right), "--prompts_file", str(prompts), "--reward_model", str(tiny.reward),
                    "--output", str(out)])  # fmt: skip
    assert_ok(proc)
    assert "verifier accuracy on 2 built-in task prompts: baseline 0.000, fine-tuned 0.500" in proc.stdout
    assert "fine-tuned win rate over baseline: 1.000 (3 wins, 0 ties, 0 losses)" in proc.stdout
    assert proc.stdout.count("578") >= 3 and proc.stdout.count("579") >= 3

    rows = read_jsonl(out.with_suffix(".jsonl"))
    assert [r["prompt"] for r in rows] == QUESTIONS
    assert {r["baseline"] for r in rows} == {" 578"} and {r["finetune"] for r in rows} == {" 579"}
    assert [r["finetune_correct"] for r in rows] == [True, False, None]
    assert [r["baseline_correct"] for r in rows] == [False, False, None]
    assert not any(r["baseline_cut_off"] or r["finetune_cut_off"] for r in rows)  # both end their answers
    for r in rows:
        assert r["finetune_reward"] == pytest.approx(8.0, abs=1e-4)
        assert r["baseline_reward"] == pytest.approx(-8.0, abs=1e-4)

    md = out.with_suffix(".md").read_text()
    table = md.split("## Answers")[1].strip().splitlines()
    assert len(table) == 2 + len(QUESTIONS)
    assert table[2].startswith("| 1 | What is 500 + 79? | 578 | 579 | wrong | right | -8.0000 | 8.0000 |")
    assert "with a pipe" in table[4] and "\\|" in table[4]
    assert "| win_rate | 1.0000 |" in md
    assert "- repetition_penalty: `1.0`" in md  # a setting every strategy reads: a report says it
    assert not list(out.parent.glob(".*.tmp"))  # written through temporary files, none left behind


def test_malformed_prompts_file_is_one_line(tiny, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "What is 1 + 2?"}\n{"prompt": "unclosed\n')
    proc = run_cmd([PROMPT_EVAL, "--model_name_or_path_baseline", str(tiny.wrong), "--model_name_or_path_finetune",
                    str(tiny.right), "--prompts_file", str(prompts)])  # fmt: skip
    error_line(proc, f"{prompts}:2: not valid JSON")


@pytest.fixture(scope="module")
def eval_main():
    return load_entry_main(PROMPT_EVAL, "dschat_prompt_eval_cli")


def test_builtin_prompts_with_contrastive_search(tiny, eval_main, capsys):
    assert eval_main(["--model_name_or_path_baseline", str(tiny.wrong), "--model_name_or_path_finetune",
                      str(tiny.right), "--num_prompts", "3", "--decoding", "contrastive", "--top_k", "3",
                      "--penalty_alpha", "0"]) == 0  # fmt: skip
    out = capsys.readouterr().out
    assert "[3/3]" in out and "[4/" not in out
    # alpha 0 is greedy: the chain models answer as always, and no built-in question has answer 578/579
    assert "verifier accuracy on 3 built-in task prompts: baseline 0.000, fine-tuned 0.000" in out
    assert out.count("| 579") == 3
    assert "win rate" not in out


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--reward_model", "{right}"], "--reward_model .*right: not a trained reward model"),
        (
            ["--model_name_or_path_finetune", "{root}/nothing"],
            "--model_name_or_path_finetune .*nothing: no such local file or directory",
        ),
        (
            ["--model_name_or_path_baseline", "{reward}"],
            "--model_name_or_path_baseline .*reward: is a reward model",
        ),
        (["--prompts_file", "{root}/none.txt"], "--prompts_file .*none.txt: no such file"),
        # it was ignored: every prompt of the file ran
        (["--prompts_file", "{root}/p.txt", "--num_prompts", "1"], "--num_prompts picks .*: give one"),
        (["--decoding", "contrastive", "--top_k", "1"], "--top_k 1: contrastive search compares"),
        (["--max_new_tokens", "2000"], "--max_new_tokens 2000: leaves no room"),
        (
            ["--output", "{right}/config.json/res"],
            "--output .*res: .*config.json exists and is not a directory",
        ),
        (["--output", "{root}/"], "--output .*: names a directory; give a file prefix"),
        (["--output", "{root}/.md"], "--output .*: names a directory; give a file prefix"),
    ],
    ids=[
        "reward-not-reward",
        "missing-model",
        "reward-as-generator",
        "missing-prompts",
        "num-prompts-with-a-file",
        "contrastive-k",
        "no-room",
        "output-under-a-file",
        "output-a-directory",
        "output-only-a-suffix",
    ],
)
def test_bad_input(tiny, eval_main, extra, message):
    base = [
        "--model_name_or_path_baseline",
        str(tiny.wrong),
        "--model_name_or_path_finetune",
        str(tiny.right),
    ]
    base += [] if "--prompts_file" in extra else ["--num_prompts", "1"]  # the two are one choice
    extra = [a.format(root=tiny.root, reward=tiny.reward, right=tiny.right) for a in extra]
    with pytest.raises(UserError, match=message):
        eval_main([*base, *extra])


def test_an_earlier_report_is_kept_unless_overwrite(tiny, eval_main, tmp_path, capsys):
    """--output over an earlier report replaced it silently; it is refused before any model loads, and
    --overwrite replaces it."""
    out = tmp_path / "cmp"
    (tmp_path / "cmp.md").write_text("earlier\n")
    base = ["--model_name_or_path_baseline", str(tiny.wrong), "--model_name_or_path_finetune", str(tiny.right),
            "--num_prompts", "1", "--output", str(out)]  # fmt: skip
    with pytest.raises(UserError, match=r"--output .*cmp: .*cmp\.md exists .*--overwrite"):
        eval_main(base)
    assert (tmp_path / "cmp.md").read_text() == "earlier\n"
    assert eval_main([*base, "--overwrite"]) == 0
    assert (tmp_path / "cmp.md").read_text() != "earlier\n" and (tmp_path / "cmp.jsonl").exists()


def test_an_unwritable_output_directory_is_refused_up_front(tiny, eval_main, tmp_path):
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    try:
        if os.access(locked, os.W_OK):
            pytest.skip("running as a user who can write anywhere (root)")
        with pytest.raises(UserError, match=r"--output .*locked/sub/cmp: cannot write in .*locked"):
            eval_main(["--model_name_or_path_baseline", str(tiny.wrong), "--model_name_or_path_finetune",
                       str(tiny.right), "--output", str(locked / "sub" / "cmp")])  # fmt: skip
    finally:
        locked.chmod(0o700)


def test_a_missing_fine_tuned_model_is_refused_before_the_baseline_generates(tiny, eval_main, capsys):
    with pytest.raises(UserError, match=r"--model_name_or_path_finetune .*nothing"):
        eval_main(["--model_name_or_path_baseline", str(tiny.wrong), "--model_name_or_path_finetune",
                   str(tiny.root / "nothing"), "--num_prompts", "1"])  # fmt: skip
    assert "==> baseline" not in capsys.readouterr().out


def test_a_reward_model_as_the_fine_tuned_model_is_refused_before_the_baseline_generates(
    tiny, eval_main, capsys
):
    """Only the config and weights were checked up front, so a reward model (or a LoRA adapter, always
    refused) given as the fine-tuned model failed after every baseline answer was generated."""
    with pytest.raises(UserError, match=r"--model_name_or_path_finetune .*reward: is a reward model"):
        eval_main(["--model_name_or_path_baseline", str(tiny.wrong), "--model_name_or_path_finetune",
                   str(tiny.reward), "--num_prompts", "1"])  # fmt: skip
    assert "==> baseline" not in capsys.readouterr().out


def test_a_lora_adapter_is_a_model_to_compare(tiny, eval_main, tmp_path, capsys):
    """An adapter directory (no config.json of its own) was refused up front, though it loads merged."""
    from tests.tiny_chat_models import lora_adapter

    adapter = lora_adapter(tmp_path / "adapter", tiny.right)
    prompts = tmp_path / "one_prompt.txt"
    prompts.write_text("What is 500 + 79?\n")
    assert eval_main(["--model_name_or_path_baseline", str(tiny.wrong), "--model_name_or_path_finetune",
                      str(adapter), "--prompts_file", str(prompts)]) == 0  # fmt: skip
    assert "==> finetune" in capsys.readouterr().out


def test_a_trailing_comma_in_tasks_is_ignored(tiny, eval_main, capsys):
    assert eval_main(["--model_name_or_path_baseline", str(tiny.wrong), "--model_name_or_path_finetune",
                      str(tiny.right), "--num_prompts", "2", "--tasks", "sort,"]) == 0  # fmt: skip
    assert "(sort)" in capsys.readouterr().out


def test_an_adapter_whose_base_moved_takes_base_model(tiny, eval_main, capsys):
    """The error for an adapter whose recorded base is gone said 'pass --base_model PATH', a flag
    prompt_eval did not have: it has it now, for whichever side is an adapter."""
    base = ["--model_name_or_path_baseline", str(tiny.wrong), "--model_name_or_path_finetune", str(tiny.adapter),
            "--num_prompts", "1"]  # fmt: skip
    with pytest.raises(
        UserError, match=r"--model_name_or_path_finetune .*deleted-base.*pass --base_model PATH"
    ):
        eval_main(base)
    assert "==> baseline" not in capsys.readouterr().out
    assert eval_main([*base, "--base_model", str(tiny.right)]) == 0
    assert "==> finetune" in capsys.readouterr().out


def test_base_model_without_an_adapter_is_one_line(tiny, eval_main):
    with pytest.raises(UserError, match=r"--base_model .*right: neither .* is a LoRA adapter"):
        eval_main(["--model_name_or_path_baseline", str(tiny.wrong), "--model_name_or_path_finetune",
                   str(tiny.right), "--base_model", str(tiny.right)])  # fmt: skip


def test_a_format_the_fine_tuned_model_lacks_is_refused_before_the_baseline_generates(
    tiny, eval_main, capsys
):
    """--chat_template on, with a model that has no template, failed after the baseline had answered
    every prompt; the format and the room for a prompt are checked for both models before any loads."""
    with pytest.raises(UserError, match=r"--chat_template on: .* has no chat template"):
        eval_main(["--model_name_or_path_baseline", str(tiny.wrong), "--model_name_or_path_finetune",
                   str(tiny.right), "--num_prompts", "1", "--chat_template", "on"])  # fmt: skip
    assert "==> baseline" not in capsys.readouterr().out


def test_tasks_that_name_no_task_are_refused(tiny, eval_main):
    # '--tasks ,' meant every task, silently
    with pytest.raises(SystemExit):
        eval_main(["--model_name_or_path_baseline", str(tiny.wrong), "--model_name_or_path_finetune",
                   str(tiny.right), "--tasks", ","])  # fmt: skip
