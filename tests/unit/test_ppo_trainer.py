"""dschat.rlhf.ppo and dschat.generation.plain on a micro Llama: the distribution rollouts are sampled from
is the one every PPO log-prob is taken of (temperature, no checkpoint generation settings, no dropout).

The engines are a minimal stand-in (forward, ``backward``, ``step`` with a torch optimizer): these tests
are about the maths of one round, not DeepSpeed, which tests/integration/test_step3.py runs for real.
"""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

import pytest
import torch

from dschat.generation.kv_decode import decode, position_ids_from_mask
from dschat.generation.plain import PlainGenerator
from dschat.generation.sampling import SamplingConfig
from dschat.generation.stops import truncated_rows
from dschat.models.builtin import build_config
from dschat.rlhf import ppo_math as M
from dschat.rlhf.ppo import PPOHyper, PPOTrainer

ROOT = Path(__file__).resolve().parents[2]


class Engine(torch.nn.Module):
    """What PPOTrainer and PlainGenerator use of a DeepSpeed engine."""

    device = torch.device("cpu")

    def __init__(self, module: torch.nn.Module, lr: float = 1e-2) -> None:
        super().__init__()
        self.module = module
        self.optimizer = torch.optim.SGD(module.parameters(), lr=lr)

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def step(self) -> None:
        self.optimizer.step()
        self.optimizer.zero_grad()

    def get_lr(self) -> list[float]:
        return [g["lr"] for g in self.optimizer.param_groups]


class Scores:
    """A reward source: a fixed score per row."""

    reads_packed = False

    def score(self, prompts, responses, sequences, attention_mask, packed=None) -> torch.Tensor:
        return torch.arange(len(responses), dtype=torch.float32)


def micro_llama(vocab: int, seed: int = 0, **config):
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = build_config("micro-llama", vocab_size=vocab)
    for k, v in config.items():
        setattr(cfg, k, v)
    return LlamaForCausalLM(cfg).eval()


def prompts(tokenizer) -> tuple[torch.Tensor, torch.Tensor, list[str]]:
    """Two left-padded prompts (B=2, P=5) of ordinary tokens, and their (dialogue) texts."""
    ids = torch.tensor([[0, 40, 41, 42, 43], [50, 60, 70, 80, 90]])
    ids[0, 0] = tokenizer.pad_token_id
    texts = [tokenizer.decode(row, skip_special_tokens=True) for row in ids]
    return ids, (torch.arange(5) >= torch.tensor([[1], [0]])).long(), texts


def trainer(
    actor, reference, tokenizer, temperature: float, max_new_tokens: int = 6, scores=None, **hyper_kw
) -> PPOTrainer:
    """A critic-free (rloo, 2 responses per prompt) trainer whose actor samples with ``temperature``;
    ``hyper_kw`` override PPOHyper's fields."""
    sampling = SamplingConfig(max_new_tokens=max_new_tokens, temperature=temperature)
    kw = dict(clip_reward_value=5.0, cliprange=0.2, cliprange_value=0.2, gamma=1.0, lam=0.95,
              whiten_advantages=False, unsup_coef=0.0, n_samples_per_prompt=2, advantage_estimator="rloo",
              temperature=temperature)  # fmt: skip
    hyper = PPOHyper(**{**kw, **hyper_kw})
    return PPOTrainer(actor=actor, reference=reference, critic=None, reward_source=scores or Scores(),
                      generator=PlainGenerator(actor, tokenizer, sampling, zero3=False), tokenizer=tokenizer,
                      hyper=hyper, kl_ctl=M.FixedKLController(0.1))  # fmt: skip


