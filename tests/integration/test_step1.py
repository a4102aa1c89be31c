"""Step 1 (SFT) run for real on the built-in micro Llama: ZeRO stages, several ranks (one node, two simulated
nodes), resume, LoRA, offload, the orchestrator and the data cache. Every run is a subprocess of the real
entry point."""

from __future__ import annotations

import json
import math
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT, cpu_ranks_env
from tests.integration.helpers import (
    FAST,
    MICRO,
    REFERENCE_1RANK,
    REFERENCE_RUN_FLAGS,
    assert_ok,
    base_weights,
    error_line,
    eval_losses,
    exported_eval_loss,
    metrics,
    resolved_config,
    step1,
    summary,
    train_losses,
    train_py,
)


@pytest.fixture(scope="module")
def reference_run(tmp_path_factory):
    """``reference_run(stage)``: output dir of a finished 20-step fp32 run at that ZeRO stage (one rank,
    batch 8 x 2 accumulation, a train row per step), run once per module and shared by the tests."""
    runs: dict[int, tuple[Path, object]] = {}

    def get(stage: int) -> Path:
        if stage not in runs:
            out = tmp_path_factory.mktemp(f"zero{stage}") / "run"
            runs[stage] = (out, step1(out, *REFERENCE_1RANK, "--zero_stage", str(stage)))
        out, proc = runs[stage]
        assert_ok(proc)
        return out

    return get


