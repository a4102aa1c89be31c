"""dschat.data.sources: local files, built-in tasks and hub datasets mapped to Sample."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from dschat.data import sources
from dschat.data.schema import Sample
from dschat.data.sources import HUB_ADAPTERS, fingerprint, load_source, read_json_file, source_kind
from dschat.utils.errors import UserError


def write_jsonl(path: Path, rows: list) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def qa_rows(n: int, prefix: str = "") -> list[dict]:
    return [{"prompt": f"{prefix}Q{i}", "response": f" {prefix}A{i}"} for i in range(n)]


# ---------------------------------------------------------------- read_json_file
def test_jsonl_prompt_response(tmp_path):
    p = write_jsonl(
        tmp_path / "d.jsonl", [{"prompt": "Q1", "response": " A1"}, {"prompt": "Q2", "response": " A2"}]
    )
    assert read_json_file(p) == [Sample("Q1", " A1", None, f"{p}:1"), Sample("Q2", " A2", None, f"{p}:2")]


def test_jsonl_prompt_chosen_rejected(tmp_path):
    p = write_jsonl(
        tmp_path / "d.jsonl", [{"prompt": "Q", "chosen": " good", "rejected": " bad", "extra": 1}]
    )
    assert read_json_file(p) == [Sample("Q", " good", " bad", f"{p}:1")]


def test_chosen_wins_over_response(tmp_path):
    p = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "Q", "chosen": " c", "response": " r"}])
    assert read_json_file(p)[0].chosen == " c"


def test_blank_lines_are_skipped_and_line_numbers_kept(tmp_path):
    p = tmp_path / "d.jsonl"
    p.write_text(
        '{"prompt": "a", "response": "b"}\n\n   \n{"prompt": "c", "response": "d"}', encoding="utf-8"
    )
    assert [s.source for s in read_json_file(p)] == [f"{p}:1", f"{p}:4"]


def test_json_list_file(tmp_path):
    p = tmp_path / "d.json"
    p.write_text(
        json.dumps(
            [{"prompt": "Q", "response": " A"}, {"prompt": "Q2", "chosen": " C", "rejected": " R"}], indent=2
        )
    )
    assert read_json_file(p) == [
        Sample("Q", " A", None, f"{p} item 0"),
        Sample("Q2", " C", " R", f"{p} item 1"),
    ]


def test_json_file_of_lines(tmp_path):
    p = write_jsonl(tmp_path / "d.json", [{"prompt": "Q", "response": " A"}])
    assert read_json_file(p) == [Sample("Q", " A", None, f"{p}:1")]


def test_unicode_content(tmp_path):
    p = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "¿Qué? 日本", "response": " 😀"}])
    assert read_json_file(p)[0] == Sample("¿Qué? 日本", " 😀", None, f"{p}:1")


def test_messages_rows_become_dialogue_text(tmp_path):
    # rendered for the model (Human/Assistant or its chat template) only when tokenized
    row = {
        "messages": [
            {"role": "system", "content": "S"},
            {"role": "user", "content": "U"},
            {"role": "assistant", "content": "R "},
        ]
    }
    p = write_jsonl(tmp_path / "d.jsonl", [row])
    assert read_json_file(p) == [Sample("\n\nSystem: S\n\nHuman: U\n\nAssistant:", " R", None, f"{p}:1")]


def test_messages_rows_pass_all_but_the_last_turn():
    row = {"messages": [{"role": "user", "content": "u1"}, {"role": "assistant", "content": "a1"},
                        {"role": "user", "content": "u2"}, {"role": "assistant", "content": "a2"}]}  # fmt: skip
    s = sources._row_to_sample(row, "w")
    assert s == Sample("\n\nHuman: u1\n\nAssistant: a1\n\nHuman: u2\n\nAssistant:", " a2", None, "w")


@pytest.mark.parametrize("turn", [{"role": "narrator", "content": "x"}, {"content": "x"}])
def test_messages_with_a_bad_turn_name_the_field(tmp_path, turn):
    p = write_jsonl(tmp_path / "d.jsonl", [{"messages": [turn, {"role": "assistant", "content": "R"}]}])
    with pytest.raises(UserError, match=re.escape(f"{p}:1: field 'messages': every turn needs a role")):
        read_json_file(p)


@pytest.mark.parametrize(
    "messages, why",
    [
        ([{"role": "user", "content": None}, {"role": "assistant", "content": "A"}], "turn 1's content"),
        ([{"role": "user", "content": "U"}, {"role": "assistant", "content": None}], "turn 2's content"),
        ([{"role": "user", "content": "U"}, {"role": "assistant"}], "turn 2's content"),
        ([{"role": "user", "content": 7}, {"role": "assistant", "content": "A"}], "turn 1's content"),
        ([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}, {"role": "assistant", "content": "A"}],
         "turn 1's content"),
        ([{"role": "system", "content": "S"}, {"role": "assistant", "content": "A"}], "no user turn"),
        # flattened to dialogue text and parsed back, this content became a user turn and an assistant turn
        ([{"role": "user", "content": "Fix this log:\n\nAssistant: ok"}, {"role": "assistant", "content": "A"}],
         "turn 1's content holds '\\n\\nAssistant:', where the pipeline's dialogue text starts a new turn"),
    ],
)  # fmt: skip
def test_messages_whose_turns_are_not_text_are_one_line(tmp_path, messages, why):
    """null content trained as the text 'None', a list of content parts as its Python repr, a missing
    final content as an empty answer, a dialogue without a user turn as a user message holding the
    rendered system turn: each is one line naming the row."""
    p = write_jsonl(tmp_path / "d.jsonl", [{"messages": messages}])
    with pytest.raises(UserError, match=re.escape(f"{p}:1: field 'messages': {why}")):
        read_json_file(p)


def test_messages_content_given_as_text_parts_is_their_text(tmp_path):
    """The OpenAI form of a turn's content: a list of {"type": "text", "text": ...} parts, joined."""
    parts = [{"type": "text", "text": "What is "}, {"type": "text", "text": "2+2?"}]
    row = {"messages": [{"role": "user", "content": parts}, {"role": "assistant", "content": [{"type": "text", "text": "4"}]}]}  # fmt: skip
    p = write_jsonl(tmp_path / "d.jsonl", [row])
    assert read_json_file(p) == [Sample("\n\nHuman: What is 2+2?\n\nAssistant:", " 4", None, f"{p}:1")]


