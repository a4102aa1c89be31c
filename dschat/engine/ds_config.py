"""DeepSpeed configuration dictionaries (pure: no deepspeed import, unit-testable)."""

from __future__ import annotations

from typing import Any

# DeepSpeed's gradient-reduction bucket, in elements. Its default (5e8) is a buffer of 1 GB in bf16 that
# ZeRO-3 keeps for the whole run on every device of every trained engine, and ZeRO-1/2 allocate for each
# backward (2 GB under ZeRO-1, in fp32), whatever the model's size; 5e7 keeps messages of 100 MB, large
# enough for the collectives' bandwidth. The memory plan counts it (dschat.memory.gradient_bucket_bytes).
REDUCE_BUCKET_SIZE = 50_000_000


def train_ds_config(
    *,
    zero_stage: int,
    dtype: str,
    micro_batch_size: int,
    gradient_accumulation_steps: int,
    world_size: int,
    offload: bool = False,
    max_grad_norm: float = 1.0,
    stage3_param_persistence_threshold: float = 1e4,
    stage3_max_live_parameters: float = 3e7,
    stage3_prefetch_bucket_size: float = 3e7,
    node_local_storage: bool = False,
) -> dict[str, Any]:
    """The config of a trained engine. ``dtype`` is the resolved one: ``fp32``, ``fp16`` or ``bf16``.

    ``node_local_storage``: DeepSpeed writes checkpoints by local rather than global rank, so that every
    node's own disk holds what its ranks need to resume (clusters without a shared filesystem).

    ``train_batch_size`` is stated explicitly (micro x accumulation x world) so DeepSpeed checks it.
    """
    device = "cpu" if offload else "none"
    zero: dict[str, Any] = {
        "stage": zero_stage,
        "overlap_comm": False,
        "contiguous_gradients": True,
        "reduce_bucket_size": REDUCE_BUCKET_SIZE,
    }
    if zero_stage >= 1 and offload:
        zero["offload_optimizer"] = {"device": device, "pin_memory": False}
    if zero_stage == 3:
        zero.update(
            {
                "offload_param": {"device": device, "pin_memory": False} if offload else {"device": "none"},
                "stage3_param_persistence_threshold": stage3_param_persistence_threshold,
                "stage3_max_live_parameters": stage3_max_live_parameters,
                "stage3_prefetch_bucket_size": stage3_prefetch_bucket_size,
                "stage3_gather_16bit_weights_on_model_save": False,
                "memory_efficient_linear": False,
            }
        )
    cfg: dict[str, Any] = {
        "train_batch_size": micro_batch_size * gradient_accumulation_steps * world_size,
        "train_micro_batch_size_per_gpu": micro_batch_size,
        "gradient_accumulation_steps": gradient_accumulation_steps,
        "gradient_clipping": max_grad_norm if max_grad_norm > 0 else 0.0,
        "zero_optimization": zero,
        "fp16": {"enabled": dtype == "fp16", "loss_scale_window": 100, "initial_scale_power": 16},
        "bf16": {"enabled": dtype == "bf16"},
        "steps_per_print": 10**9,  # our own logger reports progress
        "wall_clock_breakdown": False,
        "zero_allow_untested_optimizer": True,
    }
    if node_local_storage:
        cfg["checkpoint"] = {"use_node_local_storage": True}
    return cfg


def frozen_stage(trained_stage: int) -> int:
    """The ZeRO stage of a frozen model (reference, reward, judge) beside engines trained at
    ``trained_stage``: 3 stays 3 (its parameters are partitioned like the trained ones'), 1 and 2 become 0,
    since they partition only optimizer states and gradients, which a frozen model does not have."""
    return 3 if trained_stage == 3 else 0


def eval_ds_config(
    *, zero_stage: int, dtype: str, micro_batch_size: int, world_size: int, offload: bool = False
) -> dict[str, Any]:
    """The config of a frozen engine (reference and reward models in step 3): no optimizer states."""
    cfg = train_ds_config(
        zero_stage=frozen_stage(zero_stage),
        dtype=dtype,
        micro_batch_size=micro_batch_size,
        gradient_accumulation_steps=1,
        world_size=world_size,
        offload=offload and zero_stage == 3,
    )
    cfg["gradient_clipping"] = 0.0
    return cfg
