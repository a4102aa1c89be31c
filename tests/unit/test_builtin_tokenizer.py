"""dschat.models.builtin.build_tokenizer: one token per byte, exact round trip, fixed specials."""

from __future__ import annotations

import pytest

from dschat.models.builtin import build_tokenizer


def test_specials(tokenizer):
    assert (tokenizer.pad_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id) == (0, 1, 2)
    assert tokenizer.convert_ids_to_tokens([0, 1, 2]) == ["<pad>", "<s>", "</s>"]
    assert len(tokenizer) == 3 + 256


def test_known_ids(tokenizer):
    # the byte-level alphabet, sorted by code point, follows the 3 specials: '!' (33) is id 3, so a
    # printable ASCII character c is ord(c) - 30; a space (byte 32 -> U+0120) is 3 + 188 + 32 = 223
    assert tokenizer("ab")["input_ids"] == [1, 67, 68]
    assert tokenizer("a b", add_special_tokens=False)["input_ids"] == [67, 223, 68]
    assert tokenizer("!~", add_special_tokens=False)["input_ids"] == [3, 96]
    assert tokenizer("\n", add_special_tokens=False)["input_ids"] == [201]
    # 'é' is the UTF-8 bytes C3 A9
    assert tokenizer("é", add_special_tokens=False)["input_ids"] == [130, 105]


@pytest.mark.parametrize(
    "text",
    [
        "",
        "hello world",
        "hello , world . it ' s",
        "  leading and trailing  ",
        "tabs\tand\nnewlines\r\n",
        "¿Qué tal? Ünïcödé – “quotes”",
        "日本語のテキスト",
        "emoji 😀👍🏽 and zwj 👩‍💻",
        "\n\nHuman: What is 347 + 85?\n\nAssistant: 432",
        "<b>html</b> & <p>",
        "\x00\x01\x7f control",
    ],
)
def test_round_trip(tokenizer, text):
    ids = tokenizer(text)["input_ids"]
    assert ids[0] == 1
    assert len(ids) == 1 + len(text.encode("utf-8"))
    assert tokenizer.decode(ids, skip_special_tokens=True) == text


@pytest.mark.parametrize("text", ["hello , world .", "日本", "a\x00b", "x  y"])
def test_one_token_per_byte(tokenizer, text):
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert len(ids) == len(text.encode("utf-8"))
    assert all(3 <= i < 259 for i in ids)
    assert tokenizer.decode(ids) == text


def test_batch_encoding_prepends_bos_to_each(tokenizer):
    out = tokenizer(["a", "bc"])["input_ids"]
    assert out == [[1, 67], [1, 68, 69]]


def test_decode_keeps_specials_unless_asked(tokenizer):
    assert tokenizer.decode([1, 67, 2]) == "<s>a</s>"
    assert tokenizer.decode([1, 67, 2, 0], skip_special_tokens=True) == "a"


def test_deterministic():
    assert build_tokenizer().get_vocab() == build_tokenizer().get_vocab()


def test_rw_eval_splits_pairs_by_length_in_tokens(capsys):
    """rw_eval's 'chosen longer / shorter' split and 'longer wins' baseline count tokens, as step 2 and DPO
    do: " ééé" is 4 characters but 7 byte tokens, longer than " abcde" (6 and 6). By characters the
    chosen answer was the shorter one."""
    import argparse
    import json

    import torch

    from dschat.data.prompt_format import prompt_format
    from dschat.data.schema import Sample
    from inference.rw_eval import report_pairs

    fmt = prompt_format(build_tokenizer(), "off")
    pair = Sample(prompt="\n\nHuman: hi\n\nAssistant:", chosen=" ééé", rejected=" abcde")
    report_pairs(  # one call: the chosen answers' scores, then the rejected ones'
        [pair],
        lambda prompts, responses, partners: torch.tensor([1.0, 0.0]),
        argparse.Namespace(json=True, model="m"),
        fmt,
    )
    got = json.loads(capsys.readouterr().out)
    assert got["longer_response_baseline"] == 1.0 and got["accuracy_chosen_longer"] == 1.0


def test_rw_eval_reads_a_typed_backslash_n_as_a_newline():
    """Its own docstring's example, "\\n\\nHuman: What is 2 + 2?\\n\\nAssistant:" in a shell, arrived as
    backslash-n characters: not a dialogue, so it was wrapped as one Human turn holding the literal text."""
    from inference.rw_eval import parse_args

    args = parse_args(
        ["--model", "m", "--prompt", "\\n\\nHuman: What is 2 + 2?\\n\\nAssistant:", "--response", " 4\\nok"]
    )
    assert args.prompt == "\n\nHuman: What is 2 + 2?\n\nAssistant:" and args.response == [" 4\nok"]