# ---------------------------------------------------------------- 1. every ZeRO stage trains and exports
@pytest.mark.parametrize("stage", [0, 2, 3])
def test_zero_stage_trains_and_exports_a_loadable_model(reference_run, stage):
    out = reference_run(stage)
    s = summary(out)
    assert s["zero_stage"] == stage and s["steps"] == 20 and s["world_size"] == 1 and s["dtype"] == "fp32"
    assert s["eval_loss_end"] < s["eval_loss_start"] - 0.3, s
    assert s["eval_perplexity_end"] < s["eval_perplexity_start"]
    assert s["eval_perplexity_end"] == pytest.approx(math.exp(s["eval_loss_end"]), rel=1e-9)
    assert s["train_tokens_per_sec"] > 0 and s["wall_seconds"] > 0

    # metrics.jsonl agrees with the summary: the first and the last eval rows are the start and the end.
    evals = eval_losses(out)
    assert evals[0] == (0, pytest.approx(s["eval_loss_start"], rel=1e-12))
    assert evals[-1] == (20, pytest.approx(s["eval_loss_end"], rel=1e-12))
    assert all("perplexity" in r for r in metrics(out) if r["split"] == "eval" and "loss" in r)
    losses = train_losses(out)
    assert sorted(losses) == list(range(1, 21))
    assert all(math.isfinite(v) for v in losses.values())
    assert losses[20] < losses[1]

    cfg = resolved_config(out)
    assert cfg["global_batch_size"] == 16 and cfg["world_size"] == 1 and cfg["zero_stage"] == stage

    # The exported directory is an ordinary Hugging Face model whose forward reproduces the run's own
    # final eval loss (so the export holds the trained weights, gathered whole under ZeRO-3).
    assert json.loads((out / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]
    assert exported_eval_loss(out) == pytest.approx(s["eval_loss_end"], rel=1e-4)


# ---------------------------------------------------------------- 2. ZeRO-3 = ZeRO-0
def test_zero3_and_zero2_follow_the_zero0_loss_curve(reference_run):
    ref = train_losses(reference_run(0))
    for stage in (2, 3):
        other = train_losses(reference_run(stage))
        assert sorted(other) == sorted(ref)
        for step, loss in ref.items():
            assert other[step] == pytest.approx(loss, rel=1e-3), f"ZeRO-{stage} step {step}"
        assert summary(reference_run(stage))["eval_loss_end"] == pytest.approx(
            summary(reference_run(0))["eval_loss_end"], rel=1e-4
        )


# ---------------------------------------------------------------- 2b. accumulation = a bigger micro-batch
def test_accumulation_follows_the_loss_curve_of_one_micro_batch_of_the_whole_step(tmp_path):
    """8 x 2 accumulation vs one micro-batch of 16, the same 16 samples per step, on answers of 1 to 48
    words: the step's loss is the mean over all its target tokens, so the curves agree to float rounding.
    With the mean of the two micro-batches' means (a token weighted by how few share its micro-batch) they
    differed from the first step on."""
    data = tmp_path / "mixed.jsonl"
    words = ["one", "two", "three", "four", "five", "six", "seven", "eight"]
    rows = [{"prompt": f"\n\nHuman: count {i}\n\nAssistant:", "response": " " + " ".join(words[j % 8] for j in range(1 + (i * 7) % 48))}
            for i in range(160)]  # fmt: skip
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    # --no_group_by_length: batches of mixed lengths (grouped ones hold answers of about one length)
    flags = [*MICRO, *REFERENCE_RUN_FLAGS, "--data_path", str(data), "--data_split", "1,0,0", "--max_steps", "4",
             "--no_group_by_length"]  # fmt: skip
    runs = {}
    for name, split in (
        ("8x2", ["--gradient_accumulation_steps", "2"]),
        ("16", ["--per_device_train_batch_size", "16"]),
    ):
        assert_ok(step1(tmp_path / name, *flags, *split))
        runs[name] = train_losses(tmp_path / name)
    assert sorted(runs["16"]) == sorted(runs["8x2"]) == [1, 2, 3, 4]
    for step, loss in runs["16"].items():
        assert runs["8x2"][step] == pytest.approx(loss, rel=1e-6), f"step {step}"
    # each row's lr is the rate its step used: the first the full rate (no warm-up), the last above 0
    lrs = [r["lr"] for r in metrics(tmp_path / "16") if r["split"] == "train"]
    lr = json.loads((tmp_path / "16" / "dschat_config.json").read_text())["learning_rate"]
    assert lrs[0] == pytest.approx(lr) and lrs[-1] > 0


# ---------------------------------------------------------------- 3. two ranks = one rank at the same global batch
@pytest.mark.slow
@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="two CPU ranks need two cores")
def test_two_ranks_zero3_match_one_rank_with_accumulation(reference_run, tmp_path):
    """2 ranks x batch 8 (gloo, through train.py and the DeepSpeed launcher) vs 1 rank x batch 8 x 2
    accumulation: the sampler gives both the same 16 samples per step (rank r takes every 2nd index of
    the shuffled order, one rank takes them in a row), so the loss curves agree up to float rounding (the
    loss is the mean over the step's target tokens on both ranks)."""
    one = reference_run(3)
    proc = train_py(
        "--step", "1", "--deployment-type", "single_node", "--num-gpus", "2", "--actor-zero-stage", "3",
        "--actor-model", "builtin:micro-llama", "--output-dir", str(tmp_path), "--", *REFERENCE_RUN_FLAGS,
        env=cpu_ranks_env(),
    )  # fmt: skip
    assert_ok(proc)
    two = tmp_path / "step1"
    launch = next(line for line in proc.stdout.splitlines() if line.startswith("==> step 1 ("))
    assert "deepspeed.launcher.runner" in launch and "--num_gpus 2" in launch and "--zero_stage 3" in launch

    cfg = resolved_config(two)
    assert cfg["world_size"] == 2 and cfg["global_batch_size"] == 16
    assert summary(two)["world_size"] == 2 and summary(two)["zero_stage"] == 3
    ref, got = train_losses(one), train_losses(two)
    assert sorted(got) == sorted(ref) == list(range(1, 21))
    for step, loss in ref.items():
        assert got[step] == pytest.approx(loss, rel=1e-4), f"step {step}"
    # Same starting weights, same eval set split over ranks: identical up to summation order.
    assert summary(two)["eval_loss_start"] == pytest.approx(summary(one)["eval_loss_start"], rel=1e-6)
    assert summary(two)["eval_loss_end"] == pytest.approx(summary(one)["eval_loss_end"], rel=5e-3)


