"""Packed preference pairs (``--share_prompt``): prompt + chosen + rejected in one row, the prompt computed
once. Hand-computed layouts and masks, and real transformers models giving the unpacked values."""

from __future__ import annotations

import pytest
import torch

from dschat.data.collate import PairCollator, pair_example
from dschat.data.packing import CHOSEN, PAD, PROMPT, REJECTED, shared_prompt_mask, unpack_pair_values
from dschat.losses import gather_last
from dschat.models.attention import FAST_ATTENTION, use_fast_attention
from dschat.models.reward import ScalarHeadModel, packing_tolerance, pair_values, settle_share_prompt


def test_pack_pairs_layout_by_hand():
    # pair 0: prompt [1, 2], chosen [3, 4, 5], rejected [6]; pair 1: prompt [7], chosen [8], rejected [9, 9]
    feats = [pair_example([1, 2], [3, 4, 5], [6]), pair_example([7], [8], [9, 9])]
    out = PairCollator(pad_id=99, share_prompt=True)(feats)
    assert out["packed_input_ids"].tolist() == [[1, 2, 3, 4, 5, 6], [7, 8, 9, 9, 99, 99]]
    # the rejected answer continues the prompt's positions: 6 sits at position 2, as it does unpacked
    assert out["packed_position_ids"].tolist() == [[0, 1, 2, 3, 4, 2], [0, 1, 1, 2, 0, 0]]
    P, C, R = PROMPT, CHOSEN, REJECTED
    assert out["packed_segments"].tolist() == [[P, P, C, C, C, R], [P, C, R, R, PAD, PAD]]
    # unpacked rows (width 5): chosen 0 = packed 0..4; chosen 1 = packed 0..1; rejected 0 = prompt 0..1 then
    # packed 5; rejected 1 = prompt 0 then packed 2, 3; padding points at 0
    assert out["unpack_index"].tolist() == [
        [0, 1, 2, 3, 4],
        [0, 1, 0, 0, 0],
        [0, 1, 5, 0, 0],
        [0, 2, 3, 0, 0],
    ]
    # the unpacked fields are still there, unchanged
    assert out["input_ids"].tolist() == PairCollator(pad_id=99)(feats)["input_ids"].tolist()


def test_packed_pairs_count_the_positions_the_model_ran():
    """The same pairs as above: 13 real tokens as unpacked rows hold them (2+3, 2+1, 1+1, 1+2), 10 that the
    packed rows ran (each prompt once), 12 positions run (2 of them padding). The positions used to be the
    pairs' tokens plus the padding (15), so the padding share showed 2/15 where the model ran 2/12."""
    from dschat.data.packing import pair_token_counts

    feats = [pair_example([1, 2], [3, 4, 5], [6]), pair_example([7], [8], [9, 9])]
    tokens, computed, positions = pair_token_counts(PairCollator(pad_id=99, share_prompt=True)(feats))
    assert (int(tokens), int(computed), int(positions)) == (13, 10, 12)
    unpacked = pair_token_counts(PairCollator(pad_id=99)(feats))  # 4 rows of width 5
    assert tuple(map(int, unpacked)) == (13, 13, 20)


def test_the_padding_fraction_is_the_share_of_run_positions_that_were_padding():
    from dschat.trainer import TrainState, run_summary

    class Timer:
        def __init__(self) -> None:
            self.totals: dict = {}

        def wall(self) -> float:
            return 1.0

    from dschat import config as C

    packed = TrainState(tokens=13.0, computed=10.0, positions=12.0, train_seconds=1.0)
    s = run_summary(packed, Timer(), parameters=1, dtype="fp32", zero_stage=0, lora_dim=0,
                    run=C.RunArgs(output_dir="x"), start_step=0, skipped_steps=0)  # fmt: skip
    assert s["padding_fraction"] == pytest.approx(2 / 12)
    s = run_summary(TrainState(tokens=13.0, positions=20.0, train_seconds=1.0), Timer(), parameters=1,
                    dtype="fp32", zero_stage=0, lora_dim=0, run=C.RunArgs(output_dir="x"), start_step=0, skipped_steps=0)  # fmt: skip
    assert s["padding_fraction"] == pytest.approx(7 / 20)  # a checkpoint without "computed": its tokens ran


def test_unpack_rebuilds_the_unpacked_rows():
    feats = [pair_example([1, 2], [3, 4, 5], [6]), pair_example([7], [8], [9, 9])]
    out = PairCollator(pad_id=0, share_prompt=True)(feats)
    tokens = unpack_pair_values(out["packed_input_ids"], out["unpack_index"])
    mask = out["attention_mask"].bool()
    assert torch.equal(tokens[mask], out["input_ids"][mask])


