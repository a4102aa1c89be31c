"""Helpers shared by the integration and end-to-end tests: run the real entry points, read their outputs."""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

from tests.conftest import ROOT, STEP1, run_cmd, run_entry

TRAIN_PY = ROOT / "train.py"
PROGRESS_BAR = re.compile(r"\d+%\|.*\|")

# The smallest useful step-1 run: the built-in 64-wide Llama (MICRO), small batches, a 64-sample eval
# set, no greedy-generation accuracy pass and no mid-run evaluation (start and end only).
MICRO = ["--model_name_or_path", "builtin:micro-llama"]
RUN_FLAGS = [
    "--per_device_train_batch_size", "8",
    "--eval_interval", "0",
    "--max_eval_samples", "64",
    "--eval_generation_samples", "0",
]  # fmt: skip
FAST = [*MICRO, *RUN_FLAGS]

# Flags of the reference runs that are compared step by step: fp32 (deterministic on CPU), a train row
# per step, global batch 16 on one rank as 8 x 2 accumulation steps.
REFERENCE_RUN_FLAGS = [*RUN_FLAGS, "--dtype", "fp32", "--log_interval", "1", "--max_steps", "20"]
REFERENCE_1RANK = [*MICRO, *REFERENCE_RUN_FLAGS, "--gradient_accumulation_steps", "2"]


def step1(
    out_dir: Path | str, *flags: str, env: dict | None = None, timeout: int = 600, in_process: bool = False
) -> subprocess.CompletedProcess:
    """Run ``training/step1_supervised_finetuning/main.py --output_dir OUT FLAGS``; ``in_process`` for a
    run that stops at a bad input (:func:`tests.conftest.run_main_in_process`)."""
    return run_entry(
        STEP1, ["--output_dir", str(out_dir), *flags], env=env, timeout=timeout, in_process=in_process
    )


def train_py(*args: str, env: dict | None = None, timeout: int = 600) -> subprocess.CompletedProcess:
    return run_cmd([str(TRAIN_PY), *args], env=env, timeout=timeout)


def assert_ok(proc: subprocess.CompletedProcess) -> None:
    assert proc.returncode == 0, (
        f"exit code {proc.returncode}\n--- stdout (tail)\n{proc.stdout[-3000:]}\n--- stderr (tail)\n{proc.stderr[-5000:]}"
    )


def error_line(proc: subprocess.CompletedProcess, *needles: str) -> str:
    """Check the one-line user error contract and return the line: exit code 2, stderr is exactly one
    ``error: ...`` line containing every needle, and no traceback."""
    assert proc.returncode == 2, (
        f"expected exit code 2, got {proc.returncode}\n--- stdout\n{proc.stdout[-2000:]}\n--- stderr\n{proc.stderr[-4000:]}"
    )
    assert "Traceback" not in proc.stderr, proc.stderr[-4000:]
    # Progress bars (the built-in model is written once per cache, with transformers' bar) are not output.
    errors = [line for line in proc.stderr.splitlines() if line.strip() and not PROGRESS_BAR.search(line)]
    assert len(errors) == 1 and errors[0].startswith("error: "), (
        f"expected stderr to be one 'error: ...' line, got:\n{proc.stderr[-4000:]}"
    )
    for needle in needles:
        assert needle in errors[0], f"{needle!r} not in {errors[0]!r}"
    return errors[0]


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def metrics(out_dir: Path) -> list[dict]:
    return read_jsonl(Path(out_dir) / "metrics.jsonl")


def train_rows(out_dir: Path) -> list[dict]:
    """The run's train rows of metrics.jsonl, in order."""
    return [r for r in metrics(out_dir) if r["split"] == "train"]


def train_losses(out_dir: Path) -> dict[int, float]:
    """step -> logged train loss; fails on a step logged twice."""
    rows = train_rows(out_dir)
    steps = [r["step"] for r in rows]
    assert len(steps) == len(set(steps)), f"train steps logged more than once: {steps}"
    return {r["step"]: r["loss"] for r in rows}


def eval_losses(out_dir: Path) -> list[tuple[int, float]]:
    """(step, loss) of the perplexity eval rows, in file order (accuracy rows have no loss)."""
    return [(r["step"], r["loss"]) for r in metrics(out_dir) if r["split"] == "eval" and "loss" in r]


def summary(out_dir: Path) -> dict:
    return json.loads((Path(out_dir) / "summary.json").read_text())


def resolved_config(out_dir: Path) -> dict:
    return json.loads((Path(out_dir) / "dschat_config.json").read_text())


def data_cache_dir() -> str:
    """The tokenized-data cache of this test session (the default of --data_output_path in the runs)."""
    return os.path.join(os.environ["DSCHAT_CACHE"], "data")


def exported_eval_loss(out_dir: Path) -> float:
    """Token-weighted eval NLL of the exported Hugging Face model in ``out_dir``, computed here with plain
    ``transformers`` on the run's own eval set (rebuilt from the run's resolved data flags: a cache hit)."""
    import dataclasses

    import torch
    from transformers import AutoModelForCausalLM

    from dschat.config import DataArgs
    from dschat.data.collate import SFTCollator
    from dschat.data.pipeline import prepare_sft_data
    from dschat.losses import token_nll
    from dschat.models.loading import load_tokenizer

    cfg = resolved_config(out_dir)
    tokenizer = load_tokenizer(cfg["resolved_model_path"])
    data_args = DataArgs(**{f.name: cfg[f.name] for f in dataclasses.fields(DataArgs)})
    data = prepare_sft_data(data_args, tokenizer, phase=1)
    model = AutoModelForCausalLM.from_pretrained(out_dir, dtype=torch.float32).eval()
    collate = SFTCollator(tokenizer.pad_token_id)
    nll_sum, tokens = 0.0, 0.0
    with torch.no_grad():
        for i in range(0, len(data.eval), 16):
            batch = collate(data.eval[i : i + 16])
            logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
            assert torch.isfinite(logits).all()
            nll, n = token_nll(logits, batch["labels"])
            nll_sum += float(nll.sum())
            tokens += float(n.sum())
    return nll_sum / tokens


def base_weights(out_dir: Path) -> dict:
    """The starting model's weights of a run (the resolved --model_name_or_path directory)."""
    from safetensors.torch import load_file

    return load_file(str(Path(resolved_config(out_dir)["resolved_model_path"]) / "model.safetensors"))
