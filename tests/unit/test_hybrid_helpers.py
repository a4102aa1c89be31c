"""Pure pieces of the hybrid engine: sampling filters, the KV-cache decode loop, tensor-parallel
sharding plans, the LoRA merge, the inference copy on a plain model, and the step-3 flag checks.
No deepspeed: the copy is filled with ``no_gather`` (the weights are already whole)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from torch import nn

from dschat import config as C
from dschat.generation.inference_copy import (
    PLANS,
    InferenceCopy,
    ShardSpec,
    UnsupportedModel,
    local_shape,
    merged_lora_weight,
    no_gather,
    plan_for,
    shard,
    shard_spec,
)
from dschat.generation.kv_decode import (
    decode,
    filter_logits,
    inverse_cdf_draw,
    next_tokens,
    position_ids_from_mask,
    reserve,
    reserved_layer_class,
    shared_prompts,
)
from dschat.generation.sampling import SamplingConfig
from dschat.models.builtin import build_config
from dschat.utils.errors import UserError
from tests.unit.gloo import on_two_ranks

NEG = float("-inf")


def tiny_llama(seed: int = 0, vocab: int = 64):
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    return LlamaForCausalLM(build_config("micro-llama", vocab_size=vocab)).eval()


# ---------------------------------------------------------------------------------------------- filters
def test_temperature_divides_the_logits():
    x = torch.tensor([[1.0, 2.0, 4.0]])
    assert torch.equal(filter_logits(x, temperature=2.0), torch.tensor([[0.5, 1.0, 2.0]]))


def test_top_k_keeps_the_k_largest_and_their_ties():
    x = torch.tensor([[1.0, 4.0, 3.0, 3.0, 0.0]])
    assert torch.equal(filter_logits(x, top_k=2), torch.tensor([[NEG, 4.0, 3.0, 3.0, NEG]]))
    assert torch.equal(filter_logits(x, top_k=0), x)  # 0 = off
    assert torch.equal(filter_logits(x, top_k=10), x)  # more than the vocabulary: all stay


def test_top_p_keeps_the_smallest_set_reaching_p():
    # probabilities 0.5, 0.25, 0.125, 0.125 (logits are their logs)
    x = torch.log(torch.tensor([[0.125, 0.5, 0.125, 0.25]]))
    # p = 0.7: 0.5 alone is not enough, 0.5 + 0.25 is -> keep those two
    out = filter_logits(x, top_p=0.7)
    assert torch.isinf(out[0, [0, 2]]).all() and torch.isfinite(out[0, [1, 3]]).all()
    # p = 0.5: the top token alone reaches it
    out = filter_logits(x, top_p=0.5)
    assert torch.isfinite(out[0]).tolist() == [False, True, False, False]
    # a tiny p still keeps the most likely token
    assert torch.isfinite(filter_logits(x, top_p=1e-6)[0]).sum() == 1


def test_filters_apply_temperature_then_top_k_then_top_p():
    x = torch.log(torch.tensor([[0.4, 0.3, 0.2, 0.1]]))
    # top_k=3 removes 0.1; renormalised 0.444, 0.333, 0.222; top_p=0.7 keeps 0.444 + 0.333
    out = filter_logits(x, top_k=3, top_p=0.7)
    assert torch.isfinite(out[0]).tolist() == [True, True, False, False]


def test_next_tokens_greedy_and_sampling_follow_the_config():
    x = torch.tensor([[0.0, 5.0, 1.0], [3.0, 0.0, 0.0]])
    assert next_tokens(x, SamplingConfig(max_new_tokens=1, do_sample=False)).tolist() == [1, 0]
    g = torch.Generator().manual_seed(0)
    # top_k=1 leaves one token per row: sampling must pick it
    assert next_tokens(x, SamplingConfig(max_new_tokens=1, top_k=1), g).tolist() == [1, 0]


def test_inverse_cdf_draw_picks_the_token_whose_cumulative_probability_first_exceeds_the_uniform():
    """Probabilities 0.1, 0, 0.6, 0.3 (cumulative 0.1, 0.1, 0.7, 1.0): a uniform below 0.1 picks token 0,
    one in [0.1, 0.7) token 2, one from 0.7 on token 3; token 1 (probability 0) never. The uniforms are
    the draw's own (the same generator state, one float64 per row)."""
    probs = torch.tensor([[0.1, 0.0, 0.6, 0.3]]).expand(64, 4)
    g = torch.Generator().manual_seed(7)
    u = torch.rand(64, 1, generator=torch.Generator().set_state(g.get_state()), dtype=torch.float64)[:, 0]
    want = torch.where(u < 0.1, 0, torch.where(u < 0.7, 2, 3))
    assert {0, 2, 3} <= set(want.tolist())  # the seed reaches every bucket
    assert torch.equal(inverse_cdf_draw(probs, g), want)
    # rows whose probabilities do not sum to 1 (rounding): the uniform is scaled by the row's total, so
    # 0.3 and 0.2 are drawn 0.6 and 0.4 of the time (unscaled, a uniform above 0.5 would pick token 3)
    drawn = inverse_cdf_draw(
        torch.tensor([[0.3, 0.2, 0.0, 0.0]]).expand(20000, 4), torch.Generator().manual_seed(1)
    )
    assert set(drawn.tolist()) == {0, 1} and abs(float((drawn == 0).double().mean()) - 0.6) < 0.02
    # a diverged model: NaN, inf or a row without mass is an error, as with torch.multinomial
    for bad in ([[0.5, float("nan"), 0.5]], [[0.0, float("inf"), 1.0]], [[0.0, 0.0, 0.0]]):
        with pytest.raises(RuntimeError, match="inf or nan, or a row sums to 0"):
            inverse_cdf_draw(torch.tensor(bad))


