"""Sources -> step share -> tokenized examples, cached on disk (once per node in multi-process runs)."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import tempfile
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from dschat.config import DataArgs, parse_data_split
from dschat.data.collate import pair_example, sft_example
from dschat.data.prompt_format import PromptFormat, prompt_format
from dschat.data.schema import Sample
from dschat.data.sources import fingerprint, load_source
from dschat.data.split import phase_share
from dschat.utils import dist
from dschat.utils.errors import UserError
from dschat.utils.io import cache_root, usual_mode

LOG = logging.getLogger("dschat")
# 4: prompts rendered by PromptFormat; prompt data carries its dialogue text; 5: pairs carry prompt_len;
# 6: token columns stored as flat tensors (_pack_rows); 7: held-out prompts fit the length limit, blank
# SFT answers dropped; 8: bare prompts are one Human turn; 9: a file's held-out rows are whole prompts;
# 10: a Human/Assistant answer is one space and its text however the row spells it; 11: a plain prompt's
# surrounding whitespace is stripped; 12: a Human/Assistant dialogue prompt ends at "Assistant:" (no
# trailing space before the answer's own); 13: a pair's prompt over the budget loses its oldest turns, then
# the start of its question, inside the format's headers (it kept BOS and its last tokens); 14: that cut
# never starts inside a multi-byte character; 15: the evaluation cap and the held-out prompts follow one
# hash order (step 1 and step 3 ask the same prompts); 16: text before a dialogue's first turn leads its
# first user turn in a chat template (it was dropped)
CACHE_VERSION = 16


@dataclass
class PreparedData:
    train: list[dict]
    eval: list[dict]
    stats: dict[str, Any] = field(default_factory=dict)
    eval_prompts: list[str] = field(default_factory=list)  # for generation-based metrics (true accuracy)
    cache_hit: bool = False


def data_cache_dir(args: DataArgs) -> Path:
    if args.data_output_path:
        return Path(args.data_output_path).expanduser()
    return cache_root() / "data"


def rows_fingerprint(rows: Iterable[dict]) -> str:
    """What identifies a tokenized training set's content, in order: a hash of every row's fields (token
    tensors by their bytes, anything else by its repr). A resumed run compares it with its checkpoint's:
    the same count of other rows would resume at a position in another set."""
    h = hashlib.sha256()
    for row in rows:
        for key in sorted(row):
            value = row[key]
            h.update(key.encode())
            if isinstance(value, torch.Tensor):
                raw = value.detach().cpu().contiguous().view(-1).view(torch.uint8)  # any dtype, bf16 too
                h.update(str(value.dtype).encode() + raw.numpy().tobytes())
            else:
                h.update(repr(value).encode())
    return h.hexdigest()[:16]


def tokenizer_fingerprint(tokenizer) -> str:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    body = backend.to_str() if backend is not None else json.dumps(tokenizer.get_vocab(), sort_keys=True)
    body += "|" + str(getattr(tokenizer, "chat_template", None) or "")
    return (
        hashlib.sha256(body.encode()).hexdigest()[:16]
        + f"|{len(tokenizer)}|{tokenizer.bos_token}|{tokenizer.eos_token}"
    )


def gather_samples(args: DataArgs, phase: int) -> tuple[list[Sample], list[Sample]]:
    """Training samples of step ``phase`` from every source (blended) and the shared eval samples; their
    prompts are dialogue text (rendered for the model only when tokenized, see :class:`PromptFormat`).

    Every split is drawn with ``--data_seed``, not a step's ``--seed``: steps run with different seeds
    still get disjoint shares of each source and the same evaluation samples."""
    seed = args.data_seed
    fractions = parse_data_split(args.data_split)
    train: list[Sample] = []
    evals: list[Sample] = []
    for spec in args.data_path:
        src = load_source(spec, seed=seed)
        if not src.train and not src.eval:  # an empty file: its split is not what is wrong
            raise UserError(f"--data_path {spec}: holds no samples")
        share = phase_share(src.train, fractions, phase, seed)
        if not share:
            raise UserError(f"--data_split {args.data_split}: step {phase} gets no samples of {spec} (only "
                            f"{len(src.train)} training sample{'s' if len(src.train) != 1 else ''} to split)")  # fmt: skip
        train.extend(share)
        evals.extend(src.eval)
    if phase == 1:
        for spec in args.sft_only_data_path:
            src = load_source(spec, seed=seed)
            train.extend(src.train)
            evals.extend(src.eval)
    if args.max_eval_samples and len(evals) > args.max_eval_samples:
        evals = sorted(evals, key=lambda s: eval_rank(s.prompt, seed))[: args.max_eval_samples]
    return train, evals


def eval_rank(prompt: str, seed: int) -> bytes:
    """A held-out prompt's place in the one evaluation order of the data seed (a hash: any subset keeps the
    order). The cap of ``--max_eval_samples`` and the prompts generation is evaluated on both follow it, so
    step 1's capped set and step 3's first ``--eval_prompts`` are the same prompts (a random sample and
    a shuffle of the whole set shared 107 of 200 on the main job)."""
    return hashlib.sha256(f"eval:{seed}:{prompt}".encode()).digest()


def tokenize_sft(
    samples: list[Sample], fmt: PromptFormat, max_seq_len: int, train_on_prompt: bool
) -> tuple[list[dict], dict]:
    """Tokenize prompt and response separately (the boundary is exact), the response followed by the
    format's end token (EOS, or a chat template's end of turn), and drop over-long samples."""
    if not samples:
        return [], {"samples": 0, "kept": 0, "dropped_too_long": 0, "dropped_empty_response": 0}
    prompts = fmt.encode_prompts([s.prompt for s in samples])
    responses = fmt.encode_responses([s.chosen for s in samples])
    out, too_long, empty = [], 0, 0
    for s, p, r in zip(samples, prompts, responses, strict=True):
        if not r or not s.chosen.strip():  # spaces are no answer (the Human/Assistant form keeps them)
            empty += 1
            continue
        ex = sft_example(p, r, fmt.end_id, train_on_prompt)
        if len(ex["input_ids"]) > max_seq_len:
            too_long += 1
            continue
        out.append(ex)
    return out, {
        "samples": len(samples),
        "kept": len(out),
        "dropped_too_long": too_long,
        "dropped_empty_response": empty,
    }


def _cache_key(args: DataArgs, phase: int, fmt: PromptFormat, kind: str) -> str:
    key = {
        "v": CACHE_VERSION,
        "kind": kind,
        "phase": phase,
        "seed": args.data_seed,
        "sources": [fingerprint(s) for s in args.data_path],
        "sft_only": [fingerprint(s) for s in args.sft_only_data_path] if phase == 1 else [],
        "split": args.data_split,
        "max_seq_len": args.max_seq_len,
        "train_on_prompt": args.train_on_prompt,
        "max_eval": args.max_eval_samples,
        "tokenizer": tokenizer_fingerprint(fmt.tokenizer),
        "format": fmt.fingerprint(),
    }
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:24]


def _build_sft(args: DataArgs, phase: int, fmt: PromptFormat) -> PreparedData:
    train_s, eval_s = gather_samples(args, phase)
    train, tstats = tokenize_sft(train_s, fmt, args.max_seq_len, args.train_on_prompt)
    evals, estats = tokenize_sft(eval_s, fmt, args.max_seq_len, args.train_on_prompt)
    if not train:
        raise UserError(
            f"no training samples left for step {phase}: {tstats['dropped_too_long']} of {tstats['samples']} are longer "
            f"than --max_seq_len {args.max_seq_len} and {tstats['dropped_empty_response']} have an empty response"
        )
    if not evals:
        raise UserError(
            f"no evaluation samples: the sources give none that fit --max_seq_len {args.max_seq_len}"
        )
    prompts, _ = held_out_prompts(eval_s, fmt, args.max_seq_len - 1, args.data_seed)
    return PreparedData(train, evals, {"train": tstats, "eval": estats}, prompts)


def comparable_pairs(samples: list[Sample]) -> tuple[list[Sample], dict[str, int]]:
    """The pairs a ranking can be learned or measured on: both answers non-blank and different (an
    identical pair has no right order, and a tie would count as a wrong ranking); with the counts of the
    others. Step 2, DPO and rw_eval.py judge pairs by this one rule."""
    usable, dropped = [], {"dropped_identical": 0, "dropped_empty_response": 0}
    for s in samples:
        if not s.chosen.strip() or not s.rejected.strip():
            dropped["dropped_empty_response"] += 1
        elif s.chosen.strip() == s.rejected.strip():
            dropped["dropped_identical"] += 1
        else:
            usable.append(s)
    return usable, dropped


def tokenize_pairs(samples: list[Sample], fmt: PromptFormat, max_seq_len: int) -> tuple[list[dict], dict]:
    """Preference pairs -> ``{"chosen", "rejected"}`` token lists (see :func:`pair_example`).

    Pairs whose responses are identical or empty carry no preference and are dropped; a prompt too
    long for ``max_seq_len`` is fitted as inference fits one (:meth:`PromptFormat.fit_prompt`: its oldest
    turns, then the start of its question) so both responses stay whole; pairs whose responses leave no
    room for a prompt are dropped. All are counted.
    """
    usable, dropped = comparable_pairs(samples)
    stats = {"samples": len(samples), "kept": 0, **dropped, "dropped_too_long": 0, "prompt_truncated": 0}
    if not usable:
        return [], stats
    prompts = fmt.encode_prompts([s.prompt for s in usable])
    chosen = fmt.encode_responses([s.chosen for s in usable])
    rejected = fmt.encode_responses([s.rejected for s in usable])
    # the format's own tokens around a question of one token: less room than that, no prompt fits
    least = len(fmt.encode_prompts(["x"])[0])
    out = []
    for s, p, c, r in zip(usable, prompts, chosen, rejected):
        budget = max_seq_len - max(len(c), len(r))
        if len(p) > budget:
            if budget < least:
                stats["dropped_too_long"] += 1
                continue
            p = fmt.fit_prompt(s.prompt, budget).ids  # old turns, then the question's start (as chat.py)
            stats["prompt_truncated"] += 1
        out.append(pair_example(p, c, r))
    stats["kept"] = len(out)
    return out, stats


def _why(stats: dict) -> str:
    """The hint after a count of pairs none of which was usable: --max_seq_len only where length dropped
    some (a set of identical pairs was sent to it too)."""
    return " (see --max_seq_len)" if stats.get("dropped_too_long") else ""


def _check_pairs(samples: list[Sample]) -> None:
    for s in samples:
        if s.rejected is None:
            raise UserError(
                f"{s.source or 'data'}: missing field 'rejected' (step 2 needs preference pairs: prompt, chosen, rejected)"
            )


def held_out_prompts(
    eval_s: list[Sample], fmt: PromptFormat, limit: int, seed: int
) -> tuple[list[str], dict[str, int]]:
    """The held-out prompts that generation-based metrics (true accuracy, held-out reward) answer: those
    whose rendered ids fit ``limit`` tokens, as the training prompts must (a longer one would be evaluated
    on another distribution than the step trains on, and pad every batch beyond what the memory planner
    counted), in the data seed's evaluation order (:func:`eval_rank`: any prefix mixes every task, and every
    step's prefix of one length is the same prompts); with their counts."""
    ids = fmt.encode_prompts([s.prompt for s in eval_s])
    fits = [s.prompt for s, p in zip(eval_s, ids, strict=True) if len(p) <= limit]
    # each prompt once: a prompt's rows (several pairs of one question) share its rank and would sit together,
    # so a prefix of N held few distinct questions
    prompts = sorted(dict.fromkeys(fits), key=lambda prompt: eval_rank(prompt, seed))
    return prompts, {"samples": len(ids), "kept": len(fits), "dropped_too_long": len(ids) - len(fits)}


