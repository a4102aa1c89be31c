"""Deployment types on CPU (gloo) through train.py: two simulated nodes on loopback (torchrun rendezvous,
node-local storage) against one process, a rank that dies mid-run, and all three steps on two ranks."""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time

import pytest
import torch
from safetensors.torch import load_file

from tests.conftest import ROOT, cpu_ranks_env
from tests.integration.helpers import (
    REFERENCE_1RANK,
    REFERENCE_RUN_FLAGS,
    assert_ok,
    resolved_config,
    step1,
    summary,
    train_losses,
    train_py,
)

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="two CPU ranks need two cores"),
]


def test_two_simulated_nodes_match_one_process(tmp_path):
    """Two train.py invocations, node ranks 0 and 1, rendezvous over 127.0.0.1 (what a SLURM or Kubernetes
    job runs on each node), ZeRO-3 and one rank per node, give the loss curve of one process that takes
    the same 16 samples per step as 8 x 2 accumulation. Each "node" has its own working directory, so the
    relative --output-dir is a different directory per node, as without a shared filesystem: with
    --node-local-storage each node holds its own rank's checkpoint shards and its copy of the model."""
    from dschat.utils.dist import free_port

    ref = tmp_path / "one"
    assert_ok(step1(ref, *REFERENCE_1RANK, "--zero_stage", "3"))

    port = str(free_port())
    # one core per "node"
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", **cpu_ranks_env()}
    env.pop("RANK", None)
    env.pop("WORLD_SIZE", None)
    procs = []
    for node in (0, 1):
        cwd = tmp_path / f"node{node}"
        cwd.mkdir()
        cmd = [sys.executable, str(ROOT / "train.py"), "--step", "1", "--deployment-type", "multi_node",
               "--launcher", "torchrun", "--nnodes", "2", "--node-rank", str(node), "--master-addr", "127.0.0.1",
               "--master-port", port, "--num-gpus", "1", "--actor-zero-stage", "3", "--actor-model",
               "builtin:micro-llama", "--output-dir", "out", "--node-local-storage",
               "--", *REFERENCE_RUN_FLAGS, "--save_steps", "10"]  # fmt: skip
        procs.append(subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      text=True))  # fmt: skip
    outs = [p.communicate(timeout=900)[0] for p in procs]
    for p, out in zip(procs, outs):
        assert p.returncode == 0, out[-5000:]
    launch = next(line for line in outs[1].splitlines() if line.startswith("==> step 1 ("))
    assert "torch.distributed.run --nnodes 2 --nproc_per_node 1 --node_rank 1" in launch

    two = [tmp_path / f"node{n}" / "out" / "step1" for n in (0, 1)]
    cfg = resolved_config(two[0])
    assert cfg["world_size"] == 2 and cfg["global_batch_size"] == 16 and cfg["node_local_storage"] is True
    ref_losses, got = train_losses(ref), train_losses(two[0])
    assert sorted(got) == sorted(ref_losses) == list(range(1, 21))
    for step, loss in ref_losses.items():
        assert got[step] == pytest.approx(loss, rel=2e-2), f"step {step}"
    assert summary(two[0])["eval_loss_end"] == pytest.approx(summary(ref)["eval_loss_end"], rel=5e-3)

    # node-local storage: each node's checkpoint holds its own rank's ZeRO-3 shards and RNG state only
    for node, d in enumerate(two):
        ckpt = d / "checkpoints"
        assert (ckpt / "latest").read_text().strip() == "step10"
        names = {p.name for p in (ckpt / "step10").iterdir()}
        other = 1 - node
        assert f"zero_pp_rank_{node}_mp_rank_00_optim_states.pt" in names, names
        assert f"rng_rank{node}.pt" in names
        assert not [n for n in names if f"rank_{other}_" in n or f"rank{other}." in n], names
    # ... and the finished run (summary, exported model) on both nodes, with the same weights
    assert summary(two[1])["steps"] == 20
    a, b = load_file(str(two[0] / "model.safetensors")), load_file(str(two[1] / "model.safetensors"))
    assert set(a) == set(b) and all((a[k] == b[k]).all() for k in a)
    # node 0 writes training.log, node 1 its own log, both the full output of their torchrun
    assert (two[0] / "training.log").exists() and (two[1] / "training.node1.log").exists()


def test_a_rank_that_dies_ends_the_job_naming_it(tmp_path):
    """Rank 1 exits abruptly (os._exit, like an OOM kill) after 3 steps: rank 0 is blocked in a gloo
    collective; the launcher must end the job within seconds, non-zero, and train.py must name rank 1."""
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
    assert last.startswith("error: step 1 (supervised fine-tuning) failed with exit code 13"), proc.stderr[
        -3000:
    ]
    # The killed rank is named alone, or with the peer whose collective failed in the same 20 ms poll.
    assert ("rank 1 (pid" in last and "ended first" in last) or (
        "ranks 0 (pid" in last and ", 1 (pid" in last and "ended within 20 ms" in last
    ), last
    assert not (tmp_path / "step1" / "summary.json").exists()
    # start-up and 3 steps take ~20 s on 2 cores; without the launcher ending it, rank 0 would wait for the
    # 60 s collective timeout at least
    assert elapsed < 120, elapsed


def test_all_three_steps_on_two_ranks_through_train_py(tmp_path):
    """single_node with 2 CPU processes (the DeepSpeed launcher) runs steps 1, 2 and 3 in one job, step 3
    with ZeRO-3 actor and critic; per-step flags come from a preset file given by path."""
    preset = tmp_path / "two-ranks.yaml"
    preset.write_text(
        "model: builtin:micro-llama\n"
        "deployment_type: single_node\n"
        "step1: {--max_steps: 5, --per_device_train_batch_size: 8, --eval_interval: 0, --max_eval_samples: 32,"
        " --eval_generation_samples: 0}\n"
        "step2: {--max_steps: 5, --per_device_train_batch_size: 8, --eval_interval: 0, --max_eval_samples: 32}\n"
        "step3: {--max_steps: 3, --per_device_generation_batch_size: 8, --per_device_training_batch_size: 4,"
        " --max_answer_seq_len: 8, --max_prompt_seq_len: 96, --eval_prompts: 8, --eval_interval: 0,"
        " --actor_zero_stage: 3, --critic_zero_stage: 3}\n"
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
    # Step 3 under ZeRO-3 on both ranks. Results, not echoed flags: the partitioned actor and critic were
    # gathered whole for saving (every tensor has its start's shape and is finite), and both moved.
    run = tmp_path / "out"
    s3 = json.loads((run / "step3" / "summary.json").read_text())
    assert s3["actor_zero_stage"] == 3 and s3["steps"] == 3
    for start, saved in ((run / "step1", run / "step3" / "actor"), (run / "step2", run / "step3" / "critic")):
        before, after = load_file(start / "model.safetensors"), load_file(saved / "model.safetensors")
        assert {k: v.shape for k, v in after.items()} == {k: v.shape for k, v in before.items()}, saved
        assert all(v.float().isfinite().all() for v in after.values()), saved
        assert any(not torch.equal(before[k], after[k]) for k in after), f"{saved} did not move"
    rows = [json.loads(x) for x in (run / "step3" / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if r["split"] == "train"]
    assert len(rows) == 3 and all(math.isfinite(r["policy_loss"]) for r in rows)
    # train.py --resume reads back the stage this run chose (each model's options under its name)
    import train

    choice = train.resumed_choice(3, argparse.Namespace(output_dir=str(run)))
    assert (choice.zero_stage, choice.offload, choice.gradient_checkpointing) == (3, False, False)