def test_inverse_cdf_draw_follows_the_distribution_and_each_row_draws_alone():
    """Frequencies over 40000 rows within 0.01 of the probabilities (5 standard errors); a filtered
    (-inf) token is never drawn through ``next_tokens``; and a row's token does not depend on the other
    rows' probabilities (one uniform per row, so rows leaving the decoding batch change nothing)."""
    p = torch.tensor([0.05, 0.25, 0.0, 0.45, 0.25])
    drawn = inverse_cdf_draw(p.expand(40000, 5), torch.Generator().manual_seed(0))
    freq = torch.bincount(drawn, minlength=5).double() / 40000
    assert (freq - p.double()).abs().max() < 0.01 and freq[2] == 0
    logits = torch.log(p.clamp_min(1e-9)).expand(4000, 5)
    s = SamplingConfig(max_new_tokens=1, top_k=2)  # keeps tokens 3 and one or both of the 0.25s (ties stay)
    picked = next_tokens(logits, s, torch.Generator().manual_seed(1))
    assert set(picked.tolist()) <= {1, 3, 4} and 3 in picked.tolist()
    a = torch.softmax(torch.randn(6, 50), dim=-1)
    b = a.clone()
    b[[1, 4]] = torch.softmax(torch.randn(2, 50), dim=-1)  # other rows, other distributions
    ta, tb = (inverse_cdf_draw(x, torch.Generator().manual_seed(3)) for x in (a, b))
    assert torch.equal(ta[[0, 2, 3, 5]], tb[[0, 2, 3, 5]])


def test_sampling_draw_is_checked():
    with pytest.raises(UserError, match="--sampling_draw gumbel: must be one of inverse_cdf, multinomial"):
        SamplingConfig(max_new_tokens=4, draw="gumbel").validate({"draw": "--sampling_draw"})


# ---------------------------------------------------------------------------------------------- decoding
class Counter(nn.Module):
    """A model whose next token is always (last token + 1) mod V; enough to check the loop's bookkeeping."""

    def __init__(self, vocab: int = 10) -> None:
        super().__init__()
        self.vocab = vocab
        self.positions: list[torch.Tensor] = []

    def forward(
        self, input_ids, attention_mask=None, position_ids=None, past_key_values=None, use_cache=True
    ):
        self.positions.append(position_ids)
        logits = nn.functional.one_hot((input_ids + 1) % self.vocab, self.vocab).float() * 10
        return type("Out", (), {"logits": logits, "past_key_values": past_key_values})()


def test_decode_stops_rows_at_eos_and_pads_after_it():
    model = Counter()
    ids = torch.tensor([[0, 3], [0, 6], [1, 1]])
    mask = torch.tensor([[0, 1], [1, 1], [1, 1]])  # row 0 is left-padded
    out = decode(model, ids, mask, SamplingConfig(max_new_tokens=6, do_sample=False), eos_token_id=7,
                 pad_token_id=0, return_logprobs=True)  # fmt: skip
    # row 0: 4 5 6 7(eos) then pad; row 1: 7(eos) at once; row 2: 2 3 4 5 6 7 (stops with the last row)
    assert out.sequences[:, 2:].tolist() == [[4, 5, 6, 7, 0, 0], [7, 0, 0, 0, 0, 0], [2, 3, 4, 5, 6, 7]]
    assert out.new_tokens == 6
    # positions skip left padding: row 0's prompt token sits at position 0, its first new token at 1
    assert model.positions[0].tolist() == [[0, 0], [0, 1], [0, 1]]
    assert model.positions[1].tolist() == [[1], [2], [2]]
    # log-probs of the chosen tokens (certain here: ~0), zero after EOS
    assert out.logprobs.shape == (3, 6)
    assert out.logprobs[1, 1:].eq(0).all() and out.logprobs.abs().max() < 1e-3


def test_decode_stops_when_every_row_is_done_and_honours_min_new_tokens():
    ids, mask = torch.tensor([[5]]), torch.tensor([[1]])
    out = decode(
        Counter(),
        ids,
        mask,
        SamplingConfig(max_new_tokens=8, do_sample=False),
        eos_token_id=7,
        pad_token_id=0,
    )
    assert out.sequences.tolist() == [[5, 6, 7]]  # EOS after two tokens ends the loop
    forced = SamplingConfig(max_new_tokens=4, do_sample=False, min_new_tokens=4)
    out = decode(Counter(), ids, mask, forced, eos_token_id=7, pad_token_id=0)
    assert out.new_tokens == 4 and 7 not in out.sequences[0, 1:].tolist()


