"""Conversation logic of the chat and prompt-comparison tools: the history and its token budget.

A conversation is a list of Hugging Face style messages, ``{"role": "user" | "assistant",
"content": str}``, rendered by the model's :class:`dschat.data.prompt_format.PromptFormat` (the same
object that rendered its training data): the Human/Assistant form or the tokenizer's chat template.
Pure Python: generating and streaming the reply is :mod:`dschat.generation.streaming`'s.
"""

from __future__ import annotations

from dschat.data.prompt_format import Message, PromptFormat


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
        return self.fmt.encode_messages(messages)

    def prompt_ids(self, user_text: str) -> tuple[list[int], int, bool]:
        """``(ids, turns_dropped, message_cut)`` for the history plus ``user_text``, fitted as training
        fits a prompt (:meth:`PromptFormat.fit_prompt`); dropped turns are forgotten for good, so the
        history the model sees is the history that is kept."""
        fitted = self.fmt.fit_prompt([*self.messages, {"role": "user", "content": user_text}], self.budget)
        self.messages = fitted.messages[:-1]
        return fitted.ids, fitted.dropped, fitted.cut

    def add_exchange(self, user_text: str, reply: str) -> None:
        self.messages += [{"role": "user", "content": user_text}, {"role": "assistant", "content": reply}]
