"""Helpers of the benchmark scripts that decide what a failed run reports."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT

sys.path.insert(0, str(ROOT / "bench"))

import bench_hybrid_engine

# What torchrun printed when the benchmark's worker failed on an H100 (2026-11-26), shortened: the cause
# sits above torchrun's banner, whose last lines name no cause.
TORCHRUN_STDERR = """\
[rank0]: Traceback (most recent call last):
[rank0]:   File "bench/bench_hybrid_engine.py", line 62, in timed
[rank0]:     tdist.all_reduce(x, op=tdist.ReduceOp.MAX)
[rank0]: RuntimeError: No backend type associated with device type cpu
E1126 16:10:02 torch/distributed/elastic/multiprocessing/api.py:[ERROR] failed (exitcode: 1) local_rank: 0
Traceback (most recent call last):
  File "torch/distributed/run.py", line 940, in main
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
============================================================
bench_hybrid_engine.py FAILED
------------------------------------------------------------
Root Cause (first observed failure):
[0]:
  rank      : 0 (local_rank: 0)
  exitcode  : 1 (pid: 1150)
  error_file: <N/A>
  traceback : To enable traceback see: https://pytorch.org/docs/stable/elastic/errors.html
============================================================
"""


def test_a_failed_worker_is_reported_by_its_own_exception_not_torchruns_banner():
    lines = bench_hybrid_engine.failure_lines(TORCHRUN_STDERR, keep=3)
    assert lines == [
        '[rank0]:   File "bench/bench_hybrid_engine.py", line 62, in timed',
        "[rank0]:     tdist.all_reduce(x, op=tdist.ReduceOp.MAX)",
        "[rank0]: RuntimeError: No backend type associated with device type cpu",
    ]


def test_without_an_exception_line_the_end_of_stderr_is_kept():
    assert bench_hybrid_engine.failure_lines("a\nb\nc\nkilled", keep=2) == ["c", "killed"]


def test_a_bare_assertion_and_a_multi_line_message_are_found():
    stderr = (
        '[rank0]:   File "bench/bench_hybrid_engine.py", line 101, in run\n'
        "[rank0]:     assert out.shape[1] == ids.shape[1] + args.new_tokens\n"
        "[rank0]: AssertionError\n" + TORCHRUN_STDERR.split("[rank0]: RuntimeError", 1)[1].split("\n", 1)[1]
    )
    assert bench_hybrid_engine.failure_lines(stderr, keep=2) == [
        "[rank0]:     assert out.shape[1] == ids.shape[1] + args.new_tokens",
        "[rank0]: AssertionError",
    ]
    cuda = "[rank0]: torch.AcceleratorError: CUDA error: out of memory\n[rank0]: Search for cudaErrorMemory\nbanner"
    assert bench_hybrid_engine.failure_lines(cuda, keep=2) == [
        "[rank0]: torch.AcceleratorError: CUDA error: out of memory",
        "[rank0]: Search for cudaErrorMemory",
    ]


def test_the_rank_torchrun_names_as_the_root_cause_is_reported_not_a_peers_knock_on_error():
    stderr = (
        "[rank1]: Traceback (most recent call last):\n"
        "[rank1]: ValueError: the real cause\n"
        "[rank0]: Traceback (most recent call last):\n"
        "[rank0]: torch.distributed.DistBackendError: Connection reset by peer\n"
        "Root Cause (first observed failure):\n[1]:\n  rank      : 1 (local_rank: 1)\n  exitcode  : 1\n"
    )
    assert bench_hybrid_engine.failure_lines(stderr, keep=1) == ["[rank1]: ValueError: the real cause"]


def test_step1_throughput_is_reported_as_a_speed_only_when_the_run_learned():
    import bench_step1

    # a compiled run on an H100 (2026-11-27): 1.75x the tokens/s, the evaluation loss unchanged
    flat = {"eval_loss_start": 5.7833, "eval_loss_end": 5.7833}
    assert bench_step1.learning(flat) == {
        "eval_loss_start": 5.7833,
        "eval_loss_end": 5.7833,
        "learned": False,
    }
    fell = {"eval_loss_start": 5.7833, "eval_loss_end": 3.0646}
    assert bench_step1.learning(fell)["learned"] is True
    rose = {"eval_loss_start": 3.0, "eval_loss_end": 3.2}
    assert bench_step1.learning(rose)["learned"] is False
    # a run without an evaluation cannot show that it learned
    assert bench_step1.learning({})["learned"] is None


@pytest.mark.parametrize("stabiliser", [None, "dr_grpo", "kl_loss_k3"])
def test_the_alignment_benchmarks_verifier_runs_are_valid_step_3_options(stabiliser):
    """bench_alignment.py verifiable runs step 3 with the preset's flags and the verifier as the reward:
    every run it builds must pass step 3's own checks (the preset's --normalize_reward, a reward-model
    option, once made the verifier run exit at start-up)."""
    import bench_alignment

    from dschat.launch import presets
    from dschat.rlhf.models import RLHFOptions, check_options
    from tests.unit.test_ppo_trainer import step3_groups

    preset = presets.read_preset(presets.PRESETS / f"{bench_alignment.PRESET}.yaml")
    flags = presets.preset_flags(preset, 3, "/job")
    argv = bench_alignment.verifier_run(flags, ["--max_steps", "2"], stabiliser)
    argv += ["--actor_model_name_or_path", "/job/step1", "--critic_model_name_or_path", "/job/step2"]
    check_options(RLHFOptions(*step3_groups(*argv)))


@pytest.mark.parametrize(
    "flags",
    [
        [],
        ["--temperature", "0.7", "--truncation_penalty", "0.3", "--seed", "2"],
        ["--kl_in", "loss", "--kl_estimator", "k3", "--kl_coef", "0.1"],
    ],
)
def test_the_alignment_benchmarks_hh_run_is_valid_step_3_options(flags):
    """bench_alignment.py hh builds its PPO run from its own flags: the run must pass step 3's checks,
    and the flags it passes on must arrive (a dropped --temperature would optimise another policy)."""
    import bench_alignment

    from dschat.rlhf.models import RLHFOptions, check_options
    from tests.unit.test_ppo_trainer import step3_groups

    args = bench_alignment.parser().parse_args(["hh", *flags])
    argv = bench_alignment.hh_ppo_run(
        args, Path("/job/ppo"), Path("/job/rm_a"), Path("/job/rm_b"), Path("/job/a")
    )
    opts = RLHFOptions(*step3_groups(*argv))
    check_options(opts)
    assert opts.ppo.temperature == args.temperature
    assert opts.ppo.truncation_penalty == args.truncation_penalty
    assert opts.run.seed == args.seed
    assert (opts.ppo.kl_in, opts.ppo.kl_estimator, opts.ppo.kl_coef) == (
        args.kl_in,
        args.kl_estimator,
        args.kl_coef,
    )


def test_the_alignment_benchmarks_hh_run_refuses_bad_ppo_flags_before_any_work(tmp_path):
    """--kl_in loss with the default k1 is refused by step 3, which the benchmark reaches only after
    training two reward models (about 40 minutes): it must stop at once, with step 3's own line."""
    out = tmp_path / "run"
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "bench" / "bench_alignment.py"),
            "hh",
            "--kl_in",
            "loss",
            "--output_dir",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stderr
    assert "--kl_in loss with --kl_estimator k1" in proc.stderr.strip().splitlines()[-1]
    assert "Traceback" not in proc.stderr and not out.exists()


