"""Tokenization of one sample and batch collation: pure functions, exact tensors, no deepspeed.

Samples are padded per batch (to the longest sample in the batch, optionally rounded up to a
multiple), never to ``max_seq_len``: padding tokens cost compute and teach nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dschat.data.packing import pack_pairs, pack_preference_targets

IGNORE_INDEX = -100


def sft_example(
    prompt_ids: list[int], response_ids: list[int], eos_id: int | None, train_on_prompt: bool
) -> dict:
    """``input_ids = prompt + response + [eos]``; ``labels`` = -100 on the prompt unless ``train_on_prompt``.

    The EOS is part of the target: the model must learn to stop.
    """
    response = list(response_ids) + ([eos_id] if eos_id is not None else [])
    input_ids = list(prompt_ids) + response
    if train_on_prompt:
        labels = list(input_ids)
    else:
        labels = [IGNORE_INDEX] * len(prompt_ids) + response
    return {"input_ids": input_ids, "labels": labels}


@dataclass
class SFTCollator:
    """Right-pad a list of ``{"input_ids", "labels"}`` to the longest in the batch.

    Returns ``input_ids (B, T)`` padded with ``pad_id``, ``attention_mask (B, T)`` 1 on real tokens,
    ``labels (B, T)`` with ``IGNORE_INDEX`` on padding (and on the prompt, as tokenized).
    """

    pad_id: int
    pad_to_multiple_of: int = 1

    def __call__(self, features: list[dict]) -> dict[str, torch.Tensor]:
        longest = max(len(f["input_ids"]) for f in features)
        m = self.pad_to_multiple_of
        width = ((longest + m - 1) // m) * m
        b = len(features)
        input_ids = torch.full((b, width), self.pad_id, dtype=torch.long)
        labels = torch.full((b, width), IGNORE_INDEX, dtype=torch.long)
        attention_mask = torch.zeros((b, width), dtype=torch.long)
        for i, f in enumerate(features):
            n = len(f["input_ids"])
            input_ids[i, :n] = torch.tensor(f["input_ids"], dtype=torch.long)
            labels[i, :n] = torch.tensor(f["labels"], dtype=torch.long)
            attention_mask[i, :n] = 1
        return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}


def pair_example(prompt_ids: list[int], chosen_ids: list[int], rejected_ids: list[int]) -> dict:
    """``prompt + chosen`` and ``prompt + rejected``; no EOS is appended, so the score sits on the last
    response token and the saved model scores identically under ``AutoModelForSequenceClassification``
    (which pools at the rightmost non-pad token, and would skip an EOS that equals the pad token).
    ``prompt_len`` says where the responses start (DPO scores the responses' tokens only)."""
    return {
        "chosen": list(prompt_ids) + list(chosen_ids),
        "rejected": list(prompt_ids) + list(rejected_ids),
        "prompt_len": len(prompt_ids),
    }


@dataclass
class PairCollator:
    """Chosen and rejected of B pairs batched together, right-padded.

    Returns ``input_ids (2B, T)`` (rows 0..B-1 chosen, B..2B-1 rejected), ``attention_mask (2B, T)`` and
    ``response_len (2B,)``, each row's response length in tokens (the prompt is shared within a pair).
    With ``share_prompt`` also each pair packed into one row (:func:`dschat.data.packing.pack_pairs`), so
    that a model can compute the shared prompt once.
    """

    pad_id: int
    share_prompt: bool = False

    def __call__(self, features: list[dict]) -> dict[str, torch.Tensor]:
        out = pad_right([f["chosen"] for f in features] + [f["rejected"] for f in features], self.pad_id)
        out["response_len"] = response_lengths(features)
        if self.share_prompt:
            out.update(pack_pairs(features, self.pad_id, out["input_ids"].shape[1]))
        return out


def response_lengths(features: list[dict]) -> torch.Tensor:
    """Pairs (:func:`pair_example`) -> ``(2B,)`` response lengths in tokens, chosen rows first."""
    lengths = [len(f[side]) - f["prompt_len"] for side in ("chosen", "rejected") for f in features]
    return torch.tensor(lengths, dtype=torch.long)


def pad_right(rows: list[list[int]], pad_id: int) -> dict[str, torch.Tensor]:
    """Token lists -> ``input_ids (N, T)`` right-padded with ``pad_id`` and ``attention_mask (N, T)``."""
    width = max(len(r) for r in rows)
    input_ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        input_ids[i, : len(r)] = torch.tensor(r, dtype=torch.long)
        attention_mask[i, : len(r)] = 1
    return {"input_ids": input_ids, "attention_mask": attention_mask}


def length_batches(lengths: list[int], batch_size: int) -> list[list[int]]:
    """Indices ``0..N-1`` cut into ``ceil(N / batch_size)`` batches of similar length, longest first, for
    inference over a fixed list (scoring, answering): padded to its longest row, a batch of mixed lengths
    spends most of its compute on padding (HH prompts run from 10 to 1000 tokens). Callers put the results
    back in input order. Longest first, so that a row that does not fit in memory fails at once."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    return [order[s : s + batch_size] for s in range(0, len(order), batch_size)]


@dataclass
class PromptCollator:
    """Left-pad prompts (generation continues from the right edge): token lists, or
    ``{"input_ids", "prompt"}`` dicts whose dialogue texts are passed through.

    Returns ``input_ids (B, P)`` and ``attention_mask (B, P)``, P = the longest prompt in the batch, and
    for dicts ``prompts``: the B dialogue texts (what reward functions and verifiers read).
    """

    pad_id: int

    def __call__(self, features: list) -> dict:
        texts = [f["prompt"] for f in features] if features and isinstance(features[0], dict) else None
        if texts is not None:
            features = [f["input_ids"] for f in features]
        width = max(len(f) for f in features)
        input_ids = torch.full((len(features), width), self.pad_id, dtype=torch.long)
        attention_mask = torch.zeros((len(features), width), dtype=torch.long)
        for i, f in enumerate(features):
            input_ids[i, width - len(f) :] = torch.tensor(f, dtype=torch.long)
            attention_mask[i, width - len(f) :] = 1
        out: dict = {"input_ids": input_ids, "attention_mask": attention_mask}
        if texts is not None:
            out["prompts"] = texts
        return out


@dataclass
class PreferenceLMCollator:
    """Pairs for DPO: ``prompt + response + [end]`` of each side, chosen and rejected batched together.

    Returns ``input_ids (2B, T)`` right-padded (rows 0..B-1 chosen, B..2B-1 rejected),
    ``attention_mask (2B, T)``, ``labels (2B, T)`` = the response and its end token, ``IGNORE_INDEX``
    on the prompt and padding (as in step 1: the policy learns to stop), and ``index (B,)`` each pair's
    position in its data set (where its reference log-probs are kept).

    With ``share_prompt`` the batch also holds each pair as one packed row, prompt + chosen + rejected
    (:func:`dschat.data.packing.pack_preference_targets`: ``packed_*`` and ``target_*``), where every
    pair has a prompt token to predict its answers' first tokens from.
    """

    pad_id: int
    end_id: int | None
    share_prompt: bool = False

    def __call__(self, features: list[dict]) -> dict[str, torch.Tensor]:
        rows = [sft_example(f[side][: f["prompt_len"]], f[side][f["prompt_len"] :], self.end_id, False)
                for side in ("chosen", "rejected") for f in features]  # fmt: skip
        out = SFTCollator(self.pad_id)(rows)
        out["index"] = torch.tensor([f["index"] for f in features], dtype=torch.long)
        if self.share_prompt and all(f["prompt_len"] > 0 for f in features):
            end = [self.end_id] if self.end_id is not None else []
            out |= pack_preference_targets(
                [(f["chosen"][: f["prompt_len"]], f["chosen"][f["prompt_len"] :] + end, f["rejected"][f["prompt_len"] :] + end)
                 for f in features],
                self.pad_id,
            )  # fmt: skip
        return out