@pytest.mark.parametrize("rejected", [0, False, [], {}])
def test_a_rejected_answer_that_is_not_text_is_one_line(tmp_path, rejected):
    p = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "P", "chosen": " C", "rejected": rejected}])
    with pytest.raises(UserError, match=re.escape(f"{p}:1: field 'rejected' must be a string")):
        read_json_file(p)


@pytest.mark.parametrize(
    "messages",
    [[], "hi", [{"role": "user", "content": "U"}], [{"role": "assistant", "content": "A"}, "x"]],
)
def test_messages_must_end_with_assistant(tmp_path, messages):
    p = write_jsonl(tmp_path / "d.jsonl", [{"messages": messages}])
    with pytest.raises(UserError, match=re.escape(f"{p}:1: field 'messages' must be a list of turns ending")):
        read_json_file(p)


def test_malformed_jsonl_line_names_path_and_line(tmp_path):
    p = tmp_path / "d.jsonl"
    p.write_text('{"prompt": "a", "response": "b"}\n{"prompt": "a", \n', encoding="utf-8")
    with pytest.raises(UserError, match=re.escape(f"{p}:2: malformed JSON line")):
        read_json_file(p)


def test_malformed_json_list_names_path_and_line(tmp_path):
    p = tmp_path / "d.json"
    p.write_text('[\n  {"prompt": "a", "response": "b"},\n  {oops}\n]\n', encoding="utf-8")
    with pytest.raises(UserError, match=re.escape(f"{p}:3: malformed JSON")):
        read_json_file(p)


@pytest.mark.parametrize(
    ("row", "message"),
    [
        ({"response": "x"}, "missing field 'prompt'"),
        ({"prompt": "x"}, "missing field 'chosen' or 'response'"),
        ({"prompt": "x", "rejected": "y"}, "missing field 'chosen' or 'response'"),
        ({"prompt": 3, "response": "x"}, "field 'prompt' must be a string, got int"),
        ({"prompt": "x", "chosen": ["a"]}, "field 'chosen/response' must be a string, got list"),
        ({"prompt": "x", "chosen": "a", "rejected": 1.5}, "field 'rejected' must be a string, got float"),
        (["prompt", "x"], "expected a JSON object, got list"),
        ("text", "expected a JSON object, got str"),
    ],
)
def test_bad_rows_name_the_field_and_line(tmp_path, row, message):
    p = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "ok", "response": "ok"}, row])
    with pytest.raises(UserError, match=re.escape(f"{p}:2: {message}")):
        read_json_file(p)


def test_bad_row_in_json_list_names_the_item(tmp_path):
    p = tmp_path / "d.json"
    p.write_text(json.dumps([{"prompt": "ok", "response": "ok"}, {"prompt": "x"}]))
    with pytest.raises(UserError, match=re.escape(f"{p} item 1: missing field 'chosen' or 'response'")):
        read_json_file(p)