@pytest.mark.parametrize("do_sample", [False, True])
def test_decode_equals_hugging_face_generate(do_sample):
    """Same tokens as ``generate`` on the same model: greedy, and sampled from the same seed with every
    filter on (the draw is the same ``torch.multinomial`` over the same filtered distribution)."""
    model = tiny_llama()
    ids = torch.tensor([[0, 0, 5, 9, 11], [7, 3, 8, 8, 2], [0, 4, 4, 6, 1]])
    mask = (torch.arange(5) >= torch.tensor([[2], [0], [1]])).long()
    s = SamplingConfig(
        max_new_tokens=10, do_sample=do_sample, temperature=0.7, top_k=12, top_p=0.9, draw="multinomial"
    )
    torch.manual_seed(3)
    ours = decode(model, ids, mask, s, eos_token_id=2, pad_token_id=0).sequences
    kw = dict(temperature=0.7, top_k=12, top_p=0.9) if do_sample else {}
    torch.manual_seed(3)
    ref = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=10, do_sample=do_sample,
                         pad_token_id=0, eos_token_id=2, **kw)  # fmt: skip
    assert torch.equal(ours, ref)


@pytest.mark.parametrize("do_sample", [False, True])
def test_rows_that_repeat_a_prompt_share_one_prefill_and_draw_generate_s_tokens(do_sample):
    """PPO's K answers per prompt (rows repeated, adjacent or not): the prefill runs once per distinct
    prompt (3 rows, not 6) and its cache rows are copied; the tokens are ``generate``'s, which prefills
    every row. Two rows of equal ids but different padding are different prompts."""
    model = tiny_llama()
    a, b = [0, 0, 5, 9, 11], [7, 3, 8, 8, 2]
    ids = torch.tensor([a, a, b, a, b, [0, 0, 5, 9, 11]])
    starts = torch.tensor([[2], [2], [0], [2], [0], [1]])  # the last row: a's ids, one padding position less
    mask = (torch.arange(5) >= starts).long()
    seen: list[int] = []
    hook = model.register_forward_hook(lambda _m, _a, out: seen.append(out.logits.shape[0]))
    s = SamplingConfig(max_new_tokens=6, do_sample=do_sample, temperature=0.9, top_k=20, draw="multinomial")
    torch.manual_seed(5)
    ours = decode(model, ids, mask, s, eos_token_id=2, pad_token_id=0).sequences
    hook.remove()
    assert seen[0] == 3 and seen[1] == 6 and seen == seen[:1] + sorted(seen[1:], reverse=True)
    kw = dict(temperature=0.9, top_k=20) if do_sample else {}
    torch.manual_seed(5)
    ref = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=6, do_sample=do_sample,
                         pad_token_id=0, eos_token_id=2, **kw)  # fmt: skip
    assert torch.equal(ours, ref)
    if do_sample:  # the copies are independent draws, not one answer repeated
        assert len({tuple(r) for r in ours[[0, 1, 3], 5:].tolist()}) > 1


@pytest.mark.parametrize("do_sample", [False, True])
def test_rows_that_have_stopped_leave_the_batch_and_the_rest_draw_generate_s_tokens(do_sample):
    """Each step computes only the rows still generating (the forward's batch shrinks as rows reach
    EOS), and every row's tokens are still ``generate``'s, which computes every row to the end: greedy,
    and sampled from the same seed (the rows still generating draw what they would in the full batch)."""
    model = tiny_llama()
    ids = torch.tensor([[0, 0, 5, 9, 11], [7, 3, 8, 8, 2], [0, 4, 4, 6, 1], [9, 9, 1, 3, 5]])
    mask = (torch.arange(5) >= torch.tensor([[2], [0], [1], [0]])).long()
    kw = dict(temperature=0.9, top_k=20) if do_sample else {}
    torch.manual_seed(11)
    free = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=8, do_sample=do_sample,
                          pad_token_id=0, **kw)  # fmt: skip
    eos = int(free[0, 6])  # row 0 stops at its second new token; the others stop at that token or run on
    s = SamplingConfig(max_new_tokens=8, do_sample=do_sample, temperature=0.9, top_k=20, draw="multinomial")
    seen: list[int] = []
    hook = model.register_forward_hook(lambda _m, _a, out: seen.append(out.logits.shape[0]))
    torch.manual_seed(11)
    ours = decode(model, ids, mask, s, eos_token_id=eos, pad_token_id=0).sequences
    hook.remove()
    torch.manual_seed(11)
    ref = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=8, do_sample=do_sample,
                         pad_token_id=0, eos_token_id=eos, **kw)  # fmt: skip
    assert torch.equal(ours, ref)
    new = ours[:, 5:]
    # the rows generating at step t: those with no EOS among their first t tokens
    running = [int((~(new[:, :t] == eos).any(dim=1)).sum()) for t in range(1, new.shape[1])]
    assert seen[1:] == running and min(running) < 4  # the prefill ran all 4 rows; then only the unstopped


