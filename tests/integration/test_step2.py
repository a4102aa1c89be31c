"""Step 2 (reward model) on real DeepSpeed, CPU, tiny models: it learns to rank, saves a model that
AutoModelForSequenceClassification scores identically, and refuses bad input clearly."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from tests.conftest import ROOT, cpu_ranks_env, run_cmd, run_entry, run_main_in_process
from tests.integration.helpers import assert_ok, error_line, train_rows

STEP2 = ROOT / "training" / "step2_reward_model_finetuning" / "main.py"
RW_EVAL = ROOT / "inference" / "rw_eval.py"
FAST = ["--model_name_or_path", "builtin:micro-llama", "--per_device_train_batch_size", "16",
        "--max_eval_samples", "128", "--eval_interval", "0", "--learning_rate", "2e-3"]  # fmt: skip


def step2(out: Path, *flags: str, env: dict | None = None, in_process: bool = False):
    return run_entry(STEP2, ["--output_dir", str(out), *flags], env=env, in_process=in_process)


def preference_file(path: Path, n: int = 1200) -> Path:
    """Pairs whose preference a small model can learn in a minute: the chosen answer agrees with the
    question's polarity word, the rejected one contradicts it; the lengths tell nothing."""
    import random

    rng = random.Random(0)
    words = ["red", "blue", "green", "gold", "grey", "pink"]
    rows = []
    for i in range(n):
        mood = rng.choice(["good", "bad"])
        other = "bad" if mood == "good" else "good"
        tail = " ".join(rng.sample(words, 2))
        rows.append({"prompt": f"\n\nHuman: Is it {mood}? ({i})\n\nAssistant:", "chosen": f" {mood} {tail}",
                     "rejected": f" {other} {tail}"})  # fmt: skip
    return write_jsonl(path, rows)