def test_missing_file(tmp_path):
    p = tmp_path / "nope.jsonl"
    with pytest.raises(UserError, match=re.escape(f"{p}: data file not found")):
        read_json_file(p)
    with pytest.raises(UserError, match=re.escape(f"{p}: data file not found")):
        load_source(str(p), seed=0)


@pytest.mark.parametrize("spec", ["missing.json", "./missing", "~/missing_dschat_dir"])
def test_missing_path_like_spec(spec, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(UserError, match=re.escape(f"{spec}: data file not found")):
        source_kind(spec)


def test_unknown_spec_lists_the_registry(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(UserError) as exc:
        load_source("someone/some-dataset", seed=0)
    msg = str(exc.value)
    assert msg.startswith("--data_path someone/some-dataset: not a local file or directory")
    for name in HUB_ADAPTERS:
        assert name in msg


def test_source_kind(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    write_jsonl(tmp_path / "d.jsonl", qa_rows(1))
    assert source_kind("builtin") == "builtin"
    assert source_kind("builtin:add,sort") == "builtin"
    assert source_kind("d.jsonl") == "local"
    assert source_kind(str(tmp_path)) == "local"
    assert source_kind("Dahoas/rm-static") == "hub"
    assert source_kind("Anthropic/hh-rlhf") == "hub"


# ---------------------------------------------------------------- local sources: eval carve-out, directories
def test_local_file_holds_out_five_percent(tmp_path):
    p = write_jsonl(tmp_path / "d.jsonl", qa_rows(40))
    src = load_source(str(p), seed=3)
    assert src.name == str(p)
    assert len(src.train) == 38 and len(src.eval) == 2
    assert sorted(s.prompt for s in src.train + src.eval) == sorted(f"Q{i}" for i in range(40))
    assert not {s.prompt for s in src.train} & {s.prompt for s in src.eval}
    assert load_source(str(p), seed=3) == src
    # the train side keeps file order
    order = [int(s.prompt[1:]) for s in src.train]
    assert order == sorted(order)


def test_local_file_eval_share_rounds_and_is_at_least_one(tmp_path):
    assert [len(load_source(str(write_jsonl(tmp_path / f"{n}.jsonl", qa_rows(n))), seed=0).eval) for n in (2, 3, 30, 50, 70)] == [
        1, 1, 2, 2, 4,  # max(1, round(n * 0.05)): round(1.5) = 2, round(2.5) = 2, round(3.5) = 4
    ]  # fmt: skip


def test_local_file_with_one_sample_has_no_eval(tmp_path):
    src = load_source(str(write_jsonl(tmp_path / "d.jsonl", qa_rows(1))), seed=0)
    assert len(src.train) == 1 and src.eval == []


def test_directory_with_train_and_test_files(tmp_path):
    d = tmp_path / "data"
    write_jsonl(d / "train.jsonl", qa_rows(3, "t"))
    write_jsonl(d / "train_more.json", qa_rows(2, "m"))
    write_jsonl(d / "test.jsonl", qa_rows(2, "e"))
    write_jsonl(d / "valid.json", qa_rows(1, "v"))
    (d / "README.md").write_text("not data")
    write_jsonl(d / "sub" / "train.jsonl", qa_rows(5, "ignored"))
    src = load_source(str(d), seed=0)
    assert [s.prompt for s in src.train] == ["tQ0", "tQ1", "tQ2", "mQ0", "mQ1"]
    assert [s.prompt for s in src.eval] == ["eQ0", "eQ1", "vQ0"]


@pytest.mark.parametrize("name", ["val.jsonl", "validation.json", "dev.jsonl", "eval_set.jsonl"])
def test_a_directorys_validation_file_is_the_eval_split_under_its_common_names(tmp_path, name):
    """val/dev files are held out, never trained on (they were read as training data, and the eval set
    carved from train + val)."""
    d = tmp_path / "data"
    write_jsonl(d / "train.jsonl", qa_rows(20, "t"))
    write_jsonl(d / name, qa_rows(3, "v"))
    src = load_source(str(d), seed=0)
    assert [s.prompt for s in src.train] == [f"tQ{i}" for i in range(20)]
    assert [s.prompt for s in src.eval] == ["vQ0", "vQ1", "vQ2"]


def test_a_file_beside_train_files_that_is_no_split_is_one_line(tmp_path):
    """With train* files present, another data file is neither split: refused, not trained on."""
    d = tmp_path / "data"
    write_jsonl(d / "train.jsonl", qa_rows(3, "t"))
    write_jsonl(d / "holdout.jsonl", qa_rows(3, "h"))
    with pytest.raises(UserError, match=r"holdout\.jsonl: .*neither a train\* nor"):
        load_source(str(d), seed=0)


def test_directory_without_eval_files_is_carved(tmp_path):
    d = tmp_path / "data"
    write_jsonl(d / "a.jsonl", qa_rows(20, "a"))
    write_jsonl(d / "b.jsonl", qa_rows(20, "b"))
    src = load_source(str(d), seed=0)
    assert len(src.train) == 38 and len(src.eval) == 2


def test_directory_without_data_files(tmp_path):
    (tmp_path / "notes.txt").write_text("x")
    with pytest.raises(UserError, match=re.escape(f"{tmp_path}: directory holds no .json or .jsonl files")):
        load_source(str(tmp_path), seed=0)


# ---------------------------------------------------------------- builtin
def test_builtin_source(monkeypatch):
    monkeypatch.setattr(sources, "BUILTIN_TRAIN_PER_TASK", 30)
    monkeypatch.setattr(sources, "BUILTIN_EVAL_PER_TASK", 5)
    src = load_source("builtin:add,reverse", seed=999)
    assert src.name == "builtin:add,reverse"
    assert len(src.train) == 60 and len(src.eval) == 10
    assert [s.source for s in src.train] == ["builtin:add"] * 30 + ["builtin:reverse"] * 30
    assert not {s.prompt for s in src.train} & {s.prompt for s in src.eval}
    assert all(s.rejected is not None and s.rejected != s.chosen for s in src.train + src.eval)
    # --seed does not move the built-in data
    assert load_source("builtin:add,reverse", seed=1) == src


def test_builtin_unknown_task():
    with pytest.raises(UserError, match=re.escape("--data_path builtin:mul: unknown built-in task 'mul'")):
        load_source("builtin:mul", seed=0)


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        ({"data_path": ["builtin:sort,sort"]}, "--data_path builtin:sort,sort: built-in task sort is already named by "
         "--data_path builtin:sort,sort"),
        # bare builtin names the default tasks, sort among them
        ({"data_path": ["builtin", "builtin:sort"]}, "--data_path builtin:sort: built-in task sort is already named "
         "by --data_path builtin"),
        ({"data_path": ["builtin:reverse"], "sft_only_data_path": ["builtin"]}, "--sft_only_data_path builtin: "
         "built-in task reverse is already named by --data_path builtin:reverse"),
        ({"data_path": ["{d}/a.jsonl", "{d}/../{name}/a.jsonl"]}, "--data_path {d}/../{name}/a.jsonl: this data is already named by "
         "--data_path {d}/a.jsonl: name each source once"),
        # a directory and a file in it (the directory loads the file too)
        ({"data_path": ["{d}", "{d}/a.jsonl"]}, "--data_path {d}/a.jsonl: this data is already named by --data_path {d}:"),
        ({"data_path": ["{d}/a.jsonl"], "sft_only_data_path": ["{d}"]}, "--sft_only_data_path {d}: this data is already "
         "named by --data_path {d}/a.jsonl:"),
    ],
)  # fmt: skip
def test_data_named_twice_is_refused(tmp_path, kw, message):
    """'builtin:sort,sort' used to generate every sort question twice, and each copy was split into the
    steps' shares on its own, so step 1 trained on step 3's prompts; a file named twice did the same."""
    from dschat.config import DataArgs

    write_jsonl(tmp_path / "a.jsonl", qa_rows(4))
    kw = {k: [v.format(d=tmp_path, name=tmp_path.name) for v in vs] for k, vs in kw.items()}
    with pytest.raises(UserError, match="^" + re.escape(message.format(d=tmp_path, name=tmp_path.name))):
        DataArgs(**kw).validate()


def test_distinct_sources_are_accepted(tmp_path):
    from dschat.config import DataArgs

    write_jsonl(tmp_path / "a.jsonl", qa_rows(4))
    write_jsonl(tmp_path / "sub" / "b.jsonl", qa_rows(4))  # a directory does not read its subdirectories
    DataArgs(data_path=[str(tmp_path)], sft_only_data_path=[str(tmp_path / "sub" / "b.jsonl")]).validate()
    DataArgs(data_path=["builtin:sort", "builtin:reverse_words", str(tmp_path / "a.jsonl"), "Dahoas/rm-static"],
             sft_only_data_path=["builtin:add"]).validate()  # fmt: skip


# ---------------------------------------------------------------- hub adapters on rows
def test_anthropic_hh_splits_at_the_last_assistant_turn():
    prompt = "\n\nHuman: Hi\n\nAssistant: Hello\n\nHuman: Bye\n\nAssistant:"
    row = {"chosen": prompt + " Goodbye", "rejected": prompt + " Go away"}
    assert HUB_ADAPTERS["Anthropic/hh-rlhf"](row) == Sample(prompt, " Goodbye", " Go away")


def test_anthropic_hh_different_prompts_are_dropped():
    row = {"chosen": "\n\nHuman: A\n\nAssistant: x", "rejected": "\n\nHuman: B\n\nAssistant: y"}
    assert HUB_ADAPTERS["Anthropic/hh-rlhf"](row) is None


def test_anthropic_hh_without_assistant_turn():
    with pytest.raises(ValueError, match="Assistant"):
        HUB_ADAPTERS["Anthropic/hh-rlhf"]({"chosen": "\n\nHuman: A", "rejected": "\n\nHuman: A"})


def test_other_adapters():
    row = {"prompt": "\n\nHuman: Q\n\nAssistant:", "chosen": " C", "rejected": " R", "response": " C"}
    assert HUB_ADAPTERS["Dahoas/rm-static"](row) == Sample(row["prompt"], " C", " R")
    assert HUB_ADAPTERS["Dahoas/full-hh-rlhf"](row) == Sample(row["prompt"], " C", " R")
    assert HUB_ADAPTERS["Dahoas/synthetic-instruct-gptj-pairwise"](
        {"prompt": "Q", "chosen": "C", "rejected": "R"}
    ) == Sample("\n\nHuman: Q\n\nAssistant:", " C", " R")
    rlhf = {"prompt": "Human: Q ", "chosen": "Human: Q Assistant: C", "rejected": "Human: Q Assistant: R"}
    assert HUB_ADAPTERS["yitingxie/rlhf-reward-datasets"](rlhf) == Sample("Human: Q Assistant:", " C", " R")


# ---------------------------------------------------------------- hub path through datasets.load_dataset, offline
@pytest.fixture
def hub_mirror(tmp_path, monkeypatch):
    mirror = tmp_path / "mirror"
    mirror.mkdir()
    monkeypatch.setenv("DSCHAT_HUB_MIRROR", str(mirror))
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "hf_cache"))
    monkeypatch.chdir(tmp_path)
    return mirror


