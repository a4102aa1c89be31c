"""Reward-model evaluation: pairwise accuracy, score means and margin, split by response length."""

from __future__ import annotations

import torch

from dschat.losses import gather_last
from dschat.models.reward import pair_values
from dschat.utils import dist
from dschat.utils.metrics import mean_std


def ranking_sums(chosen: torch.Tensor, rejected: torch.Tensor, chosen_len: torch.Tensor, rejected_len: torch.Tensor,
                 weight: torch.Tensor) -> dict[str, float]:  # fmt: skip
    """Weighted sums over pairs (B,) from which :func:`ranking_metrics` derives the metrics.

    Ties (equal scores) count as wrong: a model that scores everything alike must not look right.
    """
    w = weight.float()
    right = (chosen > rejected).float() * w
    longer = (chosen_len > rejected_len).float() * w
    shorter = (chosen_len < rejected_len).float() * w
    return {
        "n": float(w.sum()),
        "right": float(right.sum()),
        "chosen": float((chosen * w).sum()),
        "rejected": float((rejected * w).sum()),
        "chosen_sq": float((chosen.float() ** 2 * w).sum()),
        "rejected_sq": float((rejected.float() ** 2 * w).sum()),
        "n_chosen_longer": float(longer.sum()),
        "right_chosen_longer": float((right * (chosen_len > rejected_len)).sum()),
        "n_chosen_shorter": float(shorter.sum()),
        "right_chosen_shorter": float((right * (chosen_len < rejected_len)).sum()),
        "longer_wins": float(longer.sum()),
    }


def ranking_metrics(s: dict[str, float]) -> dict[str, float]:
    n = max(s["n"], 1.0)
    # over both sides of every pair: what step 3's --normalize_reward standardises with where step 2 has
    # no policy samples (OpenRLHF measures its reward normalisation the same way)
    score_mean, score_std = mean_std(s["chosen"] + s["rejected"], s["chosen_sq"] + s["rejected_sq"], 2 * n)
    out = {
        "accuracy": s["right"] / n,
        "chosen_mean": s["chosen"] / n,
        "rejected_mean": s["rejected"] / n,
        "margin": (s["chosen"] - s["rejected"]) / n,
        "score_mean": score_mean,
        "score_std": score_std,
        "longer_response_baseline": s["longer_wins"] / n,
        "pairs": s["n"],
    }
    if s["n_chosen_longer"]:
        out["accuracy_chosen_longer"] = s["right_chosen_longer"] / s["n_chosen_longer"]
    if s["n_chosen_shorter"]:
        out["accuracy_chosen_shorter"] = s["right_chosen_shorter"] / s["n_chosen_shorter"]
    return out


@torch.no_grad()
def evaluate_ranking(engine, batches: list[tuple[dict, torch.Tensor]]) -> dict[str, float]:
    """Ranking metrics over the whole eval set (all ranks) for a reward engine (values (2B, T))."""
    was_training = engine.module.training
    engine.eval()
    keys = None
    totals: dict[str, float] = {}
    for batch, weight in batches:
        mask = batch["attention_mask"].to(engine.device)
        scores = gather_last(pair_values(engine, batch, engine.device), mask).cpu()
        lengths = mask.sum(dim=1).cpu()
        b = weight.shape[0]
        sums = ranking_sums(scores[:b], scores[b:], lengths[:b], lengths[b:], weight)
        keys = sorted(sums)
        for k in keys:
            totals[k] = totals.get(k, 0.0) + sums[k]
    keys = keys or []
    reduced = dict(zip(keys, dist.all_reduce_sum([totals[k] for k in keys])))
    if was_training:
        engine.train()
    return ranking_metrics(reduced)