def _build_pairs(args: DataArgs, phase: int, fmt: PromptFormat) -> PreparedData:
    train_s, eval_s = gather_samples(args, phase)
    _check_pairs(train_s)
    _check_pairs(eval_s)
    train, tstats = tokenize_pairs(train_s, fmt, args.max_seq_len)
    evals, estats = tokenize_pairs(eval_s, fmt, args.max_seq_len)
    if not train:
        raise UserError(f"no usable preference pairs for step {phase}: {json.dumps(tstats)}{_why(tstats)}")
    if not evals:
        raise UserError(f"no usable evaluation pairs: {json.dumps(estats)}{_why(estats)}")
    prompts, _ = held_out_prompts(eval_s, fmt, args.max_seq_len - 1, args.data_seed)
    return PreparedData(train, evals, {"train": tstats, "eval": estats}, prompts)


def _build_prompts(args: DataArgs, phase: int, fmt: PromptFormat) -> PreparedData:
    """Prompts of step ``phase`` as ``{"input_ids": rendered prompt ids, "prompt": dialogue text}`` (the
    text is what reward functions and verifiers read); prompts longer than ``max_seq_len`` are dropped."""
    train_s, eval_s = gather_samples(args, phase)
    ids = fmt.encode_prompts([s.prompt for s in train_s])
    train = [{"input_ids": p, "prompt": s.prompt} for p, s in zip(ids, train_s) if len(p) <= args.max_seq_len]
    stats = {"samples": len(ids), "kept": len(train), "dropped_too_long": len(ids) - len(train)}
    if not train:
        raise UserError(
            f"no prompts for step {phase}: all {len(ids)} are longer than --max_prompt_seq_len {args.max_seq_len}"
        )
    prompts, estats = held_out_prompts(eval_s, fmt, args.max_seq_len, args.data_seed)
    return PreparedData(train, [], {"train": stats, "eval": estats}, prompts)