def test_a_hub_dataset_neither_cached_nor_downloadable_is_one_line_before_datasets_retries(
    tmp_path, monkeypatch
):
    # datasets retried for 31 s (no network) before its error; datasets' prepared copy is what it reads
    # offline, so that is what counts as cached
    from dschat.models import hub

    monkeypatch.delenv("DSCHAT_HUB_MIRROR", raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "datasets"))
    with pytest.raises(UserError, match=r"^--data_path Anthropic/hh-rlhf: not in the datasets cache, and "
                                        r"HF_HUB_OFFLINE is set$"):  # fmt: skip
        load_source("Anthropic/hh-rlhf", seed=0)
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", False)
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    with pytest.raises(UserError, match=r"and HF_DATASETS_OFFLINE is set$"):
        hub.check_hub_name("Anthropic/hh-rlhf", "--data_path", repo_type="dataset")
    (tmp_path / "datasets" / "Anthropic___hh-rlhf" / "default").mkdir(parents=True)
    hub.check_hub_name("Anthropic/hh-rlhf", "--data_path", repo_type="dataset")  # prepared: datasets reads it


def test_hub_rows_that_are_not_one_prompt_with_two_answers_are_counted_aloud(hub_mirror, caplog):
    """Anthropic/hh-rlhf rows whose two dialogues differ before the last answer were dropped in silence."""
    import logging

    same = {"chosen": "\n\nHuman: Q\n\nAssistant: good", "rejected": "\n\nHuman: Q\n\nAssistant: bad"}
    other = {"chosen": "\n\nHuman: Q\n\nAssistant: good", "rejected": "\n\nHuman: X\n\nAssistant: bad"}
    write_jsonl(hub_mirror / "Anthropic" / "hh-rlhf" / "train.jsonl", [same, other, same])
    write_jsonl(hub_mirror / "Anthropic" / "hh-rlhf" / "test.jsonl", [same])
    with caplog.at_level(logging.WARNING, logger="dschat"):
        src = load_source("Anthropic/hh-rlhf", seed=0)
    assert len(src.train) == 2 and len(src.eval) == 1
    assert "Anthropic/hh-rlhf train: 1 of 3 rows left out" in caplog.text and " test:" not in caplog.text


