"""dschat.data.pipeline: tokenization with the builtin tokenizer and the on-disk cache."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import pytest
import torch

from dschat.config import DataArgs
from dschat.data import pipeline
from dschat.data.collate import IGNORE_INDEX as M
from dschat.data.pipeline import gather_samples, prepare_sft_data, tokenize_sft
from dschat.data.prompt_format import make_prompt, prompt_format
from dschat.data.schema import Sample
from dschat.models.builtin import build_tokenizer
from dschat.utils.errors import UserError

SPACE, NEWLINE = 223, 201
# A bare prompt trains as one Human turn: "\n\nHuman: " (9 tokens) before it, "\n\nAssistant:" (12) after it
WRAP = 21


def ids(text: str) -> list[int]:
    """Hand encoding of printable ASCII (id = ord - 30), spaces (223) and newlines (201) under the
    builtin tokenizer."""
    return [SPACE if c == " " else NEWLINE if c == "\n" else ord(c) - 30 for c in text]


def write_jsonl(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")


@pytest.fixture
def data_dir(tmp_path):
    """train.jsonl: Q0..Q19 -> ' A0'..' A19'; test.jsonl: E0..E2 -> ' B0'..' B2'."""
    d = tmp_path / "data"
    write_jsonl(d / "train.jsonl", [{"prompt": f"Q{i}", "response": f" A{i}"} for i in range(20)])
    write_jsonl(d / "test.jsonl", [{"prompt": f"E{i}", "response": f" B{i}"} for i in range(3)])
    return d


def make_args(data_dir, tmp_path, **kw) -> DataArgs:
    base = {"data_path": [str(data_dir)], "data_split": "1,0,0", "data_output_path": str(tmp_path / "cache")}
    return DataArgs(**{**base, **kw})


def expected(prompt: str, response: str, train_on_prompt: bool = False) -> dict:
    p, r = [1, *ids(make_prompt(prompt))], [*ids(response), 2]
    return {"input_ids": p + r, "labels": (p if train_on_prompt else [M] * len(p)) + r}


# ---------------------------------------------------------------- tokenize_sft
def test_tokenize_sft_by_hand(tokenizer):
    samples = [Sample("ab", " c"), Sample("a", "bcdefgh"), Sample("xy", "")]
    out, stats = tokenize_sft(samples, prompt_format(tokenizer), max_seq_len=8 + WRAP, train_on_prompt=False)
    prompt = [1, *ids(make_prompt("ab"))]
    assert ids("ab") == [67, 68] and len(prompt) == 3 + WRAP
    assert out == [{"input_ids": [*prompt, 223, 69, 2], "labels": [M] * len(prompt) + [223, 69, 2]}]
    assert stats == {"samples": 3, "kept": 1, "dropped_too_long": 1, "dropped_empty_response": 1}


def test_tokenize_sft_keeps_exactly_max_seq_len(tokenizer):
    # [<s> a] + [" " b c d e f] + [</s>] = 9 tokens, and the Human/Assistant wrapping
    s = Sample("a", " bcdef")
    assert tokenize_sft([s], prompt_format(tokenizer), 9 + WRAP, False)[1]["kept"] == 1
    assert tokenize_sft([s], prompt_format(tokenizer), 8 + WRAP, False)[1] == {
        "samples": 1, "kept": 0, "dropped_too_long": 1, "dropped_empty_response": 0,
    }  # fmt: skip


def test_tokenize_sft_train_on_prompt(tokenizer):
    out, _ = tokenize_sft([Sample("Q1", " A1")], prompt_format(tokenizer), 64, True)
    assert out == [expected("Q1", " A1", train_on_prompt=True)]


# ---------------------------------------------------------------- gather_samples
def test_gather_samples_phases_are_disjoint(data_dir, tmp_path):
    args = make_args(data_dir, tmp_path, data_split="1,1,0")
    t1, e1 = gather_samples(args, 1)
    t2, e2 = gather_samples(args, 2)
    assert len(t1) == 10 and len(t2) == 10
    assert sorted(s.prompt for s in t1 + t2) == sorted(f"Q{i}" for i in range(20))
    assert [s.prompt for s in e1] == [s.prompt for s in e2] == ["E0", "E1", "E2"]
    with pytest.raises(
        UserError,
        match=re.escape(f"--data_split 1,1,0: step 3 gets no samples of {data_dir} (only 20 training"),
    ):
        gather_samples(args, 3)


def test_an_empty_data_file_is_named_as_the_cause(tmp_path):
    """A file of blank lines blamed --data_split ('step 1 gets no samples ... (0 training samples)')."""
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n\n")
    args = make_args(str(empty), tmp_path / "out", data_split="2,4,4")
    with pytest.raises(UserError, match=rf"^--data_path {re.escape(str(empty))}: holds no samples$"):
        gather_samples(args, 1)


def test_gather_samples_sft_only_sources_are_step1_only(data_dir, tmp_path):
    extra = tmp_path / "extra"
    write_jsonl(extra / "train.jsonl", [{"prompt": "X", "response": " Y"}])
    write_jsonl(extra / "eval.jsonl", [{"prompt": "XE", "response": " YE"}])
    args = make_args(data_dir, tmp_path, data_split="1,1,0", sft_only_data_path=[str(extra)])
    t1, e1 = gather_samples(args, 1)
    t2, e2 = gather_samples(args, 2)
    assert "X" in {s.prompt for s in t1} and len(t1) == 11
    assert "X" not in {s.prompt for s in t2} and len(t2) == 10
    assert [s.prompt for s in e1] == ["E0", "E1", "E2", "XE"]
    assert [s.prompt for s in e2] == ["E0", "E1", "E2"]


def test_gather_samples_caps_eval(data_dir, tmp_path):
    args = make_args(data_dir, tmp_path, max_eval_samples=2)
    _, evals = gather_samples(args, 1)
    assert len(evals) == 2 and {s.prompt for s in evals} <= {"E0", "E1", "E2"}
    assert gather_samples(args, 1)[1] == evals
    assert len(gather_samples(make_args(data_dir, tmp_path, max_eval_samples=0), 1)[1]) == 3


# ---------------------------------------------------------------- prepare_sft_data and its cache
def test_prepare_sft_data_exact_examples(data_dir, tmp_path, tokenizer):
    data = prepare_sft_data(make_args(data_dir, tmp_path), tokenizer)
    assert data.cache_hit is False
    assert data.train == [expected(f"Q{i}", f" A{i}") for i in range(20)]
    assert data.eval == [expected(f"E{i}", f" B{i}") for i in range(3)]
    assert data.stats == {
        "train": {"samples": 20, "kept": 20, "dropped_too_long": 0, "dropped_empty_response": 0},
        "eval": {"samples": 3, "kept": 3, "dropped_too_long": 0, "dropped_empty_response": 0},
    }
    files = list((tmp_path / "cache").iterdir())
    assert len(files) == 1 and re.fullmatch(r"sft_[0-9a-f]{24}\.pt", files[0].name)


def test_prepare_sft_data_drops_and_counts_long_samples(data_dir, tmp_path, tokenizer):
    # Q0..Q9 + ' A0'..: 3 + 3 + eos = 7 tokens; Q10..Q19: 9 tokens (and the wrapping)
    data = prepare_sft_data(make_args(data_dir, tmp_path, max_seq_len=8 + WRAP), tokenizer)
    assert data.train == [expected(f"Q{i}", f" A{i}") for i in range(10)]
    assert data.stats["train"] == {
        "samples": 20,
        "kept": 10,
        "dropped_too_long": 10,
        "dropped_empty_response": 0,
    }


def test_second_call_is_a_cache_hit(data_dir, tmp_path, tokenizer, monkeypatch):
    args = make_args(data_dir, tmp_path)
    first = prepare_sft_data(args, tokenizer)

    def boom(*a, **k):
        raise AssertionError("tokenize_sft must not run on a cache hit")

    monkeypatch.setattr(pipeline, "tokenize_sft", boom)
    second = prepare_sft_data(args, tokenizer)
    assert second.cache_hit is True
    assert (second.train, second.eval, second.stats) == (first.train, first.eval, first.stats)
    # a fresh tokenizer object with the same content shares the cache
    assert prepare_sft_data(args, build_tokenizer()).cache_hit is True


def test_a_cache_file_gets_the_mode_a_plain_open_would(data_dir, tmp_path, tokenizer):
    """mkstemp makes its file owner-only (0600): in a cache shared by several users the others rebuilt it
    every time (or, on a sticky directory, a rank of theirs found it unreadable)."""
    import os

    args = make_args(data_dir, tmp_path)
    prepare_sft_data(args, tokenizer)
    mask = os.umask(0)
    os.umask(mask)
    files = [p for p in Path(args.data_output_path).rglob("*.pt")]
    assert files and all(p.stat().st_mode & 0o777 == 0o666 & ~mask for p in files)


def test_max_seq_len_changes_the_cache_key(data_dir, tmp_path, tokenizer):
    args = make_args(data_dir, tmp_path)
    prepare_sft_data(args, tokenizer)
    other = dataclasses.replace(args, max_seq_len=8 + WRAP)
    assert pipeline._cache_key(args, 1, prompt_format(tokenizer), "sft") != pipeline._cache_key(
        other, 1, prompt_format(tokenizer), "sft"
    )
    data = prepare_sft_data(other, tokenizer)
    assert data.cache_hit is False and len(data.train) == 10
    assert len(list((tmp_path / "cache").iterdir())) == 2


@pytest.mark.parametrize(
    "change",
    [
        {"max_seq_len": 100},
        {"train_on_prompt": True},
        {"data_split": "2,4,4"},
        {"max_eval_samples": 5},
        {"sft_only_data_path": ["builtin"]},
    ],
)
def test_cache_key_covers_data_options(data_dir, tmp_path, tokenizer, change):
    args = make_args(data_dir, tmp_path)
    key = pipeline._cache_key(args, 1, prompt_format(tokenizer), "sft")
    assert pipeline._cache_key(dataclasses.replace(args), 1, prompt_format(tokenizer), "sft") == key
    assert pipeline._cache_key(dataclasses.replace(args, **change), 1, prompt_format(tokenizer), "sft") != key


def test_cache_key_covers_data_seed_phase_kind_not_output_path(data_dir, tmp_path, tokenizer):
    args = make_args(data_dir, tmp_path)
    fmt = prompt_format(tokenizer)
    key = pipeline._cache_key(args, 1, fmt, "sft")
    assert pipeline._cache_key(dataclasses.replace(args, data_seed=1), 1, fmt, "sft") != key
    assert pipeline._cache_key(args, 2, fmt, "sft") != key
    assert pipeline._cache_key(args, 1, fmt, "rm") != key
    assert pipeline._cache_key(dataclasses.replace(args, data_output_path="/elsewhere"), 1, fmt, "sft") == key
    # sft-only sources only matter for step 1
    with_extra = dataclasses.replace(args, sft_only_data_path=["builtin"])
    assert pipeline._cache_key(with_extra, 2, fmt, "sft") == pipeline._cache_key(args, 2, fmt, "sft")


def test_the_splits_follow_the_data_seed_and_stay_disjoint(data_dir, tmp_path):
    """The splits follow --data_seed, not a step's --seed (which no longer reaches the data): a step re-run
    with another --seed (a seed sweep of step 3) used to draw its share of a source from another
    permutation, overlapping what steps 1 and 2 trained on, and another evaluation set."""
    args = make_args(data_dir, tmp_path, data_split="1,1,1")
    shares = [{s.prompt for s in gather_samples(args, phase)[0]} for phase in (1, 2, 3)]
    assert not (shares[0] & shares[1] or shares[0] & shares[2] or shares[1] & shares[2])
    other = dataclasses.replace(args, data_seed=7)
    assert {s.prompt for s in gather_samples(other, 3)[0]} != shares[2]  # the seed that does move them


def test_changed_data_file_misses_the_cache(data_dir, tmp_path, tokenizer):
    args = make_args(data_dir, tmp_path)
    prepare_sft_data(args, tokenizer)
    write_jsonl(data_dir / "train.jsonl", [{"prompt": "Z", "response": " z"}])
    data = prepare_sft_data(args, tokenizer)
    assert data.cache_hit is False
    assert data.train == [expected("Z", " z")]


def test_torn_cache_is_rebuilt(data_dir, tmp_path, tokenizer):
    args = make_args(data_dir, tmp_path)
    first = prepare_sft_data(args, tokenizer)
    (cache_file,) = (tmp_path / "cache").iterdir()
    cache_file.write_bytes(b"not a torch file")
    again = prepare_sft_data(args, tokenizer)
    assert again.cache_hit is False and again.train == first.train
    assert prepare_sft_data(args, tokenizer).cache_hit is True


def test_a_failed_cache_write_leaves_no_file_behind(data_dir, tmp_path, tokenizer, monkeypatch):
    """The temporary file was named by pid (two nodes' builders in containers share pids and a cache
    directory) and stayed behind when the write failed half-way (a full disk): a unique name, removed."""
    args = make_args(data_dir, tmp_path)

    def torn_save(obj, f):
        Path(f).write_bytes(b"half")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(pipeline.torch, "save", torn_save)
    data = prepare_sft_data(args, tokenizer)
    assert data.train and data.cache_hit is False
    assert list((tmp_path / "cache").iterdir()) == []


def test_non_builder_rank_reads_the_cache(data_dir, tmp_path, tokenizer, monkeypatch):
    args = make_args(data_dir, tmp_path)
    first = prepare_sft_data(args, tokenizer)
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setattr(pipeline, "_build_sft", lambda *a, **k: pytest.fail("only local rank 0 builds"))
    data = prepare_sft_data(args, tokenizer)
    assert data.cache_hit is True and data.train == first.train


def test_non_builder_rank_without_cache(data_dir, tmp_path, tokenizer, monkeypatch):
    monkeypatch.setenv("LOCAL_RANK", "1")
    with pytest.raises(UserError, match="tokenized data cache unreadable"):
        prepare_sft_data(make_args(data_dir, tmp_path), tokenizer)


def test_nothing_left_after_filtering(tmp_path, tokenizer):
    d = tmp_path / "long"
    write_jsonl(d / "train.jsonl", [{"prompt": f"a long prompt {i}", "response": " r"} for i in range(4)])
    write_jsonl(d / "test.jsonl", [{"prompt": "Q", "response": " A"}])
    args = make_args(d, tmp_path, max_seq_len=8)
    with pytest.raises(
        UserError, match=re.escape("4 of 4 are longer than --max_seq_len 8 and 0 have an empty response")
    ):
        prepare_sft_data(args, tokenizer)
    assert not (tmp_path / "cache").exists() or not list((tmp_path / "cache").iterdir())


def test_no_eval_sample_fits(tmp_path, tokenizer):
    d = tmp_path / "d"
    write_jsonl(d / "train.jsonl", [{"prompt": "Q", "response": " A"}])
    write_jsonl(d / "test.jsonl", [{"prompt": "a much longer eval prompt", "response": " A"}])
    with pytest.raises(
        UserError,
        match=re.escape(f"no evaluation samples: the sources give none that fit --max_seq_len {8 + WRAP}"),
    ):
        prepare_sft_data(make_args(d, tmp_path, max_seq_len=8 + WRAP), tokenizer)


# ---------------------------------------------------------------- known library bugs (see the reason strings)
def test_source_without_eval_samples_is_a_user_error(tmp_path, tokenizer):
    p = tmp_path / "one.jsonl"
    write_jsonl(p, [{"prompt": "Q", "response": " A"}])  # one sample: nothing is held out for eval
    args = DataArgs(data_path=[str(p)], data_split="1,0,0", data_output_path=str(tmp_path / "cache"))
    with pytest.raises(UserError, match="no evaluation samples"):
        prepare_sft_data(args, tokenizer)


def test_chat_template_renders_the_data_and_is_part_of_the_cache_key(tmp_path):
    d = tmp_path / "chat"
    row = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}
    write_jsonl(d / "train.jsonl", [row])
    write_jsonl(d / "test.jsonl", [row])
    args = DataArgs(data_path=[str(d)], data_split="1,0,0", data_output_path=str(tmp_path / "cache"))
    tok_a, tok_b = build_tokenizer(), build_tokenizer()
    # a ChatML-like template: every message ends with </s>, the end-of-turn token of the response
    tok_a.chat_template = (
        "{% for m in messages %}<{{ m.role }}>{{ m.content }}</s>{% endfor %}"
        "{% if add_generation_prompt %}<assistant>{% endif %}"
    )
    tok_b.chat_template = "{% for m in messages %}<{{ m.content }}{% endfor %}"
    a = prepare_sft_data(args, tok_a)
    b = prepare_sft_data(args, tok_b)
    assert tok_a.decode(a.train[0]["input_ids"]) == "<user>hi</s><assistant>yo</s>"
    assert b.cache_hit is False
    assert tok_b.decode(b.train[0]["input_ids"]) == "<hiyo</s>"  # no end of turn in the template: EOS
    off = prepare_sft_data(dataclasses.replace(args, chat_template="off"), tok_a)
    assert off.cache_hit is False
    assert tok_a.decode(off.train[0]["input_ids"]) == "<s>\n\nHuman: hi\n\nAssistant: yo</s>"


def test_cache_rows_round_trip_with_token_columns_stored_as_tensors(tmp_path):
    rows = [
        {"input_ids": [1, 2, 3], "labels": [-100, 2, 3], "prompt": "a", "prompt_len": 1},
        {"input_ids": [], "labels": [], "prompt": "", "prompt_len": 0},
        {"input_ids": [7], "labels": [7], "prompt": "c", "prompt_len": 0},
    ]
    packed = pipeline._pack_rows(rows)
    # the token columns are one flat tensor each (what makes the cache quick to read); the others stay
    assert packed["input_ids"]["flat"].tolist() == [1, 2, 3, 7]
    assert packed["labels"]["lengths"].tolist() == [3, 0, 1]
    assert packed["prompt"] == ["a", "", "c"] and packed["prompt_len"] == [1, 0, 0]
    path = tmp_path / "rows.pt"
    torch.save(packed, path)
    assert pipeline._unpack_rows(torch.load(path, weights_only=True)) == rows
    # rows of different shapes, float lists and no rows at all come back unchanged too
    ragged = [{"a": [1]}, {"a": [2], "b": 3}]
    floats = [{"w": [0.5, 1.0]}]
    for case in (ragged, floats, []):
        assert pipeline._unpack_rows(pipeline._pack_rows(case)) == case


def test_held_out_prompts_that_do_not_fit_the_prompt_budget_are_left_out(tmp_path, tokenizer):
    """Step 3 generates from its held-out prompts as from its training prompts: one longer than
    --max_prompt_seq_len (dropped from training) is left out of the evaluation too, not generated from
    (another distribution, and more memory than the planner counted)."""
    from dschat.data.pipeline import prepare_prompt_data

    d = tmp_path / "data"
    write_jsonl(d / "train.jsonl", [{"prompt": f"Q{i}", "response": " A"} for i in range(4)])
    # BOS + "E0" = 3 tokens; BOS + "E1 long long long" = 17 tokens (and the wrapping)
    write_jsonl(d / "test.jsonl", [{"prompt": "E0", "response": " B"}, {"prompt": "E1 long long long", "response": " B"},
                                   {"prompt": "E2", "response": " B"}])  # fmt: skip
    data = prepare_prompt_data(make_args(d, tmp_path, data_split="0,0,1"), tokenizer, max_prompt_len=8 + WRAP)
    assert sorted(data.eval_prompts) == ["E0", "E2"]
    assert data.stats["eval"] == {"samples": 3, "kept": 2, "dropped_too_long": 1}


@pytest.mark.parametrize("chat_template", ["off", "on"])
def test_a_whitespace_only_response_is_dropped_as_empty_in_every_format(chat_template):
    """A response of only spaces is no answer: in the Human/Assistant form it tokenized to a space and
    trained the model to answer ' ' + EOS; step 2 already drops such pairs."""
    from dschat.data.pipeline import tokenize_sft

    tok = build_tokenizer()  # not the shared fixture: a template is set on it
    if chat_template == "on":
        tok.chat_template = "{% for m in messages %}{{ m['role'] + ': ' + m['content'] + '\\n' }}{% endfor %}"
    fmt = prompt_format(tok, chat_template)
    out, stats = tokenize_sft([Sample("Q", " "), Sample("Q", "   "), Sample("Q", " A")], fmt, 64, False)
    assert stats["dropped_empty_response"] == 2 and len(out) == 1


def test_pairs_none_of_which_differ_are_not_blamed_on_max_seq_len(tmp_path, tokenizer):
    """Every pair identical: the error ended '(see --max_seq_len)', though length dropped none."""
    import json as _json

    from dschat.data.pipeline import prepare_pair_data

    rows = [{"prompt": f"Q{i}", "chosen": " same", "rejected": " same"} for i in range(20)]
    path = tmp_path / "train.jsonl"
    path.write_text("".join(_json.dumps(r) + "\n" for r in rows))
    args = make_args(str(path), tmp_path, data_split="0,1,0")
    with pytest.raises(UserError, match="no usable preference pairs") as err:
        prepare_pair_data(args, tokenizer, phase=2)
    assert "max_seq_len" not in str(err.value) and '"dropped_identical": ' in str(err.value)


def test_step_1_and_step_3_ask_the_same_held_out_prompts(tmp_path):
    """Step 1 capped its evaluation set by a random sample (--max_eval_samples) and step 3 took the first
    --eval_prompts of the whole set: the two evaluated other prompts (107 of 200 in common on the main
    job), so step 1's final accuracy and step 3's first could not be compared. One order, a hash of the
    prompt under the data seed, serves the cap and the held-out prompts alike: a prefix is a prefix."""
    write_jsonl(
        tmp_path / "d" / "test.jsonl", [{"prompt": f"Question {i}?", "response": f" {i}"} for i in range(400)]
    )
    write_jsonl(
        tmp_path / "d" / "train.jsonl", [{"prompt": f"Train {i}?", "response": f" {i}"} for i in range(40)]
    )
    fmt = prompt_format(build_tokenizer())
    common = {"data_path": [str(tmp_path / "d")], "data_split": "1,1,1", "data_seed": 7}
    _, capped = gather_samples(DataArgs(**common, max_eval_samples=200), 1)
    _, whole = gather_samples(DataArgs(**common, max_eval_samples=0), 3)
    step1, _ = pipeline.held_out_prompts(capped, fmt, 10**6, 7)
    step3, _ = pipeline.held_out_prompts(whole, fmt, 10**6, 7)
    assert len(step1) == 200 and len(step3) == 400
    assert step3[:200] == step1


def test_a_question_with_several_pairs_is_asked_once_among_the_held_out_prompts():
    """Every row of a prompt has its rank in the evaluation order, so its rows sat together: 200 questions
    of 3 pairs each gave 22 distinct questions among the first 64 held-out prompts."""
    fmt = prompt_format(build_tokenizer())
    rows = [Sample(f"Question {i}?", f" {j}", f" no {j}") for i in range(200) for j in range(3)]
    prompts, stats = pipeline.held_out_prompts(rows, fmt, 10**6, 7)
    assert len(prompts) == len(set(prompts)) == 200 and stats["kept"] == 600
