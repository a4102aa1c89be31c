"""Judging a policy on human preferences, where no verifier knows the truth: shared by
``bench_alignment.py hh`` (PPO against reward model A) and ``bench_dpo.py hh`` (DPO on A's pairs).

``../shared/data/hh_rlhf/train.jsonl`` is split into two disjoint halves, by conversation. A policy is
trained on half ``a`` only (through reward model A, or directly by DPO); the judge B is a reward model
trained on half ``b``, so it never saw the policy's training pairs. Both the untuned model and the
policy answer held-out HH prompts greedily, and the reward models score the answers.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
HH = ROOT.parent / "shared" / "data" / "hh_rlhf"
MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"
# Both benchmarks judge the same held-out prompts with answers of the same budget, so PPO and DPO compare.
JUDGE_PROMPTS = 100
MAX_NEW_TOKENS = 96
# The benchmarks run as scripts (sys.path[0] is bench/): the judging below imports the library.
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def split_by_conversation(rows: list[str]) -> tuple[list[str], list[str]]:
    """Two halves of JSONL preference rows with every conversation in one half: rows whose dialogues open
    with the same human turn (pairs taken from one conversation at different turns) stay together, so
    the judge never saw a pair of a conversation the policy trained on. Each conversation goes, in file
    order, to the half that has fewer rows so far (ties: a), so the halves differ by at most the size of
    one conversation."""
    from dschat.data.prompt_format import parse_dialogue

    halves: tuple[list[str], list[str]] = ([], [])
    where: dict[str, int] = {}
    for row in rows:
        opening = next(m["content"] for m in parse_dialogue(json.loads(row)["prompt"]) if m["role"] == "user")
        if opening not in where:
            where[opening] = int(len(halves[1]) < len(halves[0]))
        halves[where[opening]].append(row)
    return halves


def trained_half_problem(rm: str | Path, half: str) -> str | None:
    """Why the reward model ``rm`` given to an HH benchmark is not one trained on ``half`` (``"a"`` or
    ``"b"``) of the split :func:`hh_halves` makes, or None where it is. Its run's ``dschat_config.json``
    records its data; that data's rows must be exactly the half's (a judge trained on the policy's half, or
    A given as B, would judge with what the policy learned from)."""
    from dschat.utils.run import trained_config

    recorded = trained_config(rm).get("data_path")
    if not recorded:
        return "no dschat_config.json naming its data: cannot tell which half of the HH pairs it trained on"
    files = [Path(d) / "train.jsonl" if Path(d).is_dir() else Path(d) for d in recorded]
    if not all(f.is_file() for f in files):
        return f"its training data {', '.join(map(str, recorded))} is not there: cannot tell which half it trained on"
    rows = (HH / "train.jsonl").read_text().splitlines(keepends=True)
    expected = "".join(split_by_conversation(rows)["ab".index(half)])
    if "".join(f.read_text() for f in files) != expected:
        return f"trained on {', '.join(map(str, recorded))}, not on half {half} of the HH pairs (this benchmark's split)"
    return None


def hh_halves(out: Path) -> dict[str, Path]:
    """Data directories ``a`` and ``b``: disjoint halves of the HH training pairs, split by conversation
    (:func:`split_by_conversation`; before 2026-11-28 even and odd lines, which put 96 conversations in
    both), each with the HH test pairs as test.jsonl. ``a`` also gives PPO its prompts (its pairs'
    prompts; the test pairs' held out)."""
    rows = (HH / "train.jsonl").read_text().splitlines(keepends=True)
    dirs = {}
    for name, part in zip(("a", "b"), split_by_conversation(rows), strict=True):
        d = out / f"hh_{name}"
        d.mkdir(parents=True)
        (d / "train.jsonl").write_text("".join(part))
        (d / "test.jsonl").symlink_to(HH / "test.jsonl")
        dirs[name] = d
    return dirs


def judge_held_out(
    out: Path,
    policy: Path,
    reward_models: dict[str, Path],
    *,
    judge: str,
    prompts: int,
    max_new_tokens: int,
    tag: str,
    sampled: bool = True,
    temperature: float = 1.0,
    first: int = 0,
) -> dict:
    """Greedy answers of the untuned model (``step1``: SmolLM2 is already instruction-tuned) and of
    ``policy`` to ``prompts`` HH test prompts from row ``first`` on, scored by every reward model in
    ``reward_models``.

    Returns ``score_<name>_step1`` / ``score_<name>_<tag>`` (mean scores), ``win_rate_<name>`` (policy
    over step 1, ties half), ``judge_win_rate`` (the same under ``reward_models[judge]``), the mean answer
    lengths in tokens and ``length_ratio`` (policy over step 1); how many answers of each were cut off at
    ``max_new_tokens`` and the judge's win rate where neither was (``judge_win_rate_both_ended``) and in
    each other such group (``judge_win_rate_by_cut_off``). With ``sampled``, the same again for
    one answer each sampled at ``temperature`` (the distribution RL optimises, when it is the policy's
    training temperature; seed 0 for both models), under keys ending in ``_sampled``: greedy decoding
    shows only the mode, which a small policy update may leave unchanged."""
    rows = [json.loads(x) for x in (HH / "test.jsonl").read_text().splitlines()][first : first + prompts]
    out.mkdir(parents=True, exist_ok=True)
    prompts_file = out / "held_out_prompts.jsonl"
    prompts_file.write_text("".join(json.dumps({"prompt": r["prompt"]}) + "\n" for r in rows))
    result = judged_answers(out, policy, reward_models, prompts_file, judge, max_new_tokens, tag, "greedy")
    if sampled:
        more = judged_answers(out, policy, reward_models, prompts_file, judge, max_new_tokens, tag, "sample",
                              temperature)  # fmt: skip
        result.update({f"{k}_sampled": v for k, v in more.items() if k != "held_out_prompts"})
        result["sampled_temperature"] = temperature
    return result


def judged_answers(out: Path, policy: Path, reward_models: dict[str, Path], prompts_file: Path, judge: str,
                   max_new_tokens: int, tag: str, decoding: str, temperature: float = 1.0) -> dict:  # fmt: skip
    """Both models' answers to ``prompts_file`` with ``decoding`` (prompt_eval.py; ``sample`` at
    ``temperature``), and their scores."""
    from dschat.compare import win_rate
    from dschat.data.prompt_format import as_dialogue, model_format
    from dschat.models.loading import load_tokenizer, resolve
    from dschat.models.reward import load_reward_model
    from dschat.scoring import score_texts

    report = out / f"held_out_{decoding}"
    cmd = [str(ROOT / "inference/prompt_eval.py"), "--model_name_or_path_baseline", MODEL,
           "--model_name_or_path_finetune", str(policy), "--prompts_file", str(prompts_file),
           "--max_new_tokens", str(max_new_tokens), "--decoding", decoding, "--seed", "0",
           *(["--temperature", str(temperature)] if decoding == "sample" else []), "--output", str(report)]  # fmt: skip
    proc = subprocess.run([sys.executable, *cmd], capture_output=True, text=True)
    if proc.returncode != 0:
        print(json.dumps({"error": proc.stderr.strip().splitlines()[-3:], "cmd": cmd}))
        sys.exit(1)
    answered = [json.loads(x) for x in report.with_suffix(".jsonl").read_text().splitlines()]
    tok = load_tokenizer(resolve(MODEL))
    questions = [as_dialogue(r["prompt"]) for r in answered]
    same = [r["baseline"] == r["finetune"] for r in answered]

    def mean(x: list[float]) -> float:
        return sum(x) / len(x)

    def length(side: str) -> float:
        return mean([len(tok(r[side], add_special_tokens=False)["input_ids"]) for r in answered])

    result: dict = {}
    scores: dict[str, dict[str, list[float]]] = {}  # reward model -> side -> one score per prompt
    for name, rm in reward_models.items():
        model = load_reward_model(str(rm), tokenizer=tok, require_trained_head=True)
        fmt = model_format(tok, str(rm))  # the format it trained in; rows cut as it trained (trained_max_len)
        s = {side: score_texts(model, tok, questions, [r[side] for r in answered], batch_size=8, device="cpu",
                               fmt=fmt).tolist() for side in ("baseline", "finetune")}  # fmt: skip
        result[f"score_{name}_step1"] = mean(s["baseline"])
        result[f"score_{name}_{tag}"] = mean(s["finetune"])
        result[f"win_rate_{name}"] = win_rate(s["finetune"], s["baseline"], same)["win_rate"]
        scores[name] = s
    # An answer cut off at max_new_tokens stops mid-sentence, and a judge marks it down whatever it says:
    # a policy that learns only to finish within the budget wins every prompt where step 1 ran out. So the
    # judge's win rate per group: both answers ended, both cut off, only one of them cut off.
    groups: dict[str, list[int]] = {}
    for i, r in enumerate(answered):
        key = {(False, False): "both_ended", (True, True): "both_cut_off", (True, False): "only_step1_cut_off",
               (False, True): f"only_{tag}_cut_off"}[(r["baseline_cut_off"], r["finetune_cut_off"])]  # fmt: skip
        groups.setdefault(key, []).append(i)

    def judged_win_rate(ix: list[int]) -> dict:
        policy, step1 = ([scores[judge][side][i] for i in ix] for side in ("finetune", "baseline"))
        return {"prompts": len(ix), **win_rate(policy, step1, [same[i] for i in ix])}

    by_cut_off = {key: judged_win_rate(ix) for key, ix in sorted(groups.items())}
    return {
        "judge_win_rate": result[f"win_rate_{judge}"],
        "judge_win_rate_both_ended": by_cut_off.get("both_ended", {}).get("win_rate"),
        "judge_win_rate_by_cut_off": by_cut_off,
        "cut_off_step1": sum(r["baseline_cut_off"] for r in answered),
        f"cut_off_{tag}": sum(r["finetune_cut_off"] for r in answered),
        **result,
        "length_step1": length("baseline"),
        f"length_{tag}": length("finetune"),
        "length_ratio": length("finetune") / max(length("baseline"), 1e-9),
        "identical_answers": sum(same),
        "held_out_prompts": len(answered),
    }
