"""``--dtype auto``: bf16 only where the hardware computes in bf16, fp32 elsewhere.

On an AVX-512 CPU without AVX512-BF16 or AMX, oneDNN still accepts bf16 (it converts to fp32 around
every matmul), so a "does bf16 run" probe says yes while bf16 training runs about 3x slower than fp32
(measured 2026-11-28, SmolLM2 top 8 layers on 2 cores: 114 against 359 real tokens/s in step 1, 187
against 501 in step 2). The CPU's features are faked here: these are the probes' answers, not torch's.
"""

from __future__ import annotations

import pytest
import torch

from dschat.engine import core
from dschat.planning import resolve_plan_dtype
from dschat.utils.errors import UserError


def fake_cpu(monkeypatch, *, machine="x86_64", onednn_bf16=True, avx512_bf16=False, amx=False) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(core.platform, "machine", lambda: machine)
    monkeypatch.setattr(core, "_onednn_bf16", lambda: onednn_bf16)
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: avx512_bf16)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx)


@pytest.mark.parametrize(
    ("features", "auto"),
    [
        ({}, "fp32"),  # AVX-512 only: bf16 emulated
        ({"avx512_bf16": True}, "bf16"),  # Cooper Lake, Zen 4
        ({"amx": True}, "bf16"),  # Sapphire Rapids and later
        ({"onednn_bf16": False}, "fp32"),  # AVX2 only
        ({"machine": "AMD64", "avx512_bf16": True}, "bf16"),  # Windows spells x86-64 so
        ({"avx512_bf16": True, "onednn_bf16": False}, "fp32"),  # a torch without oneDNN's bf16: as explicit
        ({"machine": "aarch64"}, "bf16"),  # Arm: oneDNN says yes only where the BF16 extension is
        ({"machine": "aarch64", "onednn_bf16": False}, "fp32"),
        ({"machine": "arm64", "onednn_bf16": False}, "fp32"),  # macOS
    ],
)
def test_auto_is_bf16_only_where_the_cpu_computes_in_bf16(monkeypatch, features, auto):
    fake_cpu(monkeypatch, **features)
    assert core.resolve_dtype("auto") == auto
    assert resolve_plan_dtype("auto", on_gpu=False) == auto  # the memory planner resolves it the same way


def test_the_real_probes_answer():
    """Unpatched, on whatever CPU or GPU runs the tests: the private torch probes exist or are skipped."""
    assert core.auto_dtype() in ("bf16", "fp32")


def test_a_torch_without_the_cpu_probes_trains_in_fp32(monkeypatch):
    fake_cpu(monkeypatch, avx512_bf16=True, amx=True)
    monkeypatch.delattr(torch.cpu, "_is_avx512_bf16_supported")
    monkeypatch.delattr(torch.cpu, "_is_amx_tile_supported")
    assert core.resolve_dtype("auto") == "fp32"


@pytest.mark.parametrize(("units", "auto"), [(True, "bf16"), (False, "fp32")])
def test_on_a_gpu_auto_is_bf16_only_with_bf16_units(monkeypatch, units, auto):
    """torch.cuda.is_bf16_supported() says yes on a V100 or T4, which emulate bf16, unless asked not to
    count emulation."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(
        torch.cuda, "is_bf16_supported", lambda including_emulation=True: including_emulation or units
    )
    assert core.resolve_dtype("auto") == auto


def test_asking_for_bf16_on_an_emulating_cpu_runs_it(monkeypatch, caplog):
    """An explicit choice is honoured where bf16 runs at all, if slowly (a user may want bf16's numerics),
    with a warning; it is refused only where it does not run."""
    fake_cpu(monkeypatch)
    with caplog.at_level("WARNING", logger="dschat"):
        assert core.resolve_dtype("bf16") == "bf16"
    assert "emulated" in caplog.text and "picks fp32" in caplog.text
    fake_cpu(monkeypatch, onednn_bf16=False)
    with pytest.raises(UserError, match="--dtype bf16"):
        core.resolve_dtype("bf16")


def test_no_weight_decay_on_norms_whatever_their_name():
    """Norm weights were told by "norm" in their name: GPT-2's ln_1/ln_2/ln_f were decayed (step 2's
    default weight decay is 0.1, pulling a GPT-2 reward model's LayerNorms towards 0)."""
    from transformers import AutoConfig, GPT2LMHeadModel

    from dschat.engine.core import param_groups

    model = GPT2LMHeadModel(
        AutoConfig.for_model("gpt2", vocab_size=50, n_embd=8, n_layer=1, n_head=2, n_positions=16)
    )
    groups = param_groups(model, weight_decay=0.1, lora_lr=None, lr=1e-3)
    decayed = {id(p) for g in groups if g["weight_decay"] > 0 for p in g["params"]}
    names = {n for n, p in model.named_parameters() if id(p) in decayed}
    assert "transformer.h.0.ln_1.weight" not in names and "transformer.ln_f.weight" not in names
    assert "transformer.h.0.attn.c_attn.weight" in names and "transformer.wte.weight" in names