def spy_policy_loss(monkeypatch) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Record (new log-probs, old log-probs, action mask) of every policy loss the trainer computes."""
    calls = []
    real = M.policy_loss

    def spy(logprobs, old_logprobs, advantages, action_mask, cliprange, **kw):
        calls.append((logprobs.detach().clone(), old_logprobs.clone(), action_mask.clone()))
        return real(logprobs, old_logprobs, advantages, action_mask, cliprange, **kw)

    monkeypatch.setattr(M, "policy_loss", spy)
    return calls


def tempered_logprobs(model, sequences, attention_mask, temperature: float) -> torch.Tensor:
    """log softmax(logits / temperature) of each next token, computed here from scratch: (B, T-1)."""
    with torch.no_grad():
        logits = model(input_ids=sequences, attention_mask=attention_mask,
                       position_ids=position_ids_from_mask(attention_mask)).logits  # fmt: skip
    logp = torch.log_softmax(logits[:, :-1].double() / temperature, dim=-1)
    return logp.gather(-1, sequences[:, 1:, None]).squeeze(-1).float()


# ---------------------------------------------------------------- item 4: one distribution everywhere
def test_plain_generation_ignores_the_checkpoints_generation_settings(tokenizer):
    """A hub checkpoint's generation_config (repetition penalty, top-k, min-p ...) must not change what
    step 3 samples: the plain generator draws the same tokens as the hybrid engine's decode loop, which
    samples from softmax(logits / temperature) alone."""
    from transformers import GenerationConfig

    model = micro_llama(len(tokenizer))
    ids, mask, _ = prompts(tokenizer)
    own = GenerationConfig(do_sample=True, temperature=3.0, top_k=3, min_p=0.2, repetition_penalty=1.8,
                           no_repeat_ngram_size=2, max_new_tokens=2)  # fmt: skip
    model.generation_config = own
    for s in (
        SamplingConfig(max_new_tokens=8, temperature=0.5),
        SamplingConfig(max_new_tokens=8, do_sample=False),
    ):
        torch.manual_seed(11)
        plain = PlainGenerator(Engine(model), tokenizer, s, zero3=False).generate(ids, mask)
        torch.manual_seed(11)
        ref = decode(
            model, ids, mask, s, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id
        )
        assert torch.equal(plain, ref.sequences), s
    assert model.generation_config is own  # the checkpoint's settings are back (they are exported with it)


@pytest.mark.parametrize("do_sample", [False, True])
def test_plain_generation_draws_the_tokens_of_hugging_face_generate(tokenizer, do_sample):
    """The plain generator runs the KV-cache decoder, not ``generate``, for speed: the rollouts are still
    ``generate``'s, greedy and sampled from one seed (with ``generate``'s draw), stopping at either of two
    stop ids."""
    from transformers import GenerationConfig

    model = micro_llama(len(tokenizer))
    model.generation_config = GenerationConfig()  # nothing of a checkpoint's own (the test above)
    ids, mask, _ = prompts(tokenizer)
    s = SamplingConfig(max_new_tokens=12, temperature=0.8, top_k=20, do_sample=do_sample, draw="multinomial")
    torch.manual_seed(5)
    free = model.generate(
        input_ids=ids, attention_mask=mask, **s.generate_kwargs(), pad_token_id=tokenizer.pad_token_id
    )
    stops = [int(free[0, 7]), tokenizer.eos_token_id]  # a token the first answer draws: it must stop there
    torch.manual_seed(5)
    plain = PlainGenerator(Engine(model), tokenizer, s, zero3=False, stop_ids=stops).generate(ids, mask)
    torch.manual_seed(5)
    ref = model.generate(input_ids=ids, attention_mask=mask, **s.generate_kwargs(), eos_token_id=stops,
                         pad_token_id=tokenizer.pad_token_id)  # fmt: skip
    assert torch.equal(plain, ref)
    answer = plain[0, 5:].tolist()  # the first row stops at its third new token (or an earlier copy of it)
    cut = answer.index(stops[0])
    assert cut <= 2 and all(t == tokenizer.pad_token_id for t in answer[cut + 1 :])


@pytest.mark.parametrize("share_prompt", [False, True])
def test_log_probs_in_the_loss_are_those_of_the_tempered_sampler(tokenizer, monkeypatch, share_prompt):
    """At temperature 0.5 the old, reference and new log-probs, the KL and the entropy are those of
    softmax(logits / 0.5), the distribution the tokens were sampled from (test above). With
    ``share_prompt`` each prompt's two answers run as one packed row, and every number is the same."""
    t = 0.5
    actor, reference = micro_llama(len(tokenizer), seed=0), micro_llama(len(tokenizer), seed=1)
    ppo = trainer(Engine(actor), Engine(reference), tokenizer, temperature=t, share_prompt=share_prompt)
    calls = spy_policy_loss(monkeypatch)
    torch.manual_seed(5)
    exp, stats = ppo.make_experience(*prompts(tokenizer))
    m = exp.action_mask
    assert m.sum() > 8  # sampled responses, not only EOS
    want = tempered_logprobs(actor, exp.sequences, exp.attention_mask, t)
    want_ref = tempered_logprobs(reference, exp.sequences, exp.attention_mask, t)
    assert torch.allclose(exp.logprobs * m, want * m, atol=1e-5)
    assert torch.allclose(exp.ref_logprobs * m, want_ref * m, atol=1e-5)
    # the KL to the reference is that of the tempered policies (per sequence, summed over rows)
    assert stats["kl_sum"] == pytest.approx(float(((want - want_ref) * m).sum()), abs=1e-4)
    # the entropy is that of the tempered distribution: each answer's mean over its actions, summed over
    # the rows (it was one mean over all actions times the rows, which weighed a token by the length of
    # the other answers on its rank, so 2 ranks logged another number than 1)
    with torch.no_grad():
        logits = actor(input_ids=exp.sequences, attention_mask=exp.attention_mask,
                       position_ids=position_ids_from_mask(exp.attention_mask)).logits  # fmt: skip
    p = torch.softmax(logits[:, :-1].double() / t, dim=-1)
    entropy = -(p * p.log()).sum(-1).float()
    assert stats["entropy_sum"] == pytest.approx(float(M.masked_mean(entropy, m, dim=1).sum()), rel=1e-5)
    # the update's new log-probs are tempered too: the same numbers at the first minibatch
    ppo.train(exp)
    (new, old, mask), *_ = calls
    assert torch.equal(old, exp.logprobs)
    assert torch.allclose(new * mask, want * mask, atol=1e-5)
    assert ppo.share_prompt == share_prompt and ppo.packing_checked == share_prompt


class FixedScores:
    """A reward source with the given score per row."""

    reads_packed = False

    def __init__(self, values: list[float]) -> None:
        self.values = values

    def score(self, prompts, responses, sequences, attention_mask, packed=None) -> torch.Tensor:
        return torch.tensor(self.values)


