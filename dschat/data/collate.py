"""Tokenization of one sample and batch collation: pure functions, exact tensors, no deepspeed.

Samples are padded per batch (to the longest sample in the batch, optionally rounded up to a
multiple), never to ``max_seq_len``: padding tokens cost compute and teach nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

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
    With ``share_prompt`` also each pair packed into one row (:func:`pack_pairs`), so that a model can
    compute the shared prompt once.
    """

    pad_id: int
    share_prompt: bool = False

    def __call__(self, features: list[dict]) -> dict[str, torch.Tensor]:
        out = pad_right([f["chosen"] for f in features] + [f["rejected"] for f in features], self.pad_id)
        out["response_len"] = response_lengths(features)
        if self.share_prompt:
            out.update(pack_pairs(features, self.pad_id, out["input_ids"].shape[1]))
        return out


# Segment ids of a packed pair's tokens (pack_pairs): what each token may attend to depends on them.
PAD, PROMPT, CHOSEN, REJECTED = 0, 1, 2, 3


def pack_pairs(features: list[dict], pad_id: int, width: int) -> dict[str, torch.Tensor]:
    """Each pair as one row ``prompt + chosen + rejected``: the prompt's tokens are computed once, not twice
    (on HH-RLHF the prompt is about 40% of a pair's tokens).

    The rejected answer continues the prompt's positions (it starts at position ``prompt_len``, as the
    chosen one does) and must not see the chosen answer (:func:`shared_prompt_mask`); then every token's
    causal context equals the one it has in its own unpacked row, so the values are the same.

    Returns ``packed_input_ids (B, L)`` right-padded with ``pad_id``, ``packed_position_ids (B, L)``,
    ``packed_segments (B, L)`` (PAD, PROMPT, CHOSEN, REJECTED) and ``unpack_index (2B, width)``: for each
    position of the unpacked rows (:class:`PairCollator`, chosen rows first), where its token sits in the
    packed row (0 on padding), so that ``packed.repeat(2, 1).gather(1, unpack_index)`` unpacks.
    """
    b = len(features)
    rows, positions, segments = [], [], []
    index = torch.zeros((2 * b, width), dtype=torch.long)
    for i, f in enumerate(features):
        p, chosen, rejected = f["prompt_len"], f["chosen"], f["rejected"]
        rows.append(list(chosen) + list(rejected[p:]))
        positions.append(list(range(len(chosen))) + list(range(p, len(rejected))))
        segments.append([PROMPT] * p + [CHOSEN] * (len(chosen) - p) + [REJECTED] * (len(rejected) - p))
        index[i, : len(chosen)] = torch.arange(len(chosen))
        index[b + i, :p] = torch.arange(p)
        index[b + i, p : len(rejected)] = torch.arange(len(chosen), len(chosen) + len(rejected) - p)
    packed = pad_right(rows, pad_id)
    length = packed["input_ids"].shape[1]
    out = {"packed_input_ids": packed["input_ids"], "unpack_index": index}
    for key, vals in (("packed_position_ids", positions), ("packed_segments", segments)):
        out[key] = torch.zeros((b, length), dtype=torch.long)
        for i, v in enumerate(vals):
            out[key][i, : len(v)] = torch.tensor(v, dtype=torch.long)
    return out


def shared_prompt_mask(segments: torch.Tensor) -> torch.Tensor:
    """``segments (B, L)`` of packed pairs -> ``(B, 1, L, L)`` boolean attention mask, True = may attend.

    Causal, padding keys hidden, and the rejected answer's tokens do not see the chosen answer's. A
    padding query still sees the real tokens before it: a row with nothing to attend to would give NaN.
    """
    length = segments.shape[1]
    causal = torch.ones((length, length), dtype=torch.bool, device=segments.device).tril()
    q, k = segments.unsqueeze(2), segments.unsqueeze(1)  # (B, L, 1), (B, 1, L)
    allowed = causal & (k != PAD) & ~((q == REJECTED) & (k == CHOSEN))
    return allowed.unsqueeze(1)


def unpack_pair_values(packed: torch.Tensor, unpack_index: torch.Tensor) -> torch.Tensor:
    """Per-token values of packed pairs ``(B, L)`` -> those of the unpacked rows ``(2B, T)`` (chosen rows
    first, as :class:`PairCollator` lays them out; values on padding are meaningless, as unpacked)."""
    return packed.repeat(2, 1).gather(1, unpack_index)


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
    """

    pad_id: int
    end_id: int | None

    def __call__(self, features: list[dict]) -> dict[str, torch.Tensor]:
        rows = [sft_example(f[side][: f["prompt_len"]], f[side][f["prompt_len"] :], self.end_id, False)
                for side in ("chosen", "rejected") for f in features]  # fmt: skip
        out = SFTCollator(self.pad_id)(rows)
        out["index"] = torch.tensor([f["index"] for f in features], dtype=torch.long)
        return out
