"""Step 3 (PPO) on real DeepSpeed, CPU, tiny models: the reward rises on an easy rule-based reward, an
interrupted run resumes to the same result, bad input is refused. (ZeRO-3 on two ranks: the three steps
on two ranks in tests/integration/test_deployment.py.)"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from safetensors.torch import load_file

from tests.conftest import ROOT, run_cmd, run_entry
from tests.integration.helpers import assert_ok, error_line, train_rows

STEP3 = ROOT / "training" / "step3_rlhf_finetuning" / "main.py"
STEP2 = ROOT / "training" / "step2_reward_model_finetuning" / "main.py"
EASY = ["--reward_fn", "tests.integration.reward_fns:ascii_first"]
PPO = ["--per_device_generation_batch_size", "16", "--per_device_training_batch_size", "16",
       "--max_answer_seq_len", "12", "--max_prompt_seq_len", "96", "--eval_prompts", "16", "--eval_interval", "0"]  # fmt: skip


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> tuple[str, Path]:
    """(actor: the micro built-in LM, critic/reward: a briefly trained micro reward model)."""
    from dschat.models.builtin import materialize

    rm = tmp_path_factory.mktemp("s3") / "step2"
    assert_ok(run_cmd([str(STEP2), "--output_dir", str(rm), "--model_name_or_path", "builtin:micro-llama",
                       "--max_steps", "5", "--max_eval_samples", "32", "--eval_interval", "0"]))  # fmt: skip
    return materialize("builtin:micro-llama"), rm


def step3(
    out: Path,
    actor: str,
    critic: Path,
    *flags: str,
    env: dict | None = None,
    in_process: bool = False,
):
    args = ["--output_dir", str(out), "--actor_model_name_or_path", actor, "--critic_model_name_or_path",
            str(critic), *PPO, *flags]  # fmt: skip
    env = {"PYTHONPATH": str(ROOT), **(env or {})}  # a new process imports the reward functions under tests/
    return run_entry(STEP3, args, env=env, in_process=in_process)


@pytest.mark.slow  # 40 rounds: half a minute; marked so that its module starts early under xdist
def test_ppo_raises_an_easy_rule_based_reward(models, tmp_path):
    actor, rm = models
    out = tmp_path / "ppo"
    # One-token answers: the reward is a contextual bandit, so the signal reaches the right token. 40
    # rounds of 16 answers: the rise is about 0.3 over five seeds and both draws (at 25 rounds 0.09-0.24,
    # too close to the noise of a mean over 80 answers, about 0.08).
    proc = step3(out, actor, rm, *EASY, "--max_steps", "40", "--max_answer_seq_len", "1", "--actor_learning_rate", "3e-3",
                 "--critic_learning_rate", "3e-3", "--kl_coef", "0.01", "--critic_model_name_or_path", actor,
                 "--reward_model_name_or_path", str(rm))  # fmt: skip
    assert_ok(proc)
    rows = train_rows(out)
    first = sum(r["score_mean"] for r in rows[:5]) / 5
    last = sum(r["score_mean"] for r in rows[-5:]) / 5
    assert last > first + 0.2, (first, last)
    s = json.loads((out / "summary.json").read_text())
    for key in ("reward_start", "reward_end", "kl_end", "generation_tokens_per_sec", "generation_seconds",
                "train_seconds", "wall_seconds"):  # fmt: skip
        assert s[key] is not None, key
    for key in ("kl_to_reference", "entropy", "response_length", "policy_loss", "value_loss", "clip_fraction",
                "approx_kl", "score_std", "generation_seconds", "experience_seconds"):  # fmt: skip
        assert key in rows[-1], key
    assert (out / "actor" / "model.safetensors").exists() and (out / "critic" / "model.safetensors").exists()
    cfg = json.loads((out / "dschat_config.json").read_text())
    for key in ("kl_coef", "clip_reward_value", "cliprange", "cliprange_value", "gamma", "lam"):
        assert key in cfg
    assert cfg["sampling_draw"] == "inverse_cdf"  # how the rollouts were drawn is saved with them


# The RLVR stabilisers all at once: Dr. GRPO's baseline and loss aggregation, DAPO's uniform-group filter,
# clip-higher and overlong penalty, GRPO's k3 KL as a loss.
STABILISERS = ["--advantage_estimator", "dr_grpo", "--filter_uniform_groups", "--cliprange_high", "0.28",
               "--loss_agg", "seq_mean_token_sum_norm", "--kl_in", "loss", "--kl_estimator", "k3",
               "--truncation_penalty", "0.5"]  # fmt: skip


@pytest.mark.parametrize("variant", ["rloo", "stabilisers"])
def test_rloo_without_a_critic_raises_the_easy_reward(models, tmp_path, variant):
    actor, rm = models
    out = tmp_path / variant
    estimator = ["--advantage_estimator", "rloo"] if variant == "rloo" else STABILISERS
    # 8 prompts x 4 responses = 32 rows per round, two updates of 16; no critic is built or saved.
    proc = step3(out, actor, rm, *EASY, "--max_steps", "25", "--max_answer_seq_len", "1", "--actor_learning_rate", "3e-3",
                 "--kl_coef", "0.01", *estimator, "--n_samples_per_prompt", "4",
                 "--per_device_generation_batch_size", "8", "--eval_prompts", "8")  # fmt: skip
    assert_ok(proc)
    name = "rloo" if variant == "rloo" else "dr_grpo"
    assert f"critic none ({name}, 4 samples per prompt)" in proc.stderr + proc.stdout
    rows = train_rows(out)
    first = sum(r["score_mean"] for r in rows[:5]) / 5
    last = sum(r["score_mean"] for r in rows[-5:]) / 5
    assert last > first + 0.2, (first, last)
    assert "policy_loss" in rows[-1] and "value_loss" not in rows[-1]
    assert (out / "actor" / "model.safetensors").exists() and not (out / "critic").exists()
    s = json.loads((out / "summary.json").read_text())
    assert 0.0 <= s["true_accuracy_sampled_start"] <= 1.0 and 0.0 <= s["true_accuracy_sampled_end"] <= 1.0
    cfg = json.loads((out / "dschat_config.json").read_text())
    assert cfg["advantage_estimator"] == name and cfg["n_samples_per_prompt"] == 4
    for key in ("truncated_fraction", "uniform_group_fraction", "clipped_score_fraction"):
        assert 0.0 <= rows[-1][key] <= 1.0, key
    assert s["truncated_fraction_end"] is not None and s["entropy_end"] is not None
    if variant == "stabilisers":  # every stabiliser is saved with the run and logged
        assert (cfg["filter_uniform_groups"], cfg["cliprange_high"], cfg["loss_agg"], cfg["kl_in"], cfg["kl_estimator"],
                cfg["truncation_penalty"]) == (True, 0.28, "seq_mean_token_sum_norm", "loss", "k3", 0.5)  # fmt: skip
        assert (
            "kl_loss" in rows[-1] and rows[-1]["truncated_fraction"] > 0.5
        )  # one-token answers rarely say EOS


def test_resume_continues_to_the_same_actor(models, tmp_path):
    actor, rm = models
    # an adaptive KL controller: its coefficient, saved in the checkpoint, shapes the rewards after resuming
    # an EMA of the actor, which lives outside the engines, and the PTX term's SFT batches, read from their
    # own loader: the checkpoint keeps the average and that loader's position too
    flags = [*EASY, "--max_steps", "6", "--save_steps", "3", "--dtype", "fp32", "--actor_learning_rate", "1e-3",
             "--kl_target", "1e6", "--kl_horizon", "320", "--enable_ema", "--ema_decay", "0.5",
             "--unsupervised_dataset_name", "builtin:sort", "--unsup_coef", "0.5"]  # fmt: skip
    full = tmp_path / "full"
    assert_ok(step3(full, actor, rm, *flags))
    cut = tmp_path / "cut"
    proc = step3(cut, actor, rm, *flags, env={"DSCHAT_TEST_EXIT_AFTER_SAVE": "3"})
    assert proc.returncode == 17, proc.stderr[-2000:]
    assert not (cut / "summary.json").exists()
    assert_ok(step3(cut, actor, rm, *flags, "--resume"))
    a, b = load_file(full / "actor" / "model.safetensors"), load_file(cut / "actor" / "model.safetensors")
    assert a.keys() == b.keys()
    for k in a:
        assert (a[k] == b[k]).all(), k
    ca, cb = load_file(full / "critic" / "model.safetensors"), load_file(cut / "critic" / "model.safetensors")
    for k in ca:
        assert (ca[k] == cb[k]).all(), k
    # every round's KL is far below the target: x (1 - 0.2 * 16 / 320) per round, six rounds either way
    kl_end = [json.loads((d / "summary.json").read_text())["kl_coef_end"] for d in (full, cut)]
    assert kl_end[0] == kl_end[1] == pytest.approx(0.1 * 0.99**6, rel=1e-9)
    # the EMA continued from the saved average (it used to restart from the resumed weights)
    ea, eb = (
        load_file(full / "actor_ema" / "model.safetensors"),
        load_file(cut / "actor_ema" / "model.safetensors"),
    )
    assert ea.keys() == eb.keys() and all((ea[k] == eb[k]).all() for k in ea)
    # the summary's start is the run's (held-out evaluation, first log row), not the resume's
    sa, sb = (json.loads((d / "summary.json").read_text()) for d in (full, cut))
    starts = [k for k in sa if k.endswith("_start")]
    assert "reward_start" in starts and "held_out_reward_start" in starts
    assert {k: sb[k] for k in starts} == {k: sa[k] for k in starts}
    # and its throughput is the whole run's: the same rollouts, all six rounds' tokens (it counted three)
    assert sb["generated_tokens"] == sa["generated_tokens"] > 0


def test_generation_batches_2_runs_to_the_end_and_the_schedules_end_at_the_last_update(models, tmp_path):
    """--generation_batches 2: every update trains on two rounds whose prompt blocks usually differ in width
    (the collator pads a round to its own longest prompt). 6 prompts per round, minibatches of 4: three
    updates per two rounds; the actor sits out the first update round (--freezing_actor_steps 2). Both
    cosine schedules are as long as their real optimizer steps: they end at 0 after the last update. The
    advantages are whitened over both rounds (dschat.rlhf.ppo.update_batch)."""
    actor, rm = models
    out = tmp_path / "g2"
    proc = step3(out, actor, rm, *EASY, "--max_steps", "4", "--generation_batches", "2", "--freezing_actor_steps", "2",
                 "--per_device_generation_batch_size", "6", "--per_device_training_batch_size", "4",
                 "--eval_prompts", "8", "--whiten_advantages")  # fmt: skip
    assert_ok(proc)
    s = json.loads((out / "summary.json").read_text())
    assert s["steps"] == 4
    # every update applied: DeepSpeed skips a step on inf/NaN gradients, the schedule with it (the GPU's
    # cuDNN attention backward did this here, 2026-11-29: dschat.models.attention)
    assert (s["actor_skipped_steps"], s["critic_skipped_steps"]) == (0, 0)
    cfg = json.loads((out / "dschat_config.json").read_text())
    assert (cfg["actor_optimizer_steps"], cfg["critic_optimizer_steps"]) == (3, 6)
    rows = train_rows(out)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    a, c = (
        cfg["actor"]["learning_rate"],
        cfg["critic"]["learning_rate"],
    )  # each model's options under its name
    # the rate each model's last update used (before its first, the rate its first will use): no update
    # in rounds 1 and 3; after round 2 the critic's 3rd of 6 cosine steps (k = 2 of 0..5), the actor's
    # none; after round 4 the last step of each schedule, k = N - 1: a schedule as long as the model's real
    # optimizer steps ends there at (1 + cos(pi (N - 1) / N)) / 2 of the peak (one step longer, it would not)
    cosine = lambda k, n: (1 + math.cos(math.pi * k / n)) / 2  # noqa: E731
    assert [r["actor_lr"] for r in rows] == pytest.approx([a, a, a, a * cosine(2, 3)], rel=1e-6)
    assert [r["critic_lr"] for r in rows] == pytest.approx(
        [c, c * cosine(2, 6), c * cosine(2, 6), c * cosine(5, 6)], rel=1e-6
    )
    assert "policy_loss" in rows[-1] and "value_loss" in rows[-1] and "policy_loss" not in rows[1]


def test_adaptive_kl_coefficient_moves_every_round_without_log_lines(models, tmp_path):
    """--log_interval 0 writes no train line until the last round; the controller still follows every
    round. With a target far above any KL, each round scales the coefficient by 1 - 0.2 * rows / horizon."""
    actor, rm = models
    out = tmp_path / "kl"
    proc = step3(out, actor, rm, *EASY, "--max_steps", "3", "--log_interval", "0", "--kl_target", "1e6",
                 "--kl_horizon", "8", "--per_device_generation_batch_size", "4", "--per_device_training_batch_size", "4",
                 "--eval_prompts", "4")  # fmt: skip
    assert_ok(proc)
    # 4 rows per round: x (1 - 0.2 * 4 / 8) = x 0.9 in each of the 3 rounds
    assert json.loads((out / "summary.json").read_text())["kl_coef_end"] == pytest.approx(
        0.1 * 0.9**3, rel=1e-9
    )
    assert [r["step"] for r in train_rows(out)] == [3]


def test_adaptive_kl_coefficient_is_one_value_per_update_over_generation_batches(models, tmp_path):
    """With --generation_batches 2 the two rounds of one update carried different KL coefficients (the
    controller moved after each round): it moves once per update now, by each of the update's rounds in
    turn (compounded, as a linear step over all their rows could cross zero), so the rows of one update
    share a coefficient. 4 rows per round: x (1 - 0.2 * 4 / 8) = x 0.9 per round, x 0.81 per update."""
    actor, rm = models
    out = tmp_path / "kl2"
    proc = step3(out, actor, rm, *EASY, "--max_steps", "4", "--log_interval", "1", "--kl_target", "1e6",
                 "--kl_horizon", "8", "--per_device_generation_batch_size", "4", "--per_device_training_batch_size", "4",
                 "--generation_batches", "2", "--eval_prompts", "4")  # fmt: skip
    assert_ok(proc)
    assert [r["kl_coef"] for r in train_rows(out)] == pytest.approx([0.1, 0.1, 0.081, 0.081], rel=1e-9)
    assert json.loads((out / "summary.json").read_text())["kl_coef_end"] == pytest.approx(
        0.1 * 0.9**4, rel=1e-9
    )


def test_judge_reward_model_is_scored_beside_the_reward(models, tmp_path):
    """--judge_reward_model scores every rollout and held-out answer and is never optimised. With the
    reward model itself as the judge, the judge's numbers equal the reward's exactly."""
    actor, rm = models
    out = tmp_path / "judge"
    assert_ok(
        step3(out, actor, rm, "--max_steps", "2", "--judge_reward_model", str(rm), "--eval_prompts", "8")
    )
    rows = train_rows(out)
    assert rows and all(r["judge_score_mean"] == pytest.approx(r["score_mean"], abs=1e-5) for r in rows)
    evals = [
        r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if r["split"] == "eval"
    ]
    assert len(evals) == 2
    assert all(r["held_out_judge_score"] == pytest.approx(r["held_out_reward"], abs=1e-5) for r in evals)
    s = json.loads((out / "summary.json").read_text())
    assert s["held_out_judge_score_end"] == pytest.approx(s["held_out_reward_end"], abs=1e-5)
    assert json.loads((out / "dschat_config.json").read_text())["judge_reward_model"] == str(rm)


def test_normalize_reward_standardises_the_reward_models_scores(models, tmp_path):
    """--normalize_reward: the reward model's scores become (score - mean) / std with the statistics step 2
    saved. The same reward model as the judge (never normalised) shows the raw scores beside them."""
    actor, rm = models
    norm = json.loads((rm / "config.json").read_text())["score_normalization"]
    out = tmp_path / "norm"
    assert_ok(step3(out, actor, rm, "--max_steps", "2", "--normalize_reward", "--judge_reward_model", str(rm),
                    "--eval_prompts", "8"))  # fmt: skip
    rows = train_rows(out)
    expected = [(r["judge_score_mean"] - norm["mean"]) / norm["std"] for r in rows]
    assert [r["score_mean"] for r in rows] == pytest.approx(expected, abs=1e-4)
    s = json.loads((out / "summary.json").read_text())
    assert s["held_out_reward_end"] == pytest.approx(
        (s["held_out_judge_score_end"] - norm["mean"]) / norm["std"], abs=1e-4
    )
    assert s["reward_normalization"] == norm
    cfg = json.loads((out / "dschat_config.json").read_text())
    assert cfg["normalize_reward"] is True and cfg["reward_normalization"] == norm


def test_freezing_actor_steps_trains_the_critic_alone(models, tmp_path):
    actor, rm = models
    out = tmp_path / "frozen"
    assert_ok(step3(out, actor, rm, *EASY, "--max_steps", "2", "--freezing_actor_steps", "2", "--dtype", "fp32",
                    "--critic_learning_rate", "1e-3"))  # fmt: skip
    before, after = (
        load_file(Path(actor) / "model.safetensors"),
        load_file(out / "actor" / "model.safetensors"),
    )
    assert all((before[k] == after[k]).all() for k in after), "the actor moved while frozen"
    critic_before = load_file(rm / "model.safetensors")
    critic_after = load_file(out / "critic" / "model.safetensors")
    assert any(not (critic_before[k] == critic_after[k]).all() for k in critic_after), (
        "the critic did not learn"
    )
    rows = train_rows(out)
    assert "value_loss" in rows[-1] and "policy_loss" not in rows[-1]
    # the critic started from the reward model, whose score statistics do not describe the trained critic
    assert "score_normalization" in json.loads((rm / "config.json").read_text())
    assert "score_normalization" not in json.loads((out / "critic" / "config.json").read_text())


def test_lora_actor_shares_the_reference(models, tmp_path):
    """LoRA on both models (the critic is a scalar-head model: peft's causal-LM wrapper failed on it)."""
    actor, rm = models
    out = tmp_path / "lora"
    critic_before = load_file(rm / "model.safetensors")
    proc = step3(out, actor, rm, *EASY, "--max_steps", "3", "--actor_lora_dim", "4", "--critic_lora_dim", "4",
                 "--only_optimize_lora", "--share_reference_with_actor", "--enable_ema")  # fmt: skip
    assert_ok(proc)
    assert "actor without adapter" in proc.stdout
    assert (out / "actor_ema" / "model.safetensors").exists()
    assert not any("lora" in k for k in load_file(out / "actor" / "model.safetensors"))
    critic_after = load_file(out / "critic" / "model.safetensors")
    assert set(critic_after) == set(critic_before)  # merged: the reward model's own names, no adapter
    assert any(not (critic_before[k] == critic_after[k]).all() for k in critic_after), (
        "the critic did not learn"
    )


def test_a_shared_frozen_trunk_changes_no_number(models, tmp_path):
    """The main job's setting in small: the actor trains its top block only, the reference is the model it
    starts from, the reward model was trained from it with its top block only. With --share_frozen_trunk
    (the default) all three and the update start from the actor's bottom block; every logged number equals
    a run that computes each model in full."""
    actor, _ = models
    rm = tmp_path / "rm"
    assert_ok(run_cmd([str(STEP2), "--output_dir", str(rm), "--model_name_or_path", "builtin:micro-llama",
                       "--trainable_layers", "1", "--max_steps", "5", "--max_eval_samples", "32",
                       "--eval_interval", "0"]))  # fmt: skip
    rows, logs = {}, {}
    for flag in ("--share_frozen_trunk", "--no_share_frozen_trunk"):
        out = tmp_path / flag.strip("-")
        proc = step3(out, actor, rm, "--advantage_estimator", "rloo", "--n_samples_per_prompt", "4",
                     "--actor_trainable_layers", "1", "--max_steps", "3", "--log_interval", "1", flag)  # fmt: skip
        assert_ok(proc)
        rows[flag], logs[flag] = train_rows(out), proc.stdout + proc.stderr
    shared, full = rows["--share_frozen_trunk"], rows["--no_share_frozen_trunk"]
    for said in ("the reference starts from the actor's bottom 1 blocks",
                 "the reward starts from the actor's bottom 1 blocks",
                 "the update starts above the actor's frozen bottom 1 blocks"):  # fmt: skip
        assert said in logs["--share_frozen_trunk"], said
        assert said not in logs["--no_share_frozen_trunk"]
    # the reward model reads the actor's packed rows (--share_prompt) once they are checked against its own
    assert all(
        "the reward model's scores of packed answers match separate rows" in log for log in logs.values()
    )
    assert len(shared) == len(full) == 3
    for a, b in zip(shared, full):
        for key in ("score_mean", "reward_mean", "kl_to_reference", "entropy", "policy_loss", "approx_kl"):
            assert a[key] == pytest.approx(b[key], rel=1e-6, abs=1e-7), key


def test_a_function_reward_without_a_critic_reads_no_critic_path(models, tmp_path):
    """RLVR (--reward_fn ... replace, rloo): no critic and no reward model, so a --critic_model_name_or_path
    that names nothing (a step 2 never run) is not read: it once failed on the reward model's tokenizer."""
    actor, _ = models
    proc = step3(tmp_path / "v", actor, tmp_path / "no_step2", *EASY, "--advantage_estimator", "rloo",
                 "--n_samples_per_prompt", "2", "--per_device_generation_batch_size", "4",
                 "--per_device_training_batch_size", "8", "--eval_prompts", "4", "--max_steps", "1")  # fmt: skip
    assert_ok(proc)
    config = json.loads((tmp_path / "v" / "dschat_config.json").read_text())
    assert config["resolved_critic_path"] is None and config["resolved_reward_path"] is None


def test_bad_inputs(models, tmp_path):
    actor, rm = models
    # the critic reads the actor's token ids as the reward model does: another vocabulary was let through
    # (silently wrong values, or an IndexError rounds into the run) when the reward model came elsewhere
    import shutil

    from transformers import AutoTokenizer

    other = tmp_path / "other_vocab_critic"
    shutil.copytree(rm, other, ignore=shutil.ignore_patterns("checkpoints"))
    tok = AutoTokenizer.from_pretrained(other)
    tok.add_tokens(["<extra>"])
    tok.save_pretrained(other)
    error_line(step3(tmp_path / "voc", actor, other, "--reward_model_name_or_path", str(rm), "--max_steps", "1"),
               f"--critic_model_name_or_path {other}: its tokenizer differs from the actor's")  # fmt: skip
    # the reward model must have a trained value head
    error_line(step3(tmp_path / "a", actor, rm, "--reward_model_name_or_path", actor, "--max_steps", "1"),
               "not a trained reward model")  # fmt: skip
    # so must the judge, checked before the engines start
    error_line(step3(tmp_path / "j", actor, rm, "--judge_reward_model", actor, "--max_steps", "1"),
               f"--judge_reward_model {actor}: not a trained reward model")  # fmt: skip
    # the critic read from inside --output_dir would be written over by the run's own saves
    error_line(step3(rm.parent, actor, rm, "--max_steps", "1", in_process=True),
               f"--critic_model_name_or_path {rm}: lies inside --output_dir {rm.parent}, which this run writes over")  # fmt: skip
    # prompt + answer must fit what the models attend to: a learned position table (GPT-2, OPT) raised an
    # IndexError at the first rollout that ran past it, rounds into the run, and RoPE models ran past their
    # trained context unwarned (the built-in models: 1024 positions)
    error_line(step3(tmp_path / "ctx", actor, rm, "--max_prompt_seq_len", "1000", "--max_answer_seq_len", "100",
                     "--max_steps", "1"),
               f"--max_prompt_seq_len 1000 + --max_answer_seq_len 100 = 1100: more than the actor ({actor}) "
               "attends to (1024 positions)")  # fmt: skip
    # the PPO minibatch must divide the generated batch
    error_line(
        step3(tmp_path / "b", actor, rm, "--per_device_training_batch_size", "5", in_process=True),
        "--per_device_training_batch_size 5",
    )
    error_line(
        step3(tmp_path / "c", actor, rm, "--share_reference_with_actor", in_process=True),
        "--share_reference_with_actor",
    )
    error_line(
        step3(
            tmp_path / "d", actor, rm, "--reward_fn", "no_such_module:f", "--max_steps", "1", in_process=True
        ),
        "--reward_fn",
    )
    # --normalize_reward needs the statistics of this version's step 2, and a reward model to apply them to
    import shutil

    old_rm = tmp_path / "old_rm"
    shutil.copytree(rm, old_rm)
    cfg = json.loads((old_rm / "config.json").read_text())
    del cfg["score_normalization"]
    (old_rm / "config.json").write_text(json.dumps(cfg))
    error_line(step3(tmp_path / "n", actor, old_rm, "--normalize_reward", "--max_steps", "1"),
               f"--critic_model_name_or_path {old_rm}: --normalize_reward needs the score mean and std")  # fmt: skip
    error_line(step3(tmp_path / "m", actor, rm, "--normalize_reward", *EASY, "--advantage_estimator", "rloo",
                     "--n_samples_per_prompt", "2", "--max_steps", "1", in_process=True),
               "--normalize_reward standardises a reward model's scores")  # fmt: skip
    # train.py: step 3 without finished steps 1 and 2
    proc = run_cmd([str(ROOT / "train.py"), "--step", "3", "--output-dir", str(tmp_path / "empty")])
    error_line(proc, "needs a finished step 1")
