"""dschat.engine.ds_config: the DeepSpeed config dictionaries (pure functions)."""

from __future__ import annotations

import json

import pytest

from dschat.engine.ds_config import eval_ds_config, frozen_stage, train_ds_config

STAGE3_KEYS = {
    "offload_param",
    "stage3_param_persistence_threshold",
    "stage3_max_live_parameters",
    "stage3_prefetch_bucket_size",
    "stage3_gather_16bit_weights_on_model_save",
    "memory_efficient_linear",
}


def cfg(**kw):
    base = {
        "zero_stage": 2,
        "dtype": "bf16",
        "micro_batch_size": 4,
        "gradient_accumulation_steps": 8,
        "world_size": 2,
    }
    return train_ds_config(**{**base, **kw})


def test_batch_sizes():
    c = cfg()
    assert c["train_batch_size"] == 64
    assert c["train_micro_batch_size_per_gpu"] == 4
    assert c["gradient_accumulation_steps"] == 8
    assert cfg(micro_batch_size=3, gradient_accumulation_steps=1, world_size=5)["train_batch_size"] == 15


def test_stage2_without_offload():
    z = cfg()["zero_optimization"]
    assert z == {
        "stage": 2,
        "overlap_comm": False,
        "contiguous_gradients": True,
        "reduce_bucket_size": 50_000_000,
    }


@pytest.mark.parametrize("stage", [1, 2])
def test_offload_optimizer_only_when_offload(stage):
    assert "offload_optimizer" not in cfg(zero_stage=stage)["zero_optimization"]
    z = cfg(zero_stage=stage, offload=True)["zero_optimization"]
    assert z["offload_optimizer"] == {"device": "cpu", "pin_memory": False}
    assert not STAGE3_KEYS & set(z)


def test_stage0_never_offloads():
    z = cfg(zero_stage=0, offload=True)["zero_optimization"]
    assert z == {
        "stage": 0,
        "overlap_comm": False,
        "contiguous_gradients": True,
        "reduce_bucket_size": 50_000_000,
    }


def test_stage3_without_offload():
    z = cfg(zero_stage=3)["zero_optimization"]
    assert set(z) >= STAGE3_KEYS
    assert "offload_optimizer" not in z
    assert z["offload_param"] == {"device": "none"}
    assert z["stage3_param_persistence_threshold"] == 1e4
    assert z["stage3_max_live_parameters"] == 3e7
    assert z["stage3_prefetch_bucket_size"] == 3e7
    assert z["stage3_gather_16bit_weights_on_model_save"] is False


def test_stage3_with_offload():
    z = cfg(zero_stage=3, offload=True, stage3_max_live_parameters=5e6)["zero_optimization"]
    assert z["offload_param"] == {"device": "cpu", "pin_memory": False}
    assert z["offload_optimizer"] == {"device": "cpu", "pin_memory": False}
    assert z["stage3_max_live_parameters"] == 5e6


@pytest.mark.parametrize(
    ("dtype", "fp16", "bf16"), [("bf16", False, True), ("fp16", True, False), ("fp32", False, False)]
)
def test_precision_flags(dtype, fp16, bf16):
    c = cfg(dtype=dtype)
    assert c["fp16"]["enabled"] is fp16
    assert c["bf16"]["enabled"] is bf16


def test_gradient_clipping():
    assert cfg()["gradient_clipping"] == 1.0
    assert cfg(max_grad_norm=0.5)["gradient_clipping"] == 0.5
    assert cfg(max_grad_norm=0.0)["gradient_clipping"] == 0.0
    assert cfg(max_grad_norm=-1.0)["gradient_clipping"] == 0.0


def test_json_serialisable():
    c = cfg(zero_stage=3, offload=True)
    assert json.loads(json.dumps(c)) == c


def test_eval_config_drops_optimizer_bits():
    c = eval_ds_config(zero_stage=2, dtype="fp16", micro_batch_size=8, world_size=4, offload=True)
    assert c["train_batch_size"] == 32
    assert c["gradient_accumulation_steps"] == 1
    assert c["gradient_clipping"] == 0.0
    assert c["zero_optimization"] == {
        "stage": 0,
        "overlap_comm": False,
        "contiguous_gradients": True,
        "reduce_bucket_size": 50_000_000,
    }
    assert c["fp16"]["enabled"] is True


def test_eval_config_keeps_stage3():
    z = eval_ds_config(zero_stage=3, dtype="bf16", micro_batch_size=2, world_size=1)["zero_optimization"]
    assert z["stage"] == 3 and z["offload_param"] == {"device": "none"}
    z = eval_ds_config(zero_stage=3, dtype="bf16", micro_batch_size=2, world_size=1, offload=True)[
        "zero_optimization"
    ]
    assert z["offload_param"] == {"device": "cpu", "pin_memory": False}


@pytest.mark.parametrize("trained, frozen", [(0, 0), (1, 0), (2, 0), (3, 3)])
def test_frozen_models_partition_parameters_only_under_zero3(trained, frozen):
    # ZeRO 1 and 2 partition optimizer states and gradients, which a frozen model has none of
    assert frozen_stage(trained) == frozen
    cfg = eval_ds_config(zero_stage=trained, dtype="bf16", micro_batch_size=2, world_size=1)
    assert cfg["zero_optimization"]["stage"] == frozen