def test_inverse_cdf_decode_equals_a_loop_without_cache_while_rows_leave_the_batch():
    """The default draw (one uniform per row and step) through the whole decoder: the tokens of a plain
    loop that runs the full sequences every step, keeps every row and draws from the same seed, while
    the decoder shares a prefill and drops stopped rows (``generate`` draws otherwise, so it is no
    reference here)."""
    model = tiny_llama()
    ids = torch.tensor([[0, 0, 5, 9, 11], [7, 3, 8, 8, 2], [0, 4, 4, 6, 1], [7, 3, 8, 8, 2]])
    mask = (torch.arange(5) >= torch.tensor([[2], [0], [1], [0]])).long()
    s = SamplingConfig(max_new_tokens=8, temperature=0.9, top_k=20)
    assert s.draw == "inverse_cdf"
    seq, m = ids.clone(), mask.clone()
    torch.manual_seed(11)
    for _ in range(8):  # every row to the end; the stop is applied afterwards (it changes no draw)
        with torch.no_grad():
            logits = model(input_ids=seq, attention_mask=m, position_ids=position_ids_from_mask(m)).logits
        seq = torch.cat([seq, next_tokens(logits[:, -1].float(), s)[:, None]], 1)
        m = torch.cat([m, torch.ones(4, 1, dtype=m.dtype)], 1)
    eos = int(seq[0, 6])  # row 0 stops at its second new token
    want = seq.clone()
    for row in want[:, 5:]:
        hit = (row == eos).nonzero()
        if len(hit):
            row[int(hit[0]) + 1 :] = 0
    torch.manual_seed(11)
    seen: list[int] = []
    hook = model.register_forward_hook(lambda _m, _a, out: seen.append(out.logits.shape[0]))
    ours = decode(model, ids, mask, s, eos_token_id=eos, pad_token_id=0).sequences
    hook.remove()
    assert torch.equal(ours, want[:, : ours.shape[1]]) and not want[:, ours.shape[1] :].any()
    assert seen[0] == 3 and min(seen[1:]) < 4  # rows 1 and 3 share a prefill; stopped rows left


def test_log_probs_of_the_chosen_tokens_survive_rows_leaving_the_batch():
    """``return_logprobs`` after stopped rows have left the batch: each generated token's log-prob equals
    the full sequence's forward at that position (0 after the row's EOS)."""
    model = tiny_llama()
    ids = torch.tensor([[0, 0, 5, 9, 11], [7, 3, 8, 8, 2], [0, 4, 4, 6, 1], [9, 9, 1, 3, 5]])
    mask = (torch.arange(5) >= torch.tensor([[2], [0], [1], [0]])).long()
    free = model.generate(
        input_ids=ids, attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=0
    )
    eos = int(free[0, 6])  # row 0 stops at its second new token
    out = decode(model, ids, mask, SamplingConfig(max_new_tokens=8, do_sample=False), eos_token_id=eos,
                 pad_token_id=0, return_logprobs=True)  # fmt: skip
    new = out.sequences[:, 5:]
    stopped = (new == eos).cumsum(1) - (new == eos).long()  # > 0 after the row's EOS
    assert bool((stopped > 0).any())  # some row did stop before the end
    full_mask = torch.cat([mask, (stopped == 0).long()], dim=1)
    with torch.no_grad():
        logits = model(input_ids=out.sequences, attention_mask=full_mask,
                       position_ids=(full_mask.cumsum(1) - 1).clamp_min(0)).logits.float()  # fmt: skip
    want = torch.log_softmax(logits[:, 4:-1], dim=-1).gather(-1, new[:, :, None]).squeeze(-1)
    want = torch.where(stopped == 0, want, torch.zeros_like(want))
    assert torch.allclose(out.logprobs, want, atol=1e-4)


def test_greedy_rows_beside_sampled_rows_decode_as_each_would_alone():
    """The held-out evaluation's greedy and sampled answer to one prompt, in one batch: the greedy rows
    get greedy decoding's tokens, the sampled rows the tokens of an all-sampled batch drawn from the same
    seed, and the two rows of a prompt share its prefill (2 prompts prefilled, not 4)."""
    model = tiny_llama()
    a, b = [0, 0, 5, 9, 11], [7, 3, 8, 8, 2]
    ids, mask = torch.tensor([a, a, b, b]), (torch.arange(5) >= torch.tensor([[2], [2], [0], [0]])).long()
    greedy_rows = torch.tensor([True, False, True, False])
    s = SamplingConfig(max_new_tokens=8, do_sample=True, temperature=1.5)
    seen: list[int] = []
    hook = model.register_forward_hook(lambda _m, _a, out: seen.append(out.logits.shape[0]))
    torch.manual_seed(2)
    mixed = decode(model, ids, mask, s, eos_token_id=3, pad_token_id=0, greedy_rows=greedy_rows).sequences
    hook.remove()
    greedy = decode(model, ids, mask, replace(s, do_sample=False), eos_token_id=3, pad_token_id=0).sequences
    torch.manual_seed(2)
    drawn = decode(model, ids, mask, s, eos_token_id=3, pad_token_id=0).sequences
    n = min(mixed.shape[1], greedy.shape[1], drawn.shape[1])  # each batch stops when its own rows are done
    assert seen[0] == 2
    assert torch.equal(mixed[greedy_rows, :n], greedy[greedy_rows, :n])
    assert torch.equal(mixed[~greedy_rows, :n], drawn[~greedy_rows, :n])
    assert not torch.equal(mixed[1], mixed[0])  # at temperature 1.5 the draw leaves the greedy path


