"""Shared-prompt packing: a prompt and K continuations of it in one row, the prompt computed once.

A preference pair is a prompt with two continuations (chosen, rejected); a group of PPO rollouts is a
prompt with K sampled answers. Packed as ``prompt + c_1 + ... + c_K``, each continuation continues the
prompt's positions and sees only the prompt and itself (:func:`shared_prompt_mask`), so every token's
causal context, and therefore its hidden state, is the one it has in its own unpacked row. Pure tensor
code, no model: the mask in the form an attention implementation takes is here (:func:`custom_mask`); the
check that a model honours it lives with the models that use it (the reward model, PPO's actor).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from dschat.models.attention import FAST_ATTENTION

# Segment ids of packed tokens: padding, the shared prompt, then continuation k has id CONTINUATION + k.
PAD, PROMPT, CONTINUATION = 0, 1, 2
CHOSEN, REJECTED = CONTINUATION, CONTINUATION + 1  # a preference pair's two continuations


@dataclass
class Packed:
    """G packed rows, right-padded to L.

    ``input_ids (G, L)`` (padding ``pad_id``), ``position_ids (G, L)``, ``segments (G, L)`` (PAD, PROMPT,
    CONTINUATION + k); ``prompt_len[g]`` and ``starts[g][k]``: where continuation k of group g begins.
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    segments: torch.Tensor
    prompt_len: list[int]
    starts: list[list[int]]


def pack_continuations(groups: list[tuple[list[int], list[list[int]]]], pad_id: int) -> Packed:
    """``[(prompt tokens, [continuation tokens, ...]), ...]`` -> :class:`Packed`, one row per group."""
    rows, positions, segments, starts = [], [], [], []
    for prompt, conts in groups:
        p = len(prompt)
        row, pos, seg, st = list(prompt), list(range(p)), [PROMPT] * p, []
        for k, c in enumerate(conts):
            st.append(len(row))
            row += list(c)
            pos += range(p, p + len(c))
            seg += [CONTINUATION + k] * len(c)
        rows.append(row)
        positions.append(pos)
        segments.append(seg)
        starts.append(st)
    width = max(len(r) for r in rows)
    out = [torch.full((len(rows), width), fill, dtype=torch.long) for fill in (pad_id, 0, PAD)]
    for g, vals in enumerate(zip(rows, positions, segments)):
        for t, v in zip(out, vals):
            t[g, : len(v)] = torch.tensor(v, dtype=torch.long)
    return Packed(*out, prompt_len=[len(p) for p, _ in groups], starts=starts)


def shared_prompt_mask(segments: torch.Tensor) -> torch.Tensor:
    """``segments (G, L)`` of packed rows -> ``(G, 1, L, L)`` boolean attention mask, True = may attend.

    Causal; padding keys hidden; a continuation sees the prompt and itself, never another continuation.
    A padding query sees the real tokens before it: a row with nothing to attend to would give NaN.
    """
    length = segments.shape[1]
    causal = torch.ones((length, length), dtype=torch.bool, device=segments.device).tril()
    q, k = segments.unsqueeze(2), segments.unsqueeze(1)  # (G, L, 1), (G, 1, L)
    allowed = causal & (k != PAD) & ((k == PROMPT) | (k == q) | (q == PAD))
    return allowed.unsqueeze(1)


# ---------------------------------------------------------------- preference pairs (step 2)


def pack_pairs(features: list[dict], pad_id: int, width: int) -> dict[str, torch.Tensor]:
    """Pairs (:func:`dschat.data.collate.pair_example`) as rows ``prompt + chosen + rejected`` (on HH-RLHF
    the prompt is about 40% of a pair's tokens).

    Returns ``packed_input_ids``, ``packed_position_ids``, ``packed_segments`` (B, L) and
    ``unpack_index (2B, width)``: for each position of the unpacked rows (chosen rows first, as
    :class:`~dschat.data.collate.PairCollator` lays them out) where its token sits in the packed row (0
    on padding), so that :func:`unpack_pair_values` rebuilds per-token values of the unpacked rows.
    """
    b = len(features)
    groups = [(f["chosen"][: f["prompt_len"]], [f["chosen"][f["prompt_len"] :], f["rejected"][f["prompt_len"] :]])
              for f in features]  # fmt: skip
    packed = pack_continuations(groups, pad_id)
    index = torch.zeros((2 * b, width), dtype=torch.long)
    for i, (prompt, (chosen, rejected)) in enumerate(groups):
        p, rs = len(prompt), packed.starts[i][1]
        index[i, : p + len(chosen)] = torch.arange(p + len(chosen))
        index[b + i, :p] = torch.arange(p)
        index[b + i, p : p + len(rejected)] = torch.arange(rs, rs + len(rejected))
    return {"packed_input_ids": packed.input_ids, "packed_position_ids": packed.position_ids,
            "packed_segments": packed.segments, "unpack_index": index}  # fmt: skip


