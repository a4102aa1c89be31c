"""DPO around the loss: sequence log-probs of the responses, the reference's log-probs computed once for
every pair, and evaluation by implicit reward. The maths is :func:`dschat.losses.dpo_loss`.

The reference is frozen, so its log-probs of a pair never change: they are computed in one pass before
training (by default with the starting policy itself, before its first update, so no second model is
held in memory while training) and kept in a table indexed by the pair's position in its data set.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from dschat.config import DPOArgs
from dschat.data.packing import CUSTOM_MASK_ATTENTION, drop_packed, stop_packing
from dschat.lm import eval_batches, packed_token_logprobs, target_count, target_logits, within_rounding
from dschat.losses import DPOLoss, dpo_loss, token_nll
from dschat.models.layers import unwrap
from dschat.ranking import ranking_metrics, ranking_sums
from dschat.utils import dist
from dschat.utils.io import atomic_save_tensors

LOG = logging.getLogger("dschat")


@dataclass
class ResponseLogps:
    """Log-probs of a batch of pairs; each field (B,), rows of the chosen then of the rejected answers."""

    chosen: torch.Tensor  # summed over the response and its end token
    rejected: torch.Tensor
    chosen_tokens: torch.Tensor  # how many tokens were summed
    rejected_tokens: torch.Tensor

    @property
    def chosen_nll_mean(self) -> torch.Tensor:
        """() mean NLL per chosen token over the batch."""
        return -self.chosen.sum() / self.chosen_tokens.sum().clamp_min(1.0)


def chosen_targets(batch: dict[str, torch.Tensor]) -> int:
    """The chosen answers' target tokens in a batch of :func:`response_logps` (rows: chosen then rejected;
    packed or not): what the SFT term of an optimizer step is a mean over (``LoopSpec.targets``)."""
    if "target_valid" in batch:
        valid = batch["target_valid"]
        return int(valid[: valid.shape[0] // 2].sum())
    labels = batch["labels"]
    return int(target_count(labels[: labels.shape[0] // 2]))


def response_logps(model, batch: dict[str, torch.Tensor], device) -> ResponseLogps:
    """Forward ``batch`` from :class:`dschat.data.collate.PreferenceLMCollator` (``input_ids (2B, T)``);
    the LM head runs only on the response positions. A batch with packed rows (``--share_prompt``) runs
    those: each pair's prompt once, the same log-probs as the unpacked rows."""
    if "packed_input_ids" in batch:
        valid = batch["target_valid"].to(device)  # (2B, A)
        logp, _ = packed_token_logprobs(
            model, batch["packed_input_ids"].to(device), batch["packed_segments"].to(device),
            batch["packed_position_ids"].to(device), batch["target_group"], batch["target_source"],
            batch["target_tokens"],
        )  # fmt: skip
        # the slots a pair does not have left out, not multiplied by 0: a padded slot reads token 0, and a
        # -inf log-prob there (a masked vocabulary entry) times 0 is NaN
        nll, n = -logp.masked_fill(valid == 0, 0.0).sum(1), valid.sum(1).float()  # (2B,), (2B,)
    else:
        logits, labels = target_logits(
            model,
            batch["input_ids"].to(device),
            batch["attention_mask"].to(device),
            batch["labels"].to(device),
        )
        nll, n = token_nll(logits, labels)  # (2B,), (2B,)
    b = nll.shape[0] // 2
    return ResponseLogps(-nll[:b], -nll[b:], n[:b], n[b:])


@torch.no_grad()
def packing_mismatch(model, collate, train: list[dict], device) -> str | None:
    """Why packed pairs do not give ``model`` the log-probs of separate rows, or None where they do: the
    answers of two ``train`` pairs (the first two with a prompt: a batch packs only when all its pairs
    have one), compared per token against :func:`dschat.lm.within_rounding` (collective). ``model``: a
    policy (or its engine) or a reference, checked in eval mode."""
    module = unwrap(model)
    attn = getattr(module.config, "_attn_implementation", None)
    if attn not in CUSTOM_MASK_ATTENTION:
        return f"attention implementation {attn!r} takes no custom mask"
    batch = collate([f for f in train if f["prompt_len"] > 0][:2] or train[:2])
    if "packed_input_ids" not in batch:
        return None
    was_training = module.training
    module.eval()  # no dropout: the two forwards must be comparable
    packed = response_logps(model, batch, device)
    unpacked = dict(batch)
    drop_packed(unpacked)
    plain = response_logps(model, unpacked, device)
    module.train(was_training)
    # the answers' summed log-probs, their difference spread over the answers' tokens
    tokens = packed.chosen_tokens.sum() + packed.rejected_tokens.sum()
    gap = (packed.chosen - plain.chosen).abs().sum() + (packed.rejected - plain.rejected).abs().sum()
    ok, diff = within_rounding(float(gap / tokens), next(module.parameters()).dtype)
    if not ok:
        return f"packed pairs' log-probs differ from separate rows by {diff:.3f} nats per token on this model"
    LOG.info("--share_prompt: packed pairs match separate rows (mean |log-prob difference| %.1e)", diff)
    return None