def test_hub_dataset_from_mirror(hub_mirror):
    rows = [
        {"prompt": "\n\nHuman: Q1\n\nAssistant:", "response": " C1", "chosen": " C1", "rejected": " R1"},
        {"prompt": "\n\nHuman: Q2\n\nAssistant:", "response": " C2", "chosen": " C2", "rejected": " R2"},
    ]
    write_jsonl(hub_mirror / "Dahoas" / "rm-static" / "train.jsonl", rows)
    write_jsonl(
        hub_mirror / "Dahoas" / "rm-static" / "test.jsonl",
        [{**rows[0], "prompt": "\n\nHuman: Q3\n\nAssistant:"}],
    )
    src = load_source("Dahoas/rm-static", seed=0)
    assert src.name == "Dahoas/rm-static"
    assert src.train == [
        Sample("\n\nHuman: Q1\n\nAssistant:", " C1", " R1", "Dahoas/rm-static"),
        Sample("\n\nHuman: Q2\n\nAssistant:", " C2", " R2", "Dahoas/rm-static"),
    ]
    assert src.eval == [Sample("\n\nHuman: Q3\n\nAssistant:", " C1", " R1", "Dahoas/rm-static")]


def test_hub_anthropic_from_mirror(hub_mirror):
    p = "\n\nHuman: Hi\n\nAssistant: Hello\n\nHuman: Bye\n\nAssistant:"
    rows = [
        {"chosen": p + " Goodbye", "rejected": p + " Go away"},
        {"chosen": "\n\nHuman: A\n\nAssistant: x", "rejected": "\n\nHuman: B\n\nAssistant: y"},  # dropped
    ]
    write_jsonl(hub_mirror / "Anthropic" / "hh-rlhf" / "train.jsonl", rows)
    write_jsonl(hub_mirror / "Anthropic" / "hh-rlhf" / "test.jsonl", rows[::-1])
    src = load_source("Anthropic/hh-rlhf", seed=0)
    assert src.train == [Sample(p, " Goodbye", " Go away", "Anthropic/hh-rlhf")]
    assert src.eval == src.train