# ---------------------------------------------------------------- 3b. two simulated nodes = one rank
@pytest.mark.slow
@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="two CPU ranks need two cores")
def test_two_simulated_nodes_match_one_process(reference_run, tmp_path):
    """Two train.py invocations, node ranks 0 and 1, rendezvous over 127.0.0.1 (what a SLURM or Kubernetes
    job runs on each node), ZeRO-3 and one rank per node, give the loss curve of one process that takes
    the same 16 samples per step as 8 x 2 accumulation. Each "node" has its own working directory, so the
    relative --output-dir is a different directory per node, as without a shared filesystem: with
    --node-local-storage each node holds its own rank's checkpoint shards and its copy of the model."""
    from safetensors.torch import load_file

    from dschat.utils.dist import free_port

    ref = reference_run(3)
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
        assert got[step] == pytest.approx(loss, rel=1e-4), f"step {step}"
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


# ---------------------------------------------------------------- 4. resume after a kill is exact
def test_resume_after_interruption_is_bit_identical(reference_run, tmp_path):
    from safetensors.torch import load_file

    from dschat.engine.checkpoint import latest_tag

    ref = reference_run(3)
    out = tmp_path / "run"
    flags = [*REFERENCE_1RANK, "--zero_stage", "3", "--save_steps", "10"]

    # Killed 3 steps after the step-10 checkpoint (rows 11-13 logged): no summary, a complete checkpoint
    # named by `latest`.
    proc = step1(out, *flags, env={"DSCHAT_TEST_KILL_RANK": "0", "DSCHAT_TEST_KILL_AT_STEP": "13"})
    assert proc.returncode == 13, proc.stderr[-3000:]
    assert max(train_losses(out)) == 13
    assert not (out / "summary.json").exists()
    ckpt = out / "checkpoints"
    assert latest_tag(ckpt) == "step10"
    assert not [p.name for p in ckpt.iterdir() if p.name.startswith(".tmp-")]

    # Rerunning without --resume is refused (and does not clobber the checkpoint).
    line = error_line(step1(out, *flags, in_process=True), str(out), "--resume")
    assert "--overwrite" in line
    assert latest_tag(ckpt) == "step10"

    assert_ok(step1(out, *flags, "--resume"))
    s = summary(out)
    assert s["resumed_from_step"] == 10 and s["steps"] == 20

    # Bit-identical to the uninterrupted run, and so is everything computed from the weights.
    a, b = load_file(str(ref / "model.safetensors")), load_file(str(out / "model.safetensors"))
    assert set(a) == set(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, k
        assert float((a[k] - b[k]).abs().max()) == 0.0, k
    assert s["eval_loss_end"] == summary(ref)["eval_loss_end"]
    # The start is the run's, not the resume's (the resumed run used to re-measure it at step 10).
    assert s["eval_loss_start"] == summary(ref)["eval_loss_start"]
    assert s["eval_perplexity_start"] == summary(ref)["eval_perplexity_start"]
    # metrics.jsonl is appended: the interrupted run's rows after its checkpoint (11-13) are dropped, so
    # steps 1..20 once each (train_losses fails on a repeat), and the resumed steps equal the reference's;
    # the evaluations at the same steps (no extra one at the resume).
    got, want = train_losses(out), train_losses(ref)
    assert sorted(got) == list(range(1, 21))
    for step in range(1, 21):
        assert got[step] == pytest.approx(want[step], rel=1e-6), step
    assert [step for step, _ in eval_losses(out)] == [step for step, _ in eval_losses(ref)]

    # Finished: --resume is refused now (so is a plain rerun: test_bad_inputs), the run is left alone.
    error_line(step1(out, *flags, "--resume", in_process=True), str(out), "--overwrite")
    assert summary(out) == s


# ---------------------------------------------------------------- 5. checkpoints are atomic
class _FakeEngine:
    """Writes what DeepSpeed's save_checkpoint would into ``save_dir/tag``; ``die=True`` stops half way."""

    def __init__(self, die: bool = False):
        self.die = die

    def save_checkpoint(self, save_dir, tag, client_state=None, save_latest=True):
        assert not save_latest  # `latest` is dschat's to write, after the directory is complete
        d = Path(save_dir) / tag
        d.mkdir(parents=True, exist_ok=True)
        (d / "mp_rank_00_model_states.pt").write_bytes(b"model")
        if self.die:
            raise KeyboardInterrupt("killed mid-save")
        (d / "zero_pp_rank_0_mp_rank_00_optim_states.pt").write_bytes(b"optim")


def test_checkpoint_killed_mid_save_leaves_latest_on_the_previous_one(tmp_path):
    from dschat.engine.checkpoint import latest_tag, save_checkpoint

    root = tmp_path / "checkpoints"
    assert latest_tag(root) is None  # nothing saved yet
    save_checkpoint(_FakeEngine(), root, 10, {"step": 10})
    assert latest_tag(root) == "step10"

    with pytest.raises(KeyboardInterrupt):
        save_checkpoint(_FakeEngine(die=True), root, 20, {"step": 20})
    assert latest_tag(root) == "step10"
    assert not (root / "step20").exists()
    assert {"mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt"} <= {
        p.name for p in (root / "step10").iterdir()
    }

    # A stray half-written directory from an earlier kill changes nothing either.
    (root / ".tmp-step99").mkdir()
    (root / ".tmp-step99" / "mp_rank_00_model_states.pt").write_bytes(b"half")
    assert latest_tag(root) == "step10"

    # The next save replaces the leftover temporary directory and keeps the newest `keep`.
    save_checkpoint(_FakeEngine(), root, 20, {"step": 20}, keep=2)
    save_checkpoint(_FakeEngine(), root, 30, {"step": 30}, keep=2)
    assert latest_tag(root) == "step30"
    assert sorted(p.name for p in root.iterdir() if p.name.startswith("step")) == ["step20", "step30"]
    assert not (root / ".tmp-step20").exists() and not (root / ".tmp-step30").exists()


def test_latest_naming_a_missing_or_foreign_directory_is_no_checkpoint(tmp_path):
    from dschat.engine.checkpoint import latest_tag

    root = tmp_path / "checkpoints"
    (root / "step10").mkdir(parents=True)
    for text in ("step99\n", ".tmp-step10\n", "../step10\n", "", "step10/../step10"):
        (root / "latest").write_text(text)
        assert latest_tag(root) is None, repr(text)
    (root / "latest").write_text("step10\n")
    assert latest_tag(root) == "step10"


# ---------------------------------------------------------------- 6. LoRA
def test_lora_zero3_exports_a_plain_merged_model(tmp_path):
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, LlamaForCausalLM

    out = tmp_path / "run"
    # Default dtype (bf16 where the CPU has it): LoRA matrices created after zero.Init must be aligned.
    assert_ok(step1(out, *FAST, "--max_steps", "20", "--zero_stage", "3", "--lora_dim", "4"))
    s = summary(out)
    assert s["lora_dim"] == 4 and s["zero_stage"] == 3 and s["skipped_steps"] == 0
    assert s["eval_loss_end"] < s["eval_loss_start"] - 0.3, s

    weights = load_file(str(out / "model.safetensors"))
    base = base_weights(out)
    assert not [k for k in weights if "lora" in k]
    assert set(weights) == set(base)
    assert any(not (weights[k].float() == base[k].float()).all() for k in weights)
    model = AutoModelForCausalLM.from_pretrained(out)
    assert type(model) is LlamaForCausalLM
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([[1, 40, 41, 42]])).logits
    assert logits.shape[-1] == model.config.vocab_size and bool(logits.isfinite().all())


