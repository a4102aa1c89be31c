"""Data sources and the explicit registry that maps each to :class:`Sample`.

A source spec (``--data_path``) is one of:

* ``builtin`` or ``builtin:TASK[,TASK]``: generated verifiable tasks (see :mod:`dschat.tasks`);
* a local ``.json`` / ``.jsonl`` file, or a directory of them (``train*`` and ``test*``/``eval*``
  files become the train and eval splits), with fields ``prompt`` + ``chosen`` [+ ``rejected``],
  ``prompt`` + ``response``, or ``messages`` (the last one the assistant's response);
* a Hugging Face dataset name registered in :data:`HUB_ADAPTERS`, loaded with
  ``datasets.load_dataset``. ``DSCHAT_HUB_MIRROR=/dir`` resolves ``org/name`` to ``/dir/org/name``
  (an offline mirror of the hub files) and still goes through ``load_dataset``.
"""

from __future__ import annotations

import json
import logging
import os
import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dschat import tasks
from dschat.data.prompt_format import TURN_START, as_dialogue, dialogue_of
from dschat.data.schema import Sample
from dschat.utils.errors import UserError
from dschat.utils.io import data_lines, is_text, read_data_text

LOG = logging.getLogger("dschat")

BUILTIN_TRAIN_PER_TASK = 10000
BUILTIN_EVAL_PER_TASK = 200
BUILTIN_SEED = 2024  # fixed: the held-out prompt set must not move with --seed
EVAL_FRACTION = 0.05  # for sources without their own eval split


@dataclass
class SourceData:
    name: str
    train: list[Sample]
    eval: list[Sample]


# ---------------------------------------------------------------- hub adapters: row -> Sample | None
def _split_last_assistant(text: str) -> tuple[str, str]:
    marker = "\n\nAssistant:"
    i = text.rfind(marker)
    if i < 0:
        raise ValueError("no '\\n\\nAssistant:' turn")
    return text[: i + len(marker)], text[i + len(marker) :]


def _anthropic_hh(row: dict[str, Any]) -> Sample | None:
    prompt, chosen = _split_last_assistant(row["chosen"])
    prompt_r, rejected = _split_last_assistant(row["rejected"])
    if prompt != prompt_r:
        return None
    return Sample(prompt, chosen, rejected)


def _prompt_chosen_rejected(row: dict[str, Any]) -> Sample | None:
    return Sample(row["prompt"], row["chosen"], row["rejected"])


def _gptj_pairwise(row: dict[str, Any]) -> Sample | None:
    return Sample(f"\n\nHuman: {row['prompt']}\n\nAssistant:", " " + row["chosen"], " " + row["rejected"])


def _rlhf_reward_datasets(row: dict[str, Any]) -> Sample | None:
    return Sample(
        row["prompt"] + "Assistant:",
        row["chosen"].split("Assistant:")[-1],
        row["rejected"].split("Assistant:")[-1],
    )


HUB_ADAPTERS: dict[str, Callable[[dict[str, Any]], Sample | None]] = {
    "Dahoas/rm-static": _prompt_chosen_rejected,
    "Dahoas/full-hh-rlhf": _prompt_chosen_rejected,
    "Dahoas/synthetic-instruct-gptj-pairwise": _gptj_pairwise,
    "yitingxie/rlhf-reward-datasets": _rlhf_reward_datasets,
    "Anthropic/hh-rlhf": _anthropic_hh,
}


# ---------------------------------------------------------------- local files
def _turn_text(content: Any, where: str, i: int) -> str:
    """A ``messages`` turn's content as text: a string, or the OpenAI form's list of text parts joined."""
    if isinstance(content, str):
        return content
    if (
        isinstance(content, list)
        and content
        and all(
            isinstance(c, dict) and c.get("type") == "text" and isinstance(c.get("text"), str)
            for c in content
        )
    ):
        return "".join(c["text"] for c in content)
    raise UserError(f"{where}: field 'messages': turn {i}'s content must be text (a string or a list of "
                    f"{{\"type\": \"text\"}} parts), got {json.dumps(content)[:60]}")  # fmt: skip