@pytest.fixture(scope="module")
def trained_rm(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("rm")
    data = preference_file(tmp / "pairs.jsonl")
    out = tmp / "step2"
    assert_ok(step2(out, *FAST, "--max_steps", "60", "--data_path", str(data), "--data_split", "0,1,0"))
    return out


def test_reward_model_learns_to_rank(trained_rm):
    s = json.loads((trained_rm / "summary.json").read_text())
    assert s["eval_accuracy_start"] < 0.8
    assert s["eval_accuracy_end"] > 0.9, s
    assert s["eval_accuracy_end"] > s["eval_accuracy_start"] + 0.2
    assert s["eval_chosen_mean"] > s["eval_rejected_mean"]
    for key in ("wall_seconds", "train_samples_per_sec", "scoring_samples_per_sec"):
        assert s[key] > 0
    rows = [json.loads(x) for x in (trained_rm / "metrics.jsonl").read_text().splitlines()]
    assert {r["split"] for r in rows} == {"train", "eval"}
    # the scoring rate of the first evaluation: a later one may reuse the frozen layers' cached states
    # (--trainable_layers), a shortcut new answers never get
    first = next(r for r in rows if r["split"] == "eval")
    assert first["step"] == 0 and s["scoring_samples_per_sec"] == first["scoring_samples_per_sec"]


def test_score_normalization_is_saved_with_the_model(trained_rm):
    """Without policy samples, step 2 measures its scores on both answers of its evaluation pairs and
    saves their mean and std in config.json, where step 3's --normalize_reward reads them."""
    s = json.loads((trained_rm / "summary.json").read_text())
    saved = json.loads((trained_rm / "config.json").read_text())["score_normalization"]
    assert saved == s["score_normalization"]
    evals = [
        r
        for r in map(json.loads, (trained_rm / "metrics.jsonl").read_text().splitlines())
        if r["split"] == "eval"
    ]
    assert saved["source"] == "eval_pairs" and saved["n"] == 2 * evals[-1]["pairs"]
    assert (saved["mean"], saved["std"]) == (evals[-1]["score_mean"], evals[-1]["score_std"])
    # the mean over both sides of the same pairs that gave the chosen and rejected means
    assert saved["mean"] == pytest.approx((s["eval_chosen_mean"] + s["eval_rejected_mean"]) / 2, abs=1e-5)
    # a reward model that separates the pairs spreads its scores at least half their margin apart
    assert saved["std"] >= s["eval_margin"] / 2 > 0


def test_saved_reward_model_scores_the_same_under_auto_class(trained_rm):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from dschat.models.reward import load_reward_model
    from dschat.scoring import score_texts

    tok = AutoTokenizer.from_pretrained(trained_rm)
    auto = AutoModelForSequenceClassification.from_pretrained(trained_rm, dtype=torch.float32).eval()
    assert auto.config.num_labels == 1
    ours = load_reward_model(str(trained_rm), tokenizer=tok, require_trained_head=True)
    prompts = [
        "\n\nHuman: Reverse: abc\n\nAssistant:",
        "\n\nHuman: Sort: pig cat\n\nAssistant:",
    ]
    responses = [" cba", " cat pig but longer"]
    mine = score_texts(ours, tok, prompts, responses)
    # The auto class pools at the rightmost non-pad token: feed the same right-padded rows.
    rows = [
        tok(p)["input_ids"] + tok(r, add_special_tokens=False)["input_ids"]
        for p, r in zip(prompts, responses)
    ]
    width = max(map(len, rows))
    ids = torch.tensor([r + [tok.pad_token_id] * (width - len(r)) for r in rows])
    mask = (torch.arange(width)[None, :] < torch.tensor([len(r) for r in rows])[:, None]).long()
    with torch.no_grad():
        theirs = auto(input_ids=ids, attention_mask=mask).logits.squeeze(-1)
    torch.testing.assert_close(mine, theirs.float(), rtol=1e-5, atol=1e-5)


def test_rw_eval_table_and_json(trained_rm, tmp_path):
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text("\n".join(json.dumps(r) for r in [
        {"prompt": "\n\nHuman: Reverse: abcd\n\nAssistant:", "chosen": " dcba", "rejected": " abcd"},
        {"prompt": "\n\nHuman: Sort: pig ant\n\nAssistant:", "chosen": " ant pig", "rejected": " pig ant"},
    ]) + "\n")  # fmt: skip
    proc = run_cmd([str(RW_EVAL), "--model", str(trained_rm), "--file", str(pairs), "--json"])
    assert_ok(proc)
    res = json.loads(proc.stdout)
    assert res["pairs"] == 2 and 0.0 <= res["accuracy"] <= 1.0
    assert set(res["chosen_scores"]) == {"mean", "std", "p10", "p50", "p90"}
    table = run_cmd([str(RW_EVAL), "--model", str(trained_rm), "--file", str(pairs)])
    assert_ok(table)
    assert "pairwise accuracy" in table.stdout and "'longer wins' baseline" in table.stdout
    single = run_cmd([str(RW_EVAL), "--model", str(trained_rm), "--prompt", "\n\nHuman: hi\n\nAssistant:",
                      "--response", " a", "--response", " b", "--json"])  # fmt: skip
    assert_ok(single)
    assert len(json.loads(single.stdout)["scores"]) == 2
    # a question typed as it is scores as its dialogue (prompt_eval.py's reading); it was scored bare
    typed = run_cmd(
        [str(RW_EVAL), "--model", str(trained_rm), "--prompt", "hi", "--response", " a", "--json"]
    )
    assert_ok(typed)
    got, want = (json.loads(x.stdout)["scores"][0]["score"] for x in (typed, single))
    assert got == pytest.approx(want, rel=1e-5, abs=1e-5)  # alone, against in a batch of two: rounding


def test_lora_reward_model_learns_and_saves_a_plain_model(tmp_path):
    """LoRA on a *ForSequenceClassification body (DeepSpeed-Chat's --lora_dim on step 2): it trains with
    only the adapters and the head, and the saved model is a plain one with the adapters merged in. peft's
    causal-LM wrapper crashed on it (the classifier has no generation hooks)."""
    from transformers import AutoModelForSequenceClassification

    data = preference_file(tmp_path / "pairs.jsonl", n=640)
    out = tmp_path / "step2"
    assert_ok(step2(out, *FAST, "--max_steps", "40", "--data_path", str(data), "--data_split", "0,1,0",
                    "--lora_dim", "8", "--only_optimize_lora", "--lora_learning_rate", "5e-3"))  # fmt: skip
    s = json.loads((out / "summary.json").read_text())
    assert s["lora_dim"] == 8
    assert s["eval_accuracy_end"] > s["eval_accuracy_start"] + 0.2, s
    auto = AutoModelForSequenceClassification.from_pretrained(out)
    assert not [n for n, _ in auto.named_parameters() if "lora_" in n]
    # the score statistics reach the merged model's config.json through the peft wrapper
    saved = json.loads((out / "config.json").read_text())["score_normalization"]
    assert saved == s["score_normalization"] and saved["std"] > 0


def test_rw_eval_refuses_a_causal_lm(tmp_path):
    from dschat.models.builtin import materialize

    proc = run_main_in_process(
        RW_EVAL, ["--model", materialize("builtin:micro-llama"), "--prompt", "x", "--response", "y"]
    )
    error_line(proc, "not a trained reward model")


@pytest.mark.parametrize(("flag", "value", "message"), [("--max_samples", "-2", "--max_samples -2: must be 0"),
                                                         ("--batch_size", "0", "--batch_size 0: must be at least 1")])  # fmt: skip
def test_rw_eval_refuses_bad_counts_before_loading(tmp_path, flag, value, message):
    """A negative --max_samples sliced rows off the end; --batch_size 0 failed after the model loaded."""
    proc = run_main_in_process(RW_EVAL, ["--model", str(tmp_path / "no-model"), "--prompt", "x", "--response", "y",
                                         flag, value])  # fmt: skip
    error_line(proc, message)


# The run the equivalence tests compare with: fp32, a train row per step, global batch 16 on one rank as
# 8 x 2 accumulation, packed pairs (the default). One run, shared.
EXACT = [*FAST, "--max_steps", "6", "--dtype", "fp32", "--log_interval", "1", "--max_eval_samples", "64",
         "--data_split", "0,1,0", "--per_device_train_batch_size", "8"]  # fmt: skip


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> tuple[Path, list[str]]:
    """(the reference run's output directory, the flags that reproduce it on its data)."""
    tmp = tmp_path_factory.mktemp("rm-exact")
    flags = [*EXACT, "--data_path", str(preference_file(tmp / "pairs.jsonl", n=240))]
    assert_ok(step2(tmp / "one", *flags, "--gradient_accumulation_steps", "2"))
    return tmp / "one", flags


@pytest.mark.slow
@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="two CPU ranks need two cores")
def test_two_ranks_zero3_match_one_rank(reference, tmp_path):
    from dschat.utils.dist import free_port

    one, flags = reference
    two = tmp_path / "two"
    proc = run_cmd(["-m", "deepspeed.launcher.runner", "--master_port", str(free_port()), "--num_gpus", "2", str(STEP2),
                    "--output_dir", str(two), *flags, "--zero_stage", "3"], env=cpu_ranks_env())  # fmt: skip
    assert_ok(proc)
    a, b = train_rows(one), train_rows(two)
    assert [r["step"] for r in a] == [r["step"] for r in b] == list(range(1, 7))
    for x, y in zip(a, b):
        assert x["loss"] == pytest.approx(y["loss"], rel=2e-3, abs=2e-3)
    # the saved score statistics: the same pairs counted once across the two ranks' slices
    norms = [json.loads((d / "summary.json").read_text())["score_normalization"] for d in (one, two)]
    assert norms[0]["n"] == norms[1]["n"] > 0 and norms[0]["source"] == "eval_pairs"
    assert (norms[1]["mean"], norms[1]["std"]) == pytest.approx(
        (norms[0]["mean"], norms[0]["std"]), rel=2e-3, abs=2e-3
    )