def test_shared_prompt_mask_by_hand():
    seg = torch.tensor([[PROMPT, PROMPT, CHOSEN, CHOSEN, REJECTED, REJECTED, PAD]])
    allowed = shared_prompt_mask(seg)
    assert allowed.shape == (1, 1, 7, 7) and allowed.dtype == torch.bool
    expected = [
        [1, 0, 0, 0, 0, 0, 0],  # prompt: causal
        [1, 1, 0, 0, 0, 0, 0],
        [1, 1, 1, 0, 0, 0, 0],  # chosen: prompt and itself, causal
        [1, 1, 1, 1, 0, 0, 0],
        [1, 1, 0, 0, 1, 0, 0],  # rejected: prompt and itself, never the chosen answer
        [1, 1, 0, 0, 1, 1, 0],
        [
            1,
            1,
            1,
            1,
            1,
            1,
            0,
        ],  # padding query: the real tokens before it (never an empty row), no padding key
    ]
    assert allowed[0, 0].int().tolist() == expected


def _tiny(arch: str, seed: int = 0):
    from transformers import AutoConfig, AutoModelForSequenceClassification

    shapes = {"vocab_size": 64, "num_labels": 1, "pad_token_id": 0}
    if arch in ("llama", "qwen2", "mistral"):
        shapes |= {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
                   "num_key_value_heads": 2, "max_position_embeddings": 64}  # fmt: skip
    elif arch == "gpt2":
        shapes |= {"n_embd": 32, "n_layer": 2, "n_head": 4, "n_positions": 64}
    else:  # opt
        shapes |= {"hidden_size": 32, "ffn_dim": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
                   "word_embed_proj_dim": 32, "max_position_embeddings": 64}  # fmt: skip
    torch.manual_seed(seed)
    model = AutoModelForSequenceClassification.from_config(AutoConfig.for_model(arch, **shapes))
    torch.nn.init.normal_(model.score.weight, std=1.0)  # a fresh head is zero: make the values differ
    return ScalarHeadModel(model).eval()


def _batch():
    g = torch.Generator().manual_seed(1)

    def ids(n: int) -> list[int]:
        return torch.randint(1, 64, (n,), generator=g).tolist()

    feats = [
        pair_example(ids(5), ids(4), ids(7)),
        pair_example(ids(9), ids(2), ids(3)),
        pair_example([], ids(3), ids(3)),
    ]
    return PairCollator(pad_id=0, share_prompt=True)(feats)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral"])
@pytest.mark.parametrize("attn", ["sdpa", FAST_ATTENTION, "eager"])
def test_packed_pairs_give_the_unpacked_values(arch, attn):
    model = _tiny(arch)
    model.hf_model.config._attn_implementation = "sdpa" if attn == FAST_ATTENTION else attn
    if attn == FAST_ATTENTION:
        use_fast_attention(model.hf_model)
    batch = _batch()
    mask = batch["attention_mask"].bool()
    with torch.no_grad():
        plain = model(batch["input_ids"], batch["attention_mask"])
        packed = pair_values(model, batch, "cpu")
        unpacked_path = pair_values(model, {k: batch[k] for k in ("input_ids", "attention_mask")}, "cpu")
    assert torch.allclose(packed[mask], plain[mask], atol=1e-5)
    assert torch.equal(unpacked_path, plain)
    assert gather_last(packed, batch["attention_mask"]).tolist() == pytest.approx(
        gather_last(plain, batch["attention_mask"]).tolist(), abs=1e-5
    )
    assert model.packing_error(batch, "cpu") < packing_tolerance(torch.float32) / 10


def test_packing_error_catches_ignored_positions_or_mask(monkeypatch):
    model = _tiny("llama")
    batch = _batch()
    width = batch["packed_input_ids"].shape[1]
    wrong_positions = dict(batch, packed_position_ids=torch.arange(width).expand(3, -1))
    tolerance = packing_tolerance(torch.float32)
    assert model.packing_error(batch, "cpu") < tolerance
    assert model.packing_error(wrong_positions, "cpu") > 10 * tolerance
    # a model that applies plain causal attention: the rejected answer sees the chosen one
    import dschat.models.reward as reward

    causal = torch.ones((width, width), dtype=torch.bool).tril().expand(3, 1, -1, -1)
    monkeypatch.setattr(reward, "shared_prompt_mask", lambda segments: causal)
    assert model.packing_error(batch, "cpu") > 10 * tolerance


