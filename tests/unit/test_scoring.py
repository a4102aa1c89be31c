"""dschat.scoring: reward scores of prompt/response texts outside training."""

from __future__ import annotations

import torch

from dschat.data.prompt_format import as_dialogue
from dschat.models.builtin import build_tokenizer
from dschat.models.reward import ScalarHeadModel
from dschat.scoring import score_texts


def _gpt2_reward_model(positions: int) -> ScalarHeadModel:
    from transformers import AutoConfig, AutoModelForSequenceClassification

    config = AutoConfig.for_model("gpt2", vocab_size=259, n_embd=32, n_layer=2, n_head=4, n_positions=positions,
                                  num_labels=1, pad_token_id=0)  # fmt: skip
    torch.manual_seed(0)
    model = AutoModelForSequenceClassification.from_config(config)
    torch.nn.init.normal_(model.score.weight, std=1.0)
    return ScalarHeadModel(model).eval()


def test_a_row_longer_than_the_models_positions_keeps_the_end_of_its_prompt():
    """A model with learned positions (GPT-2, OPT) has no position past its table; the tokenizer's own
    limit may be larger (OPT's is unlimited). A long row keeps the format's 'Human:' and 'Assistant:',
    the end of its question and the whole response, as step 2 fits its pairs, instead of indexing past
    the table (since 2026-11-29 the question's start is cut inside the turn; before, BOS and the row's
    last tokens were kept, which cut 'Human:' away)."""
    tok = build_tokenizer()
    tok.model_max_length = 10**30  # as OPT's tokenizer reports it
    model = _gpt2_reward_model(positions=32)
    prompt, response = "x" * 100 + " the end?", " ok"
    long = score_texts(model, tok, [prompt], [response])
    # the same row by hand: "Human: " + the question's last characters + "Assistant:" + the response
    r = tok(response, add_special_tokens=False)["input_ids"]
    overhead = len(tok(as_dialogue("x"))["input_ids"]) - 1  # the turn's own tokens around a question
    question = tok(prompt, add_special_tokens=False)["input_ids"]
    kept = tok.decode(question[len(question) - (32 - len(r) - overhead) :]).strip()
    row = tok(as_dialogue(kept))["input_ids"] + r
    want = model.score(torch.tensor([row]), torch.ones(1, len(row), dtype=torch.long))
    text = tok.decode(row, skip_special_tokens=True)
    assert len(row) == 32 and text.startswith("\n\nHuman: ") and text.endswith("he end?\n\nAssistant: ok")
    assert torch.allclose(long, want)


def test_rows_are_scored_in_batches_of_similar_length_and_returned_in_input_order():
    """Scoring groups rows of similar length (a batch padded to its longest row wastes the rest); each
    score still belongs to its own row: equal to scoring that row alone."""
    from dschat.scoring import score_with

    tok = build_tokenizer()
    widths: list[int] = []

    def score_fn(input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        widths.append(input_ids.shape[1])
        return (input_ids * attention_mask).sum(1).float()  # a score that identifies the row

    prompts = ["a", "b" * 40, "c", "d" * 38]
    responses = [" x", " y", " zz", " w"]
    scores = score_with(score_fn, tok, prompts, responses, batch_size=2)
    alone = torch.cat([score_with(score_fn, tok, [p], [r], batch_size=1) for p, r in zip(prompts, responses)])
    assert torch.equal(scores, alone)
    assert widths[0] - widths[1] > 30  # the two long rows, then the two short ones (not long + short twice)


def test_a_response_longer_than_the_limit_keeps_bos_and_its_end():
    """A response that alone passes the limit (training drops such a pair; scoring must give a score)
    lost BOS with the whole prompt: the row began mid-response with no BOS, unlike any training row. It
    keeps BOS and the end of the response, where the score is read."""
    tok = build_tokenizer()
    model = _gpt2_reward_model(positions=16)
    prompt, response = "hi?", " " + "abcdefghij" * 3
    got = score_texts(model, tok, [prompt], [response])
    r = tok(response, add_special_tokens=False)["input_ids"]
    row = [tok.bos_token_id, *r[-15:]]
    want = model.score(torch.tensor([row]), torch.ones(1, 16, dtype=torch.long))
    assert tok.bos_token_id is not None and len(r) > 16
    assert torch.allclose(got, want)


def test_a_trained_reward_model_is_scored_on_rows_cut_as_step_2_cut_its_training_rows():
    """A reward model trained on rows cut to --max_seq_len (the end of a long dialogue) was scored on the
    whole dialogue by rw_eval.py, prompt_eval.py and the judge: a view it never trained on, and not the
    one its held-out accuracy was measured on. Its training length (trained_max_len) is the default."""
    tok = build_tokenizer()
    model = _gpt2_reward_model(positions=64)
    prompt, response = "x" * 60 + " the end?", " ok"
    whole = score_texts(model, tok, [prompt], [response])
    cut = score_texts(model, tok, [prompt], [response], max_len=24)
    model.trained_max_len = 24
    assert torch.equal(score_texts(model, tok, [prompt], [response]), cut)
    assert not torch.allclose(whole, cut)


def test_a_pair_is_scored_on_the_prompt_step_2_kept_for_both_answers():
    """Step 2 cuts a long pair's prompt once, to leave room for the longer answer, and both answers read
    that prompt; rw_eval.py cut it for each answer alone, so the shorter answer was scored with more of
    the dialogue than in training (and than its rival): a bias tied to length in the held-out accuracy."""
    from dschat.data.pipeline import tokenize_pairs
    from dschat.data.prompt_format import prompt_format
    from dschat.data.schema import Sample
    from dschat.scoring import score_with

    tok = build_tokenizer()
    fmt = prompt_format(tok)
    rows: list[list[int]] = []

    def score_fn(input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        rows.extend(ids[m.bool()].tolist() for ids, m in zip(input_ids, attention_mask))
        return torch.zeros(len(input_ids))

    prompt, chosen, rejected = "the long question text " * 6 + "end?", " yes", " no, and a much longer answer"
    (pair,), stats = tokenize_pairs([Sample(prompt, chosen, rejected)], fmt, 110)
    assert stats["prompt_truncated"] == 1
    score_with(score_fn, tok, [prompt] * 2, [chosen, rejected], partners=[rejected, chosen], max_len=110)
    assert sorted(rows) == sorted([pair["chosen"], pair["rejected"]])