def test_shared_prompt_trains_like_unpacked_rows(reference, tmp_path):
    """--share_prompt (packed pairs, the default) and --no_share_prompt run the same maths: in fp32 the
    losses, the accuracy and the saved scores agree to rounding, and the packed run computes fewer tokens."""
    packed, flags = reference
    plain = tmp_path / "plain"
    assert_ok(proc := step2(plain, *flags, "--gradient_accumulation_steps", "2", "--no_share_prompt"))
    summaries = [json.loads((d / "summary.json").read_text()) for d in (packed, plain)]
    assert summaries[0]["share_prompt"] is True and summaries[1]["share_prompt"] is False
    assert "packed pairs match unpacked rows" in (packed / "training.log").read_text()
    assert "packed pairs match unpacked rows" not in proc.stdout + proc.stderr
    rows = [train_rows(packed), train_rows(plain)]
    assert [r["loss"] for r in rows[0]] == pytest.approx([r["loss"] for r in rows[1]], rel=1e-4)
    for key in ("eval_accuracy_end", "eval_chosen_mean", "eval_rejected_mean"):
        assert summaries[0][key] == pytest.approx(summaries[1][key], rel=1e-4, abs=1e-5), key
    # the same pairs' tokens are counted; the packed run computed fewer (each prompt once)
    assert [r["tokens"] for r in rows[0]] == [r["tokens"] for r in rows[1]]
    for p, u in zip(*rows):
        assert p["computed_tokens_per_sec"] / p["tokens_per_sec"] < 0.8
        assert u["computed_tokens_per_sec"] == pytest.approx(u["tokens_per_sec"])


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_bad_pairs_are_counted_and_reported(tmp_path):
    good = [
        {"prompt": f"\n\nHuman: q{i}\n\nAssistant:", "chosen": f" yes {i}", "rejected": f" no {i}"}
        for i in range(60)
    ]
    rows = [
        *good,
        {
            "prompt": "\n\nHuman: same\n\nAssistant:",
            "chosen": " x",
            "rejected": " x ",
        },  # identical after strip
        {"prompt": "\n\nHuman: empty\n\nAssistant:", "chosen": " ", "rejected": " y"},
        {
            "prompt": "\n\nHuman: " + "long " * 80 + "\n\nAssistant:",
            "chosen": " a",
            "rejected": " b",
        },  # prompt truncated
    ]
    data = write_jsonl(tmp_path / "pairs.jsonl", rows)
    out = tmp_path / "out"
    proc = step2(out, *FAST, "--data_path", str(data), "--data_split", "0,1,0", "--max_steps", "2",
                 "--max_seq_len", "64", "--per_device_train_batch_size", "4")  # fmt: skip
    assert_ok(proc)
    cfg = json.loads((out / "dschat_config.json").read_text())
    train, evals = cfg["data"]["train"], cfg["data"]["eval"]
    assert train["dropped_identical"] + evals["dropped_identical"] == 1
    assert train["dropped_empty_response"] + evals["dropped_empty_response"] == 1
    assert train["prompt_truncated"] + evals["prompt_truncated"] == 1
    assert "dropped 1 identical" in proc.stdout or "dropped 0 identical" in proc.stdout