@pytest.mark.parametrize("arch", ["gpt2", "opt"])
def test_absolute_position_models_are_exact_or_caught(arch):
    """GPT-2 and OPT embed absolute positions; the start-up check must see whether packing holds."""
    model = _tiny(arch)
    batch = _batch()
    mask = batch["attention_mask"].bool()
    try:
        with torch.no_grad():
            exact = torch.allclose(pair_values(model, batch, "cpu")[mask],
                                   model(batch["input_ids"], batch["attention_mask"])[mask], atol=1e-5)  # fmt: skip
        error = model.packing_error(batch, "cpu")
    except Exception:  # a model that rejects the custom mask outright: step 2 must not use packing on it
        pytest.skip(f"{arch} rejects packed pairs")
    assert (error < packing_tolerance(torch.float32)) == exact


def _collated(share: bool):
    feats = [pair_example([1, 2, 3], [4, 5], [6]), pair_example([7, 8], [9], [10, 11, 12])]
    collate = PairCollator(pad_id=0, share_prompt=share)
    return collate, feats, [[(collate(feats), torch.ones(2))]]


def test_settle_share_prompt_keeps_packing_where_it_holds():
    model = _tiny("llama")
    collate, feats, evals = _collated(True)
    settle_share_prompt(model, collate, feats, evals, "cpu")
    assert collate.share_prompt and "packed_input_ids" in evals[0][0][0]


def test_settle_share_prompt_falls_back_where_it_does_not(monkeypatch, caplog):
    import dschat.models.reward as reward

    model = _tiny("llama")
    collate, feats, evals = _collated(True)
    causal = lambda segments: torch.ones(segments.shape[1], segments.shape[1], dtype=torch.bool).tril()  # noqa: E731
    monkeypatch.setattr(reward, "shared_prompt_mask", lambda seg: causal(seg).expand(seg.shape[0], 1, -1, -1))
    with caplog.at_level("WARNING", logger="dschat"):
        settle_share_prompt(model, collate, feats, evals, "cpu")
    assert not collate.share_prompt
    assert "packed pairs differ from unpacked rows" in caplog.text
    assert set(evals[0][0][0]) == {"input_ids", "attention_mask", "response_len"}  # unpacked from here on
    # an attention implementation that takes no custom mask falls back without trying
    collate, feats, evals = _collated(True)
    model.hf_model.config._attn_implementation = "flash_attention_2"
    settle_share_prompt(model, collate, feats, evals, "cpu")
    assert not collate.share_prompt and "takes no custom mask" in caplog.text


# ---------------------------------------------------------------- rollouts (step 3)


def test_pack_rollouts_layout_by_hand():
    from dschat.data.packing import pack_rollouts, read_at

    # prompt_len 3; rows 0, 1 share the prompt [5, 6] (left-padded), row 2 has [7, 8, 9]; responses are
    # the masked tokens from column 3 on: [10, 11], [12], [13, 14, 15]
    seq = torch.tensor([[0, 5, 6, 10, 11, 0], [0, 5, 6, 12, 0, 0], [7, 8, 9, 13, 14, 15]])
    mask = torch.tensor([[0, 1, 1, 1, 1, 0], [0, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1]])
    pr = pack_rollouts(seq, mask, prompt_len=3, pad_id=0)
    assert pr.packed.input_ids.tolist() == [[5, 6, 10, 11, 12, 0], [7, 8, 9, 13, 14, 15]]
    assert pr.packed.position_ids.tolist() == [[0, 1, 2, 3, 2, 0], [0, 1, 2, 3, 4, 5]]
    assert pr.group.tolist() == [0, 0, 1]
    # action j predicts response token j: from the prompt's last token (j = 0), then from token j - 1;
    # past the response, the prompt's last token again (masked)
    assert pr.source.tolist() == [[1, 2, 1], [1, 1, 1], [2, 3, 4]]
    assert pr.valid.tolist() == [[True, True, False], [True, False, False], [True, True, True]]
    assert pr.last.tolist() == [3, 4, 5]
    # read earlier in each response (the reward model's position, before an end token): 1, 0 and 2 tokens
    assert read_at(pr, torch.tensor([1, 0, 2])).last.tolist() == [2, 1, 4]  # row 1: its prompt's last token
    assert read_at(pr, torch.tensor([2, 1, 3])).last.tolist() == pr.last.tolist()
    with pytest.raises(ValueError, match="beyond its packed response"):
        read_at(pr, torch.tensor([3, 1, 3]))
    # an empty prompt, or a response with a hole in its mask, is not packed
    assert pack_rollouts(seq, torch.tensor([[0, 0, 0, 1, 1, 0]] * 3), 3, 0) is None
    assert pack_rollouts(seq, torch.tensor([[0, 1, 1, 1, 0, 1]] * 3), 3, 0) is None