def unpack_pair_values(packed: torch.Tensor, unpack_index: torch.Tensor) -> torch.Tensor:
    """Per-token values of packed pairs ``(B, L[, ...])`` -> those of the unpacked rows ``(2B, T[, ...])``
    (chosen rows first; values on padding are meaningless, as unpacked)."""
    index = unpack_index.view(*unpack_index.shape, *([1] * (packed.dim() - 2))).expand(
        -1, -1, *packed.shape[2:]
    )
    return packed.repeat(2, *([1] * (packed.dim() - 1))).gather(1, index)


# ---------------------------------------------------------------- rollouts (step 3)


@dataclass
class PackedRollouts:
    """R rollouts (prompt left-padded to ``prompt_len``, then the response) packed by prompt: adjacent rows
    with the same prompt (the K answers of one prompt) share one packed row.

    A = T - prompt_len actions per row: action j predicts response token j (at column prompt_len + j).
    """

    packed: Packed  # G rows
    group: torch.Tensor  # (R,) each rollout's packed row
    source: torch.Tensor  # (R, A) the packed position whose logits predict action j
    valid: torch.Tensor  # (R, A) bool: action j lies within the row's (masked) response
    last: torch.Tensor  # (R,) the packed position of each rollout's last real token


def pack_rollouts(sequences: torch.Tensor, attention_mask: torch.Tensor, prompt_len: int, pad_id: int) -> PackedRollouts | None:  # fmt: skip
    """Rollouts ``sequences (R, T)`` with ``attention_mask (R, T)`` (the left-padded prompt, then the
    response up to where the mask ends) -> :class:`PackedRollouts`. None where a prompt is empty (no
    position would predict the first answer token) or a response's mask is not contiguous from
    ``prompt_len`` (not a rollout): such rows are scored unpacked."""
    seq, mask = sequences.cpu(), attention_mask.cpu().bool()
    r, t = seq.shape
    groups: list[tuple[list[int], list[list[int]]]] = []
    group, k_of = [], []
    for i in range(r):
        prompt = seq[i, :prompt_len][mask[i, :prompt_len]].tolist()
        n = int(mask[i, prompt_len:].sum())
        if not prompt or not bool(mask[i, prompt_len : prompt_len + n].all()):
            return None
        if not groups or prompt != groups[-1][0]:
            groups.append((prompt, []))
        groups[-1][1].append(seq[i, prompt_len : prompt_len + n].tolist())
        group.append(len(groups) - 1)
        k_of.append(len(groups[-1][1]) - 1)
    packed = pack_continuations(groups, pad_id)
    source = torch.zeros((r, t - prompt_len), dtype=torch.long)
    valid = torch.zeros((r, t - prompt_len), dtype=torch.bool)
    last = torch.zeros(r, dtype=torch.long)
    for i, (g, k) in enumerate(zip(group, k_of)):
        p, start, n = packed.prompt_len[g], packed.starts[g][k], len(groups[g][1][k])
        source[i], valid[i] = continuation_sources(p, start, n, t - prompt_len)
        last[i] = start + n - 1 if n else p - 1
    return PackedRollouts(packed, torch.tensor(group, dtype=torch.long), source, valid, last)


def rollout_rows(pr: PackedRollouts, start: int, end: int) -> tuple[PackedRollouts, int, int] | None:
    """Rollouts ``start:end`` with their packed rows ``(packed, g0, g1)``: the groups they fill, at the
    same width; None where the range splits a prompt's group (the caller packs the rows anew)."""
    group = pr.group
    r = len(group)
    if not 0 <= start < end <= r:
        return None
    g0, g1 = int(group[start]), int(group[end - 1]) + 1
    if (start > 0 and int(group[start - 1]) == g0) or (end < r and int(group[end]) == g1 - 1):
        return None
    p = pr.packed
    sub = Packed(
        p.input_ids[g0:g1], p.position_ids[g0:g1], p.segments[g0:g1], p.prompt_len[g0:g1], p.starts[g0:g1]
    )
    rows = PackedRollouts(
        sub, group[start:end] - g0, pr.source[start:end], pr.valid[start:end], pr.last[start:end]
    )
    return rows, g0, g1


def read_at(pr: PackedRollouts, lengths: torch.Tensor) -> PackedRollouts:
    """The same packed rows, read at each rollout's token ``lengths[r] - 1`` (R,) of its response instead
    of its last one: ``lengths`` at most the packed responses' (the prompt's last token where 0).

    The reward model reads a rollout before its end token (step 2 scored responses without it). Packing
    with the end token in place and reading before it gives the same values as packing without it, since
    no earlier position attends to a later one, and keeps the rows the actor's experience pass ran,
    whose hidden states the reward model can then reuse (:mod:`dschat.models.trunk`)."""
    n = pr.valid.sum(1)
    lengths = lengths.to(n.device)
    if bool((lengths > n).any()):
        raise ValueError("read_at: a length beyond its packed response")
    last = torch.where(lengths > 0, pr.last - n + lengths, pr.source[:, 0])  # source[:, 0]: the prompt's last
    return dataclasses.replace(pr, last=last)


