"""Decoding strategies for the inference tools: greedy, sampling, beam search and contrastive search.

:class:`DecodeOptions` holds the flags (checked with their names); its greedy and sampling part is a
:class:`~dschat.generation.sampling.SamplingConfig`, which checks and builds those ``generate`` arguments; :func:`generate_replies` runs a list of prompts through any of the
strategies in left-padded batches and cuts each reply where the model starts an invented turn.

Contrastive search (Su et al., 2022, "A Contrastive Framework for Neural Text Generation") is
implemented here: transformers 5 moved it out of ``generate`` into the hub repository
``transformers-community/contrastive-search``, which would need a download and remote code.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F
from transformers import RepetitionPenaltyLogitsProcessor

from dschat.data.collate import length_batches
from dschat.data.prompt_format import TURN_STOPS, cut_reply
from dschat.generation.sampling import SamplingConfig
from dschat.generation.stops import stop_ids_for
from dschat.utils.errors import UserError

STRATEGIES = ("greedy", "sample", "beam", "contrastive")


@dataclass(frozen=True)
class DecodeOptions:
    """How to decode. ``top_k`` is the sampling cut-off (0 = off) and contrastive search's candidate count."""

    strategy: str = "greedy"
    max_new_tokens: int = 64
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    num_beams: int = 4
    penalty_alpha: float = 0.6
    repetition_penalty: float = 1.0
    seed: int | None = None  # of the sampling; None = a different draw each run

    @property
    def sampling(self) -> SamplingConfig:
        """The greedy or sampling part of these options (beam and contrastive search add their own)."""
        return SamplingConfig(max_new_tokens=self.max_new_tokens, temperature=self.temperature, top_p=self.top_p,
                              top_k=self.top_k, do_sample=self.strategy == "sample")  # fmt: skip

    def validate(self) -> DecodeOptions:
        """Raise :class:`UserError` naming the flag of the first out-of-range option."""
        if self.strategy not in STRATEGIES:
            raise UserError(f"--decoding {self.strategy}: choose one of {', '.join(STRATEGIES)}")
        if self.strategy == "sample" and self.temperature == 0:
            raise UserError(
                f"--temperature {self.temperature}: must be > 0 for --decoding sample (temperature 0 is --decoding greedy)"
            )
        self.sampling.validate()
        checks = [
            (self.num_beams >= 1, f"--num_beams {self.num_beams}: must be at least 1"),
            (0 <= self.penalty_alpha <= 1, f"--penalty_alpha {self.penalty_alpha}: must be in [0, 1]"),
            (math.isfinite(self.repetition_penalty) and self.repetition_penalty > 0,
             f"--repetition_penalty {self.repetition_penalty}: must be a finite number > 0"),
            (self.seed is None or 0 <= self.seed < 2**63, f"--seed {self.seed}: must be in 0 .. 2**63 - 1"),
            (
                self.strategy != "contrastive" or self.top_k >= 2,
                f"--top_k {self.top_k}: contrastive search compares top_k >= 2 candidates (e.g. --top_k 4)",
            ),
        ]  # fmt: skip
        for ok, message in checks:
            if not ok:
                raise UserError(message)
        return self

    def generate_kwargs(self) -> dict:
        """Arguments for ``model.generate`` (greedy, sample, beam); contrastive search does not use it."""
        kw = {
            **self.sampling.generate_kwargs(),
            "repetition_penalty": self.repetition_penalty,
            "num_beams": 1,
        }
        if self.strategy == "beam":
            kw.update(num_beams=self.num_beams, early_stopping=True)
        return kw


