"""Conversation logic of the chat and prompt-comparison tools: the history and its token budget.

A conversation is a list of Hugging Face style messages, ``{"role": "user" | "assistant",
"content": str}``, rendered by the model's :class:`dschat.data.prompt_format.PromptFormat` (the same
object that rendered its training data): the Human/Assistant form or the tokenizer's chat template.
Pure Python: generating and streaming the reply is :mod:`dschat.generation.streaming`'s.
"""

from __future__ import annotations

from collections.abc import Callable

from dschat.data.prompt_format import Message, PromptFormat


def fit_history(
    messages: list[Message], count_tokens: Callable[[list[Message]], int], budget: int
) -> tuple[list[Message], int]:
    """Drop the oldest turns until ``count_tokens(kept) <= budget``; returns ``(kept, n_dropped)``.

    Turns are dropped up to the next user message, so the kept history always starts with a user turn;
    the last message is always kept, even when it alone is over the budget (the caller then cuts the
    start of its token ids, see :func:`keep_last_tokens`).
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


class Conversation:
    """The history of one chat and the model input for its next turn, within a token budget.

    ``budget`` is the most prompt tokens the model may get (its context minus the reply's
    ``max_new_tokens``). :meth:`prompt_ids` drops the oldest turns that do not fit, and cuts the start
    of a single message that alone is too long.
    """

    def __init__(self, tokenizer, fmt: PromptFormat, budget: int) -> None:
        if budget < 1:
            raise ValueError("budget must be at least one token")
        self.tokenizer, self.fmt, self.budget = tokenizer, fmt, budget
        self.messages: list[Message] = []

    def reset(self) -> None:
        self.messages = []

    def encode(self, messages: list[Message]) -> list[int]:
        text = self.fmt.render(messages)
        return self.tokenizer(text, add_special_tokens=self.fmt.add_special_tokens)["input_ids"]

    def prompt_ids(self, user_text: str) -> tuple[list[int], int, bool]:
        """``(ids, turns_dropped, message_cut)`` for the history plus ``user_text``; dropped turns are
        forgotten for good, so the history the model sees is the history that is kept."""
        msgs = [*self.messages, {"role": "user", "content": user_text}]
        kept, dropped = fit_history(msgs, lambda m: len(self.encode(m)), self.budget)
        self.messages = kept[:-1]
        ids = self.encode(kept)
        cut = len(ids) > self.budget
        return keep_last_tokens(ids, self.budget, self.tokenizer.bos_token_id), dropped, cut

    def add_exchange(self, user_text: str, reply: str) -> None:
        self.messages += [{"role": "user", "content": user_text}, {"role": "assistant", "content": reply}]