@pytest.mark.parametrize("penalty", [0.0, 0.5])
def test_rlvr_stabilisers_in_one_round(tokenizer, penalty):
    """Dr. GRPO + DAPO's uniform-group filter and overlong penalty + GRPO's k3 KL loss, in one round:
    the penalty lowers the score of answers without EOS before the group baseline; a group whose
    (penalised) scores are all equal keeps no action in the update and is counted; with the KL in the
    loss the advantages are the pure group-relative scores, and the update's KL loss is k3 aggregated
    as Dr. GRPO does (each answer's sum over the budget 6)."""
    actor, reference = micro_llama(len(tokenizer), seed=0), micro_llama(len(tokenizer), seed=1)
    ppo = trainer(Engine(actor), Engine(reference), tokenizer, temperature=1.0, scores=FixedScores([1.0, 1.0, 0.0, 2.0]),
                  advantage_estimator="dr_grpo", filter_uniform_groups=True, kl_in="loss", kl_estimator="k3",
                  truncation_penalty=penalty, loss_agg="seq_mean_token_sum_norm", max_answer_len=6)  # fmt: skip
    torch.manual_seed(5)
    exp, stats = ppo.make_experience(*prompts(tokenizer))
    full = M.action_mask_from(exp.sequences, exp.prompt_len, [tokenizer.eos_token_id])
    truncated = truncated_rows(exp.sequences, exp.prompt_len, [tokenizer.eos_token_id])
    assert truncated.any()  # a random micro model rarely says EOS within 6 tokens
    score = torch.tensor([1.0, 1.0, 0.0, 2.0]) - penalty * truncated.float()
    relative = score.view(2, 2) - score.view(2, 2).mean(1, keepdim=True)
    uniform = (relative.abs() < 1e-6).all(1).repeat_interleave(2)
    assert stats["uniform_group_rows"] == float(uniform.sum())
    assert stats["truncated_rows"] == float(truncated.sum())
    assert stats["reward_sum"] == pytest.approx(
        float(score.sum())
    )  # the KL is a loss term, not in the reward
    assert uniform[2:].tolist() == [False, False]  # prompt 1's answers score 0 and 2: never uniform
    for i in range(4):
        if uniform[i]:
            assert exp.action_mask[i].sum() == 0  # the whole row leaves the update
        else:
            assert torch.equal(exp.action_mask[i], full[i])
            # no KL in the reward: every action's reward-to-go is the group-relative score
            acts = full[i] > 0
            assert torch.allclose(exp.advantages[i][acts], relative.view(-1)[i].expand(int(acts.sum())))
    out = ppo.train(exp)
    k3 = M.kl_estimate(exp.logprobs, exp.ref_logprobs, exp.action_mask, "k3")
    rows = (exp.action_mask.sum(1) > 0).sum()
    assert out["kl_loss"] == pytest.approx(float(k3.sum() / (rows * 6)), rel=1e-5)


def test_uniform_groups_are_counted_without_the_filter_and_stay_in_the_update(tokenizer):
    """Without --filter_uniform_groups the share of signal-free prompts is still reported (an RLVR
    diagnostic), and every row keeps its actions."""
    actor, reference = micro_llama(len(tokenizer), seed=0), micro_llama(len(tokenizer), seed=1)
    ppo = trainer(
        Engine(actor), Engine(reference), tokenizer, temperature=1.0, scores=FixedScores([1.0, 1.0, 0.0, 2.0])
    )
    torch.manual_seed(5)
    exp, stats = ppo.make_experience(*prompts(tokenizer))
    assert stats["uniform_group_rows"] == 2.0  # prompt 0's two answers both score 1
    full = M.action_mask_from(exp.sequences, exp.prompt_len, [tokenizer.eos_token_id])
    assert torch.equal(exp.action_mask, full)


def test_scores_beyond_the_clip_are_clipped_once_and_counted(tokenizer):
    """--clip_reward_value: scores 7 and -9 become 5 and -5 before the group baseline, 3 and 0.5 stay;
    the two clipped rows are what clipped_score_fraction reports."""
    actor, reference = micro_llama(len(tokenizer), seed=0), micro_llama(len(tokenizer), seed=1)
    ppo = trainer(Engine(actor), Engine(reference), tokenizer, temperature=1.0, scores=FixedScores([7.0, -9.0, 3.0, 0.5]),
                  kl_in="loss", kl_estimator="k3")  # fmt: skip
    torch.manual_seed(5)
    exp, stats = ppo.make_experience(*prompts(tokenizer))
    assert stats["clipped_score_rows"] == 2.0 and stats["rows"] == 4.0
    # RLOO with 2 answers: each clipped score minus the other's -> (10, -10) and (2.5, -2.5) on every action
    for i, want in enumerate([10.0, -10.0, 2.5, -2.5]):
        acts = exp.action_mask[i] > 0
        assert torch.allclose(exp.advantages[i][acts], torch.tensor(want).expand(int(acts.sum())))
    assert torch.equal(
        exp.scores, torch.tensor([7.0, -9.0, 3.0, 0.5])
    )  # the raw scores are kept for the logs


# ---------------------------------------------------------------- item 6: no dropout by default in step 3
def step3_groups(*argv: str) -> tuple:
    """Step 3's option groups as its own parser resolves them (its STEP_DEFAULTS included)."""
    spec = importlib.util.spec_from_file_location("dschat_train_py_ppo", ROOT / "train.py")
    train = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = train
    spec.loader.exec_module(train)
    return train.parse_step(train.STEPS[3], list(argv))


def step3_model_args(*argv: str):
    """(actor, critic) ModelArgs as step 3's own parser resolves them."""
    groups = step3_groups(*argv)
    return groups[0], groups[1]