BUILDERS = {"sft": _build_sft, "pairs": _build_pairs, "prompts": _build_prompts}


def prepare_sft_data(args: DataArgs, tokenizer, *, phase: int = 1) -> PreparedData:
    """Tokenized SFT examples (``input_ids``, ``labels``) of step ``phase``; see :func:`prepare_data`."""
    return prepare_data("sft", args, tokenizer, phase=phase)


def prepare_pair_data(args: DataArgs, tokenizer, *, phase: int = 2) -> PreparedData:
    """Tokenized preference pairs (``chosen``, ``rejected``) of step ``phase``; see :func:`prepare_data`."""
    return prepare_data("pairs", args, tokenizer, phase=phase)


def prepare_prompt_data(args: DataArgs, tokenizer, *, max_prompt_len: int, phase: int = 3) -> PreparedData:
    """Tokenized prompts of step ``phase`` (at most ``max_prompt_len`` tokens); see :func:`prepare_data`."""
    return prepare_data(
        "prompts", dataclasses.replace(args, max_seq_len=max_prompt_len), tokenizer, phase=phase
    )


def prepare_data(kind: str, args: DataArgs, tokenizer, *, phase: int) -> PreparedData:
    """Tokenized train/eval examples of ``kind`` for step ``phase``, cached under the data cache dir.
    Prompts are rendered in the format ``args.chat_template`` picks for ``tokenizer``.

    With several processes, local rank 0 of each node builds and writes the cache while the others
    wait, then everyone reads it; a failure on the builder is re-raised on every rank (no hang).
    """
    fmt = prompt_format(tokenizer, args.chat_template)
    path = data_cache_dir(args) / f"{kind}_{_cache_key(args, phase, fmt, kind)}.pt"
    builder = dist.local_rank() == 0
    data: PreparedData | None = None
    error: Exception | None = None
    if builder:
        try:
            data = _read_cache(path) if path.exists() else None
            if data is None:
                data = BUILDERS[kind](args, phase, fmt)
                _write_cache(path, data)
        except Exception as exc:  # any failure, not only bad input: re-raised once the others know of it
            error = exc
    # Every rank takes part in this reduction: it is the barrier that makes the others wait for the cache.
    failed = dist.all_reduce_sum([1.0 if error else 0.0])[0]
    if error is not None:
        raise error
    if failed:
        raise UserError("data preparation failed on another rank (see its message)")
    if data is None:
        data = _read_cache(path)
    if data is None:
        raise UserError(
            f"{path}: tokenized data cache unreadable after it was written (is the directory writable?)"
        )
    return data


