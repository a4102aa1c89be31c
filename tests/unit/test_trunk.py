"""dschat.models.trunk and --share_frozen_trunk: the bottom blocks that the actor shares with the
reference and the reward model, computed once in the experience pass, with the values of separate passes."""

from __future__ import annotations

import copy

import pytest
import torch

from dschat.models import trunk as T
from dschat.models.layers import freeze_below
from dschat.models.reward import ScalarHeadModel
from dschat.rlhf.rewards import RewardModelSource
from tests.unit.gloo import on_two_ranks
from tests.unit.test_ppo_trainer import Engine, micro_llama, prompts, trainer


def reward_model_on(actor, vocab: int, seed: int = 3) -> ScalarHeadModel:
    """A frozen reward model with the actor's embeddings and bottom block and its own top block and head."""
    from transformers import LlamaForSequenceClassification

    torch.manual_seed(seed)
    cfg = copy.deepcopy(actor.config)
    cfg.num_labels, cfg.pad_token_id = 1, 0
    rm = LlamaForSequenceClassification(cfg).eval()
    rm.model.embed_tokens.load_state_dict(actor.model.embed_tokens.state_dict())
    rm.model.layers[0].load_state_dict(actor.model.layers[0].state_dict())
    return ScalarHeadModel(rm).requires_grad_(False)


def models(tokenizer):
    """The step-3 trio of the main job in small: an actor training its top block only, the reference it
    started from, a reward model trained on the same bottom."""
    actor = micro_llama(len(tokenizer), seed=0)
    reference = copy.deepcopy(actor).requires_grad_(False)
    freeze_below(actor, 1)
    return actor, reference, reward_model_on(actor, len(tokenizer))


def counting(model) -> list[int]:
    """How many times the model's first block runs (a list holding one count)."""
    calls = [0]
    model.model.layers[0].register_forward_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    return calls


def test_shared_depth_is_read_off_the_weights(tokenizer):
    actor, reference, rm = models(tokenizer)
    assert len(actor.model.layers) == 2
    assert T.shared_depth([actor, reference]) == 1  # the top block always runs in each model
    assert T.shared_depth([Engine(actor), rm]) == 1  # through an engine and a value-head wrapper
    # one model: its own frozen bottom
    assert T.shared_depth([actor]) == 1 and T.shared_depth([micro_llama(len(tokenizer))]) == 0
    assert T.shared_depth([actor, micro_llama(len(tokenizer), seed=1).requires_grad_(False)]) == 0
    # a trainable block, or different embeddings, is not shared
    assert T.shared_depth([micro_llama(len(tokenizer), seed=0), reference]) == 0
    other = copy.deepcopy(reference)
    with torch.no_grad():
        other.model.embed_tokens.weight[0] += 1
    assert T.shared_depth([actor, other]) == 0


def test_a_replayed_trunk_gives_the_full_forward(tokenizer):
    actor, reference, _ = models(tokenizer)
    ids = torch.randint(5, len(tokenizer), (3, 7))
    with torch.no_grad():
        full = reference(input_ids=ids).logits
        with T.capture(actor, {1}) as trunks:
            actor(input_ids=ids)
        runs = counting(reference)
        with T.replay(reference, trunks[1]):
            replayed = reference(input_ids=ids).logits
    assert runs == [0] and torch.equal(replayed, full)
    assert len(reference.model.layers) == 2  # the blocks are back
    with pytest.raises(RuntimeError, match="replayed trunk"), torch.no_grad(), T.replay(reference, trunks[1]):
        reference(input_ids=ids[:2])