def _row_to_sample(row: Any, where: str) -> Sample:
    if not isinstance(row, dict):
        raise UserError(f"{where}: expected a JSON object, got {type(row).__name__}")
    if "messages" in row and "prompt" not in row:
        msgs = row["messages"]
        if (
            not isinstance(msgs, list)
            or not msgs
            or not isinstance(msgs[-1], dict)
            or msgs[-1].get("role") != "assistant"
        ):
            raise UserError(
                f"{where}: field 'messages' must be a list of turns ending with an assistant turn"
            )
        turns = [{"role": m.get("role"), "content": _turn_text(m.get("content"), where, i)} if isinstance(m, dict)
                 else m for i, m in enumerate(msgs, 1)]  # fmt: skip
        try:
            prompt = dialogue_of([{"role": str(m["role"]), "content": m["content"]} for m in turns[:-1]])
        except (KeyError, TypeError, ValueError) as exc:
            raise UserError(f"{where}: field 'messages': every turn needs a role (system, user, assistant) "
                            f"and a content ({exc})") from None  # fmt: skip
        for i, m in enumerate(turns[:-1], 1):
            if turn_mark := TURN_START.search(m["content"]):
                raise UserError(f"{where}: field 'messages': turn {i}'s content holds {turn_mark[0]!r}, where the "
                                f"pipeline's dialogue text starts a new turn: it would train as more turns")  # fmt: skip
        if not any(m["role"] == "user" for m in turns[:-1]):
            raise UserError(
                f"{where}: field 'messages': no user turn (the prompt is the dialogue before the answer)"
            )
        # A response in dialogue text starts with a space (" 432"), as in the HH-RLHF data. A pair's rejected
        # answer: a string, or an assistant message (TRL's conversational preference rows)
        rejected = row.get("rejected")
        if isinstance(rejected, dict) and rejected.get("role") == "assistant":
            rejected = _turn_text(rejected.get("content"), where, len(turns))
        elif isinstance(rejected, list) and rejected and isinstance(rejected[-1], dict):
            # a whole conversation (TRL's conversational rows) answers this one's dialogue, or it is the answer
            if rejected[-1].get("role") != "assistant":
                raise UserError(f"{where}: field 'rejected': must end with an assistant turn")
            if len(rejected) > 1 and [(m.get("role"), m.get("content")) if isinstance(m, dict) else m
                                      for m in rejected[:-1]] != [(m.get("role"), m.get("content"))
                                                                  for m in msgs[:-1]]:  # fmt: skip
                raise UserError(f"{where}: field 'rejected': its turns before the answer are not those of "
                                "'messages' (a pair answers one dialogue)")  # fmt: skip
            rejected = _turn_text(rejected[-1].get("content"), where, len(turns))
        _require_text(where, (("rejected", rejected),))
        return _text_sample(prompt, " " + turns[-1]["content"].strip(),
                            None if rejected is None else " " + rejected.strip(), where)  # fmt: skip
    if "prompt" not in row:
        raise UserError(
            f"{where}: missing field 'prompt' (need prompt + chosen [+ rejected], prompt + response, or messages)"
        )
    if "chosen" in row:
        response = row["chosen"]
    elif "response" in row:
        response = row["response"]
    else:
        raise UserError(
            f"{where}: missing field 'chosen' or 'response' (need prompt + chosen [+ rejected] or prompt + response)"
        )
    rejected = row.get("rejected")
    _require_text(where, (("prompt", row["prompt"]), ("chosen/response", response), ("rejected", rejected)))
    return _text_sample(row["prompt"], response, rejected, where)


def _text_sample(prompt: str, response: str, rejected: str | None, where: str) -> Sample:
    """The row's sample, its every field text a tokenizer takes: JSON's escapes can spell a lone surrogate
    ("\\ud83d", text cut inside a character), which loads and then fails in the tokenizer, unnamed."""
    for name, text in (("prompt", prompt), ("chosen/response", response), ("rejected", rejected or "")):
        if not is_text(text):
            raise UserError(f"{where}: field '{name}' is not valid Unicode text (a lone surrogate escape such as "
                            "\\ud83d: text cut inside a character)")  # fmt: skip
    return Sample(prompt, response, rejected, where)