def test_only_optimize_lora_changes_only_the_lora_targets(tmp_path):
    from safetensors.torch import load_file

    out = tmp_path / "run"
    flags = [*FAST, "--max_steps", "20", "--dtype", "fp32", "--lora_dim", "4", "--only_optimize_lora"]
    assert_ok(step1(out, *flags))
    s = summary(out)
    assert s["eval_loss_end"] < s["eval_loss_start"], s

    weights, base = load_file(str(out / "model.safetensors")), base_weights(out)
    assert set(weights) == set(base)
    # --lora_module_name "layers." targets the Linear layers inside the decoder blocks; everything else
    # (embeddings, norms, lm_head) is frozen and must come out bit-identical.
    targets = [k for k in base if ".layers." in k and k.endswith("_proj.weight")]
    frozen = [k for k in base if k not in targets]
    assert targets and frozen
    for k in frozen:
        assert (weights[k] == base[k]).all(), f"frozen {k} changed"
    for k in targets:
        assert not (weights[k] == base[k]).all(), f"LoRA target {k} unchanged (LoRA not merged?)"


# ---------------------------------------------------------------- 7. ZeRO-Offload
@pytest.mark.slow
def test_zero2_offload_trains(tmp_path):
    """Optimizer states in CPU memory with DeepSpeedCPUAdam (JIT-built on first use, then cached)."""
    out = tmp_path / "run"
    assert_ok(step1(out, *FAST, "--max_steps", "10", "--zero_stage", "2", "--offload"))
    s = summary(out)
    assert resolved_config(out)["offload"] is True
    assert s["steps"] == 10 and s["eval_loss_end"] < s["eval_loss_start"], s