@pytest.mark.parametrize("share_prompt", [True, False])
def test_experience_with_a_shared_trunk_equals_separate_passes(tokenizer, share_prompt):
    """Reference log-probs and reward scores equal with and without sharing; after the first batch
    (checked against full passes) neither the reference nor, with packed rows, the reward model runs its
    own bottom block."""
    runs = {}
    for share in (True, False):
        actor, reference, rm = models(tokenizer)
        ppo = trainer(Engine(actor), Engine(reference), tokenizer, temperature=1.0, share_prompt=share_prompt,
                      scores=RewardModelSource(Engine(rm)), share_frozen_trunk=share)  # fmt: skip
        ref_runs, rm_runs = counting(reference), counting(rm.model)
        out = []
        for seed in (5, 6):
            torch.manual_seed(seed)
            out.append(ppo.make_experience(*prompts(tokenizer))[0])
        runs[share] = (out, ppo, ref_runs, rm_runs)
    (shared, ppo, ref_runs, rm_runs), (separate, _, _, _) = runs[True], runs[False]
    for a, b in zip(shared, separate):
        assert torch.equal(a.sequences, b.sequences)
        assert torch.equal(a.ref_logprobs, b.ref_logprobs)
        assert torch.equal(a.scores, b.scores)
    assert ppo.trunk_depths == {"reference": 1, "reward": 1, "actor": 1}
    assert ref_runs == [1]  # the first batch's check only
    # packed rows: the first batch's trunk check and its check of packed scores against separate rows
    # (PPOTrainer._check_reward_packing); separate rows: the reward model reads other rows than the actor
    assert rm_runs == [2]


def test_a_trunk_that_does_not_reproduce_the_model_falls_back_with_a_warning(tokenizer, monkeypatch, caplog):
    actor, reference, rm = models(tokenizer)
    ppo = trainer(Engine(actor), Engine(reference), tokenizer, temperature=1.0, share_prompt=True,
                  scores=RewardModelSource(Engine(rm)), share_frozen_trunk=True)  # fmt: skip
    real = T._Replay.forward
    monkeypatch.setattr(T._Replay, "forward", lambda self, h, *a, **k: 2 * real(self, h, *a, **k))
    torch.manual_seed(5)
    with caplog.at_level("WARNING", logger="dschat"):
        exp, _ = ppo.make_experience(*prompts(tokenizer))
    assert "differs from its own pass" in caplog.text
    assert ppo.trunk_depths == {"reference": 0, "reward": 0, "actor": 1}
    plain = trainer(Engine(actor), Engine(reference), tokenizer, temperature=1.0, share_prompt=True,
                    scores=RewardModelSource(Engine(rm)))  # fmt: skip
    torch.manual_seed(5)
    want, _ = plain.make_experience(*prompts(tokenizer))
    assert torch.equal(exp.ref_logprobs, want.ref_logprobs) and torch.equal(exp.scores, want.scores)


@pytest.mark.parametrize("share_prompt", [True, False])
def test_the_update_starts_above_the_frozen_bottom_and_learns_the_same(tokenizer, share_prompt):
    """Two minibatches of whole prompt groups: the update's log-probs and the trained weights equal those
    of full passes, and the actor's bottom block runs in the experience pass only."""
    weights, counts = {}, {}
    for share in (True, False):
        actor, reference, rm = models(tokenizer)
        ppo = trainer(Engine(actor, lr=0.5), Engine(reference), tokenizer, temperature=1.0,
                      share_prompt=share_prompt, scores=RewardModelSource(Engine(rm)), share_frozen_trunk=share)  # fmt: skip
        torch.manual_seed(5)
        exp, _ = ppo.make_experience(*prompts(tokenizer))
        assert (exp.trunk is not None) == share and (exp.packed is not None) == share_prompt
        runs = counting(actor)
        for s in (0, 2):  # the groups of prompts 0 and 1 (2 answers each)
            ppo.train(exp.slice(s, s + 2))
        counts[share] = runs[0]
        weights[share] = {k: v.clone() for k, v in actor.state_dict().items()}
    assert counts == {True: 0, False: 2}
    for k, v in weights[False].items():
        assert torch.allclose(weights[True][k], v, atol=1e-6), k
    assert not torch.equal(weights[True]["model.layers.1.mlp.up_proj.weight"],
                           models(tokenizer)[0].state_dict()["model.layers.1.mlp.up_proj.weight"])  # fmt: skip


def test_a_minibatch_that_splits_a_prompts_group_is_packed_anew(tokenizer):
    actor, reference, rm = models(tokenizer)
    ppo = trainer(Engine(actor), Engine(reference), tokenizer, temperature=1.0, share_prompt=True,
                  scores=RewardModelSource(Engine(rm)), share_frozen_trunk=True)  # fmt: skip
    torch.manual_seed(5)
    exp, _ = ppo.make_experience(*prompts(tokenizer))
    whole, split = exp.slice(2, 4), exp.slice(1, 3)
    assert whole.packed.group.tolist() == [0, 0] and whole.trunk.hidden.shape[0] == 1
    assert torch.equal(whole.packed.packed.input_ids[0], exp.packed.packed.input_ids[1])
    assert split.packed is None and split.trunk is None
    # the first update cannot be checked against the experience from a split group: no sharing then
    ppo.train(split)
    assert ppo.trunk_depths["actor"] == 0


