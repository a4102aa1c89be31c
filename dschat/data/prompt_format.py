"""How a dialogue becomes model input, identically in training and inference: the one home of the
prompt format.

Inside dschat a prompt is carried as *dialogue text* in the Human/Assistant form of the HH-RLHF data
(the built-in tasks use it too)::

    "\\n\\nHuman: hi\\n\\nAssistant: hello\\n\\nHuman: 2 + 2?\\n\\nAssistant:"    ->   response " 4"

A :class:`PromptFormat` turns that text into what the model reads. ``human-assistant`` uses it as it
is (the tokenizer adds its BOS; a reply ends with EOS, or where the model starts a turn of its own).
``chat-template`` parses the dialogue into messages and renders them with the tokenizer's chat
template; a response is the message content (no leading space) followed by the template's end-of-turn
token (``<|im_end|>`` for ChatML), which is also where generation stops. Every step's data, the
steps' evaluations, the reward model's inputs and the inference tools go through the same object, so
the token ids a model is trained on are the ones it is later prompted with.

The choice is ``--chat_template auto|on|off`` (:class:`dschat.config.FormatArgs`): ``auto`` uses the
template when the tokenizer has one.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from dschat.utils.errors import UserError

Message = dict[str, str]

HUMAN = "\n\nHuman: "
ASSISTANT = "\n\nAssistant:"
SYSTEM = "\n\nSystem: "
HUMAN_ASSISTANT = "human-assistant"
CHAT_TEMPLATE = "chat-template"
CHOICES = ("auto", "on", "off")

# Where a Human/Assistant model starts writing the next turn itself. The single-newline forms catch a
# model that is sloppy about the blank line; the double-newline forms come first so that a cut at
# "\n\nHuman:" does not leave a stray newline in the reply.
TURN_STOPS = ("\n\nHuman:", "\n\nAssistant:", "\nHuman:", "\nAssistant:")


def cut_reply(text: str, stops: tuple[str, ...] = TURN_STOPS) -> str:
    """``text`` up to the first stop string (the start of an invented turn), trailing space removed."""
    cut = min((i for i in (text.find(s) for s in stops) if i >= 0), default=len(text))
    return text[:cut].rstrip()


def make_prompt(question: str) -> str:
    """The one-turn dialogue text of ``question``."""
    return f"{HUMAN}{question}{ASSISTANT}"


def is_dialogue(text: str) -> bool:
    """True for a prompt already in Human/Assistant form: it ends with the ``Assistant:`` cue and has a
    ``Human:`` turn where :func:`parse_dialogue` finds turns (at the start or after a blank line); text
    that merely mentions them is a question."""
    return text.rstrip().endswith("Assistant:") and any(m[1] == "Human" for m in _TURN.finditer(text))


def render_human_assistant(messages: list[Message]) -> str:
    """``"\\n\\nHuman: u1\\n\\nAssistant: a1 ... \\n\\nHuman: uN\\n\\nAssistant:"`` (the training form).

    Assistant turns get the single space that training responses start with (``" 432"``); a system
    message becomes a leading ``"\\n\\nSystem: ..."`` turn.
    """
    parts = []
    for m in messages:
        if m["role"] == "user":
            parts.append(HUMAN + m["content"])
        elif m["role"] == "assistant":
            parts.append(ASSISTANT + " " + m["content"])
        elif m["role"] == "system":
            parts.append(SYSTEM + m["content"])
        else:
            raise ValueError(f"unknown role {m['role']!r}")
    return "".join(parts) + ASSISTANT


def parse_dialogue(text: str, keep_preamble: bool = True) -> list[Message]:
    """Dialogue text -> messages, the inverse of :func:`render_human_assistant`.

    Turns start at ``Human:``, ``Assistant:`` or ``System:`` at the start of the text or after a blank
    line (as in the HH-RLHF data); text before the first turn (a passage the question is about) leads the
    first user turn, as it leads the Human/Assistant text (``keep_preamble=False``: the turns alone, the
    question a task recognises); the final ``Assistant:`` cue (the turn to be written) is not a message.
    """
    body = text.rstrip()
    if body.endswith("Assistant:"):
        body = body[: -len("Assistant:")]
    pieces = _TURN.split(body)
    roles = {"Human": "user", "Assistant": "assistant", "System": "system"}
    messages = [
        {"role": roles[pieces[i]], "content": pieces[i + 1].strip()} for i in range(1, len(pieces) - 1, 2)
    ]
    if not any(m["role"] == "user" for m in messages):
        raise ValueError("no 'Human:' turn")
    if keep_preamble and (preamble := pieces[0].strip()):  # dropped until 2026-11-29: lost in chat templates
        first = next(m for m in messages if m["role"] == "user")
        first["content"] = f"{preamble}\n\n{first['content']}" if first["content"] else preamble
    return messages


_ROLES = "Human|Assistant|System"
_TURN = re.compile(rf"(?:^|\n\n)({_ROLES}):")
# where a turn starts inside dialogue text: text that holds it cannot be one turn's content
TURN_START = re.compile(rf"\n\n(?:{_ROLES}):")


def as_dialogue(text: str) -> str:
    """A question (a data set's plain prompt, or typed by a person) as dialogue text; a dialogue stays as
    it is. The question's surrounding whitespace is not part of it (chat.py strips a typed line)."""
    return text if is_dialogue(text) else make_prompt(text.strip())


def dialogue_of(messages: list[Message]) -> str:
    """Messages ending with a user turn -> dialogue text (how ``messages`` rows enter the pipeline)."""
    return render_human_assistant(messages)


def fit_history(
    messages: list[Message], count_tokens: Callable[[list[Message]], int], budget: int
) -> tuple[list[Message], int]:
    """Drop the oldest turns until ``count_tokens(kept) <= budget``; returns ``(kept, n_dropped)``.

    Turns are dropped up to the next user message, so the kept history always starts with a user turn;
    the last message is always kept, even when it alone is over the budget (the caller then cuts the
    start of its token ids, see :meth:`PromptFormat.fit_prompt`).
    """
    start = 0
    while start < len(messages) - 1 and count_tokens(messages[start:]) > budget:
        start += 1
        while start < len(messages) - 1 and messages[start]["role"] != "user":
            start += 1
    return messages[start:], start


def keep_last_tokens(ids: list[int], budget: int, bos_id: int | None = None) -> list[int]:
    """The last ``budget`` tokens of ``ids``, keeping a leading BOS in place (``budget >= 1``)."""
    if len(ids) <= budget:
        return list(ids)
    if bos_id is not None and ids and ids[0] == bos_id and budget > 1:
        return [ids[0], *ids[len(ids) - budget + 1 :]]
    return list(ids[len(ids) - budget :])


class FittedPrompt(NamedTuple):
    """A prompt fitted into a token budget (:meth:`PromptFormat.fit_prompt`)."""

    ids: list[int]
    dropped: int  # oldest messages dropped whole
    cut: bool  # the start of the last message's text was cut as well
    messages: list[Message]  # what the ids render


@dataclass(frozen=True)
class PromptFormat:
    """The prompt format of one tokenizer (see the module docstring).

    ``end_id``: the token that ends a response in training (EOS, or the template's end of turn).
    ``stop_ids``: the token ids that end a response: generation stops there, and an answer without one
    was cut off. ``stop_strings``: text at which a reply is cut (a Human/Assistant model inventing the
    next turn). ``turn_start_id``: the token a template opens a turn with (:func:`_template_turn_start_id`);
    ``chat.py`` stops there too (:attr:`reply_stop_ids`).
    """

    name: str
    tokenizer: Any = field(repr=False, compare=False)
    end_id: int | None
    stop_ids: tuple[int, ...]
    stop_strings: tuple[str, ...]
    _render: Callable[[list[Message]], str] = field(repr=False, compare=False)
    turn_start_id: int | None = None

    @property
    def reply_stop_ids(self) -> tuple[int, ...]:
        """Where ``chat.py`` stops a reply: :attr:`stop_ids` and the turn's opening token, so that a model
        that skips its end of turn does not go on, in a conversation, to write the user's next message.
        Everything that measures or trains stops at :attr:`stop_ids` alone (PPO's rollouts, the steps'
        evaluations, ``prompt_eval.py``, as ``generate`` with the model's own EOS would): an answer that
        opens a turn instead of ending did not end, and is cut off (``--truncation_penalty``; on-policy
        pairs never choose it)."""
        extra = (
            () if self.turn_start_id is None or self.turn_start_id in self.stop_ids else (self.turn_start_id,)
        )
        return (*self.stop_ids, *extra)

    @property
    def add_special_tokens(self) -> bool:
        """Whether tokenizing a rendered prompt adds special tokens: a chat template writes them itself."""
        return self.name == HUMAN_ASSISTANT

    def render(self, messages: list[Message]) -> str:
        """Messages ending with a user turn -> the text the model continues."""
        return self._render(messages)

    def prompt_text(self, prompt: str) -> str:
        """A data set's prompt -> the text the model continues. A dialogue is used byte for byte in the
        Human/Assistant form (less trailing whitespace) and parsed into messages for a chat template
        (:meth:`messages_of`); any other text is one user turn in both, in training as at inference
        (``prompt_eval.py`` and ``chat.py`` ask a question so)."""
        if self.name == HUMAN_ASSISTANT:
            # ends at "Assistant:", as inference sends it (the answer brings its space)
            return as_dialogue(prompt).rstrip()
        return self.render(self.messages_of(prompt))

    def response_text(self, response: str) -> str:
        """A response as the data holds it (``" 432"``, ``"432"``) -> as it follows the prompt in this format:
        after "Assistant:" one space and the answer (as in HH-RLHF, ``messages`` rows and what ``chat.py``
        renders), so that one answer is one token sequence whatever the row's spelling; in a template, the
        answer stripped."""
        if self.name != HUMAN_ASSISTANT:
            return response.strip()
        return " " + response.lstrip() if response.strip() else response

    def encode_prompts(self, prompts: list[str]) -> list[list[int]]:
        if not prompts:
            return []
        texts = [self.prompt_text(p) for p in prompts]
        return self.tokenizer(texts, add_special_tokens=self.add_special_tokens)["input_ids"]

    def encode_responses(self, responses: list[str]) -> list[list[int]]:
        """Response token ids without the end token (what a reward model scores)."""
        if not responses:
            return []
        texts = [self.response_text(r) for r in responses]
        return self.tokenizer(texts, add_special_tokens=False)["input_ids"]

    def messages_of(self, prompt: str) -> list[Message]:
        """A data set's prompt as messages: a dialogue's turns, or one user turn (stripped, as a dialogue's
        turns are)."""
        return (
            parse_dialogue(prompt) if is_dialogue(prompt) else [{"role": "user", "content": prompt.strip()}]
        )

    def encode_messages(self, messages: list[Message]) -> list[int]:
        return self.tokenizer(self.render(messages), add_special_tokens=self.add_special_tokens)["input_ids"]

    def fit_prompt(self, prompt: str | list[Message], budget: int) -> FittedPrompt:
        """A prompt (a data set's, or messages) in at most ``budget`` tokens, as training and inference
        fit one: the oldest turns go whole (the kept ones start with a user turn), then the start of the
        last message's text, so that the format's own tokens (a template's system turn and role headers,
        "Human:" and "Assistant:") stay where the model always sees them. A prompt that fits is
        :meth:`encode_prompts`'s ids. Only where the format's tokens alone exceed the budget are the ids
        cut as tokens (BOS and the end)."""
        if isinstance(prompt, str):
            ids = self.encode_prompts([prompt])[0]
            if len(ids) <= budget:
                return FittedPrompt(ids, 0, False, self.messages_of(prompt))
            prompt = self.messages_of(prompt)
        kept, dropped = fit_history(prompt, lambda m: len(self.encode_messages(m)), budget)
        ids = self.encode_messages(kept)
        if len(ids) <= budget:
            return FittedPrompt(ids, dropped, False, kept)
        *before, last = kept
        text = self.tokenizer(last["content"], add_special_tokens=False)["input_ids"]
        start = len(ids) - budget
        while start < len(text):  # decoding and re-encoding the kept text can shift a token or two
            kept_text = self.tokenizer.decode(text[start:])
            if kept_text.startswith("\ufffd"):  # the cut fell inside a character (byte-level tokens)
                start += 1
                continue
            trimmed = [*before, {**last, "content": kept_text.strip()}]
            ids = self.encode_messages(trimmed)
            if len(ids) <= budget:
                return FittedPrompt(ids, dropped, True, trimmed)
            start += len(ids) - budget
        return FittedPrompt(keep_last_tokens(ids, budget, self.tokenizer.bos_token_id), dropped, True, kept)

    def fingerprint(self) -> str:
        """What identifies this format in a data-cache key (with the tokenizer's own fingerprint)."""
        return f"{self.name}|{self.end_id}"


def alternating(messages: list[Message]) -> list[Message]:
    """The same dialogue as a strict template takes it (Gemma, Mistral and Llama 2 raise otherwise): a
    system turn's text leads the first user turn, and consecutive turns of one role are one turn."""
    system = [m["content"] for m in messages if m["role"] == "system"]
    out: list[Message] = []
    for m in (m for m in messages if m["role"] != "system"):
        if out and out[-1]["role"] == m["role"]:
            out[-1] = {"role": m["role"], "content": out[-1]["content"] + "\n\n" + m["content"]}
        else:
            out.append(dict(m))
    if system and out and out[0]["role"] == "user":
        out[0] = {"role": "user", "content": "\n\n".join([*system, out[0]["content"]])}
    return out


def apply_template(tokenizer, messages: list[Message], **kwargs) -> str:
    """``tokenizer.apply_chat_template`` (text), with the dialogue as given where the template takes it and
    :func:`alternating` where it raises; a template that refuses both is one clear error."""
    from jinja2.exceptions import TemplateError

    try:
        return tokenizer.apply_chat_template(messages, tokenize=False, **kwargs)
    except TemplateError as exc:
        error = exc
    strict = alternating(messages)
    if strict != messages:
        try:
            return tokenizer.apply_chat_template(strict, tokenize=False, **kwargs)
        except TemplateError as exc:
            error = exc
    name = getattr(tokenizer, "name_or_path", "") or "the model"
    roles = "/".join(m["role"] for m in messages)
    raise UserError(f"the chat template of {name} rejects a dialogue of turns {roles} ({error}); "
                    "pass --chat_template off to use the Human/Assistant text")  # fmt: skip


def _template_end_id(tokenizer) -> int | None:
    """The template's end of turn: the first special token it writes after an assistant message's content
    (ChatML's ``<|im_end|>``; Llama 2's EOS, after a space), else the first token that is not whitespace,
    else EOS."""
    mark = "\u2063dschat-response\u2063"
    text = apply_template(
        tokenizer, [{"role": "user", "content": "x"}, {"role": "assistant", "content": mark}]
    )
    after = text.split(mark, 1)[1] if mark in text else ""
    ids = tokenizer(after, add_special_tokens=False)["input_ids"] if after else []
    special = set(tokenizer.all_special_ids)
    visible = [i for i in ids if tokenizer.decode([i]).strip()]
    return next((i for i in ids if i in special), visible[0] if visible else tokenizer.eos_token_id)


def _template_turn_start_id(tokenizer, end: int | None) -> int | None:
    """The first special token the template writes between an answer's end and the next user message
    (ChatML's ``<|im_start|>``, Llama 3's ``<|start_header_id|>``, BOS in Llama 2's), other than the end
    of turn, EOS and padding; or None. A model that skips its end of turn and goes on into a turn of its
    own writes it first."""
    marks = ("\u2063dschat-answer\u2063", "\u2063dschat-next\u2063")
    try:
        text = apply_template(tokenizer, [{"role": "user", "content": "x"}, {"role": "assistant", "content": marks[0]},
                                          {"role": "user", "content": marks[1]}])  # fmt: skip
    except UserError:  # a template that takes no second user turn: no header to find
        return None
    if marks[0] not in text or marks[1] not in text:
        return None
    between = text.split(marks[0], 1)[1].split(marks[1], 1)[0]
    # added tokens marked special count too (Llama 3's header tokens are not in all_special_ids)
    added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    special = {*tokenizer.all_special_ids, *(i for i, t in added.items() if getattr(t, "special", False))}
    special -= {end, tokenizer.eos_token_id, tokenizer.pad_token_id}
    return next((i for i in tokenizer(between, add_special_tokens=False)["input_ids"] if i in special), None)


def model_format(
    tokenizer, model_path: str | None, choice: str = "auto", flag: str = "--chat_template"
) -> PromptFormat:
    """The format to prompt (or score) the model at ``model_path`` in, for the inference tools: ``on`` and
    ``off`` as given; ``auto`` = the format its dschat run trained it in (``--chat_template`` recorded in
    its ``dschat_config.json``: a model trained with ``off`` is not asked in its tokenizer's template),
    else as :func:`prompt_format`."""
    if choice == "auto" and model_path:
        from dschat.utils.run import trained_config

        trained = trained_config(model_path).get("chat_template")
        if trained in CHOICES:
            choice = trained
    return prompt_format(tokenizer, choice, flag)


def prompt_format(tokenizer, choice: str = "auto", flag: str = "--chat_template") -> PromptFormat:
    """The format for ``tokenizer``: ``auto`` = its chat template if it has one, ``on`` = the template (an
    error without one), ``off`` = Human/Assistant."""
    if choice not in CHOICES:
        raise UserError(f"{flag} {choice}: choose one of {', '.join(CHOICES)}")
    has_template = bool(getattr(tokenizer, "chat_template", None))
    if choice == "on" and not has_template:
        name = getattr(tokenizer, "name_or_path", "") or "the model"
        raise UserError(f"{flag} on: the tokenizer of {name} has no chat template")
    eos = tokenizer.eos_token_id
    if choice == "on" or (choice == "auto" and has_template):
        end = _template_end_id(tokenizer)
        stops = tuple(dict.fromkeys(i for i in (end, eos) if i is not None))
        return PromptFormat(
            CHAT_TEMPLATE,
            tokenizer,
            end,
            stops,
            (),
            lambda msgs: apply_template(tokenizer, msgs, add_generation_prompt=True),
            _template_turn_start_id(tokenizer, end),
        )
    return PromptFormat(
        HUMAN_ASSISTANT, tokenizer, eos, (eos,) if eos is not None else (), TURN_STOPS, render_human_assistant
    )