def _write_cache(path: Path, data: PreparedData) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        # a name no other writer has: each node's builder may write into one shared cache directory, and
        # containers on two nodes often run with the same pid
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
        os.close(fd)
    except OSError as exc:
        LOG.warning("could not write the tokenized data cache %s (%s); continuing without it", path, exc)
        return
    try:
        torch.save(
            {"train": _pack_rows(data.train), "eval": _pack_rows(data.eval), "stats": data.stats,
             "eval_prompts": data.eval_prompts},
            tmp,
        )  # fmt: skip
        usual_mode(tmp)  # mkstemp's 0600 would keep the other users of a shared cache out
        os.replace(tmp, path)
    except (OSError, RuntimeError, OverflowError) as exc:  # a full disk, or a column torch cannot store
        LOG.warning("could not write the tokenized data cache %s (%s); continuing without it", path, exc)
        Path(tmp).unlink(missing_ok=True)


def _read_cache(path: Path) -> PreparedData | None:
    try:
        blob = torch.load(path, weights_only=True)
        train, evals = _unpack_rows(blob["train"]), _unpack_rows(blob["eval"])
    except Exception:  # a torn or foreign file: rebuild rather than fail
        return None
    return PreparedData(train, evals, blob["stats"], blob["eval_prompts"], cache_hit=True)


