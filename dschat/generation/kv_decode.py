"""Token-by-token generation with a KV cache, following :class:`SamplingConfig` the way Hugging Face
``generate`` does (same filters in the same order, rows padded after their EOS; with
``draw="multinomial"`` the same ``torch.multinomial`` draw, so the same tokens from the same seed),
without ``generate``'s per-step machinery. Used by every generator of the training steps
(the plain generator, the hybrid engine's inference copy, prompts -> texts); the inference tools keep
``generate``. Unlike ``generate`` it applies no processor from a checkpoint's generation config (a
repetition penalty, say): the steps draw from what :class:`SamplingConfig` says, nothing else.

    out = decode(model, input_ids, attention_mask, sampling, eos_token_id=2, pad_token_id=0)
    out.sequences  # (B, P + n)

No deepspeed here; ``torch.distributed`` only for ranks that must step together (``lockstep``).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from dschat.generation.sampling import SamplingConfig
from dschat.models.layers import accepts

if TYPE_CHECKING:
    from transformers import DynamicCache


def position_ids_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Positions that skip left padding, as ``generate`` computes them: (B, T)."""
    pos = attention_mask.long().cumsum(-1) - 1
    return pos.clamp_min(0)


def filter_logits(
    logits: torch.Tensor, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0
) -> torch.Tensor:
    """Temperature, then top-k, then top-p (nucleus) on (B, V) logits; removed entries become -inf.

    Hugging Face's warpers, in their order: ``top_k`` keeps every token whose logit is at least the
    k-th largest (ties stay), ``top_p`` drops the lowest-probability tokens whose cumulative
    probability is at most ``1 - top_p`` and always keeps the most likely one. 0 / 1.0 switch off.
    """
    if temperature != 1.0:
        logits = logits / temperature
    if top_k and top_k > 0:
        k = min(top_k, logits.shape[-1])
        kth = torch.topk(logits, k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=False)
        cum = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        drop_sorted = cum <= (1.0 - top_p)
        drop_sorted[..., -1:] = False
        drop = drop_sorted.scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def inverse_cdf_draw(probs: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """(B, V) probabilities -> (B,) one token per row, from one uniform number per row: the first token
    whose cumulative probability exceeds it. Summed in float64 (49152 fp32 terms would round by up to
    ~1e-3 of the total), and the uniform is scaled by each row's total, so a token of probability 0 is
    never drawn. Draws B numbers whatever the rows hold, so a row's token does not depend on the others.
    A row with NaN, inf or no mass raises, as ``torch.multinomial`` does (a diverged model must not
    quietly emit some token)."""
    cdf = probs.to(torch.float64).cumsum(dim=-1)
    total = cdf[:, -1:]
    if not bool((torch.isfinite(total) & (total > 0)).all()):
        raise RuntimeError("sampling: the probabilities contain inf or nan, or a row sums to 0")
    u = torch.rand(probs.shape[0], 1, generator=generator, dtype=torch.float64, device=probs.device)
    return torch.searchsorted(cdf, u * total, right=True).squeeze(1)


def next_tokens(
    logits: torch.Tensor,
    sampling: SamplingConfig,
    generator: torch.Generator | None = None,
    greedy_rows: torch.Tensor | None = None,
) -> torch.Tensor:
    """(B, V) float logits -> (B,) token ids: argmax, or one draw from the filtered distribution (by
    ``sampling.draw``); ``greedy_rows`` (B,) bool: those rows take the argmax whatever ``sampling`` says."""
    if not sampling.do_sample:
        return logits.argmax(dim=-1)
    probs = filter_logits(logits, sampling.temperature, sampling.top_k, sampling.top_p).softmax(dim=-1)
    if sampling.draw == "multinomial":
        drawn = torch.multinomial(probs, num_samples=1, generator=generator).squeeze(1)
    else:
        drawn = inverse_cdf_draw(probs, generator)
    return drawn if greedy_rows is None else torch.where(greedy_rows, logits.argmax(dim=-1), drawn)


def shared_prompts(
    input_ids: torch.Tensor, attention_mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Rows that repeat one prompt (PPO's ``n_samples_per_prompt`` answers, K samples to mine): (U,) the
    index of one row per distinct (ids, mask) row and (B,) each row's distinct prompt, or None when no
    two rows are alike."""
    key = torch.cat([input_ids.long(), attention_mask.long()], dim=1)
    distinct, inverse = torch.unique(key, dim=0, return_inverse=True)
    b, u = key.shape[0], distinct.shape[0]
    if u == b:
        return None
    first = torch.full((u,), b, dtype=torch.long, device=key.device)
    first.scatter_reduce_(0, inverse, torch.arange(b, device=key.device), reduce="amin")
    return first, inverse


_KV_ONLY_LAYER_TYPES = {"full_attention", "sliding_attention", "chunked_attention"}


def _rows_copyable(cache) -> bool:
    """Whether copying cache rows copies everything the cache holds: a dynamic cache whose layers are
    plain key/value stores (full or sliding-window). Linear-attention, convolution and hybrid layers keep
    other state that ``batch_select_indices`` leaves behind or cannot copy."""
    from transformers.cache_utils import DynamicCache, DynamicLayer, DynamicSlidingWindowLayer

    plain = (DynamicLayer, DynamicSlidingWindowLayer, reserved_layer_class())
    return isinstance(cache, DynamicCache) and all(type(layer) in plain for layer in cache.layers)


@functools.cache
def reserved_layer_class() -> type:
    """A transformers ``DynamicLayer`` whose keys and values are views of (B, H, capacity, D) buffers.

    ``DynamicLayer`` concatenates every new token's keys and values onto the cache, which copies the whole
    cache at every token: O(L) per token, O(L^2) per answer (a sixth of a SmolLM2 decode step at 150
    positions on CPU). Here a token writes its own position in place; past the capacity the buffers
    double (one copy). Rows leave the batch as with ``DynamicLayer`` (``batch_select_indices``)."""
    from transformers.cache_utils import DynamicLayer

    class ReservedLayer(DynamicLayer):
        @classmethod
        def holding(cls, keys: torch.Tensor, values: torch.Tensor, capacity: int) -> ReservedLayer:
            layer = cls()
            layer.lazy_initialization(keys, values)
            layer._store(keys, values, capacity)
            return layer

        def _store(self, keys: torch.Tensor, values: torch.Tensor, capacity: int) -> None:
            n = keys.shape[-2]
            self._k = keys.new_empty(*keys.shape[:-2], capacity, keys.shape[-1])
            self._v = values.new_empty(*values.shape[:-2], capacity, values.shape[-1])
            self._k[..., :n, :] = keys
            self._v[..., :n, :] = values
            self._view(n)

        def _view(self, n: int) -> None:
            self._n = n
            self.keys, self.values = self._k[..., :n, :], self._v[..., :n, :]

        def update(
            self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
        ) -> tuple[torch.Tensor, torch.Tensor]:
            if not self.is_initialized or getattr(self, "_k", None) is None:  # after reset()
                self.lazy_initialization(key_states, value_states)
                self._store(key_states, value_states, key_states.shape[-2])
                return self.keys, self.values
            # The buffers take the prefill's dtype, and a cache that casts (Fp32DynamicCache) casts before
            # this, so every token arrives in it; assigning would cast silently where cat would promote.
            assert key_states.dtype == self._k.dtype, (key_states.dtype, self._k.dtype)
            n, t = self._n, key_states.shape[-2]
            if n + t > self._k.shape[-2]:
                self._store(self.keys, self.values, max(2 * self._k.shape[-2], n + t))
            self._k[..., n : n + t, :] = key_states
            self._v[..., n : n + t, :] = value_states
            self._view(n + t)
            return self.keys, self.values

        def get_seq_length(self) -> int:
            return self._n if self.is_initialized and getattr(self, "_k", None) is not None else 0

        def crop(self, tokens_to_remove: int) -> None:
            super().crop(tokens_to_remove)  # the checks; then the view of the kept positions
            if tokens_to_remove < 0 and self.is_initialized:
                self._view(max(0, self._n + tokens_to_remove))

        def batch_select_indices(self, indices: torch.Tensor) -> None:
            if self.get_seq_length() > 0:
                self._k, self._v = self._k[indices, ...], self._v[indices, ...]
                self._view(self._n)

        def batch_repeat_interleave(self, repeats: int) -> None:
            if self.get_seq_length() > 0:
                self._k = self._k.repeat_interleave(repeats, dim=0)
                self._v = self._v.repeat_interleave(repeats, dim=0)
                self._view(self._n)

        def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
            if self.get_seq_length() > 0:
                self.batch_select_indices(beam_idx.to(self._k.device))

        def reset(self) -> None:
            self._k = self._v = None
            self._n = 0
            super().reset()

        def offload(self):  # the mixin moves keys/values only, which here are views of the buffers
            raise NotImplementedError("a reserved KV-cache layer is not offloaded")

        prefetch = offload

    return ReservedLayer


def reserve(cache: DynamicCache, positions: int) -> None:
    """Give each plain full-attention layer of ``cache`` (a transformers ``DynamicCache``) room for
    ``positions`` more tokens, in place: see :func:`reserved_layer_class`. Other layers stay as they are."""
    from transformers.cache_utils import DynamicLayer

    reserved = reserved_layer_class()
    for i, layer in enumerate(cache.layers):
        if type(layer) is DynamicLayer and layer.get_seq_length() > 0:
            cache.layers[i] = reserved.holding(layer.keys, layer.values, layer.get_seq_length() + positions)


def _may_share(model: torch.nn.Module, cache) -> bool:
    """Before the prefill: a given cache must be copyable; without one, the model's layer types (where its
    config names them) must all be attention over keys and values."""
    if cache is not None:
        return _rows_copyable(cache)
    config = getattr(model, "config", None)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    types = getattr(text, "layer_types", None) or ()
    return set(types) <= _KV_ONLY_LAYER_TYPES


@dataclass
class DecodeOutput:
    sequences: torch.Tensor  # (B, P + n): prompt, then new tokens, pad after each row's EOS
    logprobs: torch.Tensor | None  # (B, n) log-softmax of the raw logits at the chosen tokens (0 after EOS)
    new_tokens: int  # n


@torch.no_grad()
def decode(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    sampling: SamplingConfig,
    *,
    eos_token_id: int | Sequence[int] | None,
    pad_token_id: int,
    cache=None,
    generator: torch.Generator | None = None,
    lockstep=None,
    return_logprobs: bool = False,
    greedy_rows: torch.Tensor | None = None,
) -> DecodeOutput:
    """Generate up to ``sampling.max_new_tokens`` tokens for (B, P) left-padded prompts.

    ``cache`` is a transformers ``Cache`` sized for at least P + max_new_tokens (None: a dynamic one).
    Rows that repeat one prompt share its prefill: the distinct prompts run once and their cache rows
    are copied (K answers per prompt then cost one prompt forward, not K), where the cache is a dynamic
    one of key/value layers; linear-attention or convolution layers and a ``StaticCache`` prefill every
    row.
    Where the cache's rows can be copied, a row that has stopped leaves the batch: later steps compute
    only the rows still generating (answers of mixed lengths cost their own length, not the longest).
    The draws are those of the full batch (with ``multinomial``, ``generate``'s); the logits are equal in
    fp32, while in bf16 (or on a GPU, whose kernels depend on the batch's shape) a smaller batch may round
    differently.
    Positions skip left padding exactly as the training forward computes them. A row stops at its
    EOS (any of them, where ``eos_token_id`` is a list: a chat template's end of turn and the EOS, as
    ``generate`` takes them) and is padded after it; the loop stops when every row has stopped. ``lockstep`` (a process
    group, or ``True`` for the default group) keeps several ranks stepping together until all of them
    are done (needed when each forward is collective, e.g. a ZeRO-3 module); a rank that is done
    keeps running forwards on a dummy token without appending, like ``generate(synced_gpus=True)``.
    ``sampling.min_new_tokens`` forbids EOS before that many tokens (Hugging Face's ``min_new_tokens``).
    ``greedy_rows`` (B,) bool: those rows are decoded greedily, the others by ``sampling`` (a greedy and a
    sampled answer to one prompt then share its prefill).
    """
    import torch.distributed as tdist

    b = input_ids.shape[0]
    if greedy_rows is not None:
        greedy_rows = greedy_rows.to(device=input_ids.device, dtype=torch.bool)
    if sampling.max_new_tokens < 1:
        return DecodeOutput(input_ids, None, 0)
    device = input_ids.device
    mask = attention_mask.to(device=device, dtype=torch.long)
    positions = position_ids_from_mask(mask)
    # through a peft wrapper too (its forward passes the keyword on): no (B, P, V) prefill logits
    extra = {"logits_to_keep": 1} if accepts(model, "logits_to_keep") else {}
    shared = shared_prompts(input_ids, mask) if _may_share(model, cache) else None
    if shared is not None:
        first, inverse = shared
        out = model(input_ids=input_ids[first], attention_mask=mask[first], position_ids=positions[first],
                    past_key_values=cache, use_cache=True, **extra)  # fmt: skip
        if _rows_copyable(out.past_key_values):
            cache = out.past_key_values
            cache.batch_select_indices(inverse)  # (U, ...) -> (B, ...): each row its prompt's keys and values
            logits = out.logits[:, -1, :].float()[inverse]
        else:  # the model built a cache with other state (no layer types in its config): every row
            shared = None
    if shared is None:
        out = model(input_ids=input_ids, attention_mask=mask, position_ids=positions, past_key_values=cache,
                    use_cache=True, **extra)  # fmt: skip
        cache = out.past_key_values
        logits = out.logits[:, -1, :].float()
    # Rows that have stopped leave the batch (their cache rows are dropped), so each step computes only
    # the rows still generating; ``rows`` (A,) are the rows the cache holds, None while it holds all B.
    compact = _rows_copyable(cache)
    if compact:  # the new tokens' keys and values are written in place, not concatenated
        reserve(cache, sampling.max_new_tokens)
    pos = positions[:, -1:]
    rows: torch.Tensor | None = None
    unfinished = torch.ones(b, dtype=torch.bool, device=device)
    stops = None
    if eos_token_id is not None:
        ids = [eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id)
        stops = torch.tensor(ids, dtype=torch.long, device=device) if ids else None
    tokens: list[torch.Tensor] = []
    scores: list[torch.Tensor] = []
    synced = lockstep is not None and lockstep is not False
    group = None if lockstep is True else lockstep
    this_done = False
    while True:
        if not this_done:
            step_logits = logits
            if stops is not None and len(tokens) < sampling.min_new_tokens:
                step_logits = logits.clone()
                step_logits[:, stops] = float("-inf")
            tok = next_tokens(step_logits, sampling, generator, greedy_rows)
            if return_logprobs:
                lp = torch.log_softmax(logits, dim=-1).gather(1, tok[:, None]).squeeze(1)
                scores.append(torch.where(unfinished, lp, torch.zeros_like(lp)))
            tok = torch.where(unfinished, tok, torch.full_like(tok, pad_token_id))
            tokens.append(tok)
            if stops is not None:
                unfinished &= ~torch.isin(tok, stops)
            this_done = len(tokens) >= sampling.max_new_tokens or not bool(unfinished.any())
        all_done = this_done
        if synced:
            flag = torch.tensor([0.0 if this_done else 1.0], device=device)
            tdist.all_reduce(flag, op=tdist.ReduceOp.MAX, group=group)
            all_done = float(flag) == 0.0
        if all_done:
            break
        if this_done:  # a peer still generates: run the (collective) forward on a dummy token, no cache
            model(input_ids=input_ids[:1, -1:], use_cache=False)
            continue
        mask = torch.cat([mask, mask.new_ones(mask.shape[0], 1)], dim=1)
        pos = pos + 1
        held = unfinished if rows is None else unfinished[rows]  # (A,)
        if compact and not bool(held.all()):
            keep = held.nonzero().squeeze(1)
            cache.batch_select_indices(keep)
            rows = keep if rows is None else rows[keep]
            mask, pos = mask[keep], pos[keep]
        step = tokens[-1] if rows is None else tokens[-1][rows]
        out = model(input_ids=step[:, None], attention_mask=mask, position_ids=pos, past_key_values=cache,
                    use_cache=True)  # fmt: skip
        logits = out.logits[:, -1, :].float()
        if rows is not None:
            # Back to (B, V): a stopped row's logits are zeros. Its draw is discarded (it gets the pad), and
            # both draws take the same random numbers whatever the rows hold (``torch.multinomial`` one
            # exponential per entry, the inverse CDF one uniform per row), so the rows still generating
            # draw exactly what they would in the full batch (with ``multinomial``, ``generate``'s tokens).
            logits = logits.new_zeros(b, logits.shape[-1]).index_copy_(0, rows, logits)
    new = torch.stack(tokens, dim=1) if tokens else input_ids.new_zeros(b, 0)
    return DecodeOutput(
        sequences=torch.cat([input_ids, new.to(input_ids.dtype)], dim=1),
        logprobs=torch.stack(scores, dim=1) if scores else None,
        new_tokens=new.shape[1],
    )
