"""The prompt format: dialogue parsing, template rendering, the end-of-turn token, and the same token ids
in training (steps 1-3) and inference (chat, prompt comparison, reward scoring)."""

from __future__ import annotations

import json

import pytest

from dschat import tasks
from dschat.chat import Conversation
from dschat.config import DataArgs
from dschat.data.collate import IGNORE_INDEX, pad_right
from dschat.data.pipeline import prepare_prompt_data, tokenize_pairs, tokenize_sft
from dschat.data.prompt_format import (
    CHAT_TEMPLATE,
    as_dialogue,
    parse_dialogue,
    prompt_format,
    render_human_assistant,
)
from dschat.data.schema import Sample
from dschat.models.builtin import build_tokenizer
from dschat.utils.errors import UserError

# ChatML as SmolLM2 writes it (a default system message when the dialogue has none)
CHATML = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are helpful.<|im_end|>\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


@pytest.fixture
def chatml():
    """The byte-level tokenizer with <|im_start|>/<|im_end|> specials and the ChatML template."""
    tok = build_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tok.chat_template = CHATML
    return tok


def test_parse_dialogue_inverts_rendering():
    msgs = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello"},
        {"role": "user", "content": "2 + 2?"},
    ]
    assert parse_dialogue(render_human_assistant(msgs)) == msgs
    assert parse_dialogue("Human: x\n\nAssistant:") == [{"role": "user", "content": "x"}]
    # "Human:" inside a turn is text, not a new turn (turns start after a blank line)
    assert parse_dialogue("\n\nHuman: say Human: hi\n\nAssistant:") == [
        {"role": "user", "content": "say Human: hi"}
    ]
    with pytest.raises(ValueError, match="no 'Human:' turn"):
        parse_dialogue("\n\nAssistant: only me")


def test_text_before_the_first_turn_is_kept_in_the_first_question(chatml):
    """A dialogue with a preamble ("Passage: ...\\n\\nHuman: When is the meeting?") rendered into a chat
    template lost the passage silently (the Human/Assistant form keeps it): it leads the first user turn."""
    text = "Passage: The meeting is on Tuesday.\n\nHuman: When is the meeting?\n\nAssistant:"
    assert parse_dialogue(text) == [
        {"role": "user", "content": "Passage: The meeting is on Tuesday.\n\nWhen is the meeting?"}
    ]
    assert "Tuesday" in prompt_format(chatml, "on").render(parse_dialogue(text))
    assert parse_dialogue("  \n\nHuman: x\n\nAssistant:") == [{"role": "user", "content": "x"}]
    # a task still recognises its question under an instruction (the question is the turn's own text)
    from dschat import tasks

    prompt = "Answer with the words only.\n\nHuman: Sort: owl cat dog\n\nAssistant:"
    assert tasks.task_of(prompt) == "sort" and tasks.verify(prompt, " cat dog owl")


