"""Decoding options, contrastive search, and batched replies against unbatched generation."""

from __future__ import annotations

import pytest
import torch

from dschat.generation.decoding import DecodeOptions, contrastive_pick, contrastive_search, generate_replies
from dschat.models.builtin import build_config, build_tokenizer
from dschat.utils.errors import UserError


@pytest.mark.parametrize(
    ("kwargs", "flag"),
    [
        ({"strategy": "nucleus"}, "--decoding nucleus"),
        ({"max_new_tokens": 0}, "--max_new_tokens 0"),
        ({"strategy": "sample", "temperature": 0.0}, "--temperature 0.0"),
        ({"repetition_penalty": float("inf")}, "--repetition_penalty inf: must be a finite number > 0"),
        ({"top_p": 1.5}, "--top_p 1.5"),
        ({"top_k": -1}, "--top_k -1"),
        ({"num_beams": 0}, "--num_beams 0"),
        ({"penalty_alpha": 1.5}, "--penalty_alpha 1.5"),
        ({"repetition_penalty": 0.0}, "--repetition_penalty 0.0"),
        ({"strategy": "contrastive", "top_k": 1}, "--top_k 1: contrastive"),
        ({"seed": 2**64}, "--seed 18446744073709551616: must be in 0"),
        ({"seed": -1}, "--seed -1: must be in 0"),
    ],
)
def test_bad_options_name_their_flag(kwargs, flag):
    with pytest.raises(UserError, match=flag):
        DecodeOptions(**kwargs).validate()


def test_temperature_zero_is_greedy_and_refused_only_for_sampling():
    """``--decoding greedy --temperature 0`` (the usual way to say greedy) was refused with the advice to
    use greedy decoding; greedy, beam and contrastive search do not read the temperature."""
    for strategy in ("greedy", "beam", "contrastive"):
        opts = DecodeOptions(strategy, temperature=0.0, top_k=4 if strategy == "contrastive" else 0)
        assert opts.validate().generate_kwargs()["temperature"] is None
    with pytest.raises(
        UserError,
        match=r"--temperature 0.0: must be > 0 for --decoding sample \(temperature 0 is --decoding greedy\)",
    ):
        DecodeOptions("sample", temperature=0.0).validate()
    with pytest.raises(UserError, match=r"--temperature -1\.0: must be a finite number > 0"):
        DecodeOptions("greedy", temperature=-1.0).validate()


def test_generate_kwargs():
    greedy = DecodeOptions().generate_kwargs()
    assert greedy["do_sample"] is False and greedy["num_beams"] == 1 and greedy["top_k"] is None
    sample = DecodeOptions("sample", temperature=0.7, top_p=0.9, top_k=5).generate_kwargs()
    assert (sample["do_sample"], sample["temperature"], sample["top_p"], sample["top_k"]) == (
        True,
        0.7,
        0.9,
        5,
    )
    beam = DecodeOptions("beam", num_beams=3).generate_kwargs()
    assert beam["num_beams"] == 3 and beam["do_sample"] is False


def test_contrastive_pick_by_hand():
    probs = torch.tensor([0.6, 0.4])
    cand = torch.tensor([[1.0, 0.0], [0.0, 1.0]])  # candidate 0 repeats the context, candidate 1 does not
    context = torch.tensor([[2.0, 0.0], [1.0, 1.0]])
    # max cosine: candidate 0 -> 1, candidate 1 -> 1/sqrt(2)
    # alpha 0.5: 0.5*0.6 - 0.5*1 = -0.2  vs  0.5*0.4 - 0.5*0.7071 = -0.1536 -> candidate 1
    assert contrastive_pick(probs, cand, context, 0.5) == 1
    # alpha 0.1: 0.9*0.6 - 0.1 = 0.44  vs  0.9*0.4 - 0.0707 = 0.289 -> candidate 0
    assert contrastive_pick(probs, cand, context, 0.1) == 0
    assert contrastive_pick(probs, cand, context, 0.0) == 0  # plain greedy


@pytest.fixture(scope="module")
def lm():
    from transformers import LlamaForCausalLM

    tok = build_tokenizer()
    tok.padding_side = "left"
    torch.manual_seed(0)
    return LlamaForCausalLM(build_config("micro-llama", len(tok))).eval(), tok


PROMPTS = [
    "\n\nHuman: What is 2 + 3?\n\nAssistant:",
    "\n\nHuman: hi\n\nAssistant:",
    "\n\nHuman: Sort: b a\n\nAssistant:",
]


def unbatched_greedy(model, tok, prompt: str, n: int, repetition_penalty: float = 1.0) -> list[int]:
    ids = tok(prompt, return_tensors="pt")["input_ids"]
    out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                         pad_token_id=tok.pad_token_id, repetition_penalty=repetition_penalty)  # fmt: skip
    return out[0, ids.shape[1] :].tolist()


def test_contrastive_search_without_penalty_is_greedy(lm):
    model, tok = lm
    opts = DecodeOptions("contrastive", max_new_tokens=6, top_k=3, penalty_alpha=0.0)
    for p in PROMPTS:
        ids = tok(p)["input_ids"]
        assert contrastive_search(model, ids, opts, stop_ids=set()) == unbatched_greedy(model, tok, p, 6)


def test_contrastive_search_applies_the_repetition_penalty(lm):
    """--repetition_penalty was ignored by contrastive search (the other strategies pass it to generate):
    without the degeneration penalty it must pick what greedy decoding with the same penalty picks."""
    model, tok = lm
    opts = DecodeOptions("contrastive", max_new_tokens=8, top_k=3, penalty_alpha=0.0, repetition_penalty=5.0)
    found = [contrastive_search(model, tok(p)["input_ids"], opts, stop_ids=set()) for p in PROMPTS]
    assert found == [unbatched_greedy(model, tok, p, 8, repetition_penalty=5.0) for p in PROMPTS]
    assert found != [unbatched_greedy(model, tok, p, 8) for p in PROMPTS]  # the penalty changes a reply


