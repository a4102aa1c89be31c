"""Chat logic: prompt rendering, history fitting, reply cutting (whole and streamed), the conversation."""

from __future__ import annotations

import itertools

import pytest

from dschat import tasks
from dschat.chat import Conversation
from dschat.data.prompt_format import (
    CHAT_TEMPLATE,
    HUMAN_ASSISTANT,
    TURN_STOPS,
    as_dialogue,
    cut_reply,
    fit_history,
    is_dialogue,
    keep_last_tokens,
    render_human_assistant,
)
from dschat.data.prompt_format import prompt_format as chat_format
from dschat.generation.streaming import StopFilter
from dschat.models.builtin import build_tokenizer
from dschat.utils.errors import UserError


def user(text: str) -> dict[str, str]:
    return {"role": "user", "content": text}


def bot(text: str) -> dict[str, str]:
    return {"role": "assistant", "content": text}


def test_one_turn_is_the_training_prompt():
    assert render_human_assistant([user("What is 3 + 4?")]) == tasks.make_prompt("What is 3 + 4?")


def test_multi_turn_rendering():
    text = render_human_assistant([user("hi"), bot("hello"), user("2 + 2?")])
    assert text == "\n\nHuman: hi\n\nAssistant: hello\n\nHuman: 2 + 2?\n\nAssistant:"


def test_format_choice():
    tok = build_tokenizer()  # no chat template
    assert chat_format(tok).name == HUMAN_ASSISTANT
    assert chat_format(tok).add_special_tokens
    with pytest.raises(UserError, match=r"--chat_template on: the tokenizer of .* has no chat template"):
        chat_format(tok, "on")
    tok.chat_template = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}<assistant>"
    fmt = chat_format(tok)
    assert fmt.name == CHAT_TEMPLATE and not fmt.add_special_tokens and fmt.stop_strings == ()
    assert fmt.render([user("a"), bot("b"), user("c")]) == "<user>a<assistant>b<user>c<assistant>"
    assert chat_format(tok, "off").render([user("a")]) == tasks.make_prompt("a")
    assert chat_format(tok, "on").name == CHAT_TEMPLATE


def test_dialogue_prompts_are_used_verbatim_or_rendered_with_the_template():
    tok = build_tokenizer()
    fmt = chat_format(tok)
    rendered = "\n\nHuman: hi\n\nAssistant: yo\n\nHuman: and?\n\nAssistant:"
    assert is_dialogue(rendered) and fmt.prompt_text(rendered) == rendered
    assert not is_dialogue("Say Assistant:")  # no Human turn: a question like any other
    assert as_dialogue("Sort: cat dog owl") == tasks.make_prompt("Sort: cat dog owl")
    assert as_dialogue(rendered) == rendered
    # A prompt that is not a dialogue is one user turn, as prompt_eval.py and chat.py ask it: it trained
    # byte for byte until 2026-11-29, so a model tuned on bare prompts was asked another text at inference.
    assert fmt.prompt_text("raw text") == tasks.make_prompt("raw text")
    assert fmt.encode_prompts(["Sort: cat dog owl"]) == fmt.encode_prompts([as_dialogue("Sort: cat dog owl")])
    tok.chat_template = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}<assistant>"
    templated = chat_format(tok)
    assert templated.prompt_text(rendered) == "<user>hi<assistant>yo<user>and?<assistant>"
    assert templated.prompt_text("Sort: cat dog owl") == "<user>Sort: cat dog owl<assistant>"


def chars(msgs) -> int:
    return sum(len(m["content"]) for m in msgs)


def test_fit_history_keeps_what_fits():
    msgs = [user("aaaa"), bot("bbbb"), user("cc"), bot("dd"), user("e")]  # 4+4+2+2+1 = 13 chars
    assert fit_history(msgs, chars, 13) == (msgs, 0)
    # 12: the first exchange (8 chars) goes, not just the first message (a history starting with a reply)
    assert fit_history(msgs, chars, 12) == (msgs[2:], 2)
    assert fit_history(msgs, chars, 5) == (msgs[2:], 2)
    assert fit_history(msgs, chars, 4) == (msgs[4:], 4)
    # the new message is always kept, even alone over the budget
    assert fit_history(msgs, chars, 0) == (msgs[4:], 4)


