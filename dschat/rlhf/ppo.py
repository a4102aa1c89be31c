"""The PPO trainer: drives the four engines (actor, reference, critic, reward) through
experience collection and clipped PPO updates. The maths lives in :mod:`dschat.rlhf.ppo_math`.
"""

from __future__ import annotations

import contextlib
import logging
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.nn.functional as F

from dschat.data.packing import PackedRollouts, pack_rollouts, read_at
from dschat.engine.core import SkippedSteps
from dschat.generation.kv_decode import position_ids_from_mask
from dschat.generation.stops import is_stop, truncated_rows
from dschat.lm import packed_token_logprobs, sft_loss, within_rounding
from dschat.losses import token_logprobs
from dschat.models import trunk as trunk_sharing
from dschat.models.layers import accepts
from dschat.rlhf import ppo_math as M
from dschat.rlhf.experience import Experience
from dschat.utils import dist
from dschat.utils.metrics import mean_std

LOG = logging.getLogger("dschat")


def update_batch(rounds: list[Experience], pad_id: int, whiten_advantages: bool) -> Experience:
    """The rounds one update trains on (``--generation_batches`` of them) as one batch
    (:meth:`Experience.cat`). With ``--whiten_advantages`` over several rounds the advantages are whitened
    here, over the training rows of every round and rank together (``make_experience`` leaves each round's
    raw), so that the update sees one scale: whitened round by round, a round of small advantages would
    weigh as much as one of large ones (OpenRLHF whitens over its whole replay buffer)."""
    batch = Experience.cat(rounds, pad_id)
    if whiten_advantages and len(rounds) > 1:
        batch = replace(batch, advantages=M.masked_whiten(batch.advantages, batch.action_mask,
                                                          all_reduce=dist.all_reduce_sum))  # fmt: skip
    return batch


@dataclass(frozen=True)
class PPOHyper:
    """The constants of the algorithm (all flags; printed and logged by the step). The KL coefficient is
    not one of them: it lives in the KL controller (``kl_ctl``), which may adapt it and is resumed."""

    clip_reward_value: float
    cliprange: float
    cliprange_value: float
    gamma: float
    lam: float
    whiten_advantages: bool
    unsup_coef: float
    n_samples_per_prompt: int = 1
    # gae (critic) | rloo | group_norm | dr_grpo (per-prompt baseline, no critic)
    advantage_estimator: str = "gae"
    # The stabilisers of critic-free RL (each a flag; see PPOArgs): DAPO's dropping of uniform groups,
    # clip-higher and overlong penalty, the loss's token aggregation, and where and how the KL acts.
    filter_uniform_groups: bool = False
    cliprange_high: float | None = None
    loss_agg: str = "token_mean"
    max_answer_len: int = 0  # the answer budget: seq_mean_token_sum_norm divides by it
    kl_estimator: str = "k1"
    kl_in: str = "reward"
    truncation_penalty: float = 0.0
    # The sampling temperature. Rollouts are drawn from softmax(logits / temperature), so every log-prob
    # PPO takes (old, new, reference; the KL and the entropy) is of that distribution, as in OpenRLHF and
    # veRL: with raw logits the ratio and the KL would belong to a policy that did not act.
    temperature: float = 1.0
    # Each prompt's answers packed in one row for the log-prob passes (--share_prompt); checked against
    # separate rows on the first experience batch (PPOTrainer.packing_checked).
    share_prompt: bool = False
    # The frozen bottom blocks that the actor shares with the reference and reward model computed once in
    # the experience pass (--share_frozen_trunk; dschat.models.trunk); checked on the first batch.
    share_frozen_trunk: bool = False
    # Rounds collected before an update (--generation_batches): with more than one, the rounds are
    # concatenated and packed anew, so a round's rows and trunk are not kept for the update.
    generation_batches: int = 1
    # A round is one update of the actor from the weights that made it (dschat.config.one_update_per_round):
    # the experience pass's forward then *is* the update's, so it runs once, with its graph kept for the
    # update (the old log-probs are its values, detached; TRL's GRPO skips the recomputation the same way).
    # Exact; the graph, the one the update builds anyway, is held through the other models' passes.
    one_update_per_round: bool = False
    # The same for the critic (its own dropout and ZeRO stage): its experience pass, in train mode with
    # its graph, gives the old values and is the value update's forward.
    critic_one_update_per_round: bool = False