def test_the_end_of_turn_token_ends_responses_and_generation(chatml):
    fmt = prompt_format(chatml)
    im_end = chatml.convert_tokens_to_ids("<|im_end|>")
    assert fmt.name == CHAT_TEMPLATE and fmt.end_id == im_end
    assert fmt.stop_ids == (im_end, chatml.eos_token_id)
    # the inference tools stop at the next turn's opening token too: a model that skips <|im_end|> stops
    # before inventing a user turn (training keeps such an answer unended: it did not end properly)
    im_start = chatml.convert_tokens_to_ids("<|im_start|>")
    assert fmt.turn_start_id == im_start and fmt.reply_stop_ids == (im_end, chatml.eos_token_id, im_start)
    prompt = tasks.make_prompt("Sort: dog cat")
    assert fmt.prompt_text(prompt) == (
        "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\nSort: dog cat<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    assert fmt.response_text(" cat dog") == "cat dog"  # no leading space after "assistant\n"
    assert prompt_format(chatml, "off").prompt_text(prompt) == prompt


def test_on_without_a_template_is_one_line(tokenizer):
    with pytest.raises(UserError, match=r"^--chat_template on: the tokenizer of .* has no chat template$"):
        prompt_format(tokenizer, "on")


@pytest.mark.parametrize("choice", ["auto", "off"])
def test_training_and_inference_see_the_same_prompt_ids(chatml, tmp_path, choice):
    """A built-in prompt is tokenized by steps 1, 2 and 3 exactly as chat.py and prompt_eval.py tokenize
    the question a person types."""
    args = DataArgs(data_path=["builtin:sort"], data_split="1,1,1", chat_template=choice,
                    data_output_path=str(tmp_path))  # fmt: skip
    fmt = prompt_format(chatml, choice)
    row = prepare_prompt_data(args, chatml, max_prompt_len=256).train[0]  # step 3: ids + dialogue
    question = tasks.last_question(row["prompt"])
    answer = " " + tasks.reference_answer(row["prompt"])

    chat_ids, _, _ = Conversation(chatml, fmt, budget=10_000).prompt_ids(question)  # chat.py
    assert chat_ids == row["input_ids"]
    assert fmt.encode_prompts([as_dialogue(question)])[0] == row["input_ids"]  # prompt_eval.py
    if choice == "auto":
        assert chatml.decode(row["input_ids"]).endswith(
            f"user\n{question}<|im_end|>\n<|im_start|>assistant\n"
        )

    (sft,), _ = tokenize_sft([Sample(row["prompt"], answer)], fmt, 256, False)  # step 1
    n = len(row["input_ids"])
    assert sft["input_ids"][:n] == row["input_ids"]
    assert sft["labels"][:n] == [IGNORE_INDEX] * n
    assert sft["input_ids"][n:] == [*fmt.encode_responses([answer])[0], fmt.end_id]  # ends with end of turn

    (pair,), _ = tokenize_pairs([Sample(row["prompt"], answer, " wrong")], fmt, 256)  # step 2
    assert pair["chosen"][:n] == row["input_ids"] == pair["rejected"][:n]
    assert pair["chosen"][n:] == fmt.encode_responses([answer])[0]  # scored on the content: no end token
    # and the reward scoring of the inference tools and step 3's evaluation tokenizes the same way
    assert pad_right([pair["chosen"]], 0)["input_ids"][0].tolist() == (
        fmt.encode_prompts([as_dialogue(question)])[0] + fmt.encode_responses([answer])[0]
    )


# Gemma's rules as its template enforces them: no system role, user and assistant strictly alternating
STRICT = (
    "{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}{% endif %}"
    "{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def test_a_strict_template_gets_alternating_turns_and_no_system_role(chatml):
    # 6 of the 4500 HH-RLHF prompts hold two Human turns in a row; a strict template (Gemma, Mistral,
    # Llama 2) raises on them, and on a system turn. The turns are merged and the system text goes into
    # the first user turn, the way those models' own docs say to; a tolerant template sees them as given.
    chatml.chat_template = STRICT
    fmt = prompt_format(chatml)
    twice = "\n\nHuman: hi\n\nHuman: are you there?\n\nAssistant: yes\n\nHuman: 2 + 2?\n\nAssistant:"
    assert fmt.prompt_text(twice) == (
        "<|im_start|>user\nhi\n\nare you there?<|im_end|>\n<|im_start|>assistant\nyes<|im_end|>\n"
        "<|im_start|>user\n2 + 2?<|im_end|>\n<|im_start|>assistant\n"
    )
    system = "System: be brief\n\nHuman: 2 + 2?\n\nAssistant:"
    assert (
        fmt.prompt_text(system) == "<|im_start|>user\nbe brief\n\n2 + 2?<|im_end|>\n<|im_start|>assistant\n"
    )
    chatml.chat_template = CHATML  # tolerant: the turns as the data holds them
    assert "<|im_start|>user\nhi<|im_end|>\n<|im_start|>user\nare you there?" in prompt_format(
        chatml
    ).prompt_text(twice)


def test_a_template_that_rejects_a_dialogue_anyway_is_one_clear_error(chatml):
    chatml.chat_template = "{{ raise_exception('no thanks') }}"
    with pytest.raises(UserError, match=r"chat template.*no thanks"):
        prompt_format(chatml).prompt_text("\n\nHuman: hi\n\nAssistant:")


# Llama 2 chat writes ' ' + answer + ' ' + eos after each assistant turn
LLAMA2_STYLE = (
    "{% for m in messages %}{% if m['role'] == 'user' %}{{ '[INST] ' + m['content'] + ' [/INST]' }}"
    "{% else %}{{ ' ' + m['content'] + ' ' + eos_token }}{% endif %}{% endfor %}"
)


def test_the_end_of_turn_is_the_special_token_after_the_answer_not_a_space_before_it():
    """The first token after an assistant message's content was taken as its end: for Llama 2's template a
    space, so training ended answers with a space (no EOS) and generation stopped at the first space."""
    tok = build_tokenizer()
    tok.chat_template = LLAMA2_STYLE
    fmt = prompt_format(tok, "on")
    assert fmt.end_id == tok.eos_token_id and fmt.stop_ids == (tok.eos_token_id,)
    (ex,), _ = tokenize_sft([Sample("\n\nHuman: hi\n\nAssistant:", " cat dog")], fmt, 512, False)
    assert ex["input_ids"][-1] == tok.eos_token_id


@pytest.mark.parametrize("prompt", ["\nHuman: hi\nAssistant:", " Human: hi\n\nAssistant:",
                                    "Question for the Human: resources team. Assistant:"])  # fmt: skip
def test_text_that_only_looks_like_a_dialogue_is_one_user_message(chatml, prompt):
    """Such text used to be taken for a dialogue and then fail to parse (a bare ValueError in data
    preparation, on one rank): a dialogue's turns start the text or follow a blank line."""
    fmt = prompt_format(chatml, "on")
    assert fmt.prompt_text(prompt) == fmt.render([{"role": "user", "content": prompt.strip()}])
    tokenize_sft([Sample(prompt, " ok")], fmt, 512, False)


@pytest.mark.parametrize("template", ["on", "off"])
def test_a_plain_prompts_surrounding_whitespace_is_not_part_of_it(chatml, template):
    """A data set's plain prompt kept its surrounding whitespace in training ("...X?\n<|im_end|>") while
    chat.py strips what a person types and a dialogue's turns are stripped: the model met other token ids
    at inference than in training. The question is its text, in training as in chat.py."""
    from dschat.chat import Conversation

    fmt = prompt_format(chatml, template)
    typed = Conversation(chatml, fmt, budget=512).encode([{"role": "user", "content": "2 + 2?"}])
    for prompt in ("2 + 2?", "  2 + 2?\n", "2 + 2? "):
        assert fmt.encode_prompts([prompt])[0] == typed, repr(prompt)


def test_the_inference_tools_prompt_a_model_in_the_format_its_run_trained_it_in(chatml, tmp_path):
    """A model trained with --chat_template off (the README's advice where a template refuses a dialogue)
    was asked in its tokenizer's template by chat.py, prompt_eval.py and rw_eval.py, whose auto default
    did not read the run's choice. auto now reads it from the run's dschat_config.json (the model's
    directory, or step 3's step directory above actor/); on/off as given win; other models: the template."""
    import json

    from dschat.data.prompt_format import CHAT_TEMPLATE, HUMAN_ASSISTANT, model_format

    step3 = tmp_path / "step3"
    (step3 / "actor").mkdir(parents=True)
    (step3 / "dschat_config.json").write_text(json.dumps({"chat_template": "off"}))
    assert model_format(chatml, str(step3 / "actor")).name == HUMAN_ASSISTANT
    assert model_format(chatml, str(step3 / "actor"), "on").name == CHAT_TEMPLATE
    assert model_format(chatml, str(tmp_path / "elsewhere")).name == CHAT_TEMPLATE
    assert model_format(chatml, "HuggingFaceTB/SmolLM2-135M-Instruct").name == CHAT_TEMPLATE


def test_one_answer_is_one_token_sequence_however_a_row_spells_its_space(tmp_path):
    """In the Human/Assistant form a messages row's answer became " 4" and a prompt/response row's stayed
    "4": the same answer trained as two token sequences (and rw_eval.py --response 4 scored the one the
    model never saw). One space and the answer, as HH-RLHF and chat.py have it."""
    from dschat.data.sources import load_source

    fmt = prompt_format(build_tokenizer(), "off")
    rows = [{"prompt": "What is 2+2?", "response": "4"}, {"prompt": "What is 2+2?", "response": " 4"},
            {"messages": [{"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "4"}]}]  # fmt: skip
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    samples = load_source(str(path), seed=0).train + load_source(str(path), seed=0).eval
    ids = {tuple(fmt.encode_prompts([s.prompt])[0] + fmt.encode_responses([s.chosen])[0]) for s in samples}
    assert len(ids) == 1
    assert fmt.response_text("\n4") == " 4" and fmt.response_text("") == ""


def test_a_dialogue_prompt_ending_in_a_space_is_the_prompt_inference_sends():
    """A dialogue split as '...Assistant: ' + '4' trained 'Assistant:  4' (the prompt's space and the
    answer's), a prompt ending that chat.py and prompt_eval.py never send: the dialogue ends at
    'Assistant:' whatever whitespace the row keeps after it."""
    fmt = prompt_format(build_tokenizer(), "off")
    plain = "\n\nHuman: hi\n\nAssistant:"
    for spelled in (plain + " ", plain + "\n", plain):
        assert fmt.prompt_text(spelled) == plain
        assert fmt.encode_prompts([spelled]) == fmt.encode_prompts([plain])


@pytest.mark.parametrize("template", ["on", "off"])
def test_a_prompt_over_the_budget_loses_old_turns_and_then_the_start_of_its_question(chatml, template):
    """A pair's prompt over the budget kept its first token (SmolLM2's BOS is <|im_start|>, the system
    turn's opener) and then its last tokens: '<|im_start|> ...words...<|im_end|>', a turn without a role,
    unlike anything inference renders. Now, as chat.py fits a conversation: the oldest turns go whole,
    then the start of the last question's text; the format's headers stay."""
    fmt = prompt_format(chatml, template)
    words = " ".join(f"w{i}" for i in range(200))
    dialogue = render_human_assistant([{"role": "user", "content": "old question"},
                                       {"role": "assistant", "content": "old answer"},
                                       {"role": "user", "content": words}])  # fmt: skip
    full = fmt.encode_prompts([dialogue])[0]
    last_only = fmt.encode_prompts([words])[0]
    # budget between the last turn alone and the whole dialogue: the old exchange is dropped whole
    ids, dropped, cut, _ = fmt.fit_prompt(dialogue, len(last_only) + 3)
    assert len(full) > len(last_only) + 3 and (ids, dropped, cut) == (last_only, 2, False)
    # a smaller budget: the question's start is cut, inside the headers
    ids, dropped, cut, _ = fmt.fit_prompt(dialogue, 60)
    text = chatml.decode(ids)
    assert cut and len(ids) <= 60 and text.endswith(fmt.tokenizer.decode(full[-12:]))
    head = fmt.prompt_text("x").split("x")[0]  # what the format writes before a question
    assert text.startswith(head) or text.startswith(chatml.decode(chatml(head)["input_ids"])), text[:80]
    assert "w199" in text and "w0 " not in text and "old question" not in text
    # the pair pipeline fits its prompts so
    pairs, stats = tokenize_pairs([Sample(dialogue, " yes", " no")], fmt, 64)
    assert stats["prompt_truncated"] == 1
    assert chatml.decode(pairs[0]["chosen"][: pairs[0]["prompt_len"]]).startswith(text[:20])


def test_a_cut_question_does_not_start_inside_a_character():
    """With a byte-level tokenizer the cut could fall inside a multi-byte character, and the decoded
    U+FFFD ('\ufffd') went into the training or scoring prompt."""
    fmt = prompt_format(build_tokenizer(), "off")
    question = "日本語のテキストです。" * 4 + "What is it?"
    for budget in range(60, 90):
        fitted = fmt.fit_prompt(question, budget)
        text = fmt.tokenizer.decode(fitted.ids)
        assert "\ufffd" not in text and len(fitted.ids) <= budget, (budget, text)
        assert text.rstrip().endswith("What is it?\n\nAssistant:")
