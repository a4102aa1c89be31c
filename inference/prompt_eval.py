#!/usr/bin/env python
"""Compare a baseline and a fine-tuned model on the same prompts, side by side.

    python inference/prompt_eval.py --model_name_or_path_baseline output/step1 \\
        --model_name_or_path_finetune output/step3/actor --reward_model output/step2 --output results/ppo
    python inference/prompt_eval.py --model_name_or_path_baseline builtin:tiny-llama \\
        --model_name_or_path_finetune output/step1 --prompts_file prompts.txt --decoding beam --num_beams 4

Prompts are the built-in tasks' held-out questions (``--num_prompts``) or ``--prompts_file``: JSONL with
a field ``prompt``, or text with one prompt per line (``\\n`` in a line is a line break). A prompt is
rendered in each model's format (``--chat_template``, as in training) unless it already is a
Human/Assistant dialogue ending in ``Assistant:``. On built-in task prompts the verifier's accuracy of
each model is printed; ``--reward_model`` adds each answer's reward and the fine-tuned model's win
rate over the baseline (a tie counts half). ``--output PATH`` writes ``PATH.md`` and ``PATH.jsonl``.
"""

from __future__ import annotations

import argparse
import gc
import json
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from dschat import compare
from dschat.config import ArgumentParser, FormatArgs, InferenceArgs, add_group, from_namespace
from dschat.data.prompt_format import PromptFormat, as_dialogue, model_format
from dschat.generation.decoding import (
    DecodeOptions,
    Replies,
    add_decoding_args,
    context_length,
    decode_options,
    generate_replies,
)
from dschat.models.loading import (
    GenerationSource,
    inference_dtype,
    is_lora_adapter,
    load_for_generation,
    load_tokenizer,
    open_for_generation,
    require_weights,
    resolve,
)
from dschat.models.reward import load_reward_model
from dschat.scoring import score_texts
from dschat.utils import dist
from dschat.utils.errors import UserError, run_cli
from dschat.utils.io import atomic_write_text
from dschat.utils.run import check_output_prefix, output_stem

REPORT_SUFFIXES = (".md", ".jsonl")  # --output PATH writes PATH.md and PATH.jsonl

SIDES = ("baseline", "finetune")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = ArgumentParser(prog="prompt_eval.py", description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--model_name_or_path_baseline", required=True, help="model before fine-tuning (or any model)"
    )
    p.add_argument("--model_name_or_path_finetune", required=True, help="model after fine-tuning")
    p.add_argument(
        "--base_model",
        help="base model of the side that is a LoRA adapter (default: the one its config names)",
    )
    p.add_argument("--prompts_file", help="JSONL (field 'prompt') or text file, one prompt per line")
    p.add_argument(
        "--num_prompts",
        type=int,
        help="built-in held-out prompts to use without --prompts_file (default: 12)",
    )
    p.add_argument("--tasks", help="built-in tasks to draw them from, comma-separated (default: every task)")
    add_decoding_args(p, DecodeOptions(seed=0))  # greedy by default: comparable, repeatable answers
    p.add_argument("--reward_model", help="reward model (step-2 output) to score every answer")
    p.add_argument("--output", help="write PATH.md (report) and PATH.jsonl (one row per prompt)")
    p.add_argument("--overwrite", action="store_true", help="replace an earlier report at --output")
    add_group(p, FormatArgs, title="prompt format (as in training)")
    p.add_argument("--batch_size", type=int, default=8)
    add_group(p, InferenceArgs, title="device and precision")
    args = p.parse_args(argv)
    args.inference = from_namespace(InferenceArgs, args)
    if args.num_prompts is not None and args.prompts_file:  # it was ignored: every prompt of the file ran
        raise UserError(
            "--num_prompts picks how many built-in prompts; --prompts_file is used whole: give one"
        )
    args.num_prompts = 12 if args.num_prompts is None else args.num_prompts
    if args.num_prompts < 1:
        p.error(f"--num_prompts {args.num_prompts}: must be at least 1")
    from dschat import tasks

    if args.tasks is not None:
        names = [t for t in args.tasks.split(",") if t]
        if not names:
            p.error(f"--tasks {args.tasks!r}: names no task")
        try:
            tasks.resolve_tasks(names)
        except KeyError as exc:
            p.error(f"--tasks {args.tasks}: {exc.args[0]}")
        args.tasks = ",".join(names)  # 'sort,' is 'sort'
    if args.tasks and args.prompts_file:
        p.error("--tasks picks built-in prompts and --prompts_file gives your own: give one")
    if args.batch_size < 1:
        p.error(f"--batch_size {args.batch_size}: must be at least 1")
    if args.overwrite and not args.output:
        p.error("--overwrite replaces an earlier report at --output: give --output")
    if args.output:
        check_output_prefix(args.output, REPORT_SUFFIXES, overwrite=args.overwrite)
    return args