def _pack_rows(rows: list[dict]) -> dict[str, Any]:
    """Examples -> columns, each token column (lists of ints) as one flat (sum of lengths,) int64 tensor
    plus its (N,) lengths. ``torch.load(weights_only=True)`` unpickles a list of Python ints one object
    at a time: 4000 SFT examples took 0.54 s to read at every start, the columns take 0.03 s."""
    if any(row.keys() != rows[0].keys() for row in rows):  # not one table: stored as it is
        return {"__plain__": rows}
    columns: dict[str, Any] = {"__rows__": len(rows)}
    for key in rows[0] if rows else ():
        values = [row[key] for row in rows]
        if all(isinstance(v, list) and all(type(x) is int for x in v) for v in values):
            flat = [x for v in values for x in v]
            columns[key] = {"flat": torch.tensor(flat, dtype=torch.int64),
                            "lengths": torch.tensor([len(v) for v in values], dtype=torch.int64)}  # fmt: skip
        else:
            columns[key] = values
    return columns


def _unpack_rows(columns: dict[str, Any]) -> list[dict]:
    """Inverse of :func:`_pack_rows`: the same list of dicts, token columns as lists of ints."""
    if "__plain__" in columns:
        return columns["__plain__"]
    rows: list[dict] = [{} for _ in range(columns["__rows__"])]
    for key, col in columns.items():
        if key == "__rows__":
            continue
        if isinstance(col, dict):
            flat, start = col["flat"].tolist(), 0
            for row, length in zip(rows, col["lengths"].tolist(), strict=True):
                row[key] = flat[start : start + length]
                start += length
        else:
            for row, value in zip(rows, col, strict=True):
                row[key] = value
    return rows