@pytest.mark.parametrize("arch", ["lfm2", "gemma2"])
def test_a_cache_that_keeps_more_than_keys_and_values_is_prefilled_row_by_row(arch):
    """LFM2's short-convolution layers keep a state that no row copy carries over (and have no
    ``batch_select_indices``): repeated prompts then prefill every row, with ``generate``'s tokens.
    Gemma 2's sliding-window layers (window 4, prompts of 10) are plain key/value stores: they share."""
    import transformers

    common = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=2, num_key_value_heads=1)  # fmt: skip
    torch.manual_seed(0)
    if arch == "lfm2":
        model = transformers.Lfm2ForCausalLM(
            transformers.Lfm2Config(**common, layer_types=["conv", "full_attention"])
        )
    else:
        model = transformers.Gemma2ForCausalLM(
            transformers.Gemma2Config(**common, head_dim=16, sliding_window=4)
        )
    model.eval()
    ids = torch.tensor([[0, 0, 5, 9, 11, 4, 4, 6, 7, 8]] * 2 + [[3, 8, 8, 2, 9, 9, 1, 5, 5, 5]])
    mask = (torch.arange(10) >= torch.tensor([[2], [2], [0]])).long()
    seen: list[int] = []
    hook = model.register_forward_hook(lambda _m, _a, out: seen.append(out.logits.shape[0]))
    s = SamplingConfig(max_new_tokens=5, do_sample=False)
    ours = decode(model, ids, mask, s, eos_token_id=None, pad_token_id=0).sequences
    hook.remove()
    assert seen[-1] == 3 and (seen[0] == 2 if arch == "gemma2" else 3 in seen[:2])
    ref = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=5, do_sample=False, pad_token_id=0,
                         eos_token_id=None)  # fmt: skip
    assert torch.equal(ours, ref)


def test_shared_prompts_pick_one_row_per_prompt():
    ids = torch.tensor([[1, 2], [3, 4], [1, 2], [1, 2]])
    mask = torch.ones_like(ids)
    first, inverse = shared_prompts(ids, mask)
    assert torch.equal(ids[first][inverse], ids) and sorted(first.tolist()) == [0, 1]
    assert shared_prompts(ids[:2], mask[:2]) is None


def test_decode_runs_the_lm_head_on_the_last_prompt_position_only_through_a_lora_wrapper():
    """The prefill asks for one position of logits (``logits_to_keep=1``) also when the model is a peft
    LoRA wrapper, whose own forward only passes the keyword on: with SmolLM2's 49152-way head, full
    prefill logits for 32 prompts of 256 tokens are 1.6 GB in fp32. The tokens equal ``generate``'s."""
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(tiny_llama(), LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    model.eval()
    seen: list[int] = []
    base = model.get_base_model()
    hook = base.register_forward_hook(lambda _m, _a, out: seen.append(out.logits.shape[1]))
    ids = torch.tensor([[0, 0, 5, 9, 11], [7, 3, 8, 8, 2]])
    mask = (torch.arange(5) >= torch.tensor([[2], [0]])).long()
    s = SamplingConfig(max_new_tokens=4, do_sample=False)
    ours = decode(model, ids, mask, s, eos_token_id=2, pad_token_id=0).sequences
    hook.remove()
    assert seen[0] == 1 and set(seen) == {1}  # the prefill, then one position per new token
    ref = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=4, do_sample=False, pad_token_id=0,
                         eos_token_id=2)  # fmt: skip
    assert torch.equal(ours, ref)


# ---------------------------------------------------------------------------------------------- sharding
def test_shard_cuts_equal_parts_and_fused_blocks_separately():
    full = torch.arange(24).view(6, 4)
    assert shard(full, ShardSpec(0), 1, 2).tolist() == full[3:].tolist()
    assert shard(full, ShardSpec(1), 0, 2).tolist() == full[:, :2].tolist()
    # three fused blocks (q|k|v) of two rows each: rank 0 gets the first row of every block
    assert shard(full, ShardSpec(0, blocks=3), 0, 2).tolist() == full[[0, 2, 4]].tolist()
    assert shard(full, ShardSpec(None), 1, 2) is full
    assert local_shape(full.shape, ShardSpec(0, blocks=3), 2) == (3, 4)
    with pytest.raises(ValueError):
        shard(full, ShardSpec(0, blocks=3), 0, 4)