def add_decoding_args(
    p: argparse.ArgumentParser,
    defaults: DecodeOptions,
    strategies: tuple[str, ...] = STRATEGIES,
    *,
    greedy_switch: bool = False,
) -> None:
    """The inference tools' one decoding group; each tool passes its own defaults (chat samples,
    prompt_eval is greedy) and the strategies it can run; ``greedy_switch`` adds ``--greedy``. Read back
    with :func:`decode_options`. The flags a strategy may not read default to None, so that one given at
    its default value is still known to be given."""
    g = p.add_argument_group("decoding")
    g.add_argument("--decoding", choices=strategies, help=f"decoding strategy (default: {defaults.strategy})")
    if greedy_switch:
        g.add_argument("--greedy", action="store_true", help="--decoding greedy")
    g.add_argument(
        "--max_new_tokens", type=int, default=defaults.max_new_tokens, help="most new tokens per reply"
    )
    g.add_argument(
        "--temperature", type=float, help=f"sampling temperature (default: {defaults.temperature})"
    )
    g.add_argument(
        "--top_p", type=float, help=f"sampling: nucleus probability, 1 = off (default: {defaults.top_p})"
    )
    g.add_argument(
        "--top_k",
        type=int,
        help=f"sampling: the k most likely tokens (default {defaults.top_k}, "
        "0 = all)" + ("; contrastive search: candidates (default 4)" if "contrastive" in strategies else ""),
    )
    g.add_argument("--repetition_penalty", type=float, default=defaults.repetition_penalty)
    g.add_argument("--seed", type=int, default=defaults.seed,
                   help=f"seed of the sampling (default: {'a different draw each run' if defaults.seed is None else defaults.seed})")  # fmt: skip
    if "beam" in strategies:
        g.add_argument("--num_beams", type=int, help=f"beam search width (default: {defaults.num_beams})")
    if "contrastive" in strategies:
        g.add_argument("--penalty_alpha", type=float,
                       help=f"contrastive search: weight of the degeneration penalty (default: {defaults.penalty_alpha})")  # fmt: skip


# which strategies read each flag that not every strategy reads
READ_BY = {"temperature": ("sample",), "top_p": ("sample",), "top_k": ("sample", "contrastive"),
           "num_beams": ("beam",), "penalty_alpha": ("contrastive",)}  # fmt: skip


def decode_options(args: argparse.Namespace, defaults: DecodeOptions) -> DecodeOptions:
    """The validated :class:`DecodeOptions` of a parser built by :func:`add_decoding_args` (``args`` is only
    read). A flag the chosen strategy does not read is an error, whatever its value (``--temperature 0.7``
    without ``--decoding sample`` decoded greedily and said nothing); ``--temperature 0`` with greedy is
    the usual way to say greedy and is accepted. ``--greedy`` with another ``--decoding`` is a conflict."""
    strategy = args.decoding or defaults.strategy
    if getattr(args, "greedy", False):
        if args.decoding not in (None, "greedy"):
            raise UserError(f"--greedy and --decoding {args.decoding}: give one")
        strategy = "greedy"
    for name, strategies in READ_BY.items():
        value = getattr(args, name, None)
        if value is not None and strategy not in strategies:
            if name == "temperature" and value == 0 and strategy == "greedy":
                continue
            raise UserError(f"--{name} {value}: --decoding {strategy} does not read it (it applies to "
                            f"--decoding {' or '.join(strategies)})")  # fmt: skip

    def given(name: str):
        value = getattr(args, name, None)
        return getattr(defaults, name) if value is None else value

    top_k = args.top_k if args.top_k is not None else (4 if strategy == "contrastive" else defaults.top_k)
    return DecodeOptions(strategy=strategy, max_new_tokens=args.max_new_tokens, temperature=given("temperature"),
                         top_p=given("top_p"), top_k=top_k, num_beams=given("num_beams"),
                         penalty_alpha=given("penalty_alpha"), repetition_penalty=args.repetition_penalty,
                         seed=args.seed).validate()  # fmt: skip


def known_context_length(model, tokenizer) -> int | None:
    """Tokens the model (a module, or its config) can attend to: its position limit, or the tokenizer's
    limit when that is smaller; None where neither names one (ALiBi models)."""
    config = getattr(model, "config", model)
    limits = [
        getattr(config, "max_position_embeddings", None),
        getattr(tokenizer, "model_max_length", None),
    ]
    usable = [int(x) for x in limits if isinstance(x, int) and 0 < x < 10**7]
    return min(usable) if usable else None


def context_length(model, tokenizer) -> int:
    """:func:`known_context_length`, 2048 where the model names none (a budget generation can plan with)."""
    known = known_context_length(model, tokenizer)
    return 2048 if known is None else known


def contrastive_pick(
    top_probs: torch.Tensor, cand_hidden: torch.Tensor, context_hidden: torch.Tensor, alpha: float
) -> int:
    """Index of the candidate maximising ``(1 - alpha) p(v) - alpha max_j cos(h_v, h_j)``.

    ``top_probs (k,)`` model probabilities of the k candidates, ``cand_hidden (k, H)`` last-layer hidden
    state of each candidate appended to the text, ``context_hidden (T, H)`` those of the text so far.
    The second term (degeneration penalty) punishes a token whose representation repeats the context.
    """
    sim = F.cosine_similarity(cand_hidden[:, None, :].float(), context_hidden[None, :, :].float(), dim=-1)
    score = (1 - alpha) * top_probs.float() - alpha * sim.max(dim=1).values
    return int(score.argmax())