def continuation_sources(
    prompt_len: int, start: int, n: int, width: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """For a continuation of ``n`` tokens packed at ``start`` after a prompt of ``prompt_len`` tokens:
    ``(source (width,), valid (width,))``, the packed position whose logits predict its token j, and
    whether j < n. Token 0 is predicted from the prompt's last token, token j > 0 from token j - 1; past
    the continuation, from the prompt's last token (any real position: the target is masked)."""
    j = torch.arange(width)
    return torch.where((j == 0) | (j >= n), prompt_len - 1, start + j - 1), j < n


# ---------------------------------------------------------------- preference pairs for a policy (DPO)


def pack_preference_targets(rows: list[tuple[list[int], list[int], list[int]]], pad_id: int) -> dict[str, torch.Tensor]:  # fmt: skip
    """Pairs ``(prompt, chosen targets, rejected targets)`` (each answer with its end token: the tokens
    whose log-probs DPO sums) as rows ``prompt + chosen + rejected``.

    Returns ``packed_input_ids``, ``packed_position_ids``, ``packed_segments`` (B, L) and, for the 2B
    answers (chosen rows first), ``target_tokens (2B, A)`` (0 past an answer), ``target_source (2B, A)``:
    the packed position whose logits predict each, ``target_valid (2B, A)``; A = the longest answer. An
    answer's last token (its end token) predicts nothing, yet stays in the row: it is one of the targets.
    """
    b = len(rows)
    if any(not p for p, _, _ in rows):
        raise ValueError("a packed pair needs a prompt token to predict its answers' first tokens from")
    packed = pack_continuations([(p, [c, r]) for p, c, r in rows], pad_id)
    width = max(max(len(c), len(r)) for _, c, r in rows)
    tokens = torch.zeros((2 * b, width), dtype=torch.long)
    source = torch.zeros((2 * b, width), dtype=torch.long)
    valid = torch.zeros((2 * b, width), dtype=torch.bool)
    for i, (p, c, r) in enumerate(rows):
        for side, answer in ((0, c), (1, r)):
            row = side * b + i
            tokens[row, : len(answer)] = torch.tensor(answer, dtype=torch.long)
            source[row], valid[row] = continuation_sources(len(p), packed.starts[i][side], len(answer), width)
    return {"packed_input_ids": packed.input_ids, "packed_position_ids": packed.position_ids,
            "packed_segments": packed.segments, "target_group": torch.arange(2 * b) % b, "target_tokens": tokens,
            "target_source": source, "target_valid": valid}  # fmt: skip


def drop_packed(batch: dict) -> None:
    """Remove a collated batch's packed fields (a run that fell back to separate rows after collating)."""
    for key in [k for k in batch if k.startswith(("packed_", "target_")) or k == "unpack_index"]:
        del batch[key]


def stop_packing(collate, eval_sets: list[list]) -> None:
    """A run falls back to separate rows: ``collate`` (a pair collator with ``share_prompt``) stops packing,
    and the batches of ``eval_sets`` (lists of (batch, weight)), collated already, lose their packed fields."""
    collate.share_prompt = False
    for batches in eval_sets:
        for batch, _ in batches:
            drop_packed(batch)


def pair_token_counts(batch: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(tokens, computed, positions)`` of a collated batch of pairs: the pairs' real tokens as separate
    rows hold them (throughput counts these, packed or not: the same work), the real tokens the model ran
    (a shared prompt once when the batch is packed), and the positions it ran, padding included."""
    mask = batch["attention_mask"]
    tokens = mask.sum()
    if "packed_segments" not in batch:
        return tokens, tokens, torch.tensor(mask.numel())
    real = batch["packed_segments"] != PAD
    return tokens, real.sum(), torch.tensor(real.numel())


# ---------------------------------------------------------------- the mask a model takes

# Attention implementations that take a (G, 1, L, L) mask as given (flash attention takes none);
# dschat_sdpa (dschat.models.attention) is SDPA computed in fp32 and takes SDPA's mask.
CUSTOM_MASK_ATTENTION = ("sdpa", FAST_ATTENTION, "eager")


def custom_mask(allowed: torch.Tensor, attn_implementation: str | None, dtype: torch.dtype) -> torch.Tensor:
    """A boolean ``(G, 1, L, L)`` mask (True = may attend) in the form ``attn_implementation`` takes: SDPA
    (and ``dschat_sdpa``) the boolean mask, eager an additive one in the model's ``dtype`` (0 or the dtype's minimum)."""
    if attn_implementation not in CUSTOM_MASK_ATTENTION:
        raise ValueError(f"attention implementation {attn_implementation!r} takes no custom mask")
    if attn_implementation != "eager":
        return allowed
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill(
        ~allowed, torch.finfo(dtype).min
    )