def _require_text(where: str, fields: tuple[tuple[str, Any], ...]) -> None:
    """One line for the first field that is not a string (a missing rejected answer, None, is allowed):
    local rows and hub adapters' samples alike."""
    for key, val in fields:
        if not isinstance(val, str) and not (key == "rejected" and val is None):
            raise UserError(f"{where}: field '{key}' must be a string, got {type(val).__name__}")


def read_json_file(path: Path) -> list[Sample]:
    """Read a ``.jsonl`` (one object per line) or ``.json`` (a list of objects) file."""
    try:
        text = read_data_text(path)
    except FileNotFoundError:
        raise UserError(f"{path}: data file not found") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise UserError(f"{path}: cannot read ({exc})") from None
    samples: list[Sample] = []
    if path.suffix == ".json" and text.lstrip().startswith("["):
        try:
            rows = json.loads(text)
        except json.JSONDecodeError as exc:
            raise UserError(f"{path}:{exc.lineno}: malformed JSON ({exc.msg})") from None
        for i, row in enumerate(rows):
            samples.append(_row_to_sample(row, f"{path} item {i}"))
        return samples
    for lineno, line in enumerate(data_lines(text), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise UserError(f"{path}:{lineno}: malformed JSON line ({exc.msg})") from None
        samples.append(_row_to_sample(row, f"{path}:{lineno}"))
    return samples


def _carve_eval(samples: list[Sample], seed: int) -> tuple[list[Sample], list[Sample]]:
    """Deterministically hold out ``EVAL_FRACTION`` (at least one sample) for evaluation, by prompt: every
    row of a prompt (several preference pairs or answers to one question; a built-in problem in any
    wording, :func:`dschat.tasks.problem_key`) falls on one side, so evaluation never asks a question that
    training answered. Rows without a prompt (plain text) are each their own group."""
    if len(samples) < 2:
        return samples, []
    groups: dict[str, list[int]] = {}
    for i, s in enumerate(samples):
        # a prompt as it renders: "Q", "Q " and "\n\nHuman: Q\n\nAssistant:" are one question, whatever spacing
        same = " ".join(tasks.problem_key(as_dialogue(s.prompt)).split())
        groups.setdefault(same if s.prompt.strip() else f"\0row {i}", []).append(i)
    keys = sorted(groups)
    random.Random(f"eval:{seed}").shuffle(keys)
    n_eval = max(1, round(len(samples) * EVAL_FRACTION))
    held: set[int] = set()
    for key in keys:
        if len(held) >= n_eval or len(held) + len(groups[key]) >= len(samples):
            break  # the held-out share is reached; training keeps at least one group
        held.update(groups[key])
    return [s for i, s in enumerate(samples) if i not in held], [samples[i] for i in sorted(held)]


# A directory's held-out files (test.jsonl, eval.json, val.jsonl, validation.json, dev.jsonl ...)
EVAL_FILE_PREFIXES = ("test", "eval", "val", "dev")


def local_files(directory: Path) -> list[Path]:
    """The files a data directory is read from: its own .json and .jsonl files (not its subdirectories')."""
    return sorted(p for p in directory.iterdir() if p.suffix in (".json", ".jsonl") and p.is_file())


def _load_local(path: Path, seed: int) -> SourceData:
    if path.is_file():
        train, evals = _carve_eval(read_json_file(path), seed)
        return SourceData(str(path), train, evals)
    files = local_files(path)
    if not files:
        raise UserError(f"{path}: directory holds no .json or .jsonl files")
    eval_files = [p for p in files if p.stem.lower().startswith(EVAL_FILE_PREFIXES)]
    train_files = [p for p in files if p not in eval_files]
    named = [p for p in train_files if p.stem.lower().startswith("train")]
    if named and len(named) < len(train_files):  # with named splits, a file that is neither is not trained on
        other = next(p for p in train_files if p not in named)
        raise UserError(f"{other}: neither a train* nor a {'*/'.join(EVAL_FILE_PREFIXES)}* file beside "
                        f"{named[0].name}; rename it to the split it belongs to, or move it out")  # fmt: skip
    train = [s for p in train_files for s in read_json_file(p)]
    if eval_files:
        return SourceData(str(path), train, [s for p in eval_files for s in read_json_file(p)])
    train, evals = _carve_eval(train, seed)
    return SourceData(str(path), train, evals)


def _load_hub(name: str, seed: int) -> SourceData:
    import datasets

    adapter = HUB_ADAPTERS[name]
    mirror = os.environ.get("DSCHAT_HUB_MIRROR")
    target = os.path.join(mirror, name) if mirror else name
    if not mirror:  # one line now where it can be neither read nor downloaded, not datasets' retries
        from dschat.models import hub

        hub.check_hub_name(name, "--data_path", repo_type="dataset")
    try:
        ds = datasets.load_dataset(target)
    except Exception as exc:  # network, missing repo, bad files: one line, the cause named
        raise UserError(
            f"--data_path {name}: could not load from the Hugging Face Hub ({type(exc).__name__}: {exc})"
        ) from None
    splits = {}
    for split in ("train", "test"):
        rows = ds.get(split, [])
        out = []
        unpaired = 0  # rows the adapter makes no pair of (Anthropic/hh-rlhf: dialogues that differ early)
        for i, row in enumerate(rows):
            try:
                s = adapter(row)
            except (KeyError, TypeError, ValueError, AttributeError) as exc:  # a missing or null field
                raise UserError(
                    f"{name} {split} row {i}: does not fit the registered adapter ({type(exc).__name__}: {exc})"
                ) from None
            if s is None:
                unpaired += 1
                continue
            _require_text(f"{name} {split} row {i}",
                          (("prompt", s.prompt), ("chosen", s.chosen), ("rejected", s.rejected)))  # fmt: skip
            out.append(Sample(s.prompt, s.chosen, s.rejected, name))
        if unpaired:
            LOG.warning("%s %s: %d of %d rows left out: their chosen and rejected dialogues differ before the "
                        "last answer, so they are not one prompt with two answers", name, split, unpaired, len(rows))  # fmt: skip
        splits[split] = out
    if not splits["test"]:  # train-only hub datasets: hold out a share, as for local files
        train, evals = _carve_eval(splits["train"], seed)
        return SourceData(name, train, evals)
    return SourceData(name, splits["train"], splits["test"])


def builtin_task_names(spec: str) -> list[str] | None:
    """``builtin:sort,reverse`` -> ``["sort", "reverse"]``; ``builtin`` -> None (the default tasks)."""
    return spec.split(":", 1)[1].split(",") if ":" in spec else None


def source_parts(spec: str) -> list[str]:
    """What a data source spec contributes, to find data named twice: one entry per task of a built-in
    source (``builtin`` alone names the default tasks), else the resolved path of every file it reads (a
    directory's own data files, so that a directory and a file it reads overlap), or the hub name."""
    if spec == "builtin" or spec.startswith("builtin:"):
        return [f"builtin:{n}" for n in builtin_task_names(spec) or tasks.DEFAULT_TASKS]
    path = Path(spec).expanduser()
    if path.is_dir():
        return [os.path.realpath(f) for f in local_files(path)] or [os.path.realpath(path)]
    return [os.path.realpath(path)] if path.exists() else [spec]


def check_named_once(specs: dict[str, list[str]]) -> None:
    """``{flag: specs}``: no data named twice, within a flag or across flags. Data named twice is trained on
    twice, and the steps' disjoint shares are drawn per source, so step 1's share of one copy overlaps
    step 2's or step 3's of the other."""
    named: dict[str, str] = {}
    for flag, values in specs.items():
        for spec in values:
            for part in source_parts(spec):
                if part in named:
                    what = (
                        "built-in task " + part.split(":", 1)[1]
                        if part.startswith("builtin:")
                        else "this data"
                    )
                    raise UserError(
                        f"{flag} {spec}: {what} is already named by {named[part]}: name each source once"
                    )
                named[part] = f"{flag} {spec}"


def _load_builtin(spec: str) -> SourceData:
    names = builtin_task_names(spec)
    try:
        train_ex = tasks.generate(names, BUILTIN_TRAIN_PER_TASK, BUILTIN_SEED, held_out=False)
    except KeyError as exc:
        raise UserError(f"--data_path {spec}: {exc.args[0]}") from None
    eval_ex = tasks.generate(names, BUILTIN_EVAL_PER_TASK, BUILTIN_SEED + 1, held_out=True)
    to_samples = lambda exs: [Sample(e.prompt, e.chosen, e.rejected, f"builtin:{e.task}") for e in exs]  # noqa: E731
    return SourceData(spec, to_samples(train_ex), to_samples(eval_ex))


def source_kind(spec: str, flag: str = "--data_path") -> str:
    """``builtin`` | ``local`` | ``hub``; raises :class:`UserError` for a spec that is none of them."""
    if spec == "builtin" or spec.startswith("builtin:"):
        return "builtin"
    if os.path.exists(os.path.expanduser(spec)):
        return "local"
    if spec in HUB_ADAPTERS:
        return "hub"
    if spec.endswith((".json", ".jsonl")) or spec.startswith((".", "/", "~")):
        raise UserError(f"{flag} {spec}: data file not found")
    raise UserError(
        f"{flag} {spec}: not a local file or directory, 'builtin[:TASK]', or a registered dataset "
        f"({', '.join(HUB_ADAPTERS)})"
    )


# Local data up to this size is read in full by the checks before any step starts (:func:`check_local`);
# larger data is left to the step that loads it.
CHECK_BYTES = 256 * 2**20


def check_local(spec: str) -> None:
    """Read a local data source (file or directory, up to :data:`CHECK_BYTES` in all) as its step will, so
    that a malformed line or a missing field stops the job before any step starts, not when a later step
    loads it after the earlier ones have run."""
    path = Path(spec).expanduser()
    files = [path] if path.is_file() else local_files(path) if path.is_dir() else []
    if sum(f.stat().st_size for f in files) <= CHECK_BYTES:
        _load_local(path, seed=0)


def load_source(spec: str, *, seed: int) -> SourceData:
    kind = source_kind(spec)
    if kind == "builtin":
        return _load_builtin(spec)
    if kind == "local":
        return _load_local(Path(spec).expanduser(), seed)
    return _load_hub(spec, seed)


def _stat_key(files: list[Path]) -> str:
    """Each file's path, size, modification and change time: what identifies data files' content cheaply."""
    return ";".join(f"{f}:{st.st_size}:{st.st_mtime_ns}:{st.st_ctime_ns}" for f in files for st in [f.stat()])


def fingerprint(spec: str) -> str:
    """What identifies a source's content for the tokenization cache (file sizes and mtimes for local data)."""
    kind = source_kind(spec)
    if kind == "local":
        p = Path(spec).expanduser()
        # the files the source reads (a directory's own .json/.jsonl, not a cache or notes kept beside them);
        # the change time too: a same-size edit whose mtime was put back (rsync -t, a restore) changes it
        files = [p] if p.is_file() else local_files(p)
        # "split 2": val*/dev* files became held-out (2026-11-28); "split 3": the carve groups prompts as they
        # render (2026-11-29); a cache of an older split must not serve
        return spec + "|split 3|" + _stat_key(files)
    if kind == "builtin":
        return (
            f"{spec}|{BUILTIN_TRAIN_PER_TASK}|{BUILTIN_EVAL_PER_TASK}|{BUILTIN_SEED}|v{tasks.TASKS_VERSION}"
        )
    mirror = os.environ.get("DSCHAT_HUB_MIRROR", "")
    # a mirror's copy is read like a local directory: its files' sizes and times are the content's key
    # (not a clone's .git/ or a download's .cache/, which change without the data changing)
    base = Path(mirror, spec)
    held = sorted(p for p in base.rglob("*") if p.is_file() and not any(
        part.startswith(".") for part in p.relative_to(base).parts)) if mirror else []  # fmt: skip
    return spec + "|" + mirror + "|" + _stat_key(held)