def settle_share_prompt(model, collate, train: list[dict], evals: list[list], device) -> None:
    """Keep ``--share_prompt`` (a :class:`~dschat.data.collate.PreferenceLMCollator` that packs) only where
    packed pairs give the policy the unpacked log-probs (:func:`packing_mismatch`). Otherwise the
    collator stops packing and the already collated evaluation sets ``evals`` (each a list of (batch,
    weight)) lose their packed rows, with a warning. ``model``: the policy (or its engine), before its
    first update."""
    why = packing_mismatch(model, collate, train, device)
    if why is None:
        return
    LOG.warning("--share_prompt: %s; computing separate rows instead", why)
    stop_packing(collate, evals)


def reference_collate(reference, collate, train: list[dict], device):
    """The collator for a separate reference's log-probs (``--ref_model_name_or_path``): the policy's
    where packed pairs give this model its separate rows' values too (the policy's check says nothing of
    another architecture), else one that does not pack, with a warning."""
    if not collate.share_prompt:
        return collate
    why = packing_mismatch(reference, collate, train, device)
    if why is None:
        return collate
    LOG.warning("--share_prompt: the reference model: %s; its log-probs come from separate rows", why)
    return dataclasses.replace(collate, share_prompt=False)


def pair_data_args(data_args, fmt):
    """The data options DPO's pairs are tokenized with: ``--max_seq_len`` less the end token that
    :class:`dschat.data.collate.PreferenceLMCollator` appends to each answer, so that a row of prompt,
    answer and end fits ``--max_seq_len`` (the reward model's pairs have no end token)."""
    return dataclasses.replace(data_args, max_seq_len=data_args.max_seq_len - (fmt.end_id is not None))


@torch.no_grad()
def reference_table(
    model, examples: list[dict], *, batch_size: int, collate, device, only: set[int] | None = None
) -> torch.Tensor:
    """``(N, 2)`` summed log-probs of the chosen and rejected response of every example under ``model``
    (with ``only``, of those indices alone; the other rows are NaN, so using one would show at once).

    Each rank scores its share (every rank runs the same number of forwards, as ZeRO-3 needs) and the
    table is summed over ranks; every example is scored exactly once.
    """
    was_training = model.training
    model.eval()
    table = torch.zeros(len(examples), 2, dtype=torch.float64)
    if only is not None:
        table[[i for i in range(len(examples)) if i not in only]] = float("nan")
        examples = [examples[i] for i in sorted(only)]
    batches = eval_batches(examples, batch_size=batch_size, collate=collate)
    start = last = time.perf_counter()
    for i, (batch, weight) in enumerate(batches):
        if dist.is_main() and time.perf_counter() - last > 60:  # a long pass says how far it is
            last = time.perf_counter()
            LOG.info(
                "reference log-probs: %d of %d batches, %.2f s a batch", i, len(batches), (last - start) / i
            )
        lp = response_logps(model, batch, device)
        keep = weight > 0
        idx = batch["index"][keep]
        table[idx, 0] = lp.chosen.detach().double().cpu()[keep]
        table[idx, 1] = lp.rejected.detach().double().cpu()[keep]
    if was_training:
        model.train()
    if dist.world_size() > 1:
        table = torch.tensor(dist.all_reduce_sum(table.flatten().tolist()), dtype=torch.float64).view(-1, 2)
    return table.float()


