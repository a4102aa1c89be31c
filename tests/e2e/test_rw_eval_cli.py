"""``inference/rw_eval.py`` on a reward model with known scores (tests/tiny_chat_models.py: +8 for a text
ending in 9, -8 for one ending in 8)."""

from __future__ import annotations

import json

import pytest

from dschat.utils.errors import UserError
from tests.conftest import ROOT
from tests.e2e.conftest import load_entry_main


@pytest.fixture(scope="module")
def rw_main():
    return load_entry_main(str(ROOT / "inference" / "rw_eval.py"), "dschat_rw_eval_cli")


def write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_pairs_that_step_2_leaves_out_are_left_out_of_the_accuracy(tiny, rw_main, tmp_path, capsys):
    """An identical pair has no right order (its tie counted as a wrong ranking): rw_eval.py measures
    the pairs step 2 would, and says how many it left out."""
    rows = [{"prompt": "Q", "chosen": " 9", "rejected": " 8"}, {"prompt": "Q", "chosen": " 9", "rejected": " 9"},
            {"prompt": "Q", "chosen": " 8", "rejected": " 9"}]  # fmt: skip
    assert rw_main(["--model", str(tiny.reward), "--file", write(tmp_path / "p.jsonl", rows), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["pairs"] == 2 and out["accuracy"] == 0.5 and out["dropped_identical"] == 1


def test_a_file_mixing_pairs_and_single_answers_is_one_line(tiny, rw_main, tmp_path):
    rows = [{"prompt": "Q", "chosen": " 9", "rejected": " 8"}, {"prompt": "Q", "response": " 9"}]
    path = write(tmp_path / "m.jsonl", rows)
    with pytest.raises(UserError, match=rf"{path}:2: no 'rejected' answer, where 1 of the file's 2 rows"):
        rw_main(["--model", str(tiny.reward), "--file", path])


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--file", "{tmp}/missing.jsonl"], r"--file .*missing.jsonl: data file not found"),
        (["--file", "{mixed}"], r"mixed.jsonl:2: no 'rejected' answer"),
        (
            ["--prompt", "Q", "--response", " 9", "--dtype", "fp16", "--device", "cpu"],
            "--dtype fp16: half precision",
        ),
    ],
    ids=["missing-file", "mixed-file", "fp16-on-cpu"],
)
def test_bad_input_is_refused_before_the_reward_model_loads(
    tiny, rw_main, tmp_path, monkeypatch, extra, message
):
    """The file was read, and the dtype checked, only after the weights had loaded."""
    import sys

    def no_weights(*a, **k):
        raise AssertionError("the reward model loaded before its inputs were checked")

    monkeypatch.setattr(sys.modules[rw_main.__module__], "load_reward_model", no_weights)
    mixed = write(tmp_path / "mixed.jsonl", [{"prompt": "Q", "chosen": " 9", "rejected": " 8"},
                                             {"prompt": "Q", "response": " 9"}])  # fmt: skip
    extra = [a.format(tmp=tmp_path, mixed=mixed) for a in extra]
    with pytest.raises(UserError, match=message):
        rw_main(["--model", str(tiny.reward), *extra])


def test_an_empty_response_is_refused(tiny, rw_main, capsys):
    # it was scored (1.24 on a test model) though step 2 never trains on an empty answer
    with pytest.raises(SystemExit):
        rw_main(["--model", str(tiny.reward), "--prompt", "Q", "--response", " 9", "--response", "  "])
    assert "--response: an empty answer" in capsys.readouterr().err


@pytest.mark.parametrize("flag", ["--prompt", "--response"])
def test_a_prompt_or_response_that_is_not_utf8_is_one_line(tmp_path, flag, capsys):
    """Undecodable bytes in an argument (surrogate escapes) were a traceback from the tokenizer."""
    from inference.rw_eval import parse_args

    argv = {"--prompt": "hi", "--response": " yes"}
    argv[flag] += " \udcff"
    with pytest.raises(SystemExit) as exc:
        parse_args(["--model", str(tmp_path), "--prompt", argv["--prompt"], "--response", argv["--response"]])
    assert exc.value.code == 2 and f"{flag}: not valid UTF-8 text" in capsys.readouterr().err


def test_a_response_beside_a_file_is_refused(tmp_path, capsys):
    """--response belongs with --prompt: beside --file it was read by nothing."""
    from inference.rw_eval import parse_args

    with pytest.raises(SystemExit) as exc:
        parse_args(["--model", str(tmp_path), "--file", str(tmp_path / "pairs.jsonl"), "--response", " yes"])
    assert exc.value.code == 2 and "--response belongs with --prompt" in capsys.readouterr().err