def first_minibatch_log_ratio(path: str, dropout: float | None, tokenizer, monkeypatch) -> torch.Tensor:
    """Step 3's first round with the actor loaded from ``path`` with ``dropout``: the log-ratio
    log pi_new - log pi_old of the first minibatch of the first PPO epoch, on the actions."""
    from dschat.models.loading import load_causal_lm

    actor = load_causal_lm(path, tokenizer=tokenizer, dropout=dropout)
    reference = load_causal_lm(path, tokenizer=tokenizer)
    ppo = trainer(Engine(actor), Engine(reference), tokenizer, temperature=1.0)
    calls = spy_policy_loss(monkeypatch)
    torch.manual_seed(3)
    exp, _ = ppo.make_experience(*prompts(tokenizer))
    ppo.train(exp)
    new, old, mask = calls[0]
    return (new - old)[mask > 0]


def test_step3_turns_dropout_off_so_the_first_ratio_is_exactly_one(tokenizer, tmp_path, monkeypatch):
    """A checkpoint with dropout 0.1 in its config (as OPT and GPT-2 ship): experience is taken in eval
    mode, the update in train mode, so with the model's dropout the first ratio is not 1."""
    micro_llama(len(tokenizer), attention_dropout=0.1).save_pretrained(tmp_path / "m")
    actor_args, critic_args = step3_model_args()
    assert (actor_args.dropout, critic_args.dropout) == (0.0, 0.0)
    log_ratio = first_minibatch_log_ratio(str(tmp_path / "m"), actor_args.dropout, tokenizer, monkeypatch)
    assert log_ratio.numel() > 8 and torch.equal(log_ratio, torch.zeros_like(log_ratio))
    # overridable: --actor_dropout 0.1 keeps the checkpoint's dropout, and the ratio moves off 1
    actor_args, critic_args = step3_model_args("--actor_dropout", "0.1", "--critic_dropout", "0.05")
    assert (actor_args.dropout, critic_args.dropout) == (0.1, 0.05)
    log_ratio = first_minibatch_log_ratio(str(tmp_path / "m"), actor_args.dropout, tokenizer, monkeypatch)
    assert log_ratio.abs().max() > 1e-3


def test_action_logprobs_run_the_head_on_the_response_only_and_equal_the_full_pass(tokenizer):
    model = micro_llama(len(tokenizer))
    ppo = trainer(Engine(model), Engine(micro_llama(len(tokenizer), seed=1)), tokenizer, temperature=0.7)
    ids, mask, _ = prompts(tokenizer)  # (2, 5), row 0 left-padded
    seq = torch.cat([ids, torch.tensor([[7, 8, 9], [10, 11, 12]])], dim=1)
    attn = torch.cat([mask, torch.ones(2, 3, dtype=torch.long)], dim=1)
    widths = []
    hook = model.lm_head.register_forward_hook(lambda m, i, o: widths.append(i[0].shape[1]))
    lp, ent = ppo.action_logprobs(ppo.actor, seq, attn, prompt_len=5, entropy=True)
    hook.remove()
    assert widths == [4]  # positions 4..7 predict the 3 response tokens (and the one after)
    full = tempered_logprobs(model, seq, attn, 0.7)
    assert lp.shape == full.shape == (2, 7)
    torch.testing.assert_close(lp[:, 4:], full[:, 4:], rtol=1e-5, atol=1e-5)
    assert (lp[:, :4] == 0).all() and (ent[:, :4] == 0).all() and (ent[:, 4:] > 0).all()


def test_shared_reference_is_the_actor_without_its_adapter_numerically(tokenizer):
    # --share_reference_with_actor with LoRA: the reference log-probs are the base model's, the
    # actor's differ once the adapter has learned something, and the adapter is back on afterwards.
    from dschat.models.lora import inject_lora

    base = micro_llama(len(tokenizer))
    seq = torch.tensor([[5, 6, 7, 8, 9, 10], [11, 12, 13, 14, 15, 16]])
    attn = torch.ones_like(seq)
    want_ref = tempered_logprobs(base, seq, attn, 0.7)
    actor = inject_lora(base, dim=4)
    with torch.no_grad():  # a trained adapter: B is zero at initialisation, which would hide a mix-up
        for name, p in actor.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5, generator=torch.Generator().manual_seed(1))
    ppo = trainer(Engine(actor), None, tokenizer, temperature=0.7)
    with ppo.reference_mode() as ref:
        lp_ref, _ = ppo.action_logprobs(ref, seq, attn, prompt_len=2)
    lp_actor, _ = ppo.action_logprobs(ppo.actor, seq, attn, prompt_len=2)
    torch.testing.assert_close(lp_ref[:, 1:], want_ref[:, 1:], rtol=1e-5, atol=1e-5)
    assert (lp_actor[:, 1:] - lp_ref[:, 1:]).abs().max() > 1e-2
    torch.testing.assert_close(
        lp_actor[:, 1:], tempered_logprobs(actor, seq, attn, 0.7)[:, 1:], rtol=1e-5, atol=1e-5
    )


# ---------------------------------------------------------------- a chat template's end of turn
class RecordingScores(Scores):
    """Scores that keep the mask the reward model was handed."""

    def __init__(self) -> None:
        self.masks: list[torch.Tensor] = []

    def score(self, prompts, responses, sequences, attention_mask, packed=None) -> torch.Tensor:
        self.masks.append(attention_mask.clone())
        return super().score(prompts, responses, sequences, attention_mask, packed)


