#!/usr/bin/env python
"""Chat with a model in the terminal: multi-turn, streamed, in the prompt format it was trained with.

    python inference/chat.py --path output/step3/actor          # any step's model, HF name, builtin:NAME
    python inference/chat.py --path my-lora-adapter --base_model meta-llama/Llama-3.2-1B
    python inference/chat.py --path output/step1 --prompt "What is 2 + 3?" --greedy   # answer once
    printf 'What is 2 + 3?\\nSort: dog cat owl\\n' | python inference/chat.py --path output/step1

Type a message and press Enter. ``clear`` (or ``/reset``) forgets the conversation; ``quit``, ``exit``
or Ctrl-D leave; Ctrl-C stops the reply being written. When stdin is not a terminal every line is a
message of one continuing conversation (a ``clear`` line starts a new one) and only the replies are
printed, one per message.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from dschat.chat import Conversation
from dschat.config import ArgumentParser, FormatArgs, InferenceArgs, add_group, from_namespace
from dschat.data.prompt_format import PromptFormat, model_format
from dschat.generation.decoding import DecodeOptions, add_decoding_args, context_length, decode_options
from dschat.generation.streaming import ReplyStream
from dschat.models.loading import count_parameters, inference_dtype, load_for_generation, open_for_generation
from dschat.utils import dist
from dschat.utils.errors import UserError, run_cli
from dschat.utils.io import is_text

RESET = {"clear", "/clear", "/reset"}
QUIT = {"quit", "exit", "/quit", "/exit"}
# a chat samples by default (greedy replies of small models repeat themselves)
DECODING = DecodeOptions(strategy="sample", max_new_tokens=128, temperature=0.7, top_p=0.9, top_k=50)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = ArgumentParser(prog="chat.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--path", "--model_name_or_path", dest="path", required=True,
                   help="model directory (any step's output), HF name, builtin:NAME, or a peft LoRA adapter")  # fmt: skip
    p.add_argument("--base_model", help="base model of a LoRA adapter (default: the one its config names)")
    p.add_argument("--prompt", help="answer this one message and exit")
    add_decoding_args(p, DECODING, strategies=("sample", "greedy"), greedy_switch=True)
    add_group(p, FormatArgs, title="prompt format (as in training)")
    add_group(p, InferenceArgs, title="device and precision")
    args = p.parse_args(argv)
    args.inference = from_namespace(InferenceArgs, args)
    if args.prompt is not None and not args.prompt.strip():
        p.error("--prompt: the message is empty")
    if args.prompt is not None and not is_text(args.prompt):
        p.error("--prompt: not valid UTF-8 text")
    decode_options(args, DECODING)  # bad decoding flags fail before the model loads
    return args


def conversation_settings(
    tokenizer, config, args: argparse.Namespace, path: str | None
) -> tuple[PromptFormat, int]:
    """The format the model at ``path`` was trained in (auto: its run's recorded ``--chat_template``) and
    the tokens a conversation may take before the reply: from the tokenizer and config, so a bad flag is
    one line before the weights load."""
    fmt = model_format(tokenizer, path, from_namespace(FormatArgs, args).chat_template)
    context = context_length(config, tokenizer)
    if args.max_new_tokens >= context:
        raise UserError(
            f"--max_new_tokens {args.max_new_tokens}: must be below the model's context ({context})"
        )
    return fmt, context - args.max_new_tokens


class Chat:
    """One conversation with a loaded model; ``say`` streams a reply to ``out``."""

    def __init__(self, model, tokenizer, args: argparse.Namespace, out=None, path: str | None = None) -> None:
        self.model, self.tokenizer, self.out = model, tokenizer, out or sys.stdout
        self.interrupted = False  # a reply was stopped with Ctrl-C (piped input then stops too)
        self.fmt, budget = conversation_settings(tokenizer, model.config, args, path)
        self.opts = decode_options(args, DECODING)
        self.conversation = Conversation(tokenizer, self.fmt, budget)

    def note(self, text: str) -> None:
        print(f"({text})", file=self.out if self.out.isatty() else sys.stderr, flush=True)

    def say(self, message: str, label: str = "") -> str:
        """Stream the reply to ``message``; Ctrl-C stops the reply and keeps what was written."""
        ids, dropped, cut = self.conversation.prompt_ids(message)
        if dropped:
            self.note(f"the {dropped} oldest message(s) no longer fit the model's context and were forgotten")
        if cut:
            self.note("the message is longer than the model's context; its beginning was cut")
        input_ids = torch.tensor([ids], device=self.model.device)
        stream = ReplyStream(
            self.model,
            self.tokenizer,
            input_ids,
            self.opts.generate_kwargs(),
            self.fmt.stop_strings,
            self.fmt.reply_stop_ids,
        )
        self.out.write(label)
        self.out.flush()
        try:
            for piece in stream:
                self.out.write(piece)
                self.out.flush()
        except KeyboardInterrupt:
            stream.cancel()
            self.out.write(" [stopped]")
            self.interrupted = True
        except BrokenPipeError:  # the reader went away: stop generating before leaving
            stream.cancel()
            raise
        if stream.ended == "cut":  # not the model's end: say so (the history keeps the words shown)
            self.out.write(f" [cut off at --max_new_tokens {self.opts.max_new_tokens}]")
        self.out.write("\n")
        self.out.flush()
        self.conversation.add_exchange(message, stream.text)
        return stream.text

    def handle(self, line: str, label: str = "") -> bool:
        """Act on one line of input; False when the user asked to leave."""
        text = line.strip()
        if not is_text(text):
            self.note("the message is not valid UTF-8 text and was not sent")
            return True
        if text.lower() in QUIT:
            return False
        if text.lower() in RESET:
            self.conversation.reset()
            self.note("conversation cleared")
        elif text:
            self.say(text, label)
        return True


def interactive(chat: Chat) -> None:
    with contextlib.suppress(ImportError):
        import readline  # noqa: F401  (line editing and history for input())
    # Ctrl-C stops a reply even where this process was started with SIGINT ignored (Python then keeps it
    # ignored: a shell without job control ignores it in everything it starts with `&`)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    print("Type a message. 'clear' forgets the conversation; 'quit' or Ctrl-D leaves; Ctrl-C stops a reply.")
    while True:
        try:
            line = input("\nHuman: ")
        except EOFError:
            print()
            return
        except KeyboardInterrupt:
            print("\n(type 'quit' or press Ctrl-D to leave)")
            continue
        if not chat.handle(line, label="\nAssistant: "):
            return


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()  # no generation-config chatter between the turns
    hf_logging.disable_progress_bar()
    if args.seed is not None:
        torch.manual_seed(args.seed)
    where = args.inference
    dtype = inference_dtype(where.dtype, where.device)
    start = time.perf_counter()
    src = open_for_generation(
        args.path, base_model=args.base_model, trust_remote_code=where.trust_remote_code
    )
    conversation_settings(src.tokenizer, src.config, args, src.path)  # bad flags before the weights load
    model, tokenizer = load_for_generation(src, device=where.device, dtype=dtype,
                                           trust_remote_code=where.trust_remote_code)  # fmt: skip
    dist.note_shared_cpu(where.device)
    chat = Chat(model, tokenizer, args, path=src.path)
    # a line that is not UTF-8 is one note (Chat.handle), not a UnicodeDecodeError ending the chat
    if reconfigure := getattr(sys.stdin, "reconfigure", None):  # a text stream (not a test's stand-in)
        reconfigure(errors="surrogateescape")
    tty = sys.stdin.isatty() and args.prompt is None
    if tty:
        print(f"{args.path}: {type(model).__name__}, {count_parameters(model) / 1e6:.1f}M parameters, "
              f"{where.device} {str(dtype).removeprefix('torch.')}, {chat.fmt.name} format "
              f"(loaded in {time.perf_counter() - start:.1f} s)")  # fmt: skip
        interactive(chat)
    elif args.prompt is not None:
        chat.say(args.prompt.strip())  # as a typed message: "$(cat file)" keeps the file's last newline
    else:
        try:
            for line in sys.stdin:
                if not chat.handle(line) or chat.interrupted:  # Ctrl-C stops the reply and the run
                    return 130 if chat.interrupted else 0
        except BrokenPipeError:  # `chat.py < messages | head -1`: leave quietly, as Unix tools do
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no error at exit's flush
    return 0


if __name__ == "__main__":
    run_cli(main)