def test_length_expert_is_fitted_logged_and_saved(tmp_path):
    # The chosen answer is the longer one in 3 of 4 pairs: the length-only expert comes out positive,
    # right on those 3 in 4, and the run logs it and saves it (the option in the config, w in the summary).
    rows = [
        {"prompt": f"\n\nHuman: q{i}\n\nAssistant:", "chosen": " yes" * (3 if i % 4 else 1),
         "rejected": " no" * (1 if i % 4 else 3)}
        for i in range(64)
    ]  # fmt: skip
    data = write_jsonl(tmp_path / "pairs.jsonl", rows)
    out = tmp_path / "out"
    proc = step2(out, *FAST, "--data_path", str(data), "--data_split", "0,1,0", "--max_steps", "2",
                 "--per_device_train_batch_size", "4", "--length_expert")  # fmt: skip
    assert_ok(proc)
    s = json.loads((out / "summary.json").read_text())
    assert s["length_expert_coef"] > 0
    assert s["length_expert_train_accuracy"] == pytest.approx(0.75, abs=0.1)  # this step's share of the pairs
    assert "length expert: P(chosen wins) = sigmoid(" in proc.stdout + proc.stderr
    assert json.loads((out / "dschat_config.json").read_text())["length_expert"] is True


def test_missing_rejected_field_is_one_clear_line(tmp_path):
    data = write_jsonl(tmp_path / "sft.jsonl", [{"prompt": f"p{i}", "response": f" r{i}"} for i in range(40)])
    proc = step2(tmp_path / "out", *FAST, "--data_path", str(data), "--data_split", "0,1,0")
    line = error_line(proc, "missing field 'rejected'")
    assert str(data) in line
    assert not (tmp_path / "out" / "summary.json").exists()