@pytest.mark.parametrize("kind", ["plain", "hybrid"])
def test_rollouts_end_at_the_templates_end_of_turn_when_it_is_not_eos(tokenizer, kind):
    """A chat model ends its reply with its template's end-of-turn token, which need not be its EOS
    (Gemma's <end_of_turn>, Phi-3's <|end|>, a base Qwen2's <|im_end|>). Generation must stop there, and
    the action mask, the reward model's last token and the truncation flag must end there too."""
    from dschat.generation.hybrid import HybridGenerator

    actor = micro_llama(len(tokenizer))
    ids, mask, texts = prompts(tokenizer)
    greedy = SamplingConfig(max_new_tokens=6, do_sample=False)
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    free = decode(actor, ids, mask, greedy, eos_token_id=eos, pad_token_id=pad).sequences[:, ids.shape[1] :]
    end = int(free[0, 1])  # row 0's second greedy token plays the end of turn
    assert end != eos and int(free[0, 0]) != end
    # each row's answer: up to and including its first end of turn or EOS, or all 6 tokens (truncated)
    lengths, stopped = [], []
    for row in free.tolist():
        hit = [i for i, t in enumerate(row) if t in (end, eos)]
        lengths.append(hit[0] + 1 if hit else len(row))
        stopped.append(bool(hit))
    engine = Engine(actor)
    stops = (end, eos)
    gen = (PlainGenerator(engine, tokenizer, greedy, zero3=False, stop_ids=stops) if kind == "plain"
           else HybridGenerator(engine, tokenizer, greedy, zero3=False, stop_ids=stops, measure_logprobs=False))  # fmt: skip
    scores = RecordingScores()
    hyper = PPOHyper(clip_reward_value=5.0, cliprange=0.2, cliprange_value=0.2, gamma=1.0, lam=0.95,
                     whiten_advantages=False, unsup_coef=0.0, n_samples_per_prompt=2, advantage_estimator="rloo",
                     temperature=1.0)  # fmt: skip
    ppo = PPOTrainer(actor=engine, reference=Engine(micro_llama(len(tokenizer))), critic=None, reward_source=scores,
                     generator=gen, tokenizer=tokenizer, hyper=hyper, kl_ctl=M.FixedKLController(0.1))  # fmt: skip
    exp, stats = ppo.make_experience(ids, mask, texts)
    twice = [x for x in lengths for _ in range(2)]
    assert exp.sequences.shape[1] == ids.shape[1] + max(lengths) and lengths[0] == 2
    assert exp.action_mask.sum(1).tolist() == [float(n) for n in twice]
    assert stats["truncated_rows"] == 2.0 * stopped.count(False)
    # the reward model reads prompt + response without its end token, as step 2 trained it
    prompt_tokens = mask.sum(1).tolist()
    expect = [p + n - s for p, n, s in zip(prompt_tokens, lengths, stopped) for _ in range(2)]
    assert scores.masks[0].sum(1).tolist() == expect


@pytest.mark.parametrize(
    ("argv", "want"),
    [
        ((), True),  # 16 prompts per round, 16 per update, one epoch: DeepSpeed-Chat's geometry
        (
            ("--n_samples_per_prompt", "2", "--per_device_training_batch_size", "32"),
            True,
        ),  # 32 rows, one update
        (("--per_device_training_batch_size", "8"), False),  # two updates: the second from new weights
        (("--n_samples_per_prompt", "2"), False),  # 32 rows per round, 16 per update
        (("--ppo_epochs", "2"), False),
        (("--generation_batches", "2"), False),
        (("--actor_dropout", "0.1"), False),  # the experience pass runs in train mode: dropout would differ
        (("--actor_lora_dim", "4", "--actor_lora_dropout", "0.1"), False),
        (("--actor_lora_dim", "4"), True),
        (("--actor_zero_stage", "2"), True),
        (("--actor_zero_stage", "3"), False),  # ZeRO-3 saves memory: no graph held across the other passes
    ],
)
def test_one_update_per_round_is_decided_from_the_options(argv, want):
    """Step 3's options as its parser resolves them: the experience pass is the update's forward only
    where the round is one update from unchanged weights and the forward is deterministic."""
    from dschat.config import one_update_per_round
    from dschat.rlhf.models import RLHFOptions

    base = ("--per_device_generation_batch_size", "16", "--per_device_training_batch_size", "16")
    o = RLHFOptions(*step3_groups(*base, *argv))
    assert one_update_per_round(o.ppo, o.actor, o.actor_lora, o.actor_ds.zero_stage) is want


@pytest.mark.parametrize(
    "argv, want",
    [
        ((), True),
        (("--critic_dropout", "0.1"), False),  # the critic's own dropout decides, not the actor's
        (("--actor_dropout", "0.1"), True),
        (("--critic_lora_dim", "4", "--critic_lora_dropout", "0.1"), False),
        (("--critic_zero_stage", "3"), False),
        (("--actor_zero_stage", "3"), True),
        (("--ppo_epochs", "2"), False),
    ],
)
def test_the_critics_one_update_per_round_is_decided_from_its_own_options(argv, want):
    from dschat.config import one_update_per_round
    from dschat.rlhf.models import RLHFOptions

    base = ("--per_device_generation_batch_size", "16", "--per_device_training_batch_size", "16")
    o = RLHFOptions(*step3_groups(*base, *argv))
    assert one_update_per_round(o.ppo, o.critic, o.critic_lora, o.critic_ds.zero_stage) is want


class AdamEngine(Engine):
    """An engine with AdamW (momentum and weight decay): a step on a zero gradient still moves it."""

    def __init__(self, module: torch.nn.Module) -> None:
        super().__init__(module)
        self.optimizer = torch.optim.AdamW(module.parameters(), lr=1e-2, weight_decay=0.1)
        # a linear decay over 4 steps, stepped by step() as DeepSpeed's engine steps its scheduler
        self.lr_scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda s: max(0.0, 1 - s / 4))
        self.steps = 0

    def step(self) -> None:
        self.steps += 1
        super().step()
        self.lr_scheduler.step()