def test_ppo_falls_back_to_separate_rows_where_packing_does_not_hold(tokenizer, monkeypatch, caplog):
    """A model that ignores the custom mask (plain causal attention): the first batch's check switches
    packing off and the experience is that of separate rows."""
    import dschat.lm as lm_module
    from tests.unit.test_ppo_trainer import Engine, micro_llama, prompts, trainer

    def causal(segments):
        n = segments.shape[1]
        return torch.ones((n, n), dtype=torch.bool).tril().expand(segments.shape[0], 1, -1, -1)

    monkeypatch.setattr(lm_module, "shared_prompt_mask", causal)
    actor, reference = micro_llama(len(tokenizer), seed=0), micro_llama(len(tokenizer), seed=1)
    runs = {}
    for share in (True, False):
        ppo = trainer(Engine(actor), Engine(reference), tokenizer, temperature=1.0, share_prompt=share)
        torch.manual_seed(5)
        with caplog.at_level("WARNING", logger="dschat"):
            runs[share] = (ppo.make_experience(*prompts(tokenizer))[0], ppo)
    (packed_exp, ppo), (plain_exp, _) = runs[True], runs[False]
    assert ppo.packing_checked and not ppo.share_prompt
    assert "packed answers differ from separate rows" in caplog.text
    assert torch.equal(packed_exp.logprobs, plain_exp.logprobs)
    assert torch.equal(packed_exp.ref_logprobs, plain_exp.ref_logprobs)


def test_reward_model_scores_packed_rollouts_as_separate_rows():
    from dschat.data.packing import pack_rollouts
    from dschat.rlhf.rewards import RewardModelSource

    model = _tiny("llama")
    # two prompts (left-padded to 4) with two and one answers; the mask ends each answer at its last token
    seq = torch.tensor([[0, 5, 6, 7, 10, 11, 12], [0, 5, 6, 7, 13, 0, 0], [1, 2, 3, 4, 20, 21, 0]])
    mask = torch.tensor([[0, 1, 1, 1, 1, 1, 1], [0, 1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1, 0]])
    source = RewardModelSource(model)
    packed = pack_rollouts(seq, mask, prompt_len=4, pad_id=0)
    plain = source.score([""] * 3, [""] * 3, seq, mask)
    assert source.score([""] * 3, [""] * 3, seq, mask, packed).tolist() == pytest.approx(
        plain.tolist(), abs=1e-5
    )


def test_reward_read_before_the_end_token_in_the_actors_rows_equals_separate_rows_without_it():
    """Step 3 scores each rollout in the actor's packed rows (end tokens in place) at its last token
    before the end token: the values of separate rows whose mask stops before it."""
    from dschat.data.packing import pack_rollouts, read_at
    from dschat.rlhf.rewards import RewardModelSource

    model = _tiny("llama")
    end = 9
    seq = torch.tensor([[0, 5, 6, 7, 10, 11, end], [0, 5, 6, 7, end, 0, 0], [1, 2, 3, 4, 20, 21, 22]])
    mask = torch.tensor([[0, 1, 1, 1, 1, 1, 1], [0, 1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1, 1]])
    reward_mask = mask * (seq != end).long()  # row 1's answer is its end token alone: read at the prompt
    source = RewardModelSource(model)
    plain = source.score([""] * 3, [""] * 3, seq, reward_mask)
    rows = read_at(pack_rollouts(seq, mask, prompt_len=4, pad_id=0), reward_mask[:, 4:].sum(1))
    assert source.score([""] * 3, [""] * 3, seq, mask, rows).tolist() == pytest.approx(
        plain.tolist(), abs=1e-5
    )


def test_settle_share_prompt_decides_on_the_worst_rank(monkeypatch, caplog):
    """Every rank measures its own forward; the decision takes the largest error over the ranks, so that
    all ranks pack or none does (a rank scoring otherwise than its peers breaks "2 ranks == 1 rank")."""
    from dschat.utils import dist

    model = _tiny("llama")
    collate, feats, evals = _collated(True)
    # another rank measured 0.3 where this one measured rounding
    monkeypatch.setattr(dist, "all_reduce_max", lambda xs: [max(x, 0.3) for x in xs])
    with caplog.at_level("WARNING", logger="dschat"):
        settle_share_prompt(model, collate, feats, evals, "cpu")
    assert not collate.share_prompt and "differ from unpacked rows by 0.30" in caplog.text


def test_settle_share_prompt_falls_back_on_a_nan_error(monkeypatch):
    """A NaN difference (a broken pass) compares False with any tolerance: it must not keep packing."""
    model = _tiny("llama")
    collate, feats, evals = _collated(True)
    monkeypatch.setattr(ScalarHeadModel, "packing_error", lambda self, batch, device: float("nan"))
    settle_share_prompt(model, collate, feats, evals, "cpu")
    assert not collate.share_prompt