def test_contrastive_search_with_more_candidates_than_the_vocabulary_takes_them_all(lm):
    """--top_k above the vocabulary size (a crash in topk before): every token is a candidate, and
    without the penalty the pick is still the greedy one."""
    model, tok = lm
    opts = DecodeOptions("contrastive", max_new_tokens=3, top_k=100_000, penalty_alpha=0.0)
    ids = tok(PROMPTS[0])["input_ids"]
    assert contrastive_search(model, ids, opts, stop_ids=set()) == unbatched_greedy(model, tok, PROMPTS[0], 3)


def test_batched_replies_equal_one_by_one(lm):
    """Left padding must not change a greedy reply: batch of 3 prompts of different lengths."""
    model, tok = lm
    ids = [tok(p)["input_ids"] for p in PROMPTS]
    batched, _ = generate_replies(model, tok, ids, DecodeOptions(max_new_tokens=6), batch_size=3, stops=())
    single = [
        tok.decode(unbatched_greedy(model, tok, p, 6), skip_special_tokens=True).rstrip() for p in PROMPTS
    ]
    assert batched == single


def test_repetition_penalty_does_not_depend_on_the_batch(lm):
    """--repetition_penalty must not count left padding as seen text (transformers 5 skips it; a review
    suspected it did not): where the padding id is the token the short prompt's reply opens with, the reply
    is the same alone and beside a longer prompt."""
    model, tok = lm
    short, long = PROMPTS[1], PROMPTS[0] * 3
    opts = DecodeOptions(max_new_tokens=6, repetition_penalty=3.0)
    with torch.no_grad():  # the token the short prompt's reply opens with
        first = int(model(torch.tensor([tok(short)["input_ids"]])).logits[0, -1].argmax())
    padded = tok.pad_token_id
    try:
        tok.pad_token_id = first  # the padding is the token the reply opens with
        ids = [tok(short)["input_ids"], tok(long)["input_ids"]]
        one_by_one = [generate_replies(model, tok, [i], opts, stops=()).texts[0] for i in ids]
        batched = generate_replies(model, tok, ids, opts, batch_size=2, stops=()).texts
    finally:
        tok.pad_token_id = padded
    assert batched == one_by_one


def test_replies_come_back_in_prompt_order_from_batches_of_similar_length(lm):
    """Batches group prompts by length (padding to a long neighbour is wasted compute); each reply still
    belongs to its own prompt and equals the prompt's unbatched greedy reply."""
    model, tok = lm
    texts = [PROMPTS[1], PROMPTS[0] * 3, PROMPTS[2], PROMPTS[0] * 3 + " again", PROMPTS[1] + " ok"]
    ids = [tok(p)["input_ids"] for p in texts]
    widths: list[list[int]] = []
    generate = model.generate

    def recording(*args, **kwargs):
        widths.append(kwargs["attention_mask"].sum(1).tolist())
        return generate(*args, **kwargs)

    model.generate = recording
    try:
        batched, _ = generate_replies(
            model, tok, ids, DecodeOptions(max_new_tokens=5), batch_size=2, stops=()
        )
    finally:
        del model.generate
    assert widths[0] == [len(ids[3]), len(ids[1])]  # the two long prompts together, longest first
    single = [
        tok.decode(unbatched_greedy(model, tok, p, 5), skip_special_tokens=True).rstrip() for p in texts
    ]
    assert batched == single


def test_a_reply_that_runs_out_of_new_tokens_is_cut_off(lm):
    """Cut off: all max_new_tokens used and no end id, EOS or stop string reached (an unfinished answer)."""
    from dschat.generation.stops import stop_ids_for

    model, tok = lm
    ids = [tok(p)["input_ids"] for p in PROMPTS]
    greedy = [unbatched_greedy(model, tok, p, 6) for p in PROMPTS]
    end = greedy[0][2]  # prompt 0's reply ends at its third token
    ends = set(stop_ids_for(tok, (end,), model))
    out = generate_replies(
        model, tok, ids, DecodeOptions(max_new_tokens=6), batch_size=3, stops=(), stop_ids=(end,)
    )
    assert out.cut_off[0] is False and True in out.cut_off  # both kinds here
    assert out.cut_off == [not ends.intersection(g) for g in greedy]
    assert out.cut_off[1] is True  # so that the stop string below is what ends it
    # a stop string ends a reply too: prompt 1's whole reply as one
    text = tok.decode(greedy[1], skip_special_tokens=True)
    stopped = generate_replies(
        model, tok, ids, DecodeOptions(max_new_tokens=6), batch_size=3, stops=(text,), stop_ids=(end,)
    )
    assert text and stopped.cut_off[1] is False and stopped.cut_off[2] == out.cut_off[2]


def test_contrastive_replies_are_cut_off_by_the_same_rule(lm):
    from dschat.generation.stops import stop_ids_for

    model, tok = lm
    opts = DecodeOptions("contrastive", max_new_tokens=6, top_k=3, penalty_alpha=0.6)
    ids = [tok(p)["input_ids"] for p in PROMPTS]
    end = contrastive_search(model, ids[0], opts, set())[1]  # prompt 0's reply ends at its second token
    ends = set(stop_ids_for(tok, (end,), model))
    found = [contrastive_search(model, i, opts, ends) for i in ids]
    out = generate_replies(model, tok, ids, opts, stops=(), stop_ids=(end,))
    assert out.cut_off == [len(f) == 6 and not ends.intersection(f) for f in found]
    assert out.cut_off[0] is False and True in out.cut_off
