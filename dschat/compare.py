"""Comparing two models' answers to a prompt set (``inference/prompt_eval.py``): prompts, verdicts, reports.

Pure Python: where prompts come from (the built-in tasks' held-out prompts or a file), the verifier's
verdict and the reward-model win rate, the side-by-side terminal layout and the Markdown report.
"""

from __future__ import annotations

import json
import math
import textwrap
from itertools import zip_longest
from pathlib import Path
from typing import Any

from dschat import tasks
from dschat.data.prompt_format import as_dialogue
from dschat.data.sources import BUILTIN_SEED, builtin_task_names
from dschat.utils.errors import UserError
from dschat.utils.io import data_lines, read_user_text


def builtin_prompts(n: int, names: list[str] | None = None) -> list[str]:
    """``n`` questions of the built-in tasks' held-out set (the one steps 1-3 evaluate on), tasks in turn:
    ``names`` (default: every task)."""
    names = names or list(tasks.TASKS)
    per_task = math.ceil(n / len(names))
    examples = tasks.generate(names, per_task, BUILTIN_SEED + 1, held_out=True)
    by_task = [[tasks.last_question(e.prompt) for e in examples if e.task == t] for t in names]
    interleaved = [q for group in zip_longest(*by_task) for q in group if q is not None]
    return interleaved[:n]


def run_tasks(data_paths: list[str]) -> list[str] | None:
    """The built-in tasks a run's ``--data_path`` sources name, in order (``builtin`` alone: the default
    tasks); None where it names none (a run on other data)."""
    names: list[str] = []
    for spec in data_paths:
        if spec == "builtin" or spec.startswith("builtin:"):
            names += builtin_task_names(spec) or list(tasks.DEFAULT_TASKS)
    return list(dict.fromkeys(names)) or None


def read_prompts(path: str | Path, flag: str = "--prompts_file") -> list[str]:
    """Prompts from a ``.jsonl`` file (one object per line with a string field ``prompt``), a ``.json``
    file (a list of such objects, or of strings) or a text file (one prompt per line; blank lines are
    skipped). A bad line or item is a :class:`UserError` naming it."""
    p = Path(path)
    if not p.is_file():
        raise UserError(f"{flag} {path}: no such file")
    text = read_user_text(p, f"{flag} {path}", encoding="utf-8-sig")  # without a byte-order mark
    if p.suffix == ".json":
        try:
            items = json.loads(text)
        except json.JSONDecodeError as exc:
            raise UserError(f"{path}:{exc.lineno}: not valid JSON ({exc.msg})") from None
        if not isinstance(items, list):
            raise UserError(
                f"{path}: expected a JSON list of prompts (strings or objects with a field 'prompt')"
            )
        rows = [({"prompt": x} if isinstance(x, str) else x, f"{path} item {i}") for i, x in enumerate(items)]
    else:
        lines = [(line, f"{path}:{no}") for no, line in enumerate(data_lines(text), 1) if line.strip()]
        if p.suffix != ".jsonl":  # a text file: one prompt per line, "\\n" for a newline inside one
            rows = [({"prompt": line.replace("\\n", "\n")}, where) for line, where in lines]
        else:
            rows = []
            for line, where in lines:
                try:
                    rows.append((json.loads(line), where))
                except json.JSONDecodeError as exc:
                    raise UserError(f"{where}: not valid JSON ({exc.msg})") from None
    prompts: list[str] = []
    for row, where in rows:
        if not isinstance(row, dict) or "prompt" not in row:
            raise UserError(f"{where}: expected an object with a field 'prompt'")
        if not isinstance(row["prompt"], str):
            raise UserError(f"{where}: field 'prompt' must be a string, got {type(row['prompt']).__name__}")
        if not row["prompt"].strip():
            raise UserError(f"{where}: field 'prompt' is empty")
        prompts.append(row["prompt"])
    if not prompts:
        raise UserError(f"{flag} {path}: no prompts in the file")
    return prompts


def verdict(question: str, reply: str) -> bool | None:
    """The built-in verifier's verdict on ``reply`` (None when no built-in task knows the question):
    ``reply`` as its prompt format ended it (``generate_replies`` cut it at the format's stop strings), so
    it is not cut again (with a chat template, "\n\nHuman:" in a reply is text the model wrote)."""
    return tasks.verify(as_dialogue(question), reply, stops=())


def task_name(question: str) -> str | None:
    return tasks.task_of(as_dialogue(question))


def accuracy(verdicts: list[bool | None]) -> float | None:
    """Fraction right among the verdicts that exist (None when there are none)."""
    known = [v for v in verdicts if v is not None]
    return sum(known) / len(known) if known else None


def win_rate(
    finetune: list[float], baseline: list[float], same: list[bool] | None = None
) -> dict[str, float]:
    """How often ``finetune`` scores above ``baseline``, prompt by prompt; a tie counts half
    (``same[i]``: both answers are the same text, a tie whatever the scores). Computed by the shipped
    ``evaluate`` module ``dschat/evaluation/win_rate``."""
    from dschat import evaluation

    if len(finetune) != len(baseline) or not finetune:  # evaluate would fail on empty lists less clearly
        raise ValueError("need two equally long, non-empty score lists")
    return evaluation.load("win_rate").compute(predictions=finetune, references=baseline, same=same)


def side_by_side(left: str, right: str, width: int, sep: str = " | ") -> list[str]:
    """Two texts wrapped into columns of equal width, as lines of at most ``width`` characters."""
    col = max(8, (width - len(sep)) // 2)

    def wrap(text: str) -> list[str]:
        return [w for para in text.split("\n") for w in (textwrap.wrap(para, col) or [""])]

    return [f"{a:<{col}}{sep}{b}".rstrip() for a, b in zip_longest(wrap(left), wrap(right), fillvalue="")]


def _cell(text: Any) -> str:
    """A Markdown table cell: pipes escaped, line breaks as <br>."""
    if text is None:
        return ""
    if isinstance(text, bool):
        return "right" if text else "wrong"
    if isinstance(text, float):
        return f"{text:.4f}"
    return str(text).strip().replace("\\", "\\\\").replace("|", "\\|").replace("\n", "<br>")


def markdown_report(settings: dict[str, Any], summary: dict[str, Any], rows: list[dict[str, Any]]) -> str:
    """The comparison as Markdown: settings, summary and one table row per prompt."""
    out = ["# Prompt comparison: baseline vs fine-tuned", ""]
    out += [f"- {k}: `{v}`" for k, v in settings.items()]
    out += ["", "## Summary", "", "| metric | value |", "| --- | --- |"]
    out += [f"| {k} | {_cell(v)} |" for k, v in summary.items()]
    cols = ["#", "prompt", "baseline", "fine-tuned"]
    keys = ["index", "prompt", "baseline", "finetune"]
    if any(r.get("baseline_correct") is not None for r in rows):
        cols += ["baseline verdict", "fine-tuned verdict"]
        keys += ["baseline_correct", "finetune_correct"]
    if any(r.get("baseline_reward") is not None for r in rows):
        cols += ["baseline reward", "fine-tuned reward"]
        keys += ["baseline_reward", "finetune_reward"]
    out += ["", "## Answers", "", "| " + " | ".join(cols) + " |", "|" + " --- |" * len(cols)]
    out += ["| " + " | ".join(_cell(r.get(k)) for k in keys) + " |" for r in rows]
    return "\n".join(out) + "\n"
