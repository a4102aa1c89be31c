"""Reward sources behind one call: ``score(prompts, responses, sequences, mask) -> Tensor[B]``.

A trained reward model, a Python function (rule-based or verifiable rewards), or their sum.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Protocol

import torch

from dschat.data.packing import PackedRollouts, shared_prompt_mask
from dschat.data.prompt_format import TURN_STOPS
from dschat.inputs import import_function
from dschat.losses import gather_last
from dschat.models.reward import ScoreNormalization
from dschat.utils.errors import UserError


class RewardSource(Protocol):
    # whether ``packed`` rows change what is computed (a model reads them; a function reads the text)
    reads_packed: bool

    def score(
        self,
        prompts: list[str],
        responses: list[str],
        sequences: torch.Tensor,
        attention_mask: torch.Tensor,
        packed: PackedRollouts | None = None,
    ) -> torch.Tensor: ...


class RewardModelSource:
    """A frozen reward engine (``ScalarHeadModel``) scoring prompt + response at its last real token.

    ``attention_mask`` must cover the prompt and the response *without* its EOS, matching how step 2
    trained the model (scores sit on the last response token). With ``normalization``
    (``--normalize_reward``) the scores come out standardised. ``packed``: the same rows packed by
    prompt (:func:`dschat.data.packing.pack_rollouts` of that mask), scored with each prompt run once.
    """

    reads_packed = True

    def __init__(self, engine, normalization: ScoreNormalization | None = None) -> None:
        self.engine = engine
        self.normalization = normalization  # --normalize_reward: step 2's saved score mean and std

    @torch.no_grad()
    def score(self, prompts, responses, sequences, attention_mask, packed=None) -> torch.Tensor:
        if packed is None:
            raw = gather_last(self.engine(sequences, attention_mask), attention_mask).float()
        else:
            p, dev = packed.packed, sequences.device
            values = self.engine(
                p.input_ids.to(dev), shared_prompt_mask(p.segments.to(dev)), p.position_ids.to(dev)
            )
            raw = values[packed.group.to(dev), packed.last.to(dev)].float()  # (G, L) -> (R,)
        return raw if self.normalization is None else self.normalization.apply(raw)


class FunctionSource:
    """``fn(prompts, responses) -> list[float]``, loaded from ``module:function``. A function that takes
    the keyword ``stop_strings`` (the built-in verifier does) is also told where the actor's prompt format
    ends a reply in text: the Human/Assistant format's invented next turn, nothing for a chat template,
    whose end token ended the reply already (text after the answer is then the model's, to be judged)."""

    reads_packed = False

    def __init__(self, spec: str, stop_strings: tuple[str, ...] = TURN_STOPS) -> None:
        self.fn: Callable = import_function(spec, "--reward_fn")
        self.spec = spec
        self.kwargs = {"stop_strings": stop_strings} if takes_keyword(self.fn, "stop_strings") else {}

    def score(self, prompts, responses, sequences, attention_mask, packed=None) -> torch.Tensor:
        out = self.fn(prompts, responses, **self.kwargs)
        try:
            t = torch.as_tensor(list(out), dtype=torch.float32, device=sequences.device)
        except (TypeError, ValueError) as exc:
            raise UserError(
                f"--reward_fn {self.spec}: must return a list of numbers ({type(exc).__name__}: {exc})"
            ) from None
        if t.shape != (len(prompts),):
            raise UserError(f"--reward_fn returned {tuple(t.shape)} scores for {len(prompts)} responses")
        return t


def takes_keyword(fn: Callable, name: str) -> bool:
    """Whether ``fn`` names a parameter ``name`` that a keyword can fill (not one that ``**kwargs`` would
    swallow: a wrapper that forwards its ``**kwargs`` to a function without it would fail)."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):  # a builtin without a signature
        return False
    p = params.get(name)
    return p is not None and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)


class SumSource:
    def __init__(self, *sources: RewardSource) -> None:
        self.sources = sources
        self.reads_packed = any(s.reads_packed for s in sources)

    def score(self, prompts, responses, sequences, attention_mask, packed=None) -> torch.Tensor:
        return sum(s.score(prompts, responses, sequences, attention_mask, packed) for s in self.sources)
