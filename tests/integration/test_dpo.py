"""Step 2 with DPO on real DeepSpeed, CPU, the built-in micro Llama: it learns a preference, two ZeRO-3
ranks follow one rank, a resumed run equals an uninterrupted one, bad input is one line."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from tests.conftest import ROOT, cpu_ranks_env, run_cmd, run_entry
from tests.integration.helpers import assert_ok, error_line, metrics, summary, train_losses
from tests.integration.test_step2 import preference_file, write_jsonl

DPO = ROOT / "training" / "step2_dpo_finetuning" / "main.py"
FAST = ["--model_name_or_path", "builtin:micro-llama", "--per_device_train_batch_size", "16",
        "--max_eval_samples", "128", "--eval_interval", "0", "--eval_generation_samples", "0",
        "--data_split", "0,1,0"]  # fmt: skip


def dpo(out: Path, *flags: str, env: dict | None = None, in_process: bool = False):
    return run_entry(DPO, ["--output_dir", str(out), *flags], env=env, in_process=in_process)


@pytest.fixture(scope="module")
def pairs(tmp_path_factory) -> Path:
    return preference_file(tmp_path_factory.mktemp("dpo") / "pairs.jsonl")


@pytest.fixture(scope="module")
def trained(pairs, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("dpo") / "run"
    assert_ok(dpo(out, *FAST, "--data_path", str(pairs), "--max_steps", "30", "--learning_rate", "2e-3"))
    return out


def test_dpo_learns_the_preference(trained):
    s = summary(trained)
    # The policy starts as its own reference: every implicit reward is 0 and the loss is log 2.
    assert s["implicit_reward_accuracy_start"] == 0.0 and s["eval_margin_start"] == 0.0
    assert s["eval_loss_start"] == pytest.approx(0.6931, abs=1e-3)
    # Held-out pairs: the chosen answer's log-ratio rises over the rejected one's.
    assert s["implicit_reward_accuracy_end"] > 0.9, s
    assert s["eval_margin_end"] > 1.0
    assert s["eval_chosen_reward_end"] > s["eval_rejected_reward_end"]
    assert s["eval_loss_end"] < 0.3
    # split by length as the reward model's evaluation is, both halves learned
    split = [s.get(f"implicit_reward_accuracy_chosen_{side}_end") for side in ("longer", "shorter")]
    assert all(a is not None and a > 0.8 for a in split), s
    losses = train_losses(trained)
    assert losses[max(losses)] < losses[min(losses)]
    assert (trained / "reference_logps.safetensors").is_file() and (trained / "config.json").is_file()


def test_saved_policy_is_a_plain_causal_lm(trained):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(trained)
    assert model.config.architectures[0].endswith("ForCausalLM")


# The run the equivalence tests compare with: fp32, a train row per step, global batch 16 on one rank as
# 8 x 2 accumulation, packed pairs (the default), a checkpoint every 3 steps. One run, shared.
EXACT = [*FAST, "--max_steps", "6", "--dtype", "fp32", "--log_interval", "1", "--learning_rate", "2e-3",
         "--per_device_train_batch_size", "8", "--save_steps", "3"]  # fmt: skip


@pytest.fixture(scope="module")
def reference(pairs, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("dpo") / "reference"
    assert_ok(dpo(out, *EXACT, "--data_path", str(pairs), "--gradient_accumulation_steps", "2"))
    return out


@pytest.mark.slow
@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="two CPU ranks need two cores")
def test_two_ranks_zero3_match_one_rank(pairs, reference, tmp_path):
    from dschat.utils.dist import free_port

    two = tmp_path / "two"
    assert_ok(run_cmd(["-m", "deepspeed.launcher.runner", "--master_port", str(free_port()), "--num_gpus", "2",
                       str(DPO), "--output_dir", str(two), *EXACT, "--data_path", str(pairs), "--zero_stage", "3"],
                      env=cpu_ranks_env()))  # fmt: skip
    a, b = train_losses(reference), train_losses(two)
    assert sorted(a) == sorted(b) == list(range(1, 7))
    for step in a:
        assert a[step] == pytest.approx(b[step], rel=2e-3, abs=2e-3), step
    assert summary(two)["implicit_reward_accuracy_end"] == pytest.approx(
        summary(reference)["implicit_reward_accuracy_end"], abs=0.02
    )


@pytest.mark.slow
def test_resume_equals_an_uninterrupted_run(pairs, reference, tmp_path):
    from safetensors.torch import load_file

    flags = [*EXACT, "--data_path", str(pairs), "--gradient_accumulation_steps", "2"]
    out = tmp_path / "run"
    proc = dpo(out, *flags, env={"DSCHAT_TEST_EXIT_AFTER_SAVE": "3"})
    assert proc.returncode == 17, proc.stderr[-3000:]
    # The reference's log-probs are read from the run, not recomputed from the moved policy.
    assert_ok(dpo(out, *flags, "--resume"))
    assert "read from the run" in (out / "training.log").read_text()
    s = summary(out)
    assert s["resumed_from_step"] == 3 and s["steps"] == 6
    a, b = load_file(str(reference / "model.safetensors")), load_file(str(out / "model.safetensors"))
    for k in a:
        assert float((a[k] - b[k]).abs().max()) == 0.0, k
    got, want = train_losses(out), train_losses(reference)
    for step in range(1, 7):
        assert got[step] == pytest.approx(want[step], rel=1e-6), step
    # the start is the run's (a resume used to re-measure it from the moved policy)
    for key in ("implicit_reward_accuracy_start", "eval_margin_start", "eval_loss_start"):
        assert s[key] == summary(reference)[key], key


def test_a_resume_with_another_max_steps_is_refused_in_one_line(pairs, tmp_path):
    """Resumed with a larger --max_steps, DPO trained on NaN reference log-probs: the table holds the pairs
    the interrupted run planned to read. A changed option that changes what the run computes is now
    refused before any start-up (a memory lever such as --save_steps may change); the run is left as it
    was."""
    flags = [*EXACT, "--data_path", str(pairs), "--max_steps", "2", "--save_steps", "1"]
    out = tmp_path / "run"
    proc = dpo(out, *flags, env={"DSCHAT_TEST_EXIT_AFTER_SAVE": "1"})
    assert proc.returncode == 17, proc.stderr[-3000:]
    before = {p.name: p.stat().st_mtime_ns for p in out.rglob("*")}
    error_line(dpo(out, *flags, "--max_steps", "12", "--save_steps", "100", "--resume", in_process=True),
               "--resume: --max_steps 2 -> 12", str(out / "dschat_config.json"), "--overwrite")  # fmt: skip
    assert {p.name: p.stat().st_mtime_ns for p in out.rglob("*")} == before


def test_shared_prompt_trains_like_unpacked_rows(pairs, reference, tmp_path):
    """--share_prompt (packed pairs, the default) and --no_share_prompt run the same maths: in fp32 the
    losses, the reference log-probs and the implicit-reward accuracy agree to rounding, and the packed
    run computes fewer tokens."""
    from safetensors.torch import load_file

    plain = tmp_path / "plain"
    proc = dpo(
        plain, *EXACT, "--data_path", str(pairs), "--gradient_accumulation_steps", "2", "--no_share_prompt"
    )
    assert_ok(proc)
    packed = reference
    assert summary(packed)["share_prompt"] is True and summary(plain)["share_prompt"] is False
    assert "packed pairs match separate rows" in (packed / "training.log").read_text()
    assert "packed pairs match separate rows" not in proc.stdout + proc.stderr
    ref_p, ref_u = (
        load_file(str(d / "reference_logps.safetensors"))["reference_logps"] for d in (packed, plain)
    )
    read = ~ref_u.isnan()
    assert torch.allclose(ref_p[read], ref_u[read], atol=1e-4)
    a, b = train_losses(packed), train_losses(plain)
    assert sorted(a) == sorted(b) == list(range(1, 7))
    for step in a:
        assert a[step] == pytest.approx(b[step], rel=1e-4), step
    for key in ("implicit_reward_accuracy_end", "eval_margin_end", "eval_loss_end"):
        assert summary(packed)[key] == pytest.approx(summary(plain)[key], rel=1e-3, abs=1e-5), key
    rows = {d: [r for r in metrics(d) if r["split"] == "train"] for d in (packed, plain)}
    assert [r["tokens"] for r in rows[packed]] == [r["tokens"] for r in rows[plain]]
    for p, u in zip(rows[packed], rows[plain]):
        assert p["computed_tokens_per_sec"] / p["tokens_per_sec"] < 0.9
        assert u["computed_tokens_per_sec"] == pytest.approx(u["tokens_per_sec"])


@pytest.mark.parametrize(
    "flags, needles",
    [
        (["--beta", "0"], ["--beta", "> 0"]),
        (["--dpo_loss", "ipo", "--label_smoothing", "0.1"], ["--label_smoothing", "sigmoid"]),
        (["--label_smoothing", "0.5"], ["--label_smoothing", "[0, 0.5)"]),
    ],
)
def test_bad_options_are_one_line(tmp_path, flags, needles):
    error_line(dpo(tmp_path / "out", *FAST, *flags, in_process=True), *needles)
    assert not (tmp_path / "out").exists()


def test_pairs_with_identical_sides_are_one_line(tmp_path):
    rows = [{"prompt": f"\n\nHuman: q{i}\n\nAssistant:", "chosen": f" yes {i}", "rejected": f" no {i}"}
            for i in range(40)]  # fmt: skip
    rows[7]["rejected"] = rows[7]["chosen"] + " "  # the same answer once stripped
    data = write_jsonl(tmp_path / "pairs.jsonl", rows)
    error_line(dpo(tmp_path / "out", *FAST, "--data_path", str(data), "--data_split", "0,1,0"),
               str(data), "1 pair(s) have the same chosen and rejected answer")  # fmt: skip
    assert not (tmp_path / "out").exists()


def test_reference_with_another_vocabulary_is_one_line(tmp_path):
    from transformers import AutoTokenizer

    from dschat.models.loading import resolve

    other = tmp_path / "other"
    src = Path(resolve("builtin:micro-llama"))
    other.mkdir()
    for f in src.iterdir():
        (other / f.name).write_bytes(f.read_bytes())
    tok = AutoTokenizer.from_pretrained(other)
    tok.add_tokens(["<not-in-the-policy>"])
    tok.save_pretrained(other)
    line = error_line(
        dpo(tmp_path / "out", *FAST, "--ref_model_name_or_path", str(other)),
        str(other),
        "tokenizer",
    )
    assert "vocabulary" in line
    assert not (tmp_path / "out").exists()


def test_train_py_runs_dpo_as_step_two_with_policy_negatives(tmp_path):
    import json

    from tests.integration.helpers import train_py

    out = tmp_path / "run"
    # builtin tasks: an untrained policy's distinct wrong answers become rejected sides
    proc = train_py("--preset", "none", "--algorithm", "dpo", "--step", "2", "--actor-model", "builtin:micro-llama",
                    "--output-dir", str(out), "--", "--max_steps", "2", "--per_device_train_batch_size", "4",
                    "--max_eval_samples", "16", "--eval_generation_samples", "4", "--eval_interval", "0",
                    "--policy_negatives_from", "builtin:micro-llama", "--policy_negatives_max_prompts", "16",
                    "--policy_negatives_per_prompt", "2", "--policy_negatives_max_new_tokens", "6")  # fmt: skip
    assert_ok(proc)
    run = out / "step2_dpo"
    s = summary(run)
    assert s["algorithm"] == "dpo" and s["steps"] == 2
    assert not (out / "step2").exists()
    assert "step2_dpo" in proc.stdout and "chat.py" in proc.stdout  # the next commands name the DPO policy
    train = s["policy_negatives"]["train"]
    assert train["prompts"] == 16 and 0 < train["pairs"] <= 32
    rows = [json.loads(x) for x in (run / "policy_negatives_train.jsonl").read_text().splitlines()]
    assert len(rows) == train["pairs"]
    # the held-out prompts' on-policy pairs were mined and then never evaluated; they are a second held-out
    # set now, as in the reward-model step: the policy == the reference at the start (every reward 0, ties
    # count as wrong), its own mistakes ranked after the updates
    assert s["policy_negatives"]["eval"]["pairs"] > 0
    assert s["implicit_reward_accuracy_policy_negatives_start"] == 0.0
    assert 0.0 <= s["implicit_reward_accuracy_policy_negatives_end"] <= 1.0
    evals = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if '"eval"' in x]
    assert all("policy_negatives_accuracy" in r for r in evals), evals
    # the verifier's accuracy is logged as true_accuracy (step 3's name): it overwrote the implicit-reward
    # accuracy of the first and last rows, one curve of two metrics
    assert evals[0]["accuracy"] == s["implicit_reward_accuracy_start"] == 0.0, evals
    assert evals[-1]["accuracy"] == s["implicit_reward_accuracy_end"], evals
    assert evals[0]["true_accuracy"] == s["true_accuracy_start"] and "true_accuracy" in evals[-1], evals


def test_online_dpo_trains_on_pairs_a_reward_model_labels(pairs, tmp_path):
    # The policy (a chain model: " 579" then EOS) samples at temperature 12: ended " 579" answers and
    # cut-off random bytes. The reward model scores +8 for a text ending in 9. With
    # --policy_negatives_only the run trains on those pairs alone; the data's pairs give the prompts.
    import json

    from tests.tiny_chat_models import chain_model, sign_reward_model

    policy, rm = chain_model(tmp_path / "policy", " 579"), sign_reward_model(tmp_path / "rm")
    out = tmp_path / "run"
    flags = [*FAST, "--model_name_or_path", str(policy), "--data_path", str(pairs), "--max_steps", "2",
             "--per_device_train_batch_size", "4", "--policy_negatives_from", str(policy),
             "--policy_negatives_reward_model", str(rm), "--policy_negatives_only",
             "--policy_negatives_max_prompts", "24", "--policy_negatives_per_prompt", "4",
             "--policy_negatives_max_new_tokens", "6", "--policy_negatives_temperature", "12"]  # fmt: skip
    assert_ok(dpo(out, *flags))
    mined = summary(out)["policy_negatives"]["train"]
    assert mined["prompts"] == 24 and mined["answers"] == 96 and 8 <= mined["pairs"] <= 24, mined
    assert mined["mean_margin"] > 0 and 0 < mined["cut_off_fraction"] < 1
    rows = [json.loads(x) for x in (out / "policy_negatives_train.jsonl").read_text().splitlines()]
    assert len(rows) == mined["pairs"] and {r["chosen"] for r in rows} == {" 579"}
    # the data's own 1200 pairs are not trained on: only the mined ones
    assert f"data: {int(mined['pairs'])} train" in (out / "training.log").read_text()
    cfg = json.loads((out / "dschat_config.json").read_text())
    assert cfg["policy_negatives_reward_model"] == str(rm) and cfg["policy_negatives_only"] is True


def test_reward_model_labels_are_refused_by_the_reward_model_step(tmp_path):
    from tests.integration.test_step2 import step2

    proc = step2(tmp_path / "out", "--model_name_or_path", "builtin:micro-llama", "--policy_negatives_from",
                 "builtin:micro-llama", "--policy_negatives_reward_model", str(tmp_path / "rm"), in_process=True)  # fmt: skip
    error_line(proc, "--policy_negatives_reward_model is for DPO")
    assert not (tmp_path / "out").exists()