# ---------------------------------------------------------------- 7b. updates DeepSpeed skips
def test_a_run_whose_every_update_is_skipped_warns_and_stops_with_one_line(tmp_path):
    """A learning rate of 1e30: the first update throws the weights to about 1e30, bf16's matmuls then
    overflow, every later gradient is NaN and DeepSpeed skips every later step (and the schedule), silently
    in bf16, where no loss scale falls. Each skip is a warning naming the optimizer step; 8 in a row stop
    the run with one line, not a run that "finishes" having learned nothing."""
    from dschat.engine.core import bf16_supported

    if not bf16_supported():
        pytest.skip("bf16 not supported on this CPU")
    proc = step1(tmp_path / "run", *FAST, "--dtype", "bf16", "--learning_rate", "1e30", "--max_steps", "30",
                 "--log_interval", "1")  # fmt: skip
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    (line,) = [x for x in proc.stderr.splitlines() if "error:" in x]  # the progress bar shares stderr
    assert (
        "optimizer step 9: the model's last 8 updates were all skipped" in line and "--learning_rate" in line
    )
    logs = proc.stdout + proc.stderr
    assert "optimizer step 2: DeepSpeed skipped the model's update" in logs
    assert "1 skipped so far" in logs and "8 skipped so far" in logs


def test_fp32_without_zero_stops_at_the_first_update_that_left_the_weights_not_finite(tmp_path):
    """fp32 at ZeRO-0: DeepSpeed gives the step to the bare torch optimizer, which checks nothing, and an
    inf/NaN gradient is applied (no skip to count): the run stopped nowhere, its losses NaN. Now the
    weights are checked after each step and the first that leaves them not finite stops the run."""
    proc = step1(tmp_path / "run", *FAST, "--dtype", "fp32", "--learning_rate", "1e30", "--max_steps", "30",
                 "--log_interval", "1")  # fmt: skip
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    (line,) = [x for x in proc.stderr.splitlines() if "error:" in x]
    assert "the model's weights are no longer finite" in line and "fp32 without ZeRO" in line, line
    step = int(line.split("optimizer step ")[1].split(":")[0])
    assert step <= 3, line  # the first update throws the weights to ~1e30, the next forward overflows