def test_hub_dataset_without_test_split_gets_an_eval_share(hub_mirror):
    rows = [{"prompt": f"Q{i}", "chosen": f"C{i}", "rejected": f"R{i}"} for i in range(20)]
    write_jsonl(hub_mirror / "Dahoas" / "synthetic-instruct-gptj-pairwise" / "train.jsonl", rows)
    src = load_source("Dahoas/synthetic-instruct-gptj-pairwise", seed=0)
    assert len(src.train) + len(src.eval) == 20
    assert len(src.eval) == 1


def test_hub_row_that_does_not_fit_the_adapter(hub_mirror):
    write_jsonl(
        hub_mirror / "Anthropic" / "hh-rlhf" / "train.jsonl",
        [{"chosen": "\n\nHuman: A\n\nAssistant: x", "rejected": "\n\nHuman: A\n\nAssistant: y"},
         {"chosen": "\n\nHuman: no reply", "rejected": "\n\nHuman: no reply"}],
    )  # fmt: skip
    with pytest.raises(
        UserError, match=re.escape("Anthropic/hh-rlhf train row 1: does not fit the registered adapter")
    ):
        load_source("Anthropic/hh-rlhf", seed=0)


def test_hub_dataset_missing_from_mirror(hub_mirror):
    with pytest.raises(
        UserError,
        match=re.escape("--data_path Dahoas/full-hh-rlhf: could not load from the Hugging Face Hub"),
    ):
        load_source("Dahoas/full-hh-rlhf", seed=0)


# ---------------------------------------------------------------- fingerprint
def test_fingerprint_of_local_file_follows_content(tmp_path):
    p = write_jsonl(tmp_path / "d.jsonl", qa_rows(2))
    before = fingerprint(str(p))
    assert fingerprint(str(p)) == before
    write_jsonl(p, qa_rows(3))
    assert fingerprint(str(p)) != before


def test_fingerprint_of_directory_sees_new_files(tmp_path):
    write_jsonl(tmp_path / "train.jsonl", qa_rows(2))
    before = fingerprint(str(tmp_path))
    write_jsonl(tmp_path / "test.jsonl", qa_rows(1))
    assert fingerprint(str(tmp_path)) != before


