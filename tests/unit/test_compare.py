"""Prompt sets, verdicts, win rate and report layout of the prompt comparison."""

from __future__ import annotations

import json

import pytest

from dschat import compare, tasks
from dschat.utils.errors import UserError


def test_builtin_prompts_are_held_out_questions_of_every_task():
    qs = compare.builtin_prompts(7)
    assert len(qs) == 7 == len(set(qs))
    assert all(tasks.is_held_out(tasks.make_prompt(q)) for q in qs)
    assert [compare.task_name(q) for q in qs[: len(tasks.TASKS)]] == list(tasks.TASKS)  # tasks in turn
    assert compare.builtin_prompts(7) == qs  # fixed set, comparable between runs


def test_read_jsonl_and_text(tmp_path):
    j = tmp_path / "p.jsonl"
    j.write_text(
        json.dumps({"prompt": "What is 1 + 2?", "id": 3}) + "\n\n" + json.dumps({"prompt": "a|b"}) + "\n"
    )
    assert compare.read_prompts(j) == ["What is 1 + 2?", "a|b"]
    t = tmp_path / "p.txt"
    t.write_text("first\n\n   \n\\n\\nHuman: hi\\n\\nAssistant:\n")
    assert compare.read_prompts(t) == ["first", "\n\nHuman: hi\n\nAssistant:"]


@pytest.mark.parametrize(
    ("lines", "message"),
    [
        (['{"prompt": "ok"}', '{"prompt": "broken"'], r"p\.jsonl:2: not valid JSON"),
        (['{"prompt": "ok"}', '{"question": "x"}'], r"p\.jsonl:2: expected an object with a field 'prompt'"),
        (['["prompt"]'], r"p\.jsonl:1: expected an object"),
        (['{"prompt": 3}'], r"p\.jsonl:1: field 'prompt' must be a string, got int"),
        (['{"prompt": "  "}'], r"p\.jsonl:1: field 'prompt' is empty"),
        ([""], r"--prompts_file .*p\.jsonl: no prompts"),
    ],
)
def test_bad_prompt_files(tmp_path, lines, message):
    p = tmp_path / "p.jsonl"
    p.write_text("\n".join(lines) + "\n")
    with pytest.raises(UserError, match=message):
        compare.read_prompts(p)


def test_missing_prompt_file(tmp_path):
    with pytest.raises(UserError, match=r"--prompts_file .*nope\.txt: no such file"):
        compare.read_prompts(tmp_path / "nope.txt")


def test_verdicts_and_accuracy():
    assert compare.verdict("What is 500 + 79?", " 579") is True
    assert compare.verdict(tasks.make_prompt("What is 500 + 79?"), " 578") is False
    assert compare.verdict("Tell me a joke", " no") is None
    # a reply as its format ended it: not cut again at an invented turn (a chat template's reply that
    # goes on after the answer is not the answer)
    assert compare.verdict("What is 500 + 79?", " 579\n\nHuman: and 1 + 1?") is False
    assert compare.accuracy([True, None, False, True]) == pytest.approx(2 / 3)
    assert compare.accuracy([None]) is None


def test_win_rate_counts_ties_half():
    r = compare.win_rate([1.0, 2.0, 3.0, 5.0], [0.0, 2.0, 4.0, 1.0])
    assert r == {"win_rate": (2 + 0.5) / 4, "wins": 2, "ties": 1, "losses": 1}
    # the same answer is a tie even when its two scores differ by a rounding error
    r = compare.win_rate([1.0, 2.0 + 1e-7], [0.0, 2.0], same=[False, True])
    assert r == {"win_rate": 0.75, "wins": 1, "ties": 1, "losses": 0}
    with pytest.raises(ValueError):
        compare.win_rate([], [])


def test_side_by_side_columns():
    lines = compare.side_by_side("a " * 20, "short", width=30)
    col = (30 - 3) // 2
    assert all(len(line) <= 30 for line in lines)
    assert lines[0][col : col + 3] == " | " and lines[0].endswith("short")
    assert " ".join(line[:col] for line in lines).split() == ["a"] * 20


def test_markdown_report_has_one_row_per_prompt_and_escapes_cells():
    rows = [
        {"index": 1, "prompt": "a|b", "baseline": " x\ny", "finetune": " z", "baseline_correct": None,
         "finetune_correct": None, "baseline_reward": 1.0, "finetune_reward": 2.0},
        {"index": 2, "prompt": "c", "baseline": "", "finetune": "w", "baseline_correct": None,
         "finetune_correct": None, "baseline_reward": 0.5, "finetune_reward": 0.25},
    ]  # fmt: skip
    md = compare.markdown_report({"decoding": "greedy"}, {"win_rate": 0.5}, rows)
    table = md.split("## Answers")[1].strip().splitlines()
    assert table[0] == "| # | prompt | baseline | fine-tuned | baseline reward | fine-tuned reward |"
    assert len(table) == 2 + len(rows)
    assert table[2] == "| 1 | a\\|b | x<br>y | z | 1.0000 | 2.0000 |"
    assert "verdict" not in md  # no task prompts, no verdict columns


def test_a_text_prompts_file_splits_at_newlines_only_and_drops_a_byte_order_mark(tmp_path):
    t = tmp_path / "p.txt"
    t.write_text("\ufeffPage one\x0cpage two\r\nA\u2028B\n", encoding="utf-8")
    assert compare.read_prompts(t) == ["Page one\x0cpage two", "A\u2028B"]


def test_a_json_prompts_file_is_a_list_of_prompts_not_lines_of_text(tmp_path):
    """A .json file was read line by line as text: '[' and '  {"prompt": ...},' became prompts."""
    j = tmp_path / "p.json"
    j.write_text(json.dumps([{"prompt": "What is 2 + 3?"}, "Sort: b a"], indent=2))
    assert compare.read_prompts(j) == ["What is 2 + 3?", "Sort: b a"]
    j.write_text(json.dumps([{"prompt": "ok"}, {"question": "x"}]))
    with pytest.raises(UserError, match=r"p\.json item 1: expected an object with a field 'prompt'"):
        compare.read_prompts(j)
    j.write_text(json.dumps({"prompt": "x"}))
    with pytest.raises(UserError, match=r"p\.json: expected a JSON list"):
        compare.read_prompts(j)