def test_a_minibatch_whose_rows_all_left_the_update_takes_no_optimizer_step(tokenizer):
    """--filter_uniform_groups: when every group of a minibatch scores alike, no row keeps an action and
    the loss is 0; an AdamW step would still move the weights (momentum from the previous update, weight
    decay), so the actor's step is skipped and counted, and the weights stay as they were."""
    actor, reference = micro_llama(len(tokenizer), seed=0), micro_llama(len(tokenizer), seed=1)
    engine = AdamEngine(actor)
    mixed = trainer(engine, Engine(reference), tokenizer, temperature=1.0, scores=FixedScores([1.0, 0.0, 0.0, 2.0]),
                    advantage_estimator="group_norm", filter_uniform_groups=True)  # fmt: skip
    torch.manual_seed(5)
    out = mixed.train(mixed.make_experience(*prompts(tokenizer))[0])
    assert engine.steps == 1 and "policy_loss" in out  # an update with signal: the optimizer has momentum now
    uniform = trainer(engine, Engine(reference), tokenizer, temperature=1.0, scores=FixedScores([1.0, 1.0, 3.0, 3.0]),
                      advantage_estimator="group_norm", filter_uniform_groups=True)  # fmt: skip
    exp, stats = uniform.make_experience(*prompts(tokenizer))
    assert stats["uniform_group_rows"] == 4.0 and exp.action_mask.sum() == 0
    before = [p.detach().clone() for p in actor.parameters()]
    out = uniform.train(exp)
    assert engine.steps == 1 and out == {"skipped_actor_updates": 1.0}
    assert all(torch.equal(a, p) for a, p in zip(before, actor.parameters(), strict=True))
    # the skipped minibatch is one of the schedule's planned steps: the rate moves on as if it had trained
    # (else the run would end above the schedule's last rate), 1e-2 * (1 - 2/4)
    assert engine.lr_scheduler.last_epoch == 2 and engine.get_lr() == [pytest.approx(5e-3)]
    row = uniform.log_row({"rows": 4.0, "score_sum": 8.0, "score_sq_sum": 20.0, "reward_sum": 8.0, "kl_sum": 0.0,
                           "entropy_sum": 0.0, "length_sum": 8.0, "truncated_rows": 0.0, "uniform_group_rows": 4.0,
                           "clipped_score_rows": 0.0, "updates": 1.0, "skipped_actor_updates": 1.0})  # fmt: skip
    assert row["skipped_actor_updates"] == 1.0 and "policy_loss" not in row


def test_the_logged_count_of_skipped_updates_is_per_run_not_summed_over_ranks(tokenizer, monkeypatch):
    """Every rank skips a minibatch together (the decision is collective), so the window's sum over N
    ranks holds N for one skipped update: the log row counts updates, not rank-updates."""
    from dschat.utils import dist

    actor = micro_llama(len(tokenizer), seed=0)
    ppo = trainer(AdamEngine(actor), Engine(micro_llama(len(tokenizer), seed=1)), tokenizer, temperature=1.0,
                  scores=FixedScores([1.0, 1.0, 3.0, 3.0]), advantage_estimator="group_norm",
                  filter_uniform_groups=True)  # fmt: skip
    monkeypatch.setattr(dist, "world_size", lambda: 2)
    sums = {"rows": 8.0, "score_sum": 16.0, "score_sq_sum": 40.0, "reward_sum": 16.0, "kl_sum": 0.0,
            "entropy_sum": 0.0, "length_sum": 16.0, "truncated_rows": 0.0, "uniform_group_rows": 8.0,
            "clipped_score_rows": 0.0, "updates": 6.0, "actor_updates": 2.0, "policy_loss": 0.2,
            "skipped_actor_updates": 4.0}  # fmt: skip
    assert ppo.log_row(sums)["skipped_actor_updates"] == 2.0


@pytest.mark.parametrize("estimator", ["k1", "k3"])
def test_the_logged_reward_carries_the_kl_penalty_of_the_chosen_estimator(tokenizer, estimator):
    """reward_mean's sum: each row's clipped score less kl_coef times the sum of the estimator's per-token
    KL over its actions (what the per-token rewards hold), computed here from the log-probs."""
    actor, reference = micro_llama(len(tokenizer), seed=0), micro_llama(len(tokenizer), seed=1)
    ppo = trainer(Engine(actor), Engine(reference), tokenizer, temperature=1.0, scores=FixedScores([1.0, 0.0, 0.0, 2.0]),
                  kl_estimator=estimator)  # fmt: skip
    torch.manual_seed(5)
    exp, stats = ppo.make_experience(*prompts(tokenizer))
    acts = M.action_mask_from(exp.sequences, exp.prompt_len, [tokenizer.eos_token_id]).bool()
    d = (exp.logprobs - exp.ref_logprobs).double()[acts]
    k = d if estimator == "k1" else torch.exp(-d) - 1 + d
    assert stats["reward_sum"] == pytest.approx(3.0 - 0.1 * float(k.sum()), rel=1e-5)
    assert stats["kl_sum"] == pytest.approx(
        float(d.sum()), rel=1e-5
    )  # reported KL: k1 whatever the estimator


class MaskBlindScores:
    """A reward model that scores packed rows wrongly (as one that ignores the packed mask would): each row's
    sum of token ids, plus 7 when it is given packed rows."""

    reads_packed = True

    def __init__(self) -> None:
        self.packed_calls = 0

    def score(self, prompts, responses, sequences, attention_mask, packed=None) -> torch.Tensor:
        self.packed_calls += packed is not None
        return (sequences * attention_mask).sum(1).float() + (7.0 if packed is not None else 0.0)