def test_fingerprint_of_builtin_and_hub(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    assert fingerprint("builtin") != fingerprint("builtin:add")
    plain = fingerprint("Dahoas/rm-static")
    monkeypatch.setenv("DSCHAT_HUB_MIRROR", "/some/mirror")
    assert fingerprint("Dahoas/rm-static") != plain


def test_a_cache_or_notes_inside_a_data_directory_do_not_change_its_fingerprint(tmp_path):
    """The directory's fingerprint walked every file under it, its subdirectories too: a tokenized-data
    cache kept inside it (--data_output_path DATA/cache) changed the key with every file it wrote, so it
    never hit. The key is the files the source reads (its own .json/.jsonl files)."""
    write_jsonl(tmp_path / "train.jsonl", qa_rows(2))
    before = fingerprint(str(tmp_path))
    (tmp_path / "cache").mkdir()
    (tmp_path / "cache" / "abc.pt").write_bytes(b"tokens")
    (tmp_path / "README.md").write_text("notes")
    assert fingerprint(str(tmp_path)) == before


def test_a_file_edited_in_place_with_its_mtime_restored_changes_the_fingerprint(tmp_path):
    """Size and mtime alone missed a same-size edit whose mtime was put back (rsync -t, a restore): the
    inode's change time is in the key too."""
    import os

    p = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "q", "chosen": " a", "rejected": " b"}])
    st = p.stat()
    before = fingerprint(str(p))
    write_jsonl(p, [{"prompt": "q", "chosen": " b", "rejected": " a"}])
    os.utime(p, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert fingerprint(str(p)) != before


def test_text_cut_inside_a_character_is_one_line_naming_the_row(tmp_path):
    """An escaped lone surrogate ("\\ud83d", text cut inside an emoji) loaded, and tokenizing it was a
    traceback naming neither file nor line."""
    p = tmp_path / "d.jsonl"
    p.write_text('{"prompt": "ok", "response": " ok"}\n{"prompt": "q \\ud83d", "response": " a"}\n')
    with pytest.raises(UserError, match=re.escape(f"{p}:2: field 'prompt' is not valid Unicode text")):
        read_json_file(p)
    m = tmp_path / "m.jsonl"
    m.write_text(
        '{"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a \\udc00"}]}\n'
    )
    with pytest.raises(
        UserError, match=re.escape(f"{m}:1: field 'chosen/response' is not valid Unicode text")
    ):
        read_json_file(m)


def test_a_rejected_conversation_must_answer_the_same_dialogue(tmp_path):
    """A ``messages`` row's rejected side given as a whole conversation was read by its last turn alone:
    another question's answer, or a user turn, became the rejected answer to this one."""
    user = {"role": "user", "content": "Capital of France?"}
    row = {"messages": [user, {"role": "assistant", "content": "Paris"}],
           "rejected": [{"role": "user", "content": "Capital of Spain?"}, {"role": "assistant", "content": "Madrid"}]}  # fmt: skip
    p = write_jsonl(tmp_path / "d.jsonl", [row])
    with pytest.raises(UserError, match=re.escape(f"{p}:1: field 'rejected': its turns before the answer")):
        read_json_file(p)
    row["rejected"] = [user, {"role": "user", "content": "Madrid"}]
    write_jsonl(p, [row])
    with pytest.raises(
        UserError, match=re.escape(f"{p}:1: field 'rejected': must end with an assistant turn")
    ):
        read_json_file(p)
    row["rejected"] = [user, {"role": "assistant", "content": "Lyon"}]
    write_jsonl(p, [row])
    assert read_json_file(p)[0].rejected == " Lyon"
    row["rejected"] = [{"role": "assistant", "content": "Nice"}]  # the answer alone: as before
    write_jsonl(p, [row])
    assert read_json_file(p)[0].rejected == " Nice"


def test_the_held_out_carve_groups_prompts_that_render_alike(tmp_path):
    """Rows were grouped by the raw prompt string: "Q", "Q " and its dialogue form
    "\\n\\nHuman: Q\\n\\nAssistant:" render to the same tokens, yet could fall on both sides of the split."""
    rows = []
    for i in range(60):
        rows += [{"prompt": f"Question {i}", "response": " a"}, {"prompt": f"Question {i} ", "response": " b"},
                 {"prompt": f"\n\nHuman: Question  {i}\n\nAssistant:", "response": " c"}]  # fmt: skip
    src = load_source(str(write_jsonl(tmp_path / "d.jsonl", rows)), seed=3)
    key = lambda prompt: " ".join(prompt.replace("Human:", "").replace("Assistant:", "").split())  # noqa: E731
    assert src.eval and not {key(s.prompt) for s in src.train} & {key(s.prompt) for s in src.eval}


def test_a_hub_mirrors_changed_data_changes_the_fingerprint(monkeypatch, tmp_path):
    """With DSCHAT_HUB_MIRROR the key was the name and the mirror's path: new rows in the mirror served the
    old tokens. The mirror's files of that data set are in the key, as a local directory's are."""
    mirror = tmp_path / "mirror"
    write_jsonl(mirror / "Dahoas" / "rm-static" / "train.jsonl", qa_rows(2))
    monkeypatch.setenv("DSCHAT_HUB_MIRROR", str(mirror))
    before = fingerprint("Dahoas/rm-static")
    write_jsonl(mirror / "Dahoas" / "rm-static" / "train.jsonl", qa_rows(5))
    assert fingerprint("Dahoas/rm-static") != before
    after = fingerprint("Dahoas/rm-static")
    (mirror / "Dahoas" / "rm-static" / ".git").mkdir()
    (mirror / "Dahoas" / "rm-static" / ".git" / "FETCH_HEAD").write_text("abc")  # a clone's bookkeeping
    assert fingerprint("Dahoas/rm-static") == after


@pytest.mark.parametrize("raw", ["\u2028", "\u0085", "\x0c", "\u2029"])
def test_a_jsonl_row_holding_a_unicode_line_break_is_one_row(tmp_path, raw):
    """json.dumps(ensure_ascii=False) writes U+2028 and friends raw; str.splitlines would cut the row."""
    p = tmp_path / "d.jsonl"
    rows = [{"prompt": f"a{raw}b", "response": " c"}, {"prompt": "d", "response": " e"}]
    p.write_text("".join(json.dumps(r, ensure_ascii=False) + "\r\n" for r in rows), encoding="utf-8")
    assert [s.prompt for s in read_json_file(p)] == [f"a{raw}b", "d"]
    assert read_json_file(p)[1].source == f"{p}:2"


@pytest.mark.parametrize("suffix", [".jsonl", ".json"])
def test_a_data_file_with_a_byte_order_mark_is_read(tmp_path, suffix):
    p = tmp_path / f"d{suffix}"
    rows = [{"prompt": "P", "response": " R"}]
    text = json.dumps(rows) if suffix == ".json" else json.dumps(rows[0]) + "\n"
    p.write_text("\ufeff" + text, encoding="utf-8")
    assert [(s.prompt, s.chosen) for s in read_json_file(p)] == [("P", " R")]


def test_a_hub_row_with_a_null_field_is_one_line(hub_mirror):
    write_jsonl(hub_mirror / "Dahoas" / "synthetic-instruct-gptj-pairwise" / "train.jsonl",
                [{"prompt": "Q", "chosen": "C", "rejected": "R"}, {"prompt": "Q", "chosen": None, "rejected": "R"}])  # fmt: skip
    with pytest.raises(UserError, match=re.escape("Dahoas/synthetic-instruct-gptj-pairwise train row 1: ")):
        load_source("Dahoas/synthetic-instruct-gptj-pairwise", seed=0)
    write_jsonl(hub_mirror / "Dahoas" / "rm-static" / "train.jsonl",
                [{"prompt": "Q", "chosen": None, "rejected": "R", "response": "x"}])  # fmt: skip
    with pytest.raises(
        UserError,
        match=re.escape("Dahoas/rm-static train row 0: field 'chosen' must be a string, got NoneType"),
    ):
        load_source("Dahoas/rm-static", seed=0)


def test_a_files_held_out_rows_are_whole_prompts(tmp_path):
    """Rows were held out one by one, so a prompt with several pairs (or answers) sat on both sides and
    evaluation asked questions training had answered (for a file of 20 prompts x 4 pairs, most held-out
    prompts). Every row of a prompt now falls on one side; the share stays about EVAL_FRACTION."""
    rows = [
        {"prompt": f"Q{q}", "chosen": f"good {k}", "rejected": f"bad {k}"}
        for q in range(50)
        for k in range(4)
    ]
    src = load_source(str(write_jsonl(tmp_path / "pairs.jsonl", rows)), seed=3)
    held = {s.prompt for s in src.eval}
    assert held and not held & {s.prompt for s in src.train}
    assert len(src.eval) == 4 * len(held) and len(src.train) + len(src.eval) == 200
    assert 8 <= len(src.eval) <= 12  # 5% of 200 rows, in whole prompts of 4


@pytest.mark.parametrize("rejected", ["Paris?", {"role": "assistant", "content": "Paris?"},
                                      [{"role": "assistant", "content": "Paris?"}]])  # fmt: skip
def test_a_messages_row_keeps_its_rejected_answer(tmp_path, rejected):
    """A messages row's 'rejected' field was dropped: step 2 then said the row had no rejected field."""
    row = {"messages": [{"role": "user", "content": "Capital of France?"},
                        {"role": "assistant", "content": "Paris."}], "rejected": rejected}  # fmt: skip
    (s,) = read_json_file(write_jsonl(tmp_path / "m.jsonl", [row]))
    assert s.chosen == " Paris." and s.rejected == " Paris?"