def free(*objs) -> None:
    del objs
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def source(name: str, flag: str, args) -> GenerationSource:
    """One side's model opened (no weights); ``--base_model`` goes to the side that is an adapter."""
    trust = args.inference.trust_remote_code
    adapter = is_lora_adapter(resolve(name, flag))
    return open_for_generation(name, base_model=args.base_model if adapter else None, trust_remote_code=trust,
                               flag=flag)  # fmt: skip


def prompt_settings(src: GenerationSource, opts: DecodeOptions, args) -> tuple[PromptFormat, int]:
    """The format the model was trained in and the tokens a prompt may take, from its tokenizer and config:
    both sides are checked before either loads its weights."""
    fmt = model_format(
        src.tokenizer, src.path, from_namespace(FormatArgs, args).chat_template
    )  # as it trained
    budget = context_length(src.config, src.tokenizer) - opts.max_new_tokens
    if budget < 1:
        raise UserError(f"--max_new_tokens {opts.max_new_tokens}: leaves no room for a prompt in {src.path}")
    return fmt, budget


def answer(src: GenerationSource, questions: list[str], opts: DecodeOptions, args) -> tuple[Replies, int]:
    """One model's replies to every question (loaded, used, freed); and how many prompts were cut to fit."""
    where = args.inference
    fmt, budget = prompt_settings(src, opts, args)
    model, tokenizer = load_for_generation(src, device=where.device, dtype=inference_dtype(where.dtype, where.device),
                                           trust_remote_code=where.trust_remote_code)  # fmt: skip
    fitted = [fmt.fit_prompt(as_dialogue(q), budget) for q in questions]  # as training fits a prompt
    cut = sum(f.dropped > 0 or f.cut for f in fitted)
    ids = [f.ids for f in fitted]
    torch.manual_seed(args.seed)
    replies = generate_replies(
        model,
        tokenizer,
        ids,
        opts,
        batch_size=args.batch_size,
        stops=fmt.stop_strings,
        stop_ids=fmt.stop_ids,
    )
    free(model, tokenizer)
    return replies, cut


def rewards(questions: list[str], replies: dict[str, list[str]], args) -> dict[str, list[float]]:
    path = resolve(args.reward_model, "--reward_model")
    where = args.inference
    tokenizer = load_tokenizer(path, trust_remote_code=where.trust_remote_code, flag="--reward_model")
    model = load_reward_model(path, tokenizer=tokenizer, trust_remote_code=where.trust_remote_code,
                              require_trained_head=True, flag="--reward_model")  # fmt: skip
    model = model.to(where.device, inference_dtype(where.dtype, where.device))  # as rw_eval.py scores
    # the format the reward model trained in: --chat_template says how to prompt the two policies
    fmt = model_format(tokenizer, path)
    prompts = [as_dialogue(q) for q in questions]
    out = {side: score_texts(model, tokenizer, prompts, replies[side], batch_size=args.batch_size,
                             device=where.device, fmt=fmt).tolist() for side in SIDES}  # fmt: skip
    free(model, tokenizer)
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    opts = decode_options(args, DecodeOptions())
    questions = (
        compare.read_prompts(args.prompts_file)
        if args.prompts_file
        else compare.builtin_prompts(args.num_prompts, args.tasks.split(",") if args.tasks else None)
    )
    if args.reward_model:  # fail on a bad reward model before minutes of generation
        from dschat.models.loading import has_value_head

        path = resolve(args.reward_model, "--reward_model")
        if not has_value_head(path):
            raise UserError(f"--reward_model {args.reward_model}: not a trained reward model (no config.json of a "
                            "1-label sequence-classification model; pass the step-2 output directory)")  # fmt: skip
        require_weights(path, "--reward_model")
    models = {"baseline": args.model_name_or_path_baseline, "finetune": args.model_name_or_path_finetune}
    # both models found, fit to generate (a GGUF converted) and to the flags before minutes of generation
    sources = {side: source(models[side], f"--model_name_or_path_{side}", args) for side in SIDES}
    if args.base_model and not any(src.base_path for src in sources.values()):
        raise UserError(
            f"--base_model {args.base_model}: neither model is a LoRA adapter; it names an adapter's base"
        )
    for side in SIDES:
        prompt_settings(sources[side], opts, args)
    dist.note_shared_cpu(
        args.inference.device
    )  # another run on these cores makes minutes of generation hours
    replies: dict[str, list[str]] = {}
    cut_off: dict[str, list[bool]] = {}
    for side in SIDES:
        print(f"==> {side}: {models[side]} ({len(questions)} prompts, {opts.strategy})", flush=True)
        (replies[side], cut_off[side]), cut = answer(sources[side], questions, opts, args)
        if cut:
            print(f"    {cut} prompt(s) longer than the context kept only their end", flush=True)
    scores = rewards(questions, replies, args) if args.reward_model else None

    rows = []
    for i, q in enumerate(questions):
        row = {"index": i + 1, "prompt": q, "task": compare.task_name(q)}
        for side in SIDES:
            row[side] = replies[side][i]
            row[f"{side}_cut_off"] = cut_off[side][i]
            row[f"{side}_correct"] = compare.verdict(q, replies[side][i])
            row[f"{side}_reward"] = scores[side][i] if scores else None
        rows.append(row)
    summary = summarize(rows, scores, len(questions))
    print_side_by_side(rows)
    print_summary(summary)
    if args.output:
        write_reports(args, models, opts, summary, rows)
    return 0


