"""dschat.launch.presets: a preset file that cannot mean what it says is one line naming file and key."""

from __future__ import annotations

import pytest

from dschat.launch.presets import PRESETS, read_preset
from dschat.utils.errors import UserError


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        # wrong types reached argparse and crashed there (TypeError tracebacks)
        ("model: 5\n", "model must be a model name or path (a string), got 5"),
        ("reward_model: [a]\n", "reward_model must be a model name or path (a string), got ['a']"),
        # flags train.py sets after the preset's: the preset's value was dropped without a word
        ("step1: {--output_dir: /tmp/x}\n", "'step1' sets --output_dir, which train.py's --output-dir sets"),
        ("step2: {--model_name_or_path: m}\n", "'step2' sets --model_name_or_path, which train.py sets"),
        ("step3: {--critic_model_name_or_path: m}\n", "'step3' sets --critic_model_name_or_path"),
        ("step1: {--resume: true}\n", "'step1' sets --resume, which is train.py's own switch"),
        (b"model: caf\xe9\n", "not UTF-8 text"),
    ],
)
def test_a_preset_that_cannot_mean_what_it_says_is_one_line(tmp_path, text, needle):
    path = tmp_path / "p.yaml"
    path.write_bytes(text) if isinstance(text, bytes) else path.write_text(text)
    with pytest.raises(UserError, match=rf"^{path}: .*") as err:
        read_preset(path)
    assert needle in str(err.value) and "\n" not in str(err.value)


def test_every_shipped_preset_reads():
    for path in sorted(PRESETS.glob("*.yaml")):
        assert read_preset(path), path