@pytest.mark.parametrize(
    ("argv", "named"), [(["verifiable", "--seed", "2"], "--seed"), (["hh", "--stabilisers"], "--stabilisers")]
)
def test_the_alignment_benchmark_refuses_an_option_of_the_other_suite(tmp_path, argv, named):
    """verifiable --seed 2 was accepted and unused: a "replicate" that reran the default seed."""
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "bench_alignment.py"), *argv, "--output_dir",
                           str(tmp_path / "run")], capture_output=True, text=True, timeout=120)  # fmt: skip
    assert proc.returncode == 2 and f"{named}: not an option of the" in proc.stderr.strip().splitlines()[-1]
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("suite", ["verifiable", "hh"])
def test_the_dpo_benchmarks_loss_flags_reach_its_dpo_run(tmp_path, monkeypatch, suite):
    """bench_dpo.py reports --sft_coef, --beta, --learning_rate and --seed in its JSON: both suites' DPO
    commands must carry them (the hh suite ran without --sft_coef while reporting it)."""
    import argparse

    import bench_dpo

    class Stop(Exception):
        pass

    seen: list[list[str]] = []

    def run(cmd):
        seen.append(cmd)
        if "step2_dpo_finetuning" in cmd[0]:
            raise Stop

    monkeypatch.setattr(bench_dpo, "run", run)
    monkeypatch.setattr(bench_dpo, "HH", tmp_path / "hh_data")  # the hh suite links the data, never reads it
    args = argparse.Namespace(suite=suite, step1=str(tmp_path / "step1"), judge=None, labeller=None, start=None,
                              learning_rate=3e-5, beta=0.2, sft_coef=0.5, seed=7, max_steps=5, lora_dim=0,
                              dpo_loss="ipo")  # fmt: skip
    with pytest.raises(Stop):
        (bench_dpo.verifiable if suite == "verifiable" else bench_dpo.hh)(args, tmp_path / "out")
    cmd = seen[-1]
    flags = {cmd[i]: cmd[i + 1] for i in range(1, len(cmd) - 1) if cmd[i].startswith("--")}
    assert (
        flags["--sft_coef"],
        flags["--beta"],
        flags["--learning_rate"],
        flags["--seed"],
        flags["--dpo_loss"],
    ) == (
        "0.5",
        "0.2",
        "3e-05",
        "7",
        "ipo",
    )


