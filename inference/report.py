#!/usr/bin/env python
"""One Markdown report with PNG plots for a finished run, to look at instead of reading JSON.

    python inference/report.py output                  # writes output/report/report.md and its PNGs
    python inference/report.py output --num_prompts 0  # without side-by-side answers (no model is loaded)

Reads ``OUTPUT_DIR/step1``, ``step2`` (or ``step2_dpo``) and ``step3`` (whichever exist): each step's
headline numbers; step 3's curves per round (reward and score, the judge's score where
``--judge_reward_model`` was given, KL to the reference, answer length, entropy, the share of answers cut
off) and its held-out evaluations (true accuracy, per task, of greedy and of sampled answers); per-task
true accuracy before and after; and greedy answers of the step-1 model beside the final policy's on
built-in held-out prompts, with the verifier's verdict and (where step 2 trained one) the reward model's
score, through ``inference/prompt_eval.py``.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dschat import compare
from dschat.config import InferenceArgs
from dschat.utils.errors import UserError, run_cli
from dschat.utils.io import atomic_write_bytes, atomic_write_text

HERE = Path(__file__).resolve().parent
# step-3 training curves: (metrics key, title); a panel is drawn where the run logged the key
TRAIN_PANELS = [
    (("score_mean", "reward_mean"), "reward-model score and total reward (score - KL penalty)"),
    (("judge_score_mean",), "judge reward model's score (not optimised)"),
    (("kl_to_reference",), "KL to the reference (per answer)"),
    (("response_length",), "answer length (tokens)"),
    (("entropy",), "entropy of the sampled tokens"),
    (("truncated_fraction",), "answers cut off at the token budget"),
    (("clipped_score_fraction",), "scores clipped at +-clip_reward_value"),
]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="report.py", description=__doc__.split("\n\n")[0])
    p.add_argument("output_dir", help="a run's --output-dir (holding step1/, step2/, step3/)")
    p.add_argument(
        "--num_prompts", type=int, default=12, help="built-in held-out prompts answered side by side"
    )
    p.add_argument("--max_new_tokens", type=int, default=64)
    p.add_argument("--device", default="cpu", choices=("auto", "cpu", "cuda"))
    p.add_argument("--overwrite", action="store_true", help="replace an earlier report of this run")
    args = p.parse_args(argv)
    # checked before anything is written: a bad flag failed inside prompt_eval after the plots were
    if args.num_prompts < 0:
        raise UserError(f"--num_prompts must be >= 0, got {args.num_prompts}")
    if args.max_new_tokens < 1:
        raise UserError(f"--max_new_tokens must be >= 1, got {args.max_new_tokens}")
    InferenceArgs(device=args.device).validate()  # cuda without a GPU
    report = Path(args.output_dir) / "report" / "report.md"
    if report.exists() and not args.overwrite:
        raise UserError(f"{report} exists (an earlier report); pass --overwrite to replace it")
    return args


def read_json(path: Path) -> dict | None:
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise UserError(f"{path}: not valid JSON ({exc})") from None


def read_metrics(path: Path) -> list[dict]:
    """metrics.jsonl rows (a line cut short by a killed run is skipped)."""
    rows = []
    if path.is_file():
        for line in path.read_text().splitlines():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return rows


def fmt(x) -> str:
    if x is None:
        return "-"
    return f"{x:.3f}" if isinstance(x, float) else str(x)


def headline(steps: dict[str, dict], metrics: list[dict]) -> list[str]:
    """A table row per step: what it trained and how much better it got; step 3's first and last
    logged rounds for its reward, KL, entropy and answer length."""
    lines = ["| step | measure | start | end | wall (min) |", "|---|---|---|---|---|"]
    truth = ("true accuracy (greedy)", "true_accuracy_start", "true_accuracy_end")
    dpo = ("implicit-reward accuracy", "implicit_reward_accuracy_start", "implicit_reward_accuracy_end")
    rows = {
        "step1": [truth],
        "step2": [("held-out pairwise accuracy", "eval_accuracy_start", "eval_accuracy_end")],
        "step2_dpo": [dpo, truth],  # on built-in tasks DPO measures the truth too
        "step3": [truth],
    }
    for name, s in steps.items():
        for what, a, b in rows[name]:
            if (what, a, b) == truth and name == "step2_dpo" and a not in s:
                continue  # DPO on data no verifier knows
            lines.append(f"| {name} | {what} | {fmt(s.get(a))} | {fmt(s.get(b))} | "
                         f"{s.get('wall_seconds', 0) / 60:.1f} |")  # fmt: skip
    train = [r for r in metrics if r.get("split") == "train"]
    norm = steps.get("step3", {}).get("reward_normalization")  # --normalize_reward: standardised scores
    score = (
        f"reward-model score, standardised (raw - {norm['mean']:.3g}) / {norm['std']:.3g},"
        if norm
        else "reward-model score"
    )
    if train:
        for what, key in ((score, "score_mean"), ("KL to the reference", "kl_to_reference"),
                          ("entropy", "entropy"), ("answer length", "response_length")):  # fmt: skip
            lines.append(
                f"| step3 | {what} (round 1, last) | {fmt(train[0].get(key))} | {fmt(train[-1].get(key))} | |"
            )
    return lines


def plot_png(panels: list[tuple[str, list[tuple[str, list[float], list[float]]]]]) -> bytes:
    """A grid of line plots: ``panels`` = [(title, [(label, xs, ys), ...]), ...] -> PNG bytes."""
    import io

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cols = 2
    rows = (len(panels) + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(11, 3.2 * rows), squeeze=False)
    for ax, (title, series) in zip(axes.flat, panels):
        for label, xs, ys in series:
            ax.plot(xs, ys, marker="o" if len(xs) < 12 else None, label=label)
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("round")
        ax.grid(alpha=0.3)
        if len(series) > 1:
            ax.legend(fontsize=8)
    for ax in list(axes.flat)[len(panels) :]:
        ax.axis("off")
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=90)
    plt.close(fig)
    return buf.getvalue()


def step3_panels(metrics: list[dict]) -> tuple[list, list]:
    """(training panels, evaluation panels) from step 3's metrics.jsonl."""
    train = [r for r in metrics if r.get("split") == "train"]
    evals = [r for r in metrics if r.get("split") == "eval"]

    def series(rows: list[dict], key: str) -> tuple[str, list[float], list[float]]:
        pts = [(r["step"], r[key]) for r in rows if isinstance(r.get(key), (int, float))]
        return key, [p[0] for p in pts], [p[1] for p in pts]

    tp = []
    for keys, title in TRAIN_PANELS:
        ss = [series(train, k) for k in keys]
        ss = [s for s in ss if s[1]]
        if ss:
            tp.append((title, ss))
    ep = []
    acc = [k for k in sorted({k for r in evals for k in r}) if k.startswith("true_accuracy")]
    greedy = [series(evals, k) for k in acc if not k.startswith("true_accuracy_sampled")]
    sampled = [series(evals, k) for k in acc if k.startswith("true_accuracy_sampled")]
    if greedy:
        ep.append(("true accuracy of greedy answers (held out)", greedy))
    if sampled:
        ep.append(("true accuracy of sampled answers (held out)", sampled))
    for key, title in (("held_out_reward", "reward of greedy answers (held out)"),
                       ("held_out_judge_score", "judge's score of greedy answers (held out)")):  # fmt: skip
        s = series(evals, key)
        if s[1]:
            ep.append((title, [s]))
    return tp, ep