def test_shard_specs_follow_megatron_splits():
    llama, gpt2 = PLANS["llama"], PLANS["gpt2"]
    assert shard_spec("model.layers.3.self_attn.q_proj.weight", llama, 2) == ShardSpec(0)
    assert shard_spec("model.layers.0.mlp.down_proj.weight", llama, 2) == ShardSpec(1)
    assert shard_spec("model.layers.0.mlp.down_proj.bias", llama, 2) == ShardSpec(None, rank0_only=True)
    assert shard_spec("model.layers.0.input_layernorm.weight", llama, 2) == ShardSpec(None)
    assert shard_spec("model.embed_tokens.weight", llama, 2) == ShardSpec(None)
    assert shard_spec("model.layers.3.self_attn.q_proj.weight", llama, 1) == ShardSpec(None)
    # Conv1D stores (in, out): column split on dim 1, q|k|v fused; its bias is split like the output
    assert shard_spec("transformer.h.1.attn.c_attn.weight", gpt2, 2) == ShardSpec(1, blocks=3)
    assert shard_spec("transformer.h.1.attn.c_attn.bias", gpt2, 2) == ShardSpec(0, blocks=3)
    assert shard_spec("transformer.h.1.mlp.c_proj.weight", gpt2, 2) == ShardSpec(0)


def test_column_then_row_parallel_mlp_sums_to_the_full_mlp():
    """Llama MLP down(silu(gate x) * up x): the ranks' partial outputs add up to the unsplit output."""
    torch.manual_seed(0)
    mlp = tiny_llama().model.layers[0].mlp
    x = torch.randn(3, 64)
    full = mlp(x)
    plan, size = PLANS["llama"], 2
    total = torch.zeros_like(full)
    for r in range(size):
        w = {n: shard(getattr(mlp, n).weight, shard_spec(f"model.layers.0.mlp.{n}.weight", plan, size), r, size)
             for n in ("gate_proj", "up_proj", "down_proj")}  # fmt: skip
        h = nn.functional.silu(x @ w["gate_proj"].T) * (x @ w["up_proj"].T)
        total += h @ w["down_proj"].T
    assert torch.allclose(total, full, atol=1e-6)


# ---------------------------------------------------------------------------------------------- LoRA merge
def test_merged_lora_weight_gives_the_adapter_forward():
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(8, 6))
    model = get_peft_model(base, LoraConfig(r=2, lora_alpha=4, target_modules=["0"]))
    layer = model.base_model.model[0]
    nn.init.normal_(layer.lora_B["default"].weight)
    x = torch.randn(5, 8)
    w = merged_lora_weight(layer.base_layer.weight, layer.lora_A["default"].weight, layer.lora_B["default"].weight,
                           layer.scaling["default"])  # fmt: skip
    assert layer.scaling["default"] == 2.0
    assert torch.allclose(nn.functional.linear(x, w, layer.base_layer.bias), model(x), atol=1e-6)
    # fan_in_fan_out (Conv1D weights stored as (in, out)): the delta is transposed
    wt = merged_lora_weight(layer.base_layer.weight.T, layer.lora_A["default"].weight,
                            layer.lora_B["default"].weight, 2.0, fan_in_fan_out=True)  # fmt: skip
    assert torch.allclose(wt, w.T)


# ---------------------------------------------------------------------------------------------- the copy
def test_inference_copy_of_a_lora_model_matches_it_and_leaves_it_untouched():
    from dschat.models.lora import inject_lora

    model = inject_lora(tiny_llama(), dim=4)
    for name, p in model.named_parameters():
        if "lora_B" in name:
            nn.init.normal_(p, std=0.05)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    copy = InferenceCopy(model, dtype=torch.float32, device=torch.device("cpu"))
    assert not any("lora" in n for n, _ in copy.model.named_parameters())
    copy.refill(no_gather)
    ids = torch.tensor([[1, 5, 9, 3, 7]])
    with torch.no_grad():
        assert torch.allclose(copy.model(input_ids=ids).logits, model(input_ids=ids).logits, atol=1e-5)
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    # chunked gathering: the non-block parameters, then one group per decoder block (2 blocks)
    chunks = copy.chunks(1)
    assert len(chunks) == 3 and sum(len(c) for c in chunks) == len(copy.fills)
    copy.release()
    assert sum(p.numel() for p in copy.model.parameters()) == 0
    copy.allocate()
    copy.refill(no_gather, layers_per_chunk=1)
    with torch.no_grad():
        assert torch.allclose(copy.model(input_ids=ids).logits, model(input_ids=ids).logits, atol=1e-5)


@pytest.mark.parametrize("module_name", ["lm_head", ""])
def test_inference_copy_keeps_lora_on_a_tied_lm_head(module_name):
    """A tied LM head (SmolLM2, Qwen2.5, Gemma) with an adapter (LoRA in every Linear, or on lm_head): the
    copy used to fill the tied tensor once, from the embedding, and generate without the head's adapter
    (logits off by 1.5-1.9 here). The head gets its own merged tensor; the embedding keeps its own."""
    from dschat.models.lora import inject_lora

    model = _tiny_causal_lm("llama")
    model.config.tie_word_embeddings = True
    model.tie_weights()
    assert model.lm_head.weight is model.model.embed_tokens.weight
    model = inject_lora(model, dim=4, module_name=module_name)
    for name, p in model.named_parameters():
        if "lora_B" in name:
            nn.init.normal_(p, std=0.5)
    copy = InferenceCopy(model, dtype=torch.float32, device=torch.device("cpu"))
    copy.refill(no_gather)
    ids = torch.tensor([[1, 5, 9, 3, 7]])
    with torch.no_grad():
        assert torch.allclose(copy.model(input_ids=ids).logits, model(input_ids=ids).logits, atol=1e-5)


