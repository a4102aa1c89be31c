"""A reply as it is generated, cut where the model starts an invented turn.

A model trained on the Human/Assistant form keeps writing the dialogue after its answer
("\\n\\nHuman: ..."): :func:`dschat.data.prompt_format.cut_reply` (whole texts) and :class:`StopFilter` (text arriving in pieces)
end the reply where that invented turn starts. :class:`ReplyStream` runs ``model.generate`` in a
background thread and yields the reply's text as it is generated::

    stream = ReplyStream(model, tokenizer, input_ids, {"max_new_tokens": 64}, fmt.stop_strings)
    for piece in stream:
        print(piece, end="", flush=True)
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator
from typing import Any

import torch

from dschat.data.prompt_format import TURN_STOPS
from dschat.generation.stops import stop_ids_for


class StopFilter:
    """Streaming form of :func:`cut_reply`: feed text pieces, get back the part that is safe to show.

    A piece's tail that could be the start of a stop string is held back until the next piece shows
    whether it is one; after a stop string nothing more comes out. Joining every returned piece and
    :meth:`flush` gives ``text[:first stop]``, whatever the split into pieces. ``lstrip`` drops the
    reply's leading whitespace (training responses start with a space).
    """

    def __init__(self, stops: tuple[str, ...] = TURN_STOPS, *, lstrip: bool = True) -> None:
        self.stops = tuple(s for s in stops if s)
        self.pending = ""
        self.stopped = False
        self.started = not lstrip

    def _emit(self, text: str) -> str:
        if not self.started:
            text = text.lstrip()
            self.started = bool(text)
        return text

    def push(self, piece: str) -> str:
        if self.stopped:
            return ""
        buf = self.pending + piece
        hits = [i for i in (buf.find(s) for s in self.stops) if i >= 0]
        if hits:
            self.stopped, self.pending = True, ""
            return self._emit(buf[: min(hits)])
        hold = max((k for s in self.stops for k in range(1, len(s)) if buf.endswith(s[:k])), default=0)
        self.pending = buf[len(buf) - hold :] if hold else ""
        return self._emit(buf[: len(buf) - hold])

    def flush(self) -> str:
        """The held-back tail once the text has ended without a stop string."""
        out, self.pending = self.pending, ""
        return "" if self.stopped else self._emit(out)


class _TokenQueueStreamer:
    """``generate`` streamer that queues the decoded text of every new token (not word by word).

    Text is decoded from all tokens so far and the new suffix queued, except while it ends in an
    incomplete UTF-8 character (decoded as U+FFFD), which waits for its remaining bytes.
    """

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.queue: queue.Queue[str | None] = queue.Queue()
        self.ids: list[int] = []
        self.shown = 0
        self.prompt_seen = False

    def put(self, value: torch.Tensor) -> None:
        if not self.prompt_seen:  # generate first passes the prompt
            self.prompt_seen = True
            return
        self.ids.extend(value.reshape(-1).tolist())
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        if not text.endswith("\ufffd") and len(text) > self.shown:
            self.queue.put(text[self.shown :])
            self.shown = len(text)

    def end(self) -> None:
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        if len(text) > self.shown:
            self.queue.put(text[self.shown :])
            self.shown = len(text)
        self.queue.put(None)


class _StopOnEvent:
    """Stopping criterion: end generation once ``event`` is set (a stop string was seen, or Ctrl-C)."""

    def __init__(self, event: threading.Event) -> None:
        self.event = event

    def __call__(self, input_ids: torch.Tensor, scores: Any = None, **kwargs: Any) -> torch.Tensor:
        return torch.full(
            (input_ids.shape[0],), self.event.is_set(), dtype=torch.bool, device=input_ids.device
        )


class ReplyStream:
    """One reply, generated in a background thread and iterated as text pieces cut at a stop string.

    ``input_ids`` is ``(1, T)`` on the model's device; ``generate_kwargs`` go to ``model.generate``
    (``max_new_tokens``, ``do_sample``, ...); ``stops`` are stop strings, ``stop_ids`` the token ids
    that end a reply (the format's ``stop_ids``; default: the model's EOS). Iterating yields the shown pieces; afterwards ``text``
    is the whole reply and ``ended`` says why it ended: ``"stop"`` (the model began an invented turn),
    ``"end"`` (an end token), ``"cut"`` (``max_new_tokens`` ran out first) or ``"cancelled"`` (:meth:`cancel`,
    e.g. on Ctrl-C).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        tokenizer: Any,
        input_ids: torch.Tensor,
        generate_kwargs: dict[str, Any],
        stops: tuple[str, ...] = TURN_STOPS,
        stop_ids: tuple[int, ...] = (),
    ) -> None:
        from transformers import StoppingCriteriaList

        self.text = ""
        self.ended: str | None = None
        self._event = threading.Event()
        self._error: list[BaseException] = []
        self._streamer = _TokenQueueStreamer(tokenizer)
        self._filter = StopFilter(stops)
        kwargs = {
            **generate_kwargs,
            "input_ids": input_ids,
            "attention_mask": torch.ones_like(input_ids),
            "streamer": self._streamer,
            "stopping_criteria": StoppingCriteriaList([_StopOnEvent(self._event)]),
            "pad_token_id": tokenizer.pad_token_id,
            # the format's end of turn (a chat template's <|im_end|>) as well as every EOS ends the reply;
            # the list replaces the generation config's, so that one's EOS ids are part of it
            "eos_token_id": list(stop_ids_for(tokenizer, stop_ids, model)),
        }
        self._ends, self._budget = set(kwargs["eos_token_id"]), generate_kwargs.get("max_new_tokens")

        def run() -> None:
            try:
                with torch.no_grad():
                    model.generate(**kwargs)
            except BaseException as exc:  # re-raised in the reading thread
                self._error.append(exc)
                self._streamer.queue.put(None)

        self._thread = threading.Thread(target=run, daemon=True)
        self._thread.start()

    def __iter__(self) -> Iterator[str]:
        while True:
            try:  # a timeout keeps the wait interruptible by Ctrl-C everywhere
                piece = self._streamer.queue.get(timeout=0.1)
            except queue.Empty:
                continue
            if piece is None:
                break
            shown = self._filter.push(piece)
            if self._filter.stopped:
                self._event.set()  # stop generating the invented turn
            if shown:
                self.text += shown
                yield shown
            if self._filter.stopped:
                break
        if not self._filter.stopped:
            tail = self._filter.flush()
            if tail:
                self.text += tail
                yield tail
        self._finish("stop" if self._filter.stopped else "cut" if self._ran_out() else "end")
        if self._error:
            raise self._error[0]

    def _ran_out(self) -> bool:
        """The whole budget generated and no end token last: the reply did not end, it was cut."""
        ids = self._streamer.ids
        return bool(self._budget) and len(ids) >= self._budget and ids[-1] not in self._ends

    def cancel(self) -> None:
        """Stop generating (the text shown so far stays in ``text``)."""
        self._finish("cancelled")

    def _finish(self, why: str) -> None:
        self._event.set()
        self._thread.join()
        if self.ended is None:
            self.ended = why
        self.text = self.text.rstrip()