def tiny(kind: str, vocab: int, layers: int = 4):
    """A frozen small model of ``kind``: llama; gemma2 with sliding and full attention alternating and a
    window (2) shorter than the rows; opt with a projection between its embeddings and its blocks."""
    from transformers import AutoModelForCausalLM, Gemma2Config, LlamaConfig, OPTConfig

    torch.manual_seed(0)
    common = dict(vocab_size=vocab, num_hidden_layers=layers, num_attention_heads=2, hidden_size=32)
    if kind == "llama":
        cfg = LlamaConfig(intermediate_size=64, num_key_value_heads=2, **common)
    elif kind == "gemma2":
        types = ["sliding_attention", "full_attention"] * (layers // 2)
        cfg = Gemma2Config(intermediate_size=64, num_key_value_heads=1, head_dim=16, sliding_window=2,
                           layer_types=types, **common)  # fmt: skip
    else:
        cfg = OPTConfig(ffn_dim=64, word_embed_proj_dim=16, max_position_embeddings=64, **common)
    return AutoModelForCausalLM.from_config(cfg).eval().requires_grad_(False)


@pytest.mark.parametrize("kind", ["llama", "gemma2"])
def test_a_deeper_trunk_replays_the_full_forward_whatever_the_layer_types(tokenizer, kind):
    """Depth 2 of 4 blocks: Gemma 2 picks each layer's attention (sliding or full) by its position in
    the loop, so the stand-ins keep the list's length; rows of 7 tokens go past the window."""
    reference = tiny(kind, len(tokenizer))
    actor = copy.deepcopy(reference).requires_grad_(True)
    freeze_below(actor, 2)
    assert T.shared_depth([actor, reference]) == 2 and T.shared_depth([actor]) == 2
    ids = torch.randint(5, len(tokenizer), (3, 7))
    with torch.no_grad():
        full = reference(input_ids=ids).logits
        with T.capture(actor, {2}) as trunks:
            actor(input_ids=ids)
        with T.replay(reference, trunks[2]):
            replayed = reference(input_ids=ids).logits
    assert torch.equal(replayed, full)


def test_something_trainable_before_the_blocks_shares_nothing(tokenizer):
    """OPT-350m's shape: a projection between the embeddings and the blocks (--trainable_layers freezes
    it; a LoRA adapter or another freezing could leave it trainable). Traced on a one-token forward;
    frozen, it is compared like the embeddings."""
    reference = tiny("opt", len(tokenizer))
    actor = copy.deepcopy(reference).requires_grad_(True)
    freeze_below(actor, 1)
    assert not actor.model.decoder.project_in.weight.requires_grad
    assert T.shared_depth([actor, reference]) == 3
    actor.model.decoder.project_in.requires_grad_(True)
    assert T.shared_depth([actor, reference]) == 0 and T.shared_depth([actor]) == 0
    actor.model.decoder.project_in.requires_grad_(False)
    assert T.shared_depth([actor, reference]) == 3
    with torch.no_grad():
        actor.model.decoder.project_in.weight[0, 0] += 1
    assert T.shared_depth([actor, reference]) == 0


def test_the_first_update_is_checked_on_every_answer_even_where_some_do_not_train(
    tokenizer, monkeypatch, caplog
):
    """--filter_uniform_groups drops the answers of a prompt that all score alike from the update. A
    minibatch of only such answers takes no update (and so no check: the weights stay those of the
    experience); the first that trains is checked against the experience on every answer, those that do
    not train too, and a wrong trunk is caught."""
    from tests.unit.test_ppo_trainer import FixedScores

    actor, reference, _ = models(tokenizer)
    ppo = trainer(Engine(actor), Engine(reference), tokenizer, temperature=1.0, share_prompt=True,
                  scores=FixedScores([1.0, 1.0, 0.0, 2.0]), filter_uniform_groups=True, share_frozen_trunk=True)  # fmt: skip
    torch.manual_seed(5)
    exp, _ = ppo.make_experience(*prompts(tokenizer))
    assert exp.action_mask[:2].sum() == 0 and exp.action_mask[2:].sum() > 0
    real = T._Replay.forward
    monkeypatch.setattr(T._Replay, "forward", lambda self, h, *a, **k: 2 * real(self, h, *a, **k))
    with caplog.at_level("WARNING", logger="dschat"):
        assert ppo.train(exp.slice(0, 2)) == {"skipped_actor_updates": 1.0}
        assert "update" not in ppo.trunk_checked and ppo.trunk_depths["actor"] == 1
        ppo.train(exp.slice(0, 4))  # two answers that do not train, two that do
    assert "computing the whole actor" in caplog.text and ppo.trunk_depths["actor"] == 0


def _first_update(rank: int) -> int:
    from dschat.models.builtin import build_tokenizer

    tokenizer = build_tokenizer()
    actor, reference, rm = models(tokenizer)
    ppo = trainer(Engine(actor), Engine(reference), tokenizer, temperature=1.0, share_prompt=True,
                  scores=RewardModelSource(Engine(rm)), share_frozen_trunk=True)  # fmt: skip
    torch.manual_seed(5)
    exp, _ = ppo.make_experience(*prompts(tokenizer))
    # rank 0's minibatch holds a whole group (hidden states kept), rank 1's splits one (none kept)
    ppo.train(exp.slice(2, 4) if rank == 0 else exp.slice(1, 3))
    return ppo.trunk_depths["actor"]


def test_the_first_updates_check_is_taken_by_every_rank_together():
    """The first update's check against the experience is collective: a rank whose minibatch kept no
    hidden states (a split group) must still take part, and then no rank shares (else the ranks with
    kept states wait in the reduction for a peer that never comes). Two real gloo ranks."""
    assert on_two_ranks(_first_update) == {0: 0, 1: 0}


def test_an_evaluation_memo_runs_a_repeated_batch_above_the_frozen_bottom_only(tokenizer, caplog):
    """The same held-out batch scored again (step 2's evaluations): the first time in full, recording the
    hidden states above the frozen bottom; the second time from them, checked once against the full pass;
    then from them alone. The trained top block still runs every time, so a changed top changes the
    scores; a new batch, or a model with nothing frozen, runs in full."""
    _, _, rm = models(tokenizer)
    ids, mask, _ = prompts(tokenizer)
    memo = T.EvalMemo(Engine(rm), "test")
    calls = counting(rm.model)
    assert memo.depth == 1 and memo.device == torch.device("cpu")  # the engine's attributes show through
    with memo.evaluation():
        first = memo(ids, mask)
        assert calls[0] == 1
        assert torch.equal(memo(ids, mask), first) and calls[0] == 2  # the first evaluation replays nothing
    with memo.evaluation(), caplog.at_level("INFO", logger="dschat"):
        again = memo(ids, mask)  # replayed, and once in full for the check
        assert (
            calls[0] == 3 and torch.equal(again, first) and "above the frozen bottom 1 blocks" in caplog.text
        )
        assert torch.equal(memo(ids, mask), first) and calls[0] == 3  # replayed alone
    with torch.no_grad():
        rm.model.model.layers[1].mlp.up_proj.weight.mul_(1.5)  # the top block trains between evaluations
    with memo.evaluation():
        assert torch.equal(memo(ids, mask), rm(ids, mask)) and calls[0] == 4  # replayed; then the full pass
        memo(ids.flip(0), mask)
        assert calls[0] == 5  # a batch not seen before runs in full
    free = T.EvalMemo(Engine(micro_llama(len(tokenizer))), "test")
    assert free.depth == 0 and torch.equal(free(input_ids=ids).logits, free.model(input_ids=ids).logits)


def test_an_evaluation_memo_that_does_not_reproduce_the_model_stops_with_a_warning(tokenizer, caplog):
    _, _, rm = models(tokenizer)
    ids, mask, _ = prompts(tokenizer)
    memo = T.EvalMemo(Engine(rm), "test")
    with memo.evaluation():
        full = memo(ids, mask)
    [kept] = memo.kept.values()
    kept.hidden += 1.0  # what a model that does more than its blocks say would look like
    with memo.evaluation(), caplog.at_level("WARNING", logger="dschat"):
        assert torch.equal(memo(ids, mask), full)  # the full pass's values, not the replayed ones
    assert "computing it in full" in caplog.text and memo.depth == 0 and not memo.kept


def _memo_on_a_rank(rank: int) -> list[int]:
    from dschat.models.builtin import build_tokenizer

    tokenizer = build_tokenizer()
    _, _, rm = models(tokenizer)
    ids, mask, _ = prompts(tokenizer)
    other = (ids.flip(0), mask.flip(0))
    memo = T.EvalMemo(Engine(rm), "test")
    calls = counting(rm.model)
    for _ in range(2):  # two evaluations of the same batches; rank 0 has a batch twice, rank 1 does not
        with memo.evaluation():
            memo(ids, mask)
            memo(*((ids, mask) if rank == 0 else other))
    return [calls[0], memo.depth]


def test_an_evaluation_memo_checks_on_every_rank_together():
    """The replay check is collective: it ran at each rank's first repeated batch, so a rank that met a
    batch twice within the first evaluation (duplicate held-out pairs, a policy giving the same answers)
    waited in the reduction for a peer that had none. Every rank now checks at the first batch of the
    second evaluation. Two real gloo ranks; 2 + 1 full passes each (the second evaluation's check)."""
    assert on_two_ranks(_memo_on_a_rank, timeout=60) == {0: [3, 1], 1: [3, 1]}


def count_actor_passes(ppo) -> list[int]:
    """How many log-prob passes the trainer runs on its actor (a list holding one count; generation
    does not count)."""
    runs, score = [0], ppo.action_logprobs

    def counted(engine, *args, **kw):
        runs[0] += engine is ppo.actor
        return score(engine, *args, **kw)

    ppo.action_logprobs = counted
    return runs


@pytest.mark.parametrize("share_prompt", [True, False])
@pytest.mark.parametrize("kl_in", ["reward", "loss"])
def test_one_update_per_round_reuses_the_experience_pass_and_learns_the_same(tokenizer, share_prompt, kl_in):
    """Where a round is one update (one_update_per_round), the update's forward is the experience pass's,
    kept with its graph: three rounds give the same log-probs, losses and trained weights as separate
    passes (fp32; packed and with the shared frozen trunk, or neither), and the actor's log-prob pass
    runs once per round instead of twice."""
    result = {}
    for fused in (True, False):
        actor, reference, rm = models(tokenizer)
        ppo = trainer(Engine(actor, lr=0.5), Engine(reference), tokenizer, temperature=1.0, share_prompt=share_prompt,
                      scores=RewardModelSource(Engine(rm)), kl_in=kl_in, kl_estimator="k3" if kl_in == "loss" else "k1",
                      share_frozen_trunk=share_prompt, one_update_per_round=fused)  # fmt: skip
        runs = count_actor_passes(ppo)
        torch.manual_seed(5)
        logs = []
        for _ in range(3):
            exp, stats = ppo.make_experience(*prompts(tokenizer))
            assert (exp.actor_graph is not None) == fused
            assert not exp.logprobs.requires_grad  # the old log-probs are values, never differentiated
            logs.append((exp.sequences, exp.logprobs, stats["kl_sum"], stats["entropy_sum"], ppo.train(exp)))
        result[fused] = logs, {k: v.clone() for k, v in actor.state_dict().items()}, runs[0]
    (logs, weights, runs), (want_logs, want_weights, want_runs) = result[True], result[False]
    checks = 1 if share_prompt else 0  # the first batch's packing check runs the actor once more
    assert (runs, want_runs) == (3 + checks, 6 + checks)
    for (seq, lp, kl, ent, out), (want_seq, want_lp, want_kl, want_ent, want_out) in zip(logs, want_logs):
        assert torch.equal(seq, want_seq)  # the same rollouts: the weights stayed equal round by round
        assert torch.allclose(lp, want_lp, atol=1e-6)
        assert kl == pytest.approx(want_kl, abs=1e-5) and ent == pytest.approx(want_ent, rel=1e-5)
        assert out.keys() == want_out.keys()
        for k in out:
            assert out[k] == pytest.approx(want_out[k], abs=1e-5), k
    for k, v in want_weights.items():
        assert torch.allclose(weights[k], v, atol=1e-6), k
    assert not torch.equal(want_weights["model.layers.1.mlp.up_proj.weight"],
                           models(tokenizer)[0].state_dict()["model.layers.1.mlp.up_proj.weight"])  # fmt: skip


def test_a_round_split_over_minibatches_keeps_no_graph_in_its_parts(tokenizer):
    """A minibatch that is part of the round cannot take the round's graph (its second part would run a
    backward through a freed graph): it computes its own forward."""
    actor, reference, rm = models(tokenizer)
    ppo = trainer(Engine(actor), Engine(reference), tokenizer, temperature=1.0,
                  scores=RewardModelSource(Engine(rm)), one_update_per_round=True)  # fmt: skip
    torch.manual_seed(5)
    exp, _ = ppo.make_experience(*prompts(tokenizer))
    assert exp.slice(0, 2).actor_graph is None and exp.slice(2, 4).actor_graph is None
    assert exp.slice(0, 4).actor_graph is not None
    # a freezing round (the critic learns alone) keeps no graph either
    torch.manual_seed(5)
    frozen, _ = ppo.make_experience(*prompts(tokenizer), train_actor=False)
    assert frozen.actor_graph is None and not actor.training


def gae_trainer(actor, reference, critic, rm, tokenizer, fused: bool):
    """A GAE trainer (one answer per prompt) whose critic's experience pass is its update's or not."""
    from dschat.generation.plain import PlainGenerator
    from dschat.generation.sampling import SamplingConfig
    from dschat.rlhf import ppo_math as M
    from dschat.rlhf.ppo import PPOHyper, PPOTrainer

    hyper = PPOHyper(clip_reward_value=5.0, cliprange=0.2, cliprange_value=0.2, gamma=1.0, lam=0.95,
                     whiten_advantages=False, unsup_coef=0.0, advantage_estimator="gae",
                     one_update_per_round=fused, critic_one_update_per_round=fused)  # fmt: skip
    sampling = SamplingConfig(max_new_tokens=6, temperature=1.0)
    return PPOTrainer(actor=actor, reference=reference, critic=critic, reward_source=RewardModelSource(Engine(rm)),
                      generator=PlainGenerator(actor, tokenizer, sampling, zero3=False), tokenizer=tokenizer,
                      hyper=hyper, kl_ctl=M.FixedKLController(0.1))  # fmt: skip


def test_the_critics_experience_pass_is_its_update_forward_and_learns_the_same(tokenizer):
    """With critic_one_update_per_round the critic runs once per round, in train mode with its graph, and
    the value update reuses it: three GAE rounds give the same values, value losses and trained critic
    as an experience pass in eval mode followed by the update's own forward (fp32, no dropout)."""
    result = {}
    for fused in (True, False):
        actor, reference, rm = models(tokenizer)
        critic = copy.deepcopy(rm).requires_grad_(True)
        ppo = gae_trainer(
            Engine(actor, lr=0.5), Engine(reference), Engine(critic, lr=0.5), rm, tokenizer, fused
        )
        calls = counting(critic.model)
        torch.manual_seed(5)
        logs = []
        for _ in range(3):
            exp, _ = ppo.make_experience(*prompts(tokenizer))
            assert (exp.critic_graph is not None) == fused and not exp.values.requires_grad
            logs.append((exp.sequences, exp.values, ppo.train(exp)))
        result[fused] = logs, {k: v.clone() for k, v in critic.state_dict().items()}, calls[0]
    (logs, weights, calls), (want_logs, want_weights, want_calls) = result[True], result[False]
    assert (calls, want_calls) == (3, 6)
    for (seq, values, out), (want_seq, want_values, want_out) in zip(logs, want_logs):
        assert torch.equal(seq, want_seq)
        assert torch.allclose(values, want_values, atol=1e-6)
        assert out["value_loss"] == pytest.approx(want_out["value_loss"], abs=1e-6)
    for k, v in want_weights.items():
        assert torch.allclose(weights[k], v, atol=1e-6), k
    assert not torch.equal(want_weights["model.model.layers.1.mlp.up_proj.weight"],
                           rm.state_dict()["model.model.layers.1.mlp.up_proj.weight"])  # fmt: skip
    # a part of the round cannot take the round's graph
    assert exp.slice(0, 1).critic_graph is None