def test_policy_negatives_add_the_policys_own_mistakes(tmp_path):
    out = tmp_path / "step2"
    # An untrained policy answers (almost) everything wrong: each of its distinct answers becomes a pair.
    # (the top block alone trains: the end's evaluation starts its repeated batches above the bottom one)
    proc = step2(out, *FAST, "--max_steps", "3", "--policy_negatives_from", "builtin:micro-llama",
                 "--policy_negatives_max_prompts", "16", "--policy_negatives_per_prompt", "2",
                 "--policy_negatives_max_new_tokens", "6", "--trainable_layers", "1")  # fmt: skip
    assert_ok(proc)
    s = json.loads((out / "summary.json").read_text())
    train, held_out = s["policy_negatives"]["train"], s["policy_negatives"]["eval"]
    assert train["prompts"] == 16 and train["answers"] == 32
    assert 0 < train["pairs"] <= train["wrong_answers"] <= 32
    assert held_out["pairs"] > 0
    assert 0.0 <= s["eval_policy_negatives_accuracy_end"] <= 1.0
    # The reward model's pick among each held-out prompt's answers can be right only where one is.
    assert 0.0 <= s["eval_policy_best_of_k_accuracy_end"] <= held_out["pass_at_k"] <= 1.0
    assert held_out["sampled_accuracy"] <= held_out["pass_at_k"]
    # reported at start and end (the value itself: tests/unit/test_policy_pairs.py, by hand)
    for end in ("start", "end"):
        assert -1.0 <= s[f"eval_policy_advantage_correlation_{end}"] <= 1.0
    assert (
        "on the policy's own mistakes" in proc.stderr + proc.stdout
        and "its pick of the policy's 2" in proc.stderr + proc.stdout
    )
    assert (
        "step 2's evaluation: repeated batches start above the frozen bottom 1 blocks"
        in proc.stdout + proc.stderr
    )
    rows = [json.loads(x) for x in (out / "policy_negatives_train.jsonl").read_text().splitlines()]
    assert len(rows) == train["pairs"] and all(r["chosen"] != r["rejected"] for r in rows)
    # the score normalisation is measured on the policy's own answers to the held-out prompts
    norm = s["score_normalization"]
    assert norm["source"] == "policy_samples" and norm["n"] == held_out["answers"] and norm["std"] > 0


def test_policy_negatives_from_a_missing_model_is_one_line(tmp_path):
    proc = step2(
        tmp_path / "o",
        *FAST,
        "--max_steps",
        "1",
        "--policy_negatives_from",
        str(tmp_path / "nope"),
        in_process=True,
    )
    error_line(proc, "--policy_negatives_from", str(tmp_path / "nope"))