# ---------------------------------------------------------------- 8. train.py end to end
def test_train_py_runs_step1_and_captures_its_output(tmp_path):
    from transformers import AutoModelForCausalLM

    proc = train_py(
        "--step", "1", "--actor-model", "builtin:micro-llama", "--output-dir", str(tmp_path),
        "--", "--max_steps", "10", *FAST[2:],
    )  # fmt: skip
    assert_ok(proc)
    out = tmp_path / "step1"
    launch = [line for line in proc.stdout.splitlines() if line.startswith("==> step 1 (")]
    assert len(launch) == 1
    cmd = shlex.split(launch[0].split(": ", 1)[1])
    assert cmd[1].endswith("training/step1_supervised_finetuning/main.py")
    assert cmd[cmd.index("--output_dir") + 1] == str(out)
    assert cmd[cmd.index("--model_name_or_path") + 1] == "builtin:micro-llama"
    assert cmd[-len(FAST[2:]) - 2 :] == ["--max_steps", "10", *FAST[2:]]
    assert f"==> step 1 done: {out}" in proc.stdout

    log = (out / "training.log").read_text()
    assert log.startswith(f"$ {shlex.join(cmd)}\n")
    # The child's own output is in the log exactly once (it does not also write the file itself).
    assert log.count("INFO done: eval perplexity") == 1
    assert "INFO done: eval perplexity" in proc.stdout
    assert summary(out)["steps"] == 10
    model = AutoModelForCausalLM.from_pretrained(out)
    assert model.config.hidden_size == 64


# ---------------------------------------------------------------- 9. tokenized-data cache
def test_second_identical_run_hits_the_data_cache_and_overwrite_replaces_the_run(tmp_path):
    cache = tmp_path / "data-cache"
    out = tmp_path / "run"
    flags = [
        *MICRO,
        *FAST[2:],
        "--max_steps",
        "5",
        "--data_path",
        "builtin:add",
        "--data_output_path",
        str(cache),
    ]
    assert_ok(step1(out, *flags))
    first = resolved_config(out)
    assert first["data_cache_hit"] is False
    assert len(list(cache.glob("*.pt"))) == 1
    start = summary(out)["eval_loss_start"]

    assert_ok(step1(out, *flags, "--overwrite"))
    second = resolved_config(out)
    assert second["data_cache_hit"] is True
    assert second["data"] == first["data"]
    assert summary(out)["eval_loss_start"] == start
    # --overwrite started over: one run's rows in metrics.jsonl, not two.
    assert [step for step, _ in eval_losses(out)] == [0, 5]


# ---------------------------------------------------------------- 6b. training only the top layers
def test_trainable_layers_zero3_equals_zero0_and_freezes_the_rest(tmp_path):
    """--trainable_layers 1 on the 2-layer micro Llama: layer 0 and the embeddings (and, untied, the LM
    head) come out bit-identical, layer 1 and the final norm change; ZeRO-3 follows ZeRO-0 step by step.
    (LoRA inside the top layers only: tests/unit/test_layers.py.)"""
    from safetensors.torch import load_file

    flags = [*REFERENCE_RUN_FLAGS, *MICRO, "--max_steps", "8", "--trainable_layers", "1"]
    runs = {}
    for stage in (0, 3):
        runs[stage] = tmp_path / f"z{stage}"
        assert_ok(step1(runs[stage], *flags, "--zero_stage", str(stage)))
    ref, z3 = train_losses(runs[0]), train_losses(runs[3])
    assert sorted(ref) == sorted(z3) and ref[8] < ref[1]
    for step, loss in ref.items():
        assert z3[step] == pytest.approx(loss, rel=1e-3), f"step {step}"
    for run in runs.values():
        weights, base = load_file(str(run / "model.safetensors")), base_weights(run)
        frozen = [k for k in base if ".layers.0." in k or "embed_tokens" in k or "lm_head" in k]
        trained = [k for k in base if ".layers.1." in k and k.endswith("_proj.weight")] + [
            "model.norm.weight"
        ]
        for k in frozen:
            assert (weights[k] == base[k]).all(), f"frozen {k} changed"
        for k in trained:
            assert not (weights[k] == base[k]).all(), f"{k} did not train"