def summarize(rows: list[dict], scores: dict[str, list[float]] | None, n: int) -> dict:
    summary: dict = {"prompts": n}
    for side in SIDES:  # unfinished answers: a reason to raise --max_new_tokens, and a judge's bias
        summary[f"{side}_cut_off"] = sum(r[f"{side}_cut_off"] for r in rows)
    task_rows = sum(r["task"] is not None for r in rows)
    if task_rows:
        summary["task_prompts"] = task_rows
        for side in SIDES:
            summary[f"{side}_accuracy"] = compare.accuracy([r[f"{side}_correct"] for r in rows])
    if scores:
        for side in SIDES:
            summary[f"{side}_mean_reward"] = sum(scores[side]) / n
        same = [r["baseline"] == r["finetune"] for r in rows]
        summary.update(compare.win_rate(scores["finetune"], scores["baseline"], same))
    return summary


def print_side_by_side(rows: list[dict]) -> None:
    width = shutil.get_terminal_size((120, 24)).columns
    for r in rows:
        print(
            f"\n[{r['index']}/{len(rows)}] {r['prompt'].strip()}" + (f"   ({r['task']})" if r["task"] else "")
        )
        notes = {}
        for side in SIDES:
            bits = [] if r[f"{side}_reward"] is None else [f"reward {r[f'{side}_reward']:.3f}"]
            if r[f"{side}_correct"] is not None:
                bits.append("right" if r[f"{side}_correct"] else "wrong")
            notes[side] = ", ".join(bits)
        lines = compare.side_by_side("BASELINE", "FINE-TUNED", width - 2)
        lines += compare.side_by_side(
            r["baseline"].strip() or "(empty)", r["finetune"].strip() or "(empty)", width - 2
        )
        if any(notes.values()):
            lines += compare.side_by_side(f"[{notes['baseline']}]", f"[{notes['finetune']}]", width - 2)
        print("\n".join("  " + line for line in lines))


def print_summary(s: dict) -> None:
    print(f"\n==> {s['prompts']} prompts")
    if s["baseline_cut_off"] or s["finetune_cut_off"]:
        print(f"    cut off at --max_new_tokens before they ended: baseline {s['baseline_cut_off']}, "
              f"fine-tuned {s['finetune_cut_off']}")  # fmt: skip
    if "task_prompts" in s:
        print(f"    verifier accuracy on {s['task_prompts']} built-in task prompts: "
              f"baseline {s['baseline_accuracy']:.3f}, fine-tuned {s['finetune_accuracy']:.3f}")  # fmt: skip
    if "win_rate" in s:
        print(
            f"    mean reward: baseline {s['baseline_mean_reward']:.4f}, fine-tuned {s['finetune_mean_reward']:.4f}"
        )
        print(f"    fine-tuned win rate over baseline: {s['win_rate']:.3f} "
              f"({s['wins']} wins, {s['ties']} ties, {s['losses']} losses)")  # fmt: skip


def write_reports(args, models: dict, opts: DecodeOptions, summary: dict, rows: list[dict]) -> None:
    stem = output_stem(args.output, REPORT_SUFFIXES)
    settings = {"baseline": models["baseline"], "fine-tuned": models["finetune"],
                "prompts": args.prompts_file or f"built-in held-out ({args.num_prompts})",
                "decoding": opts.strategy, "max_new_tokens": opts.max_new_tokens,
                "repetition_penalty": opts.repetition_penalty, "reward model": args.reward_model or "none",
                "seed": args.seed}  # fmt: skip
    if opts.strategy == "sample":
        settings.update(temperature=opts.temperature, top_p=opts.top_p, top_k=opts.top_k)
    elif opts.strategy == "beam":
        settings.update(num_beams=opts.num_beams)
    elif opts.strategy == "contrastive":
        settings.update(top_k=opts.top_k, penalty_alpha=opts.penalty_alpha)
    atomic_write_text(f"{stem}.jsonl", "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
    atomic_write_text(f"{stem}.md", compare.markdown_report(settings, summary, rows))
    print(f"==> wrote {stem}.md and {stem}.jsonl")


if __name__ == "__main__":
    run_cli(main)
