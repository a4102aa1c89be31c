#!/usr/bin/env python
"""Score prompt/response pairs with a trained reward model (step 2 output).

    python inference/rw_eval.py --model output/step2 --prompt "\\n\\nHuman: What is 2 + 2?\\n\\nAssistant:" \\
        --response " 4" --response " 5"
    python inference/rw_eval.py --model output/step2 --file pairs.jsonl          # prompt, chosen, rejected
    python inference/rw_eval.py --model output/step2 --file answers.jsonl --json # prompt, response

With preference pairs it prints pairwise accuracy, the score distribution of chosen and rejected
responses, and accuracy split by whether the chosen response is the longer one (a length-only model
shows itself there). ``--json`` prints one JSON object for programs instead of a table.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from dschat.config import ArgumentParser, FormatArgs, InferenceArgs, add_group, from_namespace
from dschat.data.pipeline import comparable_pairs
from dschat.data.prompt_format import as_dialogue, model_format
from dschat.data.sources import read_json_file
from dschat.models.loading import inference_dtype, load_tokenizer, resolve
from dschat.models.reward import load_reward_model, require_reward_model
from dschat.ranking import ranking_metrics, ranking_sums
from dschat.scoring import score_texts
from dschat.utils import dist
from dschat.utils.errors import UserError, run_cli
from dschat.utils.io import is_text


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = ArgumentParser(prog="rw_eval.py", description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--model", "--model_name_or_path", dest="model", required=True, help="trained reward model directory"
    )
    p.add_argument(
        "--prompt",
        help="a prompt to score --response values against (\\n typed as two characters is a newline)",
    )
    p.add_argument(
        "--response", action="append", default=[], help="a response (repeatable; \\n as in --prompt)"
    )
    p.add_argument("--file", help="JSONL/JSON with prompt+response rows, or prompt+chosen+rejected pairs")
    p.add_argument("--max_samples", type=int, default=0, help="score only the first N rows (0 = all)")
    p.add_argument("--batch_size", type=int, default=32)
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    add_group(p, FormatArgs, title="prompt format (as in training)")
    add_group(p, InferenceArgs, title="device and precision")
    args = p.parse_args(argv)
    args.inference = from_namespace(InferenceArgs, args)
    if bool(args.prompt) == bool(args.file):
        p.error("give either --prompt with --response, or --file")
    if args.prompt and not args.response:
        p.error("--prompt needs at least one --response")
    if args.file and args.response:
        p.error("--response belongs with --prompt; --file holds its own responses")
    for flag, texts in (("--prompt", [args.prompt or ""]), ("--response", args.response)):
        if not all(is_text(t) for t in texts):
            p.error(f"{flag}: not valid UTF-8 text")
    if any(not r.strip() for r in args.response):  # step 2 leaves such answers out: its score means nothing
        p.error("--response: an empty answer (step 2 never trains on one, so its score means nothing)")
    # "\n\nHuman: ..." typed in a shell arrives as backslash-n: a newline, as prompt_eval.py's text files read it
    if args.prompt:
        args.prompt = args.prompt.replace("\\n", "\n")
        args.response = [r.replace("\\n", "\n") for r in args.response]
    if args.max_samples < 0:
        p.error(f"--max_samples {args.max_samples}: must be 0 (all rows) or more")
    if args.batch_size < 1:
        p.error(f"--batch_size {args.batch_size}: must be at least 1")
    return args


def describe(x: torch.Tensor) -> dict[str, float]:
    q = torch.quantile(x, torch.tensor([0.1, 0.5, 0.9])).tolist() if len(x) else [float("nan")] * 3
    return {
        "mean": float(x.mean()),
        "std": float(x.std()) if len(x) > 1 else 0.0,
        "p10": q[0],
        "p50": q[1],
        "p90": q[2],
    }


def read_rows(args) -> tuple[list[dict] | None, list | None]:
    """What to score, read before the model loads: ``(rows, None)`` of prompt + response, or ``(None,
    pairs)`` of a preference file."""
    if args.prompt:  # a question typed as it is becomes the one-turn dialogue, as prompt_eval.py reads it
        return [{"prompt": as_dialogue(args.prompt), "response": r} for r in args.response], None
    try:
        samples = read_json_file(Path(args.file))
    except UserError as exc:
        raise UserError(f"--file {exc}") from None
    if args.max_samples:
        samples = samples[: args.max_samples]
    if not samples:
        raise UserError(f"--file {args.file}: no rows")
    paired = sum(s.rejected is not None for s in samples)
    if 0 < paired < len(samples):
        first = next(s for s in samples if s.rejected is None)
        raise UserError(f"{first.source}: no 'rejected' answer, where {paired} of the file's {len(samples)} rows "
                        "have one: give preference pairs or prompt + response rows, not both")  # fmt: skip
    if paired:
        return None, samples
    return [{"prompt": s.prompt, "response": s.chosen} for s in samples], None


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    path = resolve(args.model, "--model")
    where = args.inference
    require_reward_model(path, "--model")  # a policy or an adapter: this line, not its tokenizer's error
    rows, pairs = read_rows(args)  # the inputs and the dtype before the weights load
    dtype = inference_dtype(where.dtype, where.device)
    tokenizer = load_tokenizer(path, trust_remote_code=where.trust_remote_code, flag="--model")
    fmt = model_format(tokenizer, path, from_namespace(FormatArgs, args).chat_template)  # as it trained
    model = load_reward_model(path, tokenizer=tokenizer, trust_remote_code=where.trust_remote_code,
                              require_trained_head=True, flag="--model")  # fmt: skip
    model = model.to(where.device, dtype)
    dist.note_shared_cpu(where.device)

    def score(prompts: list[str], responses: list[str], partners: list[str] | None = None) -> torch.Tensor:
        return score_texts(model, tokenizer, prompts, responses, batch_size=args.batch_size, device=where.device,
                           fmt=fmt, partners=partners)  # fmt: skip

    if pairs:
        return report_pairs(pairs, score, args, fmt)
    scores = score([r["prompt"] for r in rows], [r["response"] for r in rows])
    out = [{**r, "score": float(s)} for r, s in zip(rows, scores)]
    if args.json:
        print(json.dumps({"model": path, "scores": out}, indent=2))
        return 0
    print(f"{'score':>9}  response (prompt tail)")
    for r in out:
        tail = r["prompt"][-40:].replace("\n", " ")
        print(f"{r['score']:9.4f}  {r['response'].strip()[:60]!r}  ({tail!r})")
    return 0


def report_pairs(samples, score, args, fmt) -> int:
    """Pairwise accuracy, split by which answer is longer in tokens (as step 2 and DPO count them), and the
    score distributions."""
    samples, dropped = comparable_pairs(samples)  # as step 2 evaluates them
    if not samples:
        raise UserError(f"{args.file}: no pair with two different, non-empty answers ({json.dumps(dropped)})")
    # each pair's prompt cut once, for the longer answer, as step 2 cuts it: both answers read the same one
    answers = [s.chosen for s in samples] + [s.rejected for s in samples]
    scores = score(
        [s.prompt for s in samples] * 2, answers, answers[len(samples) :] + answers[: len(samples)]
    )
    chosen, rejected = scores[: len(samples)], scores[len(samples) :]
    lc, lr = (torch.tensor([len(ids) for ids in fmt.encode_responses([getattr(s, side) for s in samples])])
              for side in ("chosen", "rejected"))  # fmt: skip
    metrics = ranking_metrics(ranking_sums(chosen, rejected, lc, lr, torch.ones(len(samples))))
    result = {"model": args.model, "pairs": len(samples), **dropped, **metrics, "chosen_scores": describe(chosen),
              "rejected_scores": describe(rejected), "margin_scores": describe(chosen - rejected)}  # fmt: skip
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    skipped = sum(dropped.values())
    print(f"reward model {args.model}: {len(samples)} pairs"
          + (f" ({skipped} left out: identical or empty answers, as step 2 leaves them out)" if skipped else ""))  # fmt: skip
    print(f"  pairwise accuracy       {metrics['accuracy']:.4f}")
    if "accuracy_chosen_longer" in metrics:
        print(f"    chosen longer          {metrics['accuracy_chosen_longer']:.4f}")
    if "accuracy_chosen_shorter" in metrics:
        print(f"    chosen shorter         {metrics['accuracy_chosen_shorter']:.4f}")
    print(f"  'longer wins' baseline  {metrics['longer_response_baseline']:.4f}")
    print(f"  {'':16}{'mean':>9}{'std':>9}{'p10':>9}{'p50':>9}{'p90':>9}")
    for name in ("chosen", "rejected", "margin"):
        d = result[f"{name}_scores"]
        print(f"  {name:16}{d['mean']:9.4f}{d['std']:9.4f}{d['p10']:9.4f}{d['p50']:9.4f}{d['p90']:9.4f}")
    return 0


if __name__ == "__main__":
    run_cli(main)