def test_keep_last_tokens():
    assert keep_last_tokens([1, 5, 6, 7, 8], 10, bos_id=1) == [1, 5, 6, 7, 8]
    assert keep_last_tokens([1, 5, 6, 7, 8], 3, bos_id=1) == [1, 7, 8]
    assert keep_last_tokens([5, 6, 7, 8], 3, bos_id=1) == [6, 7, 8]
    assert keep_last_tokens([1, 5, 6], 1, bos_id=1) == [6]


@pytest.mark.parametrize(
    ("text", "reply"),
    [
        (" 42\n\nHuman: and now?\n\nAssistant: 7", " 42"),
        (" 42\nHuman: more", " 42"),
        (" sure.\n\nAssistant: again", " sure."),
        (" no turn here  \n", " no turn here"),
        ("\n\nHuman: at once", ""),
        (" a Human: inside a line is fine", " a Human: inside a line is fine"),
    ],
)
def test_cut_reply(text, reply):
    assert cut_reply(text) == reply


TEXTS = [
    " 0123456789\nHuman: 0123",
    " 42\n\nHuman: next",
    " ab\n\nHugs are not a turn\n\nAssistant: x",
    "  plain reply with\n\nnewlines\n",
    " ends with a partial\n\nHum",
]


@pytest.mark.parametrize("text", TEXTS)
def test_streamed_cut_equals_whole_cut_for_every_split(text):
    """However the text arrives in pieces, what is shown is the whole-text cut (without leading space)."""
    expected = cut_reply(text).lstrip()
    for i, j in itertools.combinations(range(len(text) + 1), 2):
        f = StopFilter(TURN_STOPS)
        shown = f.push(text[:i]) + f.push(text[i:j]) + f.push(text[j:]) + f.flush()
        assert shown.rstrip() == expected, (i, j)


def test_stop_filter_holds_back_only_what_could_be_a_stop():
    f = StopFilter(TURN_STOPS)
    assert f.push(" 12") == "12"
    assert f.push("\n\nHu") == ""  # could be "\n\nHuman:"
    assert f.push("gs") == "\n\nHugs"  # it was not
    assert f.push("\nHuman: x") == "" and f.stopped
    assert f.push("more") == "" and f.flush() == ""


def test_conversation_drops_oldest_turns_to_fit():
    tok = build_tokenizer()  # one token per byte, plus BOS
    fmt = chat_format(tok)
    # "\n\nHuman: hi\n\nAssistant:" = 1 + 9 + 2 + 12 = 24 tokens; with the reply " 579" and a second
    # "hi" turn: 24 + 4 + 9 + 2 + 12 = 51 tokens.
    conv = Conversation(tok, fmt, budget=30)
    ids, dropped, cut = conv.prompt_ids("hi")
    assert (len(ids), dropped, cut) == (24, 0, False)
    assert tok.decode(ids, skip_special_tokens=True) == tasks.make_prompt("hi")
    conv.add_exchange("hi", "579")
    ids, dropped, cut = conv.prompt_ids("hi")
    assert (len(ids), dropped, cut) == (24, 2, False)
    assert conv.messages == []  # the dropped exchange is forgotten
    conv.add_exchange("hi", "579")
    big = Conversation(tok, fmt, budget=51)
    big.messages = list(conv.messages)
    ids, dropped, _ = big.prompt_ids("hi")
    assert (len(ids), dropped) == (51, 0)
    assert tok.decode(ids, skip_special_tokens=True) == render_human_assistant(
        [user("hi"), bot("579"), user("hi")]
    )


def test_conversation_cuts_the_start_of_a_message_too_long_alone():
    tok = build_tokenizer()
    conv = Conversation(tok, chat_format(tok), budget=20)
    ids, dropped, cut = conv.prompt_ids("x" * 100)
    assert cut and dropped == 0 and len(ids) == 20
    assert ids[0] == tok.bos_token_id
    assert tok.decode(ids[1:]).endswith("xx\n\nAssistant:")
    conv.reset()
    assert conv.messages == []