class PPOTrainer:
    """``make_experience(prompts) -> Experience`` and ``train(experience) -> metrics``.

    ``reference`` is an engine, or None when the reference is the LoRA actor with its adapter
    disabled (``--share_reference_with_actor``). ``after_actor_step`` runs after each of the actor's
    optimizer steps (a skipped minibatch takes none). ``critic`` is None with the critic-free advantage
    estimators (``rloo``, ``group_norm``, ``dr_grpo``).
    """

    def __init__(
        self,
        *,
        actor,
        reference,
        critic,
        reward_source,
        generator,
        tokenizer,
        hyper: PPOHyper,
        kl_ctl,
        judge=None,
        after_actor_step: Callable[[], None] | None = None,
    ) -> None:
        self.actor, self.reference, self.critic = actor, reference, critic
        self.reward_source, self.generator, self.tokenizer = reward_source, generator, tokenizer
        self.judge = judge  # a second reward source scored beside the reward, never optimised
        self.hyper, self.kl_ctl = hyper, kl_ctl
        # run after each optimizer step of the actor, never after a skipped one (a minibatch left without
        # rows, or a step DeepSpeed skipped: the EMA is an average per step, as --ema_decay says)
        self.after_actor_step = after_actor_step
        # the rate each trained model's last optimizer step used (the log's, as steps 1 and 2 log it: after the
        # step the scheduler has moved on); None before the first step
        self.used_lr: dict[str, float | None] = {"actor": None, "critic": None}
        # optimizer steps DeepSpeed skipped (inf/NaN gradients): a warning each, a stop after many in a row
        self.skipped = {
            name: SkippedSteps(e, name) for name, e in (("actor", actor), ("critic", critic)) if e is not None
        }
        self.timing: dict[str, float] = {"generation": 0.0, "experience": 0.0, "train": 0.0}
        self.generated_tokens = 0.0
        self.share_prompt = hyper.share_prompt  # False once the first batch shows packing does not hold
        self.packing_checked = False
        # {"reward" | "judge": whether its scores of packed rows matched separate rows}, settled on the first
        # packed batch (_check_reward_packing)
        self.reward_packing: dict[str, bool] = {}
        # {"actor" (its own frozen bottom, for the update) | "reference" | "reward" | "judge": shared depth},
        # settled on the first experience batch
        self.trunk_depths: dict[str, int] | None = None if hyper.share_frozen_trunk else {}

    def progress(self) -> dict[str, Any]:
        """The run's time per phase and generated tokens so far: saved with each checkpoint, so that a
        resumed run's summary counts the whole run's throughput, not the resumed part's. Collective: the
        tokens are every rank's (the checkpoint keeps the writing rank's copy of this, and every rank
        resumes from it)."""
        (total,) = dist.all_reduce_sum([self.generated_tokens])
        return {"timing": dict(self.timing), "generated_tokens_all_ranks": total}

    def load_progress(self, saved: dict[str, Any]) -> None:
        self.timing.update(saved["timing"])
        if "generated_tokens_all_ranks" in saved:  # each rank its share: the summary sums them again
            self.generated_tokens = float(saved["generated_tokens_all_ranks"]) / dist.world_size()
        else:  # a checkpoint of an earlier dschat: the writing rank's own count
            self.generated_tokens = float(saved["generated_tokens"])

    def log_row(self, w: dict[str, float]) -> dict[str, float]:
        """The train-split log row of a window of rounds (``w``: :class:`dschat.trainer.MetricWindow` sums
        over all ranks): per-sequence means over the rollouts, per-update means of the losses (the
        policy's over actor updates only), the KL coefficient, time so far and learning rates."""
        rows = max(w["rows"], 1.0)
        score_mean, score_std = mean_std(w["score_sum"], w["score_sq_sum"], rows)
        row = {
            "reward_mean": w["reward_sum"] / rows, "score_mean": score_mean, "score_std": score_std,
            **({"judge_score_mean": w["judge_score_sum"] / rows} if "judge_score_sum" in w else {}),
            "kl_to_reference": w["kl_sum"] / rows, "kl_coef": self.kl_ctl.value, "entropy": w["entropy_sum"] / rows,
            "response_length": w["length_sum"] / rows, "truncated_fraction": w["truncated_rows"] / rows,
            "uniform_group_fraction": w["uniform_group_rows"] / rows,
            "clipped_score_fraction": w["clipped_score_rows"] / rows,
            **{f"{k}_seconds": v for k, v in self.timing.items()}, "actor_lr": self._lr("actor", self.actor),
        }  # fmt: skip
        if self.critic is not None:
            row["critic_lr"] = self._lr("critic", self.critic)
        if w.get("updates"):
            u, ua = w["updates"], max(w.get("actor_updates", 0.0), 1.0)
            row.update(
                {k: w[k] / u for k in ("value_loss", "value_clip_fraction") if k in w}
            )  # critic updates
            actor_keys = ("policy_loss", "clip_fraction", "approx_kl", "ptx_loss", "kl_loss")
            row.update({k: w[k] / ua for k in actor_keys if k in w})
        if "skipped_actor_updates" in w:  # minibatches with no row left to train (--filter_uniform_groups)
            # every rank skips together (a collective decision), so the sum over ranks counts each N times
            row["skipped_actor_updates"] = w["skipped_actor_updates"] / dist.world_size()
        return row

    # ------------------------------------------------------------------ helpers
    @contextlib.contextmanager
    def _timed(self, name: str) -> Iterator[None]:
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        t = time.perf_counter()
        yield
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        self.timing[name] += time.perf_counter() - t

    @contextlib.contextmanager
    def reference_mode(self) -> Iterator[torch.nn.Module]:
        """The reference policy: its own engine, or the actor with its LoRA adapter switched off."""
        if self.reference is not None:
            yield self.reference
            return
        with self.actor.module.disable_adapter():
            yield self.actor

    def _trunk_consumers(self) -> dict[str, torch.nn.Module]:
        """The engines that may start from the actor's frozen trunk: a reference engine (not the LoRA
        actor's disabled adapter: its bottom blocks carry adapters) and reward models behind a plain
        reward-model source."""
        out = {"reference": self.reference, "reward": getattr(self.reward_source, "engine", None),
               "judge": getattr(self.judge, "engine", None)}  # fmt: skip
        return {k: v for k, v in out.items() if v is not None}

    def _replayed(self, name: str, trunks: dict[int, trunk_sharing.Trunk], run, same_rows: bool = True):
        """``run()`` for consumer ``name``, started from the actor's trunk where it shares one. On the
        first batch also run in full: equal within the shared prompt's tolerance, or sharing stops for
        this consumer with a warning."""
        depth = (self.trunk_depths or {}).get(name, 0)
        if not depth or not same_rows:
            return run()
        trunk = trunks.get(depth)
        if trunk is None or trunk.hidden is None:  # blocks that return tuples: nothing to start from
            self.trunk_depths[name] = 0
            return run()
        with trunk_sharing.replay(self._trunk_consumers()[name], trunk):
            out = run()
        if name in self.trunk_checked:
            return out
        self.trunk_checked.add(name)
        full = run()
        ok, diff = trunk_sharing.replay_agrees(out, full, self.actor)
        if ok:
            LOG.info("--share_frozen_trunk: the %s starts from the actor's bottom %d blocks (max difference "
                     "%.1e against its own)", name, depth, diff)  # fmt: skip
            return out
        LOG.warning("--share_frozen_trunk: the %s from the actor's bottom %d blocks differs from its own pass by "
                    "%.3g; computing its own", name, depth, diff)  # fmt: skip
        self.trunk_depths[name] = 0
        return full

    def _within_rounding(self, diff: float) -> tuple[bool, float]:
        """A shortcut's check (packing, the shared trunk): decided on every rank's largest difference."""
        return within_rounding(diff, next(self.actor.module.parameters()).dtype)

    def _settle_trunk_depths(self) -> None:
        """Once: how many bottom blocks each consumer shares with the actor (frozen and equal), and how
        many of the actor's own are frozen (its update starts above them)."""
        self.trunk_checked: set[str] = set()
        self.trunk_depths = {
            name: trunk_sharing.shared_depth([self.actor, engine])
            for name, engine in self._trunk_consumers().items()
        }
        self.trunk_depths["actor"] = trunk_sharing.shared_depth([self.actor])

    def _update_logprobs(self, exp: Experience) -> torch.Tensor:
        """The actor's log-probs (B, T-1) for the update, with gradients, on the experience's own rows: the
        experience pass's own where it kept its graph (``one_update_per_round``). Else above its frozen
        bottom where the experience kept the hidden states there: the frozen blocks give those values
        again and pass no gradient. Checked on the first update (the weights that made the experience, so
        the log-probs must be the old ones), else computed in full from then on."""
        if exp.actor_graph is not None:
            return exp.actor_graph
        # The rows the experience pass ran (and its trunk covers), packed or separate; else packed anew
        kept = exp.packed is not None or exp.trunk is not None
        packed = exp.packed if kept else self.pack(exp.sequences, exp.attention_mask, exp.prompt_len)

        def run() -> torch.Tensor:
            return self.action_logprobs(
                self.actor, exp.sequences, exp.attention_mask, exp.prompt_len, packed=packed
            )[0]

        if not (self.trunk_depths or {}).get("actor"):
            return run()
        first = "update" not in self.trunk_checked
        self.trunk_checked.add("update")
        missing = exp.trunk is None or exp.trunk.hidden is None  # e.g. a minibatch that splits a group
        # Only the first update can be checked against the experience, and the check is collective: where
        # any rank's minibatch kept no hidden states, no rank shares (every rank reaches this call).
        if first and dist.any_rank(missing):
            self.trunk_depths["actor"] = 0
            return run()
        if missing:
            return run()
        with trunk_sharing.replay(self.actor, exp.trunk):
            logprobs = run()
        if not first:
            return logprobs
        # every response position (the update's mask may drop rows: --filter_uniform_groups)
        m = exp.attention_mask[:, 1:].float()
        m[:, : exp.prompt_len - 1] = 0.0
        ok, diff = self._within_rounding(
            float(M.masked((logprobs.detach() - exp.logprobs).abs(), m).max()) if m.numel() else 0.0
        )
        if ok:
            LOG.info("--share_frozen_trunk: the update starts above the actor's frozen bottom %d blocks (max "
                     "difference %.1e against the experience)", exp.trunk.depth, diff)  # fmt: skip
            return logprobs
        LOG.warning("--share_frozen_trunk: the update from the kept hidden states differs from the experience by "
                    "%.3g; computing the whole actor", diff)  # fmt: skip
        self.trunk_depths["actor"] = 0
        return run()

    @property
    def pack_wanted(self) -> bool:
        """Whether rollouts are packed (``--share_prompt``, several answers per prompt); rows that cannot be
        packed (an empty prompt) are then scored unpacked on every rank."""
        return self.share_prompt and self.hyper.n_samples_per_prompt > 1

    def pack(
        self, sequences: torch.Tensor, attention_mask: torch.Tensor, prompt_len: int
    ) -> PackedRollouts | None:
        """The rollouts packed by prompt for :meth:`action_logprobs`, or None (``--no_share_prompt``, one
        answer per prompt, or rows that cannot be packed)."""
        if not self.pack_wanted:
            return None
        return pack_rollouts(sequences, attention_mask, prompt_len, self.tokenizer.pad_token_id)

    def action_logprobs(
        self,
        engine,
        sequences: torch.Tensor,
        attention_mask: torch.Tensor,
        prompt_len: int,
        entropy: bool = False,
        packed: PackedRollouts | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Log-probs (B, T-1) of the tokens at the tempered sampling distribution, and with ``entropy`` the
        per-position entropy (B, T-1); both 0 at positions before ``prompt_len - 1`` (prompt tokens, never
        actions).

        The LM head runs only on the positions that predict a response token (``logits_to_keep``): the
        prompt is most of every row, and a 49152-way head with fp32 log-softmax over it would be most of
        the cost of the pass. Values equal those of the full-sequence computation. With ``packed``
        (:meth:`pack`) the body, too, runs each prompt once for all its answers; then positions past a
        row's response (masked actions) are 0.
        """
        if packed is not None:
            return self._packed_action_logprobs(engine, sequences, prompt_len, packed, entropy)
        t = sequences.shape[1]
        keep = t - prompt_len + 1  # logits at positions prompt_len - 1 .. T-1
        extra = {"logits_to_keep": keep} if keep < t and accepts(engine, "logits_to_keep") else {}
        logits = engine(input_ids=sequences, attention_mask=attention_mask,
                        position_ids=position_ids_from_mask(attention_mask), **extra).logits  # fmt: skip
        if logits.shape[1] != keep:  # a model without logits_to_keep (a slice's backward zero-fills all)
            logits = logits[:, -keep:]
        pad = (t - keep, 0)
        logprobs, ent = token_logprobs(logits, sequences[:, -keep:], self.hyper.temperature, entropy=entropy)
        return F.pad(logprobs, pad), (F.pad(ent, pad) if entropy else None)

    def _packed_action_logprobs(
        self, engine, sequences: torch.Tensor, prompt_len: int, pr: PackedRollouts, entropy: bool
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        dev, p = sequences.device, pr.packed
        valid = pr.valid.to(dev)
        logprobs, ent = packed_token_logprobs(engine, p.input_ids.to(dev), p.segments.to(dev), p.position_ids.to(dev),
                                              pr.group, pr.source, sequences[:, prompt_len:], self.hyper.temperature,
                                              entropy=entropy)  # fmt: skip
        pad = (prompt_len - 1, 0)
        # actions past a row's response left out, not multiplied by 0: they read a pad token, whose -inf
        # log-prob (a masked vocabulary entry) times 0 is NaN
        return (F.pad(logprobs.masked_fill(~valid, 0.0), pad),
                F.pad(ent.masked_fill(~valid, 0.0), pad) if entropy else None)  # fmt: skip

    def _check_packing(self, sequences, attention_mask, prompt_len, packed, logprobs, action_mask) -> None:
        """Once, on the first experience batch: the actor's log-probs from packed rows against separate
        rows. A model that ignores the custom mask or the position ids differs by far more than rounding
        (:func:`dschat.lm.within_rounding`, all ranks together); then packing is switched off for the rest of the
        run, with a warning."""
        self.packing_checked = True
        plain, _ = self.action_logprobs(self.actor, sequences, attention_mask, prompt_len)
        ok, diff = self._within_rounding(
            float(M.masked_mean((plain - logprobs).abs(), action_mask))  # -inf beyond an answer's end: masked
        )
        if ok:
            LOG.info(
                "--share_prompt: packed answers match separate rows (mean |log-prob difference| %.1e)", diff
            )
            return
        LOG.warning("--share_prompt: packed answers differ from separate rows by %.3f nats per token on this model; "
                    "computing separate rows instead", diff)  # fmt: skip
        self.share_prompt = False

    def _check_reward_packing(self, name: str, plain: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
        """Once per reward source, on the first packed batch: its scores (R,) from the actor's packed rows
        against separate rows. A reward model of another architecture than the actor's may ignore the
        custom mask or the position ids where the actor did not (the actor's check says nothing about
        it); then it scores separate rows for the rest of the run, with a warning. Collective."""
        engine = self._trunk_consumers().get(name, self.actor)
        ok, diff = trunk_sharing.replay_agrees(packed, plain, engine)
        self.reward_packing[name] = ok
        if ok:
            LOG.info("--share_prompt: the %s model's scores of packed answers match separate rows (max difference "
                     "%.1e)", name, diff)  # fmt: skip
            return packed
        LOG.warning("--share_prompt: the %s model scores packed answers %.3g away from separate rows; scoring "
                    "separate rows instead", name, diff)  # fmt: skip
        return plain

    # ------------------------------------------------------------------ 1. experience
    @torch.no_grad()
    def make_experience(
        self,
        prompt_ids: torch.Tensor,
        prompt_mask: torch.Tensor,
        prompt_texts: list[str],
        *,
        train_actor: bool = True,
    ) -> tuple[Experience, dict[str, float]]:
        """Generate ``n_samples_per_prompt`` responses for each of (B, P) left-padded prompts and score them
        with every model. ``prompt_texts`` are the B prompts as dialogue text (what a reward function
        reads). Rows of the result: B * n_samples_per_prompt, each prompt's responses adjacent.
        ``train_actor``: the actor's update follows (not a ``--freezing_actor_steps`` round); with
        ``one_update_per_round`` its forward is then this pass, kept with its graph."""  # fmt: skip
        tok, h = self.tokenizer, self.hyper
        prompts = [p for p in prompt_texts for _ in range(h.n_samples_per_prompt)]
        if h.n_samples_per_prompt > 1:
            prompt_ids = prompt_ids.repeat_interleave(h.n_samples_per_prompt, dim=0)
            prompt_mask = prompt_mask.repeat_interleave(h.n_samples_per_prompt, dim=0)
        with self._timed("generation"), self.generator.generation_mode() as gen:
            sequences = gen.generate(prompt_ids, prompt_mask)
        prompt_len = prompt_ids.shape[1]
        with self._timed("experience"):
            stops = self.generator.stop_ids  # EOS and the chat template's end of turn
            action_mask = M.action_mask_from(sequences, prompt_len, stops)
            self.generated_tokens += float(action_mask.sum())
            response_mask = torch.zeros_like(sequences)
            response_mask[:, 1:] = action_mask.long()
            attention_mask = torch.cat([prompt_mask, response_mask[:, prompt_len:]], dim=1)
            # The reward model was trained on prompt + response without its end token: score at the last
            # content token.
            is_end = is_stop(sequences, stops) & (response_mask > 0)
            reward_mask = attention_mask * (~is_end).long()

            # the update's own forward (train mode, with its graph) where it is this one
            fused = h.one_update_per_round and train_actor
            self.actor.train(fused)
            if self.trunk_depths is None:
                self._settle_trunk_depths()
            packed = self.pack(sequences, attention_mask, prompt_len)
            if self.pack_wanted and dist.any_rank(packed is None):  # the checks below are collective
                packed = None
            # the hidden states each consumer starts from (the actor's own update too, unless it is this pass)
            depths = {d for k, d in self.trunk_depths.items() if d and not (fused and k == "actor")}

            def actor_pass(packed: PackedRollouts | None) -> tuple[torch.Tensor, torch.Tensor, dict]:
                # the actor's pass keeps the hidden states the others (and the update) start from
                with torch.set_grad_enabled(fused), trunk_sharing.capture(self.actor, depths) as trunks:
                    lp, ent = self.action_logprobs(
                        self.actor, sequences, attention_mask, prompt_len, entropy=True, packed=packed
                    )
                return lp, ent, trunks

            actor_graph, per_token_entropy, trunks = actor_pass(packed)
            if packed is not None and not self.packing_checked:
                self._check_packing(
                    sequences, attention_mask, prompt_len, packed, actor_graph.detach(), action_mask
                )
                if not self.share_prompt:
                    packed = actor_graph = per_token_entropy = trunks = None  # one graph at a time
                    actor_graph, per_token_entropy, trunks = actor_pass(None)
            logprobs = actor_graph.detach()
            # each answer's mean entropy per token, summed over the rows (the log averages over rows of every
            # rank: one token mean per rank times its rows weighed a token by its rank's other answers)
            entropy_sum = M.masked_mean(per_token_entropy, action_mask, dim=1).sum()
            with self.reference_mode() as ref:
                ref.eval()
                ref_logprobs = self._replayed("reference", trunks, lambda: self.action_logprobs(
                    ref, sequences, attention_mask, prompt_len, packed=packed)[0])  # fmt: skip
            responses = tok.batch_decode(sequences[:, prompt_len:], skip_special_tokens=True)
            # The reward models read the actor's packed rows before each end token (the trunk's rows)
            reward_packed = (
                read_at(packed, reward_mask[:, prompt_len:].sum(1)) if packed is not None else None
            )

            def scored(name: str, source) -> torch.Tensor:
                rows = reward_packed if self.reward_packing.get(name, True) else None
                out = self._replayed(name, trunks, lambda: source.score(
                    prompts, responses, sequences, reward_mask, rows), same_rows=rows is not None)  # fmt: skip
                if rows is None or name in self.reward_packing or not source.reads_packed:
                    return out
                return self._check_reward_packing(
                    name, source.score(prompts, responses, sequences, reward_mask), out
                )

            # equal answers to one prompt get one score (their mean): 16-bit rounding apart, a group baseline
            # (group_norm's division by the std above all) would read the rounding as a preference. Equal as
            # the reward model reads them: up to their end token, whichever stop it was
            read = sequences.masked_fill(reward_mask == 0, -1)
            scores = M.share_scores_of_identical_answers(
                scored("reward", self.reward_source), read, h.n_samples_per_prompt
            )
            judged = scored("judge", self.judge) if self.judge is not None else None

            truncated = truncated_rows(sequences, prompt_len, stops)
            clipped, was_clipped = M.clip_scores(scores, h.clip_reward_value)
            clipped = clipped - h.truncation_penalty * truncated.float()
            # With --kl_in loss the penalty is the actor's loss term (train), not a per-token reward.
            reward_kl_coef = self.kl_ctl.value if h.kl_in == "reward" else 0.0
            # k1, what is reported and what the adaptive controller follows, whatever the estimator
            kl = M.masked(logprobs - ref_logprobs, action_mask)
            # Groups whose answers all score alike carry no signal (always counted with a group baseline);
            # with --filter_uniform_groups (DAPO) they leave the update: their rows keep no action.
            uniform = (M.uniform_groups(clipped, h.n_samples_per_prompt) if self.critic is None
                       else torch.zeros_like(truncated))  # fmt: skip
            train_mask = (
                action_mask * (~uniform).float().unsqueeze(1) if h.filter_uniform_groups else action_mask
            )
            critic_graph = None
            if self.critic is not None:  # GAE with the critic's values
                # the value update's own forward (train mode, with its graph) where it is this one
                fused_critic = h.critic_one_update_per_round
                self.critic.train(fused_critic)
                with torch.set_grad_enabled(fused_critic):
                    critic_values = self.critic(sequences, attention_mask)[:, :-1]
                values = critic_values.detach() * action_mask
                if fused_critic:
                    critic_graph = critic_values
                rewards, kl_penalty = M.kl_shaped_rewards(clipped, logprobs, ref_logprobs, action_mask, reward_kl_coef,
                                                 h.kl_estimator)  # fmt: skip
                advantages, returns = M.gae(rewards, values, action_mask, h.gamma, h.lam)
            else:  # per-prompt baseline: the clipped score minus the other responses' scores, then reward-to-go
                values = torch.zeros_like(logprobs)
                relative = M.group_relative_scores(clipped, h.n_samples_per_prompt, h.advantage_estimator)
                rewards, kl_penalty = M.kl_shaped_rewards(relative, logprobs, ref_logprobs, action_mask, reward_kl_coef,
                                                 h.kl_estimator)  # fmt: skip
                advantages = returns = M.discounted_returns(rewards, action_mask, h.gamma)
            if h.whiten_advantages and h.generation_batches == 1:  # over the rows that train, all ranks
                advantages = M.masked_whiten(advantages, train_mask, all_reduce=dist.all_reduce_sum)
            # with several rounds per update, over all of them together: update_batch
        exp = Experience(
            sequences=sequences, attention_mask=attention_mask, action_mask=train_mask, logprobs=logprobs,
            ref_logprobs=ref_logprobs, values=values, rewards=rewards, advantages=advantages, returns=returns,
            scores=scores, prompt_len=prompt_len, packed=packed,
            trunk=trunks.get(self.trunk_depths.get("actor", 0)) if h.generation_batches == 1 and not fused else None,
            actor_graph=actor_graph if fused else None, critic_graph=critic_graph,
        )  # fmt: skip
        lengths = action_mask.sum(1)
        stats = {
            "score_sum": float(scores.sum()),
            "score_sq_sum": float((scores.float() ** 2).sum()),
            # per-sequence total reward (clipped score - the KL penalty the rewards carry: the chosen
            # estimator's, none with --kl_in loss) summed over rows; with the group baselines ``rewards``
            # holds the baseline-subtracted score instead, so it is summed from its parts
            "reward_sum": float(clipped.sum() - reward_kl_coef * kl_penalty.sum()),
            "kl_sum": float(kl.sum()),  # per-sequence KL to the reference, summed over rows
            "entropy_sum": float(entropy_sum),
            "length_sum": float(lengths.sum()),
            "truncated_rows": float(truncated.sum()),
            "clipped_score_rows": float(was_clipped.sum()),
            "uniform_group_rows": float(uniform.sum()),
            "rows": float(len(lengths)),
        }
        if judged is not None:
            stats["judge_score_sum"] = float(judged.float().sum())
        return exp, stats

    # ------------------------------------------------------------------ 2. PPO update
    def train(
        self, exp: Experience, unsup_batch: dict[str, torch.Tensor] | None = None, *, train_actor: bool = True
    ) -> dict[str, float]:
        """One clipped PPO update of actor and critic on a minibatch of experience.

        ``train_actor=False`` updates the critic alone (``--freezing_actor_steps``).
        """
        h = self.hyper
        out: dict[str, float] = {}
        with self._timed("train"):
            if train_actor and self._actor_has_work(exp, unsup_batch):
                out.update(self._train_actor(exp, unsup_batch))
            elif train_actor:
                self._skip_actor_update()
                out["skipped_actor_updates"] = 1.0
            if self.critic is None:
                return out
            # 2b. critic: clipped value regression towards the GAE returns
            self.critic.train()
            values = (exp.critic_graph if exp.critic_graph is not None
                      else self.critic(exp.sequences, exp.attention_mask)[:, :-1])  # fmt: skip
            v_loss, v_stats = M.value_loss(values, exp.values, exp.returns, exp.action_mask, h.cliprange_value,
                                           all_reduce=dist.all_reduce_sum)  # fmt: skip
            self.critic.backward(v_loss)
            self.used_lr["critic"] = self.critic.get_lr()[0]
            self.skipped["critic"].step()  # critic.step(), watched
        out.update(
            {
                "value_loss": float(v_loss.detach()),
                "value_clip_fraction": float(v_stats["value_clip_fraction"]),
            }
        )
        return out

    def _lr(self, name: str, engine) -> float:
        """The rate ``name``'s last optimizer step used; before its first (the critic-only rounds of
        --freezing_actor_steps), the rate its first will use."""
        used = self.used_lr[name]
        return engine.get_lr()[0] if used is None else used

    def _actor_has_work(self, exp: Experience, unsup_batch: dict[str, torch.Tensor] | None) -> bool:
        """Whether the actor's update has anything to learn from on some rank: a minibatch whose rows all
        left the update (``--filter_uniform_groups``) on every rank, without a PTX term, has a zero loss,
        and an optimizer step on its zero gradient would still move the weights (Adam's momentum, weight
        decay). Such a step is skipped, as DAPO drops such groups from the batch. Collective: every rank
        skips together (ZeRO's gathers and the gradient all-reduce are collectives)."""
        if not self.hyper.filter_uniform_groups or (unsup_batch is not None and self.hyper.unsup_coef > 0):
            return True  # every row keeps its actions (or the PTX term trains): no host sync needed
        return dist.any_rank(bool(exp.action_mask.sum() > 0))

    def _skip_actor_update(self) -> None:
        """The learning-rate schedule was planned over every minibatch of the run: a skipped one still
        advances it (as every rank does, together), so the run ends on the schedule's last rate instead of
        above it. DeepSpeed steps its scheduler only inside ``engine.step()``, which is not called here."""
        scheduler = getattr(self.actor, "lr_scheduler", None)
        if scheduler is not None:
            with warnings.catch_warnings():  # "scheduler.step() before optimizer.step()": meant so
                warnings.simplefilter("ignore", UserWarning)
                scheduler.step()

    def _train_actor(self, exp: Experience, unsup_batch: dict[str, torch.Tensor] | None) -> dict[str, float]:
        # 2a. actor: clipped surrogate on the response tokens (+ PTX language-modelling loss)
        h = self.hyper
        self.actor.train()
        logprobs = self._update_logprobs(exp)
        # every loss term a mean over all ranks' tokens or rows (M.aggregate): 2 ranks train as 1 rank would
        pg_loss, pg_stats = M.policy_loss(logprobs, exp.logprobs, exp.advantages, exp.action_mask, h.cliprange,
                                          cliprange_high=h.cliprange_high, agg=h.loss_agg, norm_len=h.max_answer_len,
                                          all_reduce=dist.all_reduce_sum)  # fmt: skip
        actor_loss = pg_loss
        out: dict[str, float] = {}
        if h.kl_in == "loss":  # the KL to the reference as a loss term with its gradient (GRPO)
            kl = M.kl_estimate(logprobs, exp.ref_logprobs, exp.action_mask, h.kl_estimator)
            kl_loss = M.aggregate(kl, exp.action_mask, h.loss_agg, h.max_answer_len, dist.all_reduce_sum)
            actor_loss = actor_loss + self.kl_ctl.value * kl_loss
            out["kl_loss"] = float(kl_loss.detach())
        if unsup_batch is not None and h.unsup_coef > 0:
            ptx, n = sft_loss(
                self.actor, unsup_batch["input_ids"], unsup_batch["attention_mask"], unsup_batch["labels"]
            )
            total, ranks = dist.all_reduce_sum([float(n), 1.0])  # the mean over every rank's target tokens
            actor_loss = actor_loss + h.unsup_coef * ptx * (n * ranks / max(total, 1.0))
            out["ptx_loss"] = float(ptx.detach())
        self.actor.backward(actor_loss)
        self.used_lr["actor"] = self.actor.get_lr()[0]
        if not self.skipped["actor"].step() and self.after_actor_step is not None:  # actor.step(), watched
            self.after_actor_step()
        out.update(
            {
                "policy_loss": float(pg_loss.detach()),
                "clip_fraction": float(pg_stats["clip_fraction"]),
                "approx_kl": float(pg_stats["approx_kl"]),
            }
        )
        return out