def per_task(metrics: list[dict]) -> list[str]:
    """Per-task true accuracy at step 3's first and last evaluation (the step-1 model, then the policy)."""
    evals = [r for r in metrics if r.get("split") == "eval"]
    if len(evals) < 1:
        return []
    first, last = evals[0], evals[-1]
    tasks = sorted(k.split("/", 1)[1] for k in first if k.startswith("true_accuracy/"))
    if not tasks:
        return []
    lines = [
        "| task | step 1 (greedy) | step 3 (greedy) | step 1 (sampled) | step 3 (sampled) |",
        "|---|---|---|---|---|",
    ]
    for t in ["all", *tasks]:
        g, s = (
            ("true_accuracy", "true_accuracy_sampled")
            if t == "all"
            else (f"true_accuracy/{t}", f"true_accuracy_sampled/{t}")
        )
        lines.append(
            f"| {t} | {fmt(first.get(g))} | {fmt(last.get(g))} | {fmt(first.get(s))} | {fmt(last.get(s))} |"
        )
    return lines


def answers(run: Path, out: Path, args: argparse.Namespace) -> list[str]:
    """Greedy answers of the step-1 model and of the final policy, side by side (prompt_eval's report)."""
    step, final = (
        (run / "step3", run / "step3" / "actor")
        if (run / "step3" / "actor").is_dir()
        else (run / "step2_dpo",) * 2
    )
    if args.num_prompts == 0 or not (run / "step1").is_dir() or not final.is_dir():
        return []
    spec = importlib.util.spec_from_file_location("dschat_prompt_eval", HERE / "prompt_eval.py")
    prompt_eval = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(prompt_eval)
    argv = ["--model_name_or_path_baseline", str(run / "step1"), "--model_name_or_path_finetune", str(final),
            "--num_prompts", str(args.num_prompts), "--max_new_tokens", str(args.max_new_tokens),
            "--device", args.device, "--output", str(out / "answers"),
            *(["--overwrite"] if args.overwrite else [])]  # fmt: skip
    if (run / "step2" / "config.json").is_file():
        argv += ["--reward_model", str(run / "step2")]
    # the prompts of the tasks the run trained on, in the prompt format it trained with
    trained = read_json(step / "dschat_config.json") or read_json(run / "step1" / "dschat_config.json") or {}
    if names := compare.run_tasks(trained.get("data_path") or []):
        argv += ["--tasks", ",".join(names)]
    if trained.get("chat_template"):
        argv += ["--chat_template", str(trained["chat_template"])]
    prompt_eval.main(argv)
    body = (out / "answers.md").read_text()
    return [
        f"Baseline: the step-1 model; fine-tuned: `{final.relative_to(run)}`. Also in `answers.jsonl`.",
        "",
        body,
    ]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    run = Path(args.output_dir)
    steps = {
        n: s for n in ("step1", "step2", "step2_dpo", "step3") if (s := read_json(run / n / "summary.json"))
    }
    if not steps:
        raise UserError(
            f"{run}: no finished step there (no step1/, step2/, step2_dpo/ or step3/ with summary.json)"
        )
    out = run / "report"
    out.mkdir(exist_ok=True)
    # a step 3 without summary.json stopped midway: its rounds are not a before and after
    unfinished = "step3" not in steps and (run / "step3" / "metrics.jsonl").is_file()
    metrics = read_metrics(run / "step3" / "metrics.jsonl") if "step3" in steps else []
    md = [f"# Report: {run}", "", "## Steps", "", *headline(steps, metrics), ""]
    if unfinished:
        md += [
            "step 3 did not finish (no step3/summary.json): resume it (`--resume`) for its rounds here",
            "",
        ]
    if metrics:
        train_panels, eval_panels = step3_panels(metrics)
        md += ["## Step 3, round by round", ""]
        if train_panels:
            atomic_write_bytes(out / "step3_training.png", plot_png(train_panels))
            md += ["![step 3 training curves](step3_training.png)", ""]
        if eval_panels:
            atomic_write_bytes(out / "step3_evaluation.png", plot_png(eval_panels))
            md += ["![step 3 held-out evaluation](step3_evaluation.png)", ""]
        table = per_task(metrics)
        if table:
            md += ["## True accuracy per task, before and after step 3", "", *table, ""]
    side = answers(run, out, args)
    if side:
        md += ["## Answers side by side", "", *side]
    atomic_write_text(out / "report.md", "\n".join(md) + "\n")
    print(f"==> wrote {out / 'report.md'}")
    return 0


if __name__ == "__main__":
    run_cli(main)
