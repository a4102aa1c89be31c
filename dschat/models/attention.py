"""Attention on CPU for 16-bit models: SDPA computed in fp32 for bf16/fp16 tensors, registered with
transformers under ``dschat_sdpa``, and a KV cache that stores keys and values in fp32 once.

Every model the steps load uses it in place of ``sdpa`` (:func:`use_fast_attention`). PyTorch's CPU SDPA
in bf16 is about 2x slower than in fp32 at decoding shapes (one query row, with the fp32 cache) and up to
1.7x slower forward and backward at short training shapes, while the matmuls stay faster in bf16
(:func:`_in_fp32` has the measurements, and where bf16 would win). Elsewhere (fp32 tensors, a GPU) it is
``sdpa`` itself, so the switch changes little there: on CUDA, cuDNN's kernel is left out
(:func:`sdpa_backends`: NaN gradients with masks, a new plan per length without). Right-padded batches
need no mask at all (:func:`causal_only`). The mask is SDPA's.
"""

from __future__ import annotations

import torch
from torch import nn

FAST_ATTENTION = "dschat_sdpa"
_registered = False


def _in_fp32(x: torch.Tensor) -> bool:
    """Whether SDPA on ``x`` (a query, or a weight of the model) runs in fp32: for bf16/fp16 tensors on
    CPU, always.

    Measured on 2 CPU cores (2026-11-27, SmolLM2's 9 heads of 64): one query row against an fp32 KV cache
    (:func:`fp32_kv_cache`) 1.2 ms against 2.7 in bf16 (64 rows x 110 keys); forward and backward
    22.4 ms against 34.5 at 16 rows x 144 positions, but 59.1 against 53.3 at 256; a forward without
    gradient (reference, reward model, evaluation) 11.8 against 6.0 at 16 x 144, the casts included. A
    finer rule (bf16 for forwards without gradient and for more than 192 keys) was slower end to end all
    the same: step 3 of the main job, 12 rounds, took 12.8-15.3 s in its updates against 9.1-9.4 with this
    one (6 and 3 runs; the cause was not found), and its experience passes were no faster."""
    return x.device.type == "cpu" and x.dtype in (torch.bfloat16, torch.float16)


def sdpa_backends(device_type: str) -> list | None:
    """The SDPA kernels allowed on ``device_type``: on CUDA every one but cuDNN's; elsewhere None
    (PyTorch's own choice).

    With a mask, cuDNN's SDPA backward (PyTorch 2.11 to 2.13, H100/H200, where it is the default
    kernel) returns NaN query gradients when a row's log-sum-exp is below about -88.7, which a fully
    masked row (a left-padding position) always is; the forward stays right (pytorch/pytorch#196678,
    huggingface/trl#7181). Every gradient of the model is then NaN and DeepSpeed skips every step: step
    3's schedules stood still on an H200 on 2026-11-29, and move with this rule (2026-11-30). Without a
    mask (:func:`causal_only`) cuDNN builds a plan for every new sequence length, and length-grouped
    batches bring one nearly every step: step 1 on ``builtin:llama-100m`` (H200, bf16, micro-batch 64,
    up to 1024 tokens) ran at 122k real tokens/s with cuDNN's causal kernel, 173k with the mask and the
    memory-efficient kernel, 211k with flash attention's causal kernel (one run each, 2026-11-30)."""
    if device_type != "cuda":
        return None
    from torch.nn.attention import SDPBackend

    return [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def causal_only(attention_mask: torch.Tensor | None) -> torch.Tensor | None:
    """``None`` where ``attention_mask`` (B, T) pads only on the right (or is None), else the mask itself.

    A causal LM gives the same outputs at every real position of a right-padded row with or without
    the mask: padding follows every real token, so causal attention never reaches it, and positions
    count from 0 either way. Without a mask SDPA runs its causal kernel (flash attention on GPUs) instead
    of a masked one (:func:`sdpa_backends` on CUDA). A left-padded row keeps its mask. For a mask on an
    accelerator the check is a host sync; step 1 decides on the CPU batch before moving it."""
    if attention_mask is None or bool((attention_mask[:, 1:] <= attention_mask[:, :-1]).all()):
        return None
    return attention_mask


def _fast_sdpa(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask,
               **kwargs):  # fmt: skip
    """SDPA, computed in fp32 for bf16/fp16 tensors on CPU (:func:`_in_fp32`; the matmuls around it stay
    in 16 bits); otherwise transformers' SDPA, on CUDA without cuDNN's kernel (:func:`sdpa_backends`)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if _in_fp32(query):
        if attention_mask is not None and attention_mask.is_floating_point():
            attention_mask = attention_mask.float()
        out, weights = sdpa_attention_forward(module, query.float(), key.float(), value.float(), attention_mask,
                                              **kwargs)  # fmt: skip
        return out.to(query.dtype), weights
    backends = sdpa_backends(query.device.type)
    if backends is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    from torch.nn.attention import sdpa_kernel

    with sdpa_kernel(backends):
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


_FP32_CACHE: type | None = None


def fp32_kv_cache(config):
    """A dynamic KV cache that keeps keys and values in fp32. With :func:`_fast_sdpa` on CPU each new
    key/value is cast once when it is stored, instead of the whole cache being cast at every step."""
    global _FP32_CACHE
    if _FP32_CACHE is None:
        from transformers import DynamicCache

        class Fp32DynamicCache(DynamicCache):
            def update(self, key_states, value_states, layer_idx, *args, **kwargs):
                return super().update(key_states.float(), value_states.float(), layer_idx, *args, **kwargs)

        _FP32_CACHE = Fp32DynamicCache
    return _FP32_CACHE(config=config)


def use_fast_attention(model: nn.Module) -> nn.Module:
    """Switch ``model`` (a transformers model) from ``sdpa`` to ``dschat_sdpa``, in place; a model on any
    other implementation (eager, flash attention) is left as it is. Not saved: ``config.json`` never
    carries the implementation, so a saved model loads anywhere."""
    config = getattr(model, "config", None)
    if getattr(config, "_attn_implementation", None) == "sdpa":
        register_fast_attention()
        config._attn_implementation = FAST_ATTENTION
    return model


def decode_cache(model: nn.Module):
    """The KV cache for decoding with ``model``: an fp32 one (:func:`fp32_kv_cache`) where its attention
    runs in fp32 (``dschat_sdpa`` with 16-bit weights on CPU), so each new key and value is cast once,
    not the whole cache at every token; otherwise None (the model builds its own)."""
    config = getattr(model, "config", None)
    if getattr(config, "_attn_implementation", None) != FAST_ATTENTION:
        return None
    weight = next(iter(model.parameters()), None)
    return fp32_kv_cache(config) if weight is not None and _in_fp32(weight) else None


def register_fast_attention() -> None:
    """Register :func:`_fast_sdpa` (and SDPA's mask builder) with transformers under ``dschat_sdpa``."""
    global _registered
    if _registered:
        return
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(FAST_ATTENTION, _fast_sdpa)
    AttentionMaskInterface.register(FAST_ATTENTION, sdpa_mask)
    _registered = True