def test_lever_throughput_is_tokens_over_seconds_not_a_mean_of_window_rates():
    """After the warm-up window: 100 tokens at 100/s (1 s), then 100 tokens at 25/s (4 s): 200 tokens in
    5 s is 40 tokens/s, where the mean of the two rates says 62.5."""
    import mfu

    rows = [{"tokens": 50, "tokens_per_sec": 10.0}, {"tokens": 150, "tokens_per_sec": 100.0},
            {"tokens": 250, "tokens_per_sec": 25.0, "computed_tokens_per_sec": 50.0}]  # fmt: skip
    out = mfu.steady_rates(rows)
    assert out["real_tokens_per_sec"] == pytest.approx(200 / 5)
    assert out["computed_tokens_per_sec"] == pytest.approx((100 * 1 + 50 * 4) / 5)
    rows = [{**r, "target_fraction": f} for r, f in zip(rows, (0.9, 0.5, 0.3), strict=True)]
    assert mfu.steady_rates(rows)["target_fraction"] == pytest.approx(0.4)


def test_step_1s_lm_head_flops_count_its_answer_tokens_only():
    """Hand count: 2 layers of 10 parameters, a head of 100, top-1 layer trained, 30% answer tokens:
    forward 2 * (20 + 30), backward 4 * 10 + 2 * 30 (the head's input gradient, on the answers)."""
    import mfu

    shape = {"layers": 2, "per_layer": 10, "head": 100, "hidden": 4}
    assert mfu.flops_per_token(shape, 1, 1, target_fraction=0.3) == pytest.approx(100 + 40 + 60)
    assert mfu.flops_per_token(shape, 2, 1) == pytest.approx(2 * (20 + 4) + 40 + 2 * 4)


def test_the_step1_benchmark_counts_its_rates_and_flops_as_the_levers_benchmark():
    """bench_step1's MFU counted 6 x parameters per token (the embedding, and the head on every token) and
    averaged the windows' rates; it counts what bench_levers counts now: 200 tokens in 5 s after the
    warm-up window, full fine-tuning with 40% answer tokens."""
    import bench_step1
    import mfu

    shape = {"layers": 2, "per_layer": 10, "head": 100, "hidden": 4}
    rows = [{"split": "train", "tokens": 50, "tokens_per_sec": 10.0, "target_fraction": 0.9},
            {"split": "eval", "loss": 1.0},
            {"split": "train", "tokens": 150, "tokens_per_sec": 100.0, "target_fraction": 0.5},
            {"split": "train", "tokens": 250, "tokens_per_sec": 25.0, "target_fraction": 0.3}]  # fmt: skip
    summary = {"parameters": 1000, "dtype": "bf16", "steps": 3, "train_tokens_per_sec": 30.0}
    r = bench_step1.result("m", summary, rows, shape)
    assert r["tokens_per_sec_steady"] == pytest.approx(40.0)
    flops = mfu.flops_per_token(shape, 1, "all", 0.4)
    assert flops == pytest.approx(2 * (20 + 40) + 4 * 20 + 2 * 40)
    assert r["model_gflops_per_token"] == pytest.approx(flops / 1e9)
    assert r["model_tflops_per_sec"] == pytest.approx(flops * 40.0 / 1e12)


def test_the_hh_halves_keep_each_conversation_in_one_half():
    """Pairs from one conversation at different turns open with the same human turn: the judge's half
    must hold none of the policy's conversations. x opens in a; y, then z, go to b, the half with fewer
    rows at the time; later turns follow their conversation."""
    import json

    import hh_judge

    def row(first: str, later: str = "") -> str:
        p = (
            f"\n\nHuman: {first}"
            + (f"\n\nAssistant: ok\n\nHuman: {later}" if later else "")
            + "\n\nAssistant:"
        )
        return json.dumps({"prompt": p, "chosen": " c", "rejected": " r"}) + "\n"

    rows = [row("x"), row("y"), row("x", "more"), row("z"), row("x", "again"), row("y", "more")]
    a, b = hh_judge.split_by_conversation(rows)
    assert a == [rows[0], rows[2], rows[4]] and b == [rows[1], rows[3], rows[5]]
    firsts = [{json.loads(r)["prompt"].split("\n\n")[1] for r in half} for half in (a, b)]
    assert not firsts[0] & firsts[1]