def _tiny_causal_lm(arch: str) -> nn.Module:
    from transformers import AutoConfig, AutoModelForCausalLM

    shapes = {"vocab_size": 64, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64, "pad_token_id": 0,
              "head_dim": 8, "eos_token_id": 2, "bos_token_id": 1}  # fmt: skip
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(AutoConfig.for_model(arch, **shapes)).eval()


@pytest.mark.parametrize("arch", ["qwen3", "gemma2", "phi3", "gpt_neox"])
def test_any_architecture_gets_an_inference_copy_without_tensor_parallelism(arch):
    """Without TP the copy is the same model with the same weights: no per-architecture table is needed,
    so a new model keeps the fast path instead of falling back to plain generate."""
    model = _tiny_causal_lm(arch)
    copy = InferenceCopy(model, dtype=torch.float32, device=torch.device("cpu"))
    copy.refill(no_gather)
    ids = torch.tensor([[1, 5, 9, 3, 7]])
    with torch.no_grad():
        assert torch.allclose(copy.model(input_ids=ids).logits, model(input_ids=ids).logits, atol=1e-5)
    # the decoder blocks are still found, so ZeRO-3 gathering goes block by block
    chunks = copy.chunks(1)
    assert len(chunks) == 3 and sum(len(c) for c in chunks) == len(copy.fills)


def test_tensor_parallelism_needs_a_plan_for_the_architecture():
    with pytest.raises(UnsupportedModel, match=r"phi3.*--inference_tp_size 1"):
        plan_for(_tiny_causal_lm("phi3"), tp_size=2)  # fused q|k|v of unequal blocks: no plan
    for arch in ("qwen2", "qwen3", "gemma2"):
        assert plan_for(_tiny_causal_lm(arch), tp_size=2).colwise, arch  # planned ones split


# ---------------------------------------------------------------------------------------------- flags
def engine_args(*flags: str) -> C.RLHFEngineArgs:
    parser = C.ArgumentParser(prog="step3")
    C.add_group(parser, C.RLHFEngineArgs)
    return C.from_namespace(C.RLHFEngineArgs, parser.parse_args(list(flags)))


def test_hybrid_flags_parse_and_validate():
    a = engine_args("--enable_hybrid_engine", "--inference_tp_size", "2", "--tp_gather_partition_size", "4",
                    "--release_inference_cache")  # fmt: skip
    assert (a.enable_hybrid_engine, a.inference_tp_size, a.tp_gather_partition_size) == (True, 2, 4)
    assert engine_args().inference_tp_size == 1 and engine_args().tp_gather_partition_size == 0
    for flags, needle in (
        (["--inference_tp_size", "2"], "--inference_tp_size needs --enable_hybrid_engine"),
        (["--release_inference_cache"], "--release_inference_cache needs --enable_hybrid_engine"),
        (["--unpin_actor_parameters"], "--unpin_actor_parameters needs --enable_hybrid_engine"),
        (["--enable_hybrid_engine", "--inference_tp_size", "0"], "--inference_tp_size must be >= 1"),
        (["--enable_hybrid_engine", "--tp_gather_partition_size", "-1"], "--tp_gather_partition_size"),
        (["--enable_hybrid_engine", "--unpin_actor_parameters", "--inference_tp_size", "2"], "--unpin_actor_parameters"),
    ):  # fmt: skip
        with pytest.raises(UserError, match=needle):
            engine_args(*flags)


@pytest.mark.parametrize("arch", ["qwen3", "gemma2"])
def test_hybrid_greedy_on_an_unplanned_architecture_equals_generate(arch):
    """The hybrid engine serves a model outside the TP table from its copy (no fallback), and its greedy
    answers are Hugging Face ``generate``'s."""
    from types import SimpleNamespace

    from dschat.generation.hybrid import HybridGenerator

    model = _tiny_causal_lm(arch)
    engine = SimpleNamespace(module=model, device=torch.device("cpu"), eval=model.eval, train=model.train)
    tok = SimpleNamespace(eos_token_id=2, pad_token_id=0)
    greedy = SamplingConfig(max_new_tokens=6, do_sample=False)
    gen = HybridGenerator(engine, tok, greedy, zero3=False, measure_logprobs=False)
    assert gen.fallback is None and gen.copy is not None
    ids = torch.tensor([[0, 5, 9, 3], [4, 8, 12, 7]])
    mask = (ids != 0).long()
    with gen.generation_mode() as g:
        ours = g.generate(ids, mask)
    want = model.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=6, eos_token_id=2,
                          pad_token_id=0)  # fmt: skip
    assert torch.equal(ours, want[:, : ours.shape[1]]) and (want[:, ours.shape[1] :] == 0).all()


