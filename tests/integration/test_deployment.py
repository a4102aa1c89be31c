"""Deployment types on CPU (gloo) through train.py: a rank that dies mid-run, and all three steps on two
ranks. (Two simulated nodes against one process: tests/integration/test_step1.py, beside the one-process
run it compares with.)"""

from __future__ import annotations

import argparse
import json
import math
import os
import time

import pytest
import torch
from safetensors.torch import load_file

from tests.conftest import build_deepspeed_shared_memory_op, cpu_ranks_env
from tests.integration.helpers import (
    assert_ok,
    train_py,
    train_rows,
)

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="two CPU ranks need two cores"),
]


def test_a_rank_that_dies_ends_the_job_naming_it(tmp_path):
    """Rank 1 exits abruptly (os._exit, like an OOM kill) after 3 steps: rank 0 is blocked in a gloo
    collective; the launcher must end the job within seconds, non-zero, and train.py must name rank 1."""
    build_deepspeed_shared_memory_op()  # else the first test after a new virtualenv times its compilation
    t0 = time.monotonic()
    proc = train_py(
        "--step", "1", "--deployment-type", "single_node", "--num-gpus", "2", "--actor-model", "builtin:micro-llama",
        "--output-dir", str(tmp_path), "--dist-timeout", "60",
        "--", "--max_steps", "40", "--per_device_train_batch_size", "8", "--eval_interval", "0",
        "--max_eval_samples", "64", "--eval_generation_samples", "0",
        env={"DSCHAT_TEST_KILL_RANK": "1", "DSCHAT_TEST_KILL_AT_STEP": "3", **cpu_ranks_env()}, timeout=300,
    )  # fmt: skip
    elapsed = time.monotonic() - t0
    assert proc.returncode != 0
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("error: step 1 (supervised fine-tuning) failed with exit code "), proc.stderr[
        -3000:
    ]
    # The killed rank is named alone with its own exit code (the launcher's may be rank 0's, whose collective
    # failed a moment later), or with the peer whose collective failed in the same 20 ms poll.
    if "ended first" in last:
        assert "failed with exit code 13: rank 1 (pid " in last and ", exit code 13) ended first" in last, (
            last
        )
    else:
        assert "ranks 0 (pid" in last and ", 1 (pid" in last and "exit code 13)" in last, last
        assert "ended within 20 ms" in last, last
    assert not (tmp_path / "step1" / "summary.json").exists()
    # start-up and 3 steps take ~20 s on 2 cores; without the launcher ending it, rank 0 would wait for the
    # 60 s collective timeout at least
    assert elapsed < 120, elapsed


def test_all_three_steps_on_two_ranks_through_train_py(tmp_path):
    """single_node with 2 CPU processes (the DeepSpeed launcher) runs steps 1, 2 and 3 in one job, step 3
    with a ZeRO-3 actor and a ZeRO-2 critic (both stages of PPO on two ranks); per-step flags come from a
    preset file given by path."""
    preset = tmp_path / "two-ranks.yaml"
    preset.write_text(
        "model: builtin:micro-llama\n"
        "deployment_type: single_node\n"
        "step1: {--max_steps: 5, --per_device_train_batch_size: 8, --eval_interval: 0, --max_eval_samples: 32,"
        " --eval_generation_samples: 0}\n"
        "step2: {--max_steps: 5, --per_device_train_batch_size: 8, --eval_interval: 0, --max_eval_samples: 32}\n"
        "step3: {--max_steps: 3, --per_device_generation_batch_size: 8, --per_device_training_batch_size: 4,"
        " --max_answer_seq_len: 8, --max_prompt_seq_len: 96, --eval_prompts: 8, --eval_interval: 0,"
        " --actor_zero_stage: 3, --critic_zero_stage: 2}\n"
    )
    out = str(tmp_path / "out")
    proc = train_py(
        "--preset", str(preset), "--num-gpus", "2", "--output-dir", out, timeout=1200, env=cpu_ranks_env()
    )
    assert_ok(proc)
    assert "==> preset two-ranks (--preset): deployment single_node; model builtin:micro-llama" in proc.stdout
    launches = [
        line
        for line in proc.stdout.splitlines()
        if line.startswith(("==> step 1 (", "==> step 2 (", "==> step 3 ("))
    ]
    assert len(launches) == 3
    assert all("deepspeed.launcher.runner" in line and "--num_gpus 2" in line for line in launches)
    for n in (1, 2, 3):
        s = json.loads((tmp_path / "out" / f"step{n}" / "summary.json").read_text())
        assert s["world_size"] == 2, (n, s)
    # Step 3 on both ranks. Results, not echoed flags: the partitioned actor and critic were
    # gathered whole for saving (every tensor has its start's shape and is finite), and both moved.
    run = tmp_path / "out"
    s3 = json.loads((run / "step3" / "summary.json").read_text())
    assert s3["actor_zero_stage"] == 3 and s3["critic_zero_stage"] == 2 and s3["steps"] == 3
    for start, saved in ((run / "step1", run / "step3" / "actor"), (run / "step2", run / "step3" / "critic")):
        before, after = load_file(start / "model.safetensors"), load_file(saved / "model.safetensors")
        assert {k: v.shape for k, v in after.items()} == {k: v.shape for k, v in before.items()}, saved
        assert all(v.float().isfinite().all() for v in after.values()), saved
        assert any(not torch.equal(before[k], after[k]) for k in after), f"{saved} did not move"
    rows = train_rows(run / "step3")
    assert len(rows) == 3 and all(math.isfinite(r["policy_loss"]) for r in rows)
    # train.py --resume reads back the stage this run chose (each model's options under its name)
    import train

    ns = argparse.Namespace(output_dir=str(run))
    assert train.resumed_flags(3, ns, []) == ["--actor_zero_stage", "3", "--critic_zero_stage", "2"]
