"""On-policy negatives for reward-model training: the policy's own wrong answers as rejected responses.

A reward model trained only on synthetic wrong answers ranks those well and can still be fooled by the
mistakes the PPO actor actually makes (measured on the built-in tasks: held-out accuracy 0.98, yet PPO
raised its score while true accuracy fell). InstructGPT's reward model was trained on comparisons of
its SFT model's own samples; here a verifier plays the labeller. For every built-in prompt, sample
answers from the policy (the step-1 model), and pair each wrong one (rejected) with the right answer
(chosen). Prompts no built-in task recognises are skipped: there is no verifier to label them.

    samples, stats = mine_policy_negatives(model, tokenizer, prompts, samples_per_prompt=4, ...)
"""

from __future__ import annotations

import torch

from dschat import tasks
from dschat.data.schema import Sample
from dschat.generation import generate_texts
from dschat.rlhf.generation import SamplingConfig
from dschat.utils import dist


def wrong_answer_pairs(prompts: list[str], answers: list[str]) -> list[Sample]:
    """(prompt, sampled answer) -> a pair for each distinct wrong, non-empty answer: chosen = the right
    answer, rejected = the sampled one, both in the built-in data's form (" " + answer)."""
    out, seen = [], set()
    for p, a in zip(prompts, answers):
        right = tasks.reference_answer(p)
        answer = tasks.clean_response(a)
        if right is None or not answer or answer == right or (p, answer) in seen:
            continue
        seen.add((p, answer))
        out.append(Sample(prompt=p, chosen=" " + right, rejected=" " + answer, source="policy"))
    return out


@torch.no_grad()
def mine_policy_negatives(
    model: torch.nn.Module,
    tokenizer,
    prompts: list[str],
    *,
    samples_per_prompt: int,
    max_new_tokens: int,
    temperature: float,
    device,
    seed: int,
    batch_size: int = 64,
) -> tuple[list[Sample], dict[str, float]]:
    """Sample ``samples_per_prompt`` answers per built-in prompt and keep the wrong ones as pairs.

    ``model`` is a plain (not DeepSpeed) causal LM; each rank answers its share of the prompts and the
    pairs are gathered, so every rank returns the same list in the same order. Returns (pairs, stats:
    prompts, answers, wrong answers, pairs, sampled accuracy).
    """
    known = [p for p in prompts if tasks.reference_answer(p) is not None]
    world, rank = dist.world_size(), dist.rank()
    per = -(-len(known) // world) if known else 0
    mine = known[rank * per : (rank + 1) * per]
    repeated = [p for p in mine for _ in range(samples_per_prompt)]
    with torch.random.fork_rng(devices=[device] if torch.device(device).type == "cuda" else []):
        torch.manual_seed(seed + rank)
        answers = generate_texts(
            model, tokenizer, repeated, device=device, batch_size=batch_size,
            sampling=SamplingConfig(max_new_tokens=max_new_tokens, temperature=temperature),
        )  # fmt: skip
    pairs = wrong_answer_pairs(repeated, answers)
    right = sum(bool(tasks.verify(p, a)) for p, a in zip(repeated, answers))
    if world > 1:
        gathered: list[list[Sample]] = [[] for _ in range(world)]
        torch.distributed.all_gather_object(gathered, pairs)
        pairs = [s for part in gathered for s in part]
    n_answers, n_right = dist.all_reduce_sum([float(len(repeated)), float(right)])
    stats = {
        "prompts": float(len(known)),
        "answers": n_answers,
        "wrong_answers": n_answers - n_right,
        "pairs": float(len(pairs)),
        "sampled_accuracy": n_right / max(n_answers, 1.0),
    }
    return pairs, stats