@pytest.mark.parametrize("blind", [False, True])
def test_a_reward_model_that_mis_scores_packed_rows_scores_separate_rows(tokenizer, blind):
    """--share_prompt: the actor passes its own packing check, which says nothing about a reward model of
    another architecture. The reward source's packed scores are checked against separate rows on the
    first batch: a mismatch gives the separate rows' scores, and separate rows from then on."""
    actor, reference = micro_llama(len(tokenizer), seed=0), micro_llama(len(tokenizer), seed=1)
    source = MaskBlindScores() if blind else FixedScores([1.0, 0.0, 0.0, 2.0])
    ppo = trainer(
        Engine(actor), Engine(reference), tokenizer, temperature=1.0, scores=source, share_prompt=True
    )
    torch.manual_seed(5)
    exp, _ = ppo.make_experience(*prompts(tokenizer))
    assert ppo.share_prompt and exp.packed is not None  # the actor packs
    if not blind:  # a source that does not read packed rows is not checked
        assert ppo.reward_packing == {}
        return
    reward_mask = (
        exp.attention_mask * (~torch.isin(exp.sequences, torch.tensor([tokenizer.eos_token_id]))).long()
    )
    assert torch.equal(exp.scores, (exp.sequences * reward_mask).sum(1).float())
    assert ppo.reward_packing == {"reward": False} and source.packed_calls == 1
    ppo.make_experience(*prompts(tokenizer))
    assert source.packed_calls == 1  # separate rows from then on


def test_rounds_with_a_frozen_actor_read_no_ptx_batches(monkeypatch):
    """--freezing_actor_steps with --unsupervised_dataset_name: the frozen rounds drew an SFT batch for every
    minibatch and threw it away (only the actor's update uses it), so the PTX term skipped that much data."""
    from types import SimpleNamespace

    from dschat.trainer import MetricWindow, TrainState
    from training.step3_rlhf_finetuning import main as step3

    class Collected:
        def __len__(self):
            return 8

        def slice(self, start, stop):
            return (start, stop)

    monkeypatch.setattr(step3.Experience, "cat", staticmethod(lambda buffer, pad_id: Collected()))
    seen = []

    class Trainer:
        def make_experience(self, *args, train_actor):
            return object(), {"kl_sum": 0.0, "rows": 8.0}

        def train(self, minibatch, unsup, *, train_actor):
            seen.append((train_actor, unsup["i"].item() if unsup is not None else None))
            return {}

    ptx = iter({"i": torch.tensor(i)} for i in range(100))
    o = SimpleNamespace(ppo=SimpleNamespace(freezing_actor_steps=2, generation_batches=1, whiten_advantages=False, ppo_epochs=1,
                                            per_device_training_batch_size=4))  # fmt: skip
    m = SimpleNamespace(actor=SimpleNamespace(device="cpu"), ema=None)
    rounds = SimpleNamespace(unsup=ptx)
    batch = {
        "input_ids": torch.zeros(2, 3, dtype=torch.long),
        "attention_mask": torch.ones(2, 3),
        "prompts": [],
    }
    state = TrainState()
    for _ in range(3):
        step3.ppo_round(o, Trainer(), m, batch, [], rounds, state, MetricWindow(), pad_id=0)
    # two frozen rounds of two minibatches, then the first trained round reads the first two SFT batches
    assert seen == [(False, None)] * 4 + [(True, 0), (True, 1)]


def _resumed_token_total(rank: int) -> float:
    """Rank r generated 10 + 20 r tokens; the checkpoint keeps the writing rank's (rank 0's) client state,
    and every rank resumes from that copy. The summary sums the ranks' counts."""
    from types import SimpleNamespace

    import torch.distributed as torch_dist

    from dschat.utils import dist

    me = SimpleNamespace(timing={"generation": 1.0}, generated_tokens=10.0 + 20.0 * rank)
    saved = PPOTrainer.progress(me)  # every rank saves; only rank 0's copy is kept
    kept = [None, None]
    torch_dist.all_gather_object(kept, saved)
    resumed = SimpleNamespace(timing={"generation": 0.0}, generated_tokens=0.0)
    PPOTrainer.load_progress(resumed, kept[0])
    return dist.all_reduce_sum([resumed.generated_tokens])[0]


def test_a_resumed_run_counts_every_ranks_generated_tokens():
    """Every rank restored rank 0's count, so a resumed two-rank run's summary counted 2 x 10 tokens where
    the ranks had generated 10 + 30."""
    from tests.unit.gloo import on_two_ranks

    assert on_two_ranks(_resumed_token_total) == {0: 40.0, 1: 40.0}


def test_the_actor_step_hook_runs_after_each_optimizer_step_and_not_after_a_skipped_one(tokenizer):
    """--enable_ema averages the actor after each of its optimizer steps (the hook the step passes): it
    was updated after every minibatch, a skipped one too (--filter_uniform_groups), so it moved towards
    unchanged weights and decayed faster than --ema_decay says."""
    actor, reference = micro_llama(len(tokenizer), seed=0), micro_llama(len(tokenizer), seed=1)
    engine, calls = AdamEngine(actor), []

    def make(scores):
        t = trainer(engine, Engine(reference), tokenizer, temperature=1.0, scores=FixedScores(scores),
                    advantage_estimator="group_norm", filter_uniform_groups=True)  # fmt: skip
        t.after_actor_step = lambda: calls.append(engine.steps)
        return t

    torch.manual_seed(5)
    mixed = make([1.0, 0.0, 0.0, 2.0])
    mixed.train(mixed.make_experience(*prompts(tokenizer))[0])
    uniform = make([1.0, 1.0, 3.0, 3.0])
    assert uniform.train(uniform.make_experience(*prompts(tokenizer))[0]) == {"skipped_actor_updates": 1.0}
    assert calls == [1]  # after the one step taken, after it