def test_a_reward_model_given_to_an_hh_benchmark_must_have_trained_on_its_half(tmp_path):
    """--reward_models A B, --judge and --labeller were taken on trust: A given as the judge (or a judge
    trained on the policy's half) would judge with what the policy learned from. Each must record the
    half of this benchmark's split it trained on."""
    import json

    import hh_judge

    if not (hh_judge.HH / "train.jsonl").is_file():
        pytest.skip("HH data not present")
    halves = hh_judge.hh_halves(tmp_path / "run")
    models = {}
    for name, data in (("a", halves["a"]), ("b", halves["b"]), ("whole", hh_judge.HH)):
        models[name] = tmp_path / f"rm_{name}"
        models[name].mkdir()
        (models[name] / "dschat_config.json").write_text(json.dumps({"data_path": [str(data)]}))
    assert hh_judge.trained_half_problem(models["a"], "a") is None
    assert hh_judge.trained_half_problem(models["b"], "b") is None
    assert "not on half b of the HH pairs" in hh_judge.trained_half_problem(models["a"], "b")
    assert "not on half a" in hh_judge.trained_half_problem(models["whole"], "a")
    (tmp_path / "plain").mkdir()
    assert "cannot tell which half" in hh_judge.trained_half_problem(tmp_path / "plain", "b")
    # through the benchmark's command line, before any work
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "bench_alignment.py"), "hh", "--reward_models",
                           str(models["a"]), str(models["a"]), "--output_dir", str(tmp_path / "out")],
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert proc.returncode == 2 and "--reward_models" in proc.stderr.strip().splitlines()[-1]
    assert "not on half b" in proc.stderr and not (tmp_path / "out").exists()


@pytest.mark.parametrize("flag", [["--trainable_layers", "4"], ["--lora_dim=8"]])
def test_the_step1_benchmark_refuses_frozen_layers_its_mfu_would_overstate(flag):
    """Its MFU is 6 x parameters x tokens/s: with the bottom layers frozen (or LoRA) their backward is not
    run, and the MFU it printed counted it anyway."""
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "bench_step1.py"), *flag, "--steps", "1"],
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert proc.returncode == 2 and "bench_levers.py" in proc.stderr.strip().splitlines()[-1]


def test_lever_speedups_are_against_the_same_steps_baseline():
    """Every lever's speedup was over step 1's full_bf16, the reward model's step-2 levers too: a pair of
    HH answers against an SFT row. Each step's levers now compare with that step's plain run."""
    import bench_levers

    results = [
        {"lever": "full_bf16", "step": 1, "real_tokens_per_sec": 100.0},
        {"lever": "top8_bf16", "step": 1, "real_tokens_per_sec": 300.0},
        {"lever": "rm_top8_bf16", "step": 2, "real_tokens_per_sec": 500.0},
        {"lever": "rm_top8_bf16_grouped_shared", "step": 2, "real_tokens_per_sec": 750.0},
        {"lever": "lora_all_bf16", "error": "x"},
    ]
    bench_levers.add_speedups(results)
    assert [(r.get("speedup"), r.get("speedup_over")) for r in results] == [
        (1.0, "full_bf16"), (3.0, "full_bf16"), (1.0, "rm_top8_bf16"), (1.5, "rm_top8_bf16"), (None, None)
    ]  # fmt: skip
    step2_only = [dict(results[3])]
    step2_only[0].pop("speedup"), step2_only[0].pop("speedup_over")
    bench_levers.add_speedups(step2_only)  # no step-2 baseline ran: no speedup, not step 1's
    assert "speedup" not in step2_only[0]


def test_throughput_runs_the_harness_flagged_stay_out_of_the_ratio():
    """A run of ours that kept fewer rows than the workload (another workload) was averaged into the ratio
    against DeepSpeed-Chat beside the harness's own warning."""
    import bench_throughput

    def rec(fw: str, tps: float, **kw) -> dict:
        return {"framework": fw, "stage": "sft", "status": "ok", "tokens_per_s": tps, **kw}

    records = [
        rec("ours", 130.0),
        rec("ours", 400.0, warning="ours kept 300 of 512 rows"),
        rec("dschat", 100.0),
    ]
    sft = bench_throughput.summarize(records, ["ours", "dschat"])["sft"]
    assert sft["ours"]["per_repeat"] == [130.0] and sft["ratio"] == 1.3 and sft["target_met"]