@torch.no_grad()
def contrastive_search(
    model: torch.nn.Module, prompt_ids: list[int], opts: DecodeOptions, stop_ids: set[int]
) -> list[int]:
    """New token ids for one prompt by contrastive search (``opts.top_k`` candidates, ``opts.penalty_alpha``).

    Each step runs the model on the k candidate continuations without a KV cache (k x T tokens), so it
    is meant for comparing short answers, not for long texts. ``opts.repetition_penalty`` reweighs the
    candidates' probabilities as it does for the other strategies (on every token of the text so far).
    """
    device = next(model.parameters()).device
    ids = torch.tensor([prompt_ids], device=device)
    out = model(input_ids=ids, output_hidden_states=True, use_cache=False)
    context = out.hidden_states[-1][0]  # (T, H)
    logits = out.logits[0, -1]
    penalise = (
        RepetitionPenaltyLogitsProcessor(opts.repetition_penalty) if opts.repetition_penalty != 1 else None
    )
    new: list[int] = []
    for _ in range(opts.max_new_tokens):
        if penalise is not None:
            logits = penalise(ids, logits[None].float())[0]
        probs = logits.float().softmax(-1)
        k = min(opts.top_k, probs.shape[-1])  # more candidates than tokens: every token is one
        top_probs, top_ids = probs.topk(k)
        cand = torch.cat([ids.expand(k, -1), top_ids[:, None]], dim=1)  # (k, T+1)
        o = model(input_ids=cand, output_hidden_states=True, use_cache=False)
        best = contrastive_pick(top_probs, o.hidden_states[-1][:, -1], context, opts.penalty_alpha)
        ids, context, logits = cand[best : best + 1], o.hidden_states[-1][best], o.logits[best, -1]
        new.append(int(top_ids[best]))
        if new[-1] in stop_ids:
            break
    return new


class Replies(NamedTuple):
    texts: list[str]  # one reply per prompt
    cut_off: list[bool]  # per prompt: the reply ran out of max_new_tokens before it ended


@torch.no_grad()
def generate_replies(
    model: torch.nn.Module,
    tokenizer,
    prompt_ids: list[list[int]],
    opts: DecodeOptions,
    *,
    batch_size: int = 8,
    stops: tuple[str, ...] = TURN_STOPS,
    stop_ids: tuple[int, ...] = (),
) -> Replies:
    """Replies (text after each prompt, cut at an invented turn, leading space kept) for token-id prompts,
    and which of them were cut off.

    Prompts of similar length are left-padded into batches of ``batch_size`` for greedy, sampling and beam
    search (the replies come back in the prompts' order), and run one at a time for contrastive search. A
    reply ends at one of ``stop_ids`` (a format's end of turn) or the model's EOS. Special tokens (EOS,
    padding) are not part of the text. A reply that used all ``opts.max_new_tokens`` without reaching an
    end (EOS, an end id or a stop string) is cut off: it stops mid-answer, and a judge or reward model
    scoring it sees an unfinished answer.
    """
    device = next(model.parameters()).device
    model.eval()
    replies: list[list[int]] = [[] for _ in prompt_ids]
    ends = set(stop_ids_for(tokenizer, stop_ids, model))  # the format's end ids and every EOS
    if opts.strategy == "contrastive":
        replies = [contrastive_search(model, p, opts, ends) for p in prompt_ids]
    else:
        pad = tokenizer.pad_token_id
        for ix in length_batches([len(p) for p in prompt_ids], batch_size):
            chunk = [prompt_ids[i] for i in ix]
            width = max(len(p) for p in chunk)
            input_ids = torch.tensor([[pad] * (width - len(p)) + p for p in chunk], device=device)
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in chunk], device=device)
            seq = model.generate(input_ids=input_ids, attention_mask=mask, pad_token_id=pad,
                                 eos_token_id=sorted(ends), **opts.generate_kwargs())  # fmt: skip
            for i, reply in zip(ix, seq[:, width:].tolist(), strict=True):
                replies[i] = reply
    texts = tokenizer.batch_decode(replies, skip_special_tokens=True)
    cut_off = [
        len(r) >= opts.max_new_tokens and not ends.intersection(r) and not any(s in t for s in stops)
        for r, t in zip(replies, texts, strict=True)
    ]
    return Replies([cut_reply(t, stops) for t in texts], cut_off)