def _lockstep_decode(rank: int) -> bool:
    import torch.distributed as torch_dist

    model = tiny_llama()
    ids = torch.tensor([[0, 0, 5, 9, 11], [7, 3, 8, 8, 2]]) if rank == 0 else torch.tensor([[9, 9, 1, 3, 5]])
    mask = (ids != 0).long()
    s = SamplingConfig(max_new_tokens=8, do_sample=False)
    eos = int(decode(model, ids[:1], mask[:1], s, eos_token_id=None, pad_token_id=0).sequences[0, 6])
    eos = torch.tensor([eos if rank == 0 else 0])
    torch_dist.broadcast(eos, src=0)  # one EOS for both ranks: rank 0's first row stops early
    alone = decode(model, ids, mask, s, eos_token_id=int(eos), pad_token_id=0).sequences
    together = decode(model, ids, mask, s, eos_token_id=int(eos), pad_token_id=0, lockstep=True).sequences
    n = alone.shape[1]
    return torch.equal(together[:, :n], alone) and bool((together[:, n:] == 0).all())


def test_ranks_in_lockstep_drop_their_stopped_rows_and_decode_as_alone():
    """ZeRO-3 ranks step together until every rank is done (a done rank runs dummy forwards): with rows
    leaving each rank's batch at different steps, each rank's tokens are those it decodes alone (padded
    while a peer runs on). Two real gloo ranks."""
    assert on_two_ranks(_lockstep_decode) == {0: True, 1: True}


def test_reserved_cache_layer_holds_what_a_dynamic_layer_holds_and_writes_in_place():
    """The same updates, row selections and crops on a transformers ``DynamicLayer`` and on the reserved
    layer give the same keys and values at every step; within its capacity a token is written into the
    buffer (no new allocation), past it the buffer grows."""
    from transformers.cache_utils import DynamicCache, DynamicLayer

    g = torch.Generator().manual_seed(0)

    def kv(b: int, t: int) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.randn(b, 2, t, 4, generator=g), torch.randn(b, 2, t, 4, generator=g)

    plain = DynamicLayer()
    plain.update(*kv(3, 5))
    reserved = reserved_layer_class().holding(plain.keys, plain.values, capacity=7)
    assert reserved.get_seq_length() == 5 and reserved._k.shape[-2] == 7
    buffer = reserved._k.data_ptr()

    def same() -> None:
        assert reserved.get_seq_length() == plain.get_seq_length()
        assert torch.equal(reserved.keys, plain.keys) and torch.equal(reserved.values, plain.values)

    for _ in range(2):  # positions 6 and 7: inside the capacity, written in place
        step = kv(3, 1)
        assert [torch.equal(a, b) for a, b in zip(reserved.update(*step), plain.update(*step))] == [
            True,
            True,
        ]
        same()
    assert reserved._k.data_ptr() == buffer
    step = kv(3, 1)  # position 8: the buffer doubles
    reserved.update(*step), plain.update(*step)
    same()
    assert reserved._k.shape[-2] == 14
    keep = torch.tensor([2, 0])  # rows leave the batch (and are reordered)
    reserved.batch_select_indices(keep), plain.batch_select_indices(keep)
    same()
    step = kv(2, 3)
    reserved.update(*step), plain.update(*step)
    same()
    reserved.crop(-4), plain.crop(-4)
    same()
    step = kv(2, 1)
    reserved.update(*step), plain.update(*step)
    same()

    # reserve() turns a cache's full-attention dynamic layers into reserved ones, holding the same tensors
    cache = DynamicCache()
    cache.update(*kv(2, 3), layer_idx=0)
    cache.update(*kv(2, 3), layer_idx=1)
    before = [(layer.keys.clone(), layer.values.clone()) for layer in cache.layers]
    reserve(cache, 10)
    for layer, (k, v) in zip(cache.layers, before):
        assert type(layer) is reserved_layer_class() and layer._k.shape[-2] == 13
        assert torch.equal(layer.keys, k) and torch.equal(layer.values, v)
    assert cache.get_seq_length() == 3


def test_the_hybrid_engine_keeps_one_static_cache_whatever_batch_sizes_it_sees():
    """A StaticCache is allocated per batch size; kept for every size seen (the rollouts', an evaluation's
    and its last partial batch's), they all stayed in device memory through training."""
    from transformers import LlamaForCausalLM

    from dschat.generation.hybrid import HybridGenerator

    model = LlamaForCausalLM(build_config("micro-llama", vocab_size=64))
    gen = HybridGenerator.__new__(HybridGenerator)  # the cache policy alone: no engine needed
    gen.static_cache, gen._caches = True, {}
    first = gen._cache(model, 8, 40)
    assert gen._cache(model, 8, 30) is first  # the same rows, no longer: reused
    gen._cache(model, 3, 40)
    assert list(gen._caches) == [3]
    again = gen._cache(model, 8, 40)
    assert again is not first and list(gen._caches) == [8]