def pair_loss(
    lp: ResponseLogps, ref: torch.Tensor, hp: DPOArgs, sft_tokens: float | None = None
) -> tuple[torch.Tensor, DPOLoss]:
    """The training objective of one batch: DPO (``ref (B, 2)`` from :func:`reference_table`) plus
    ``sft_coef`` times the chosen answers' NLL per token. Returns (loss, the DPO part's details).

    ``sft_tokens``: the tokens the NLL is divided by; default this batch's chosen tokens. A micro-batch
    of an optimizer step passes the training loop's ``token_share`` (:attr:`dschat.trainer.LoopSpec.targets`
    with :func:`chosen_targets`): the step's SFT term is then the mean over all its chosen tokens, whatever
    the split into micro-batches and ranks, as step 1's loss is."""
    ref = ref.to(lp.chosen.device)
    out = dpo_loss(lp.chosen, lp.rejected, ref[:, 0], ref[:, 1], beta=hp.beta, loss_type=hp.dpo_loss,
                   label_smoothing=hp.label_smoothing, chosen_tokens=lp.chosen_tokens,
                   rejected_tokens=lp.rejected_tokens)  # fmt: skip
    if not hp.sft_coef:
        return out.loss, out
    tokens = lp.chosen_tokens.sum().clamp_min(1.0) if sft_tokens is None else max(sft_tokens, 1e-9)
    return out.loss + hp.sft_coef * (-lp.chosen.sum()) / tokens, out


@torch.no_grad()
def evaluate_pairs(
    model, batches: list[tuple[dict, torch.Tensor]], ref: torch.Tensor, hp: DPOArgs, device
) -> dict:
    """Held-out pairs (all ranks), scored as a reward model is (:mod:`dschat.ranking`) with the implicit
    rewards as scores: accuracy (the chosen answer's reward strictly higher; ties count as wrong, so the
    untrained policy scores 0), split by which answer is longer, the "longer wins" baseline, the mean
    margin and rewards; and the training objective as ``loss`` (with ``--sft_coef`` its SFT term is the
    chosen NLL over all held-out chosen tokens) and its DPO (or IPO) part as ``preference_loss``."""
    was_training = model.training
    model.eval()
    totals: dict[str, float] = {}
    for batch, weight in batches:
        lp = response_logps(model, batch, device)
        w = weight.to(lp.chosen.device)
        _, out = pair_loss(lp, ref[batch["index"]], hp)
        sums = ranking_sums(out.chosen_rewards, out.rejected_rewards, lp.chosen_tokens, lp.rejected_tokens, w)
        sums["loss"] = float((out.losses * w).sum())
        sums["chosen_nll"] = float(-(lp.chosen * w).sum())
        sums["chosen_tokens"] = float((lp.chosen_tokens * w).sum())
        for k, v in sums.items():
            totals[k] = totals.get(k, 0.0) + v
    if was_training:
        model.train()
    keys = sorted(totals)
    reduced = dict(zip(keys, dist.all_reduce_sum([totals[k] for k in keys])))
    m = ranking_metrics(reduced)
    m["chosen_reward"], m["rejected_reward"] = m.pop("chosen_mean"), m.pop("rejected_mean")
    m["preference_loss"] = reduced["loss"] / max(reduced["n"], 1.0)
    sft = reduced["chosen_nll"] / max(reduced["chosen_tokens"], 1.0)
    m["loss"] = m["preference_loss"] + hp.sft_coef * sft
    return m


def pairs_fingerprint(examples: list[dict]) -> str:
    """SHA-256 of tokenized pairs in order (their token ids and prompt lengths), saved with a reference
    table: a resumed run reuses the table only for the very pairs it was computed on. On-policy pairs are
    sampled again on resume, and a changed world size or seed draws others, often as many of them."""
    h = hashlib.sha256()
    for ex in examples:
        h.update(json.dumps([ex["chosen"], ex["rejected"], ex["prompt_len"]]).encode())
    return h.hexdigest()


def save_table(path: Path, table: torch.Tensor, fingerprint: str) -> None:
    """Written atomically by the writing rank (safetensors, the pairs' fingerprint in its metadata; with
    node-local storage one per node, so that every node's resume reads it); every rank waits for it."""
    if dist.is_node_writer():
        atomic_save_tensors(path, {"reference_logps": table}, metadata={"pairs_sha256": fingerprint})
    dist.barrier()


def read_table(path: Path) -> torch.Tensor:
    from safetensors.torch import load_file

    return load_file(str(path))["reference_logps"]


def table_matches(path: Path, fingerprint: str) -> bool:
    """Whether ``path`` holds a table computed for the pairs of ``fingerprint`` (False if there is none,
    or it predates fingerprints): a resumed run reads its table, since the policy has moved since the
    table was computed from it."""
    if not path.is_file():
        return False
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        return (f.metadata() or {}).get("pairs_sha256") == fingerprint