def test_identical_answers_to_a_prompt_share_one_score_so_group_norm_sees_no_signal(tokenizer):
    """A reward model in bf16 can score the same answer a rounding step apart (another row, another
    padding: 2**-7 at a score of 1). GRPO's division by the group's std turned that into advantages of
    +-0.71 for two identical answers; the answer's text is what is scored, so equal answers to a prompt get
    their mean score, the group is uniform and carries no advantage."""
    actor, reference = micro_llama(len(tokenizer), seed=0), micro_llama(len(tokenizer), seed=1)
    scores = [1.0, 1.0 + 2**-7, 0.0, 2**-6]
    ppo = trainer(Engine(actor), Engine(reference), tokenizer, temperature=1e-4, scores=FixedScores(scores),
                  advantage_estimator="group_norm", kl_in="loss", kl_estimator="k3")  # fmt: skip
    exp, stats = ppo.make_experience(*prompts(tokenizer))
    # near-greedy: each prompt's two answers are one answer
    assert torch.equal(exp.sequences[0], exp.sequences[1]) and torch.equal(exp.sequences[2], exp.sequences[3])
    assert stats["uniform_group_rows"] == 4.0
    assert exp.advantages.abs().max() == 0.0  # the KL is a loss term here: advantages are the scores' alone
    assert stats["score_sum"] == pytest.approx(sum(scores))  # each pair's mean, twice


def test_packed_rollouts_leave_out_the_actions_a_row_does_not_have(tokenizer, monkeypatch):
    """As DPO's packed pairs: an action past a row's response reads a pad token, and a -inf log-prob there
    (a masked vocabulary entry) made ``logprobs * valid`` NaN in the stored log-probs."""
    import dschat.rlhf.ppo as ppo_module
    from dschat.data.packing import Packed, PackedRollouts

    logp = torch.tensor([[-1.0, float("-inf")]])  # (R=1, A=2): the row's one action, then past its end
    monkeypatch.setattr(ppo_module, "packed_token_logprobs", lambda *a, **k: (logp, logp.clone()))
    t = trainer(Engine(micro_llama(len(tokenizer))), Engine(micro_llama(len(tokenizer))), tokenizer, 1.0)
    z = torch.zeros(1, 3, dtype=torch.long)
    packed = PackedRollouts(Packed(z, z, z, [2], [[2]]), torch.zeros(1, dtype=torch.long), torch.zeros(1, 2, dtype=torch.long),
                            torch.tensor([[True, False]]), torch.zeros(1, dtype=torch.long))  # fmt: skip
    lp, ent = t._packed_action_logprobs(None, torch.zeros(1, 4, dtype=torch.long), 2, packed, entropy=True)
    assert lp.tolist() == [[0.0, -1.0, 0.0]] and torch.isfinite(ent).all()


def test_the_logged_learning_rate_is_the_one_the_rounds_update_used(tokenizer):
    """Steps 1 and 2 log the rate a step used; step 3 read it after the round's updates, one scheduler step
    ahead (row 1 of the main job showed 1.4e-05 where its updates ran at 0 and 7e-06)."""
    engine = AdamEngine(micro_llama(len(tokenizer), seed=0))
    ppo = trainer(engine, Engine(micro_llama(len(tokenizer), seed=1)), tokenizer, temperature=1.0,
                  scores=FixedScores([1.0, 0.0, 3.0, 2.0]))  # fmt: skip
    torch.manual_seed(5)
    exp, _ = ppo.make_experience(*prompts(tokenizer))
    ppo.train(exp)
    row = ppo.log_row({"rows": 4.0, "score_sum": 6.0, "score_sq_sum": 14.0, "reward_sum": 6.0, "kl_sum": 0.0,
                       "entropy_sum": 0.0, "length_sum": 8.0, "truncated_rows": 0.0, "uniform_group_rows": 0.0,
                       "clipped_score_rows": 0.0})  # fmt: skip
    assert row["actor_lr"] == pytest.approx(1e-2)  # the first step's rate; the schedule is now at 7.5e-3
    assert engine.get_lr() == [pytest.approx(7.5e-3)]


@pytest.mark.parametrize("flag, value", [("--critic_learning_rate", "1e-4"), ("--lam", "0.9"),
                                         ("--critic_trainable_layers", "2"), ("--critic_lora_dim", "8")])  # fmt: skip
def test_a_critic_option_without_a_critic_is_refused(flag, value):
    """A critic-free estimator builds no critic: its learning rate, LoRA, layers and GAE's lambda were
    accepted and read by nothing. The critic's ZeRO stage (the reward model's too) and its model (the
    reward model's default) stay accepted."""
    from dschat.utils.errors import UserError

    rloo = ("--advantage_estimator", "rloo", "--n_samples_per_prompt", "4")
    with pytest.raises(UserError, match=re.escape(f"{flag} is the critic's, and --advantage_estimator rloo")):
        step3_groups(*rloo, flag, value)
    step3_groups(*rloo, "--critic_zero_stage", "2", "--critic_model_name_or_path", "builtin:micro-llama")
    step3_groups(flag, value)  # gae: a critic reads it
