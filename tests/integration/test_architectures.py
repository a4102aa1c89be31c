"""ZeRO-3 loading through ``from_pretrained`` with a live HfDeepSpeedConfig, for several architectures.

Building OPT from a config inside ``deepspeed.zero.Init`` breaks in transformers 5.23; loading a saved
directory is the path dschat uses, and it must give partitioned parameters with the same function.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import run_cmd

SCRIPT = Path(__file__).with_name("zero3_archs_script.py")


@pytest.mark.slow
def test_zero3_from_pretrained_for_opt_gpt2_qwen2_mistral_qwen3_gemma2(tmp_path):
    proc = run_cmd([str(SCRIPT), str(tmp_path)], timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = {r["arch"]: r for r in (json.loads(x) for x in proc.stdout.splitlines() if x.startswith("{"))}
    assert set(rows) == {"opt", "gpt2", "qwen2", "mistral", "qwen3", "gemma2"}
    for name, r in rows.items():
        assert r["partitioned"], f"{name}: parameters were not partitioned by zero.Init"
        assert r["params"] == r["expected"], name
        # Same weights as the saved model: the ZeRO-3 forward gives the plain model's loss.
        assert r["loss"] == pytest.approx(r["reference_loss"], rel=1e-4), name
        assert r["trained"], name
