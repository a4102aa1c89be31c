"""Attention for the inference copy on CPU: SDPA computed in fp32 for bf16/fp16 tensors, registered
with transformers under ``dschat_sdpa``, and a KV cache that stores keys and values in fp32 once."""

from __future__ import annotations

import torch
from torch import nn

FAST_ATTENTION = "dschat_sdpa"
_registered = False


def _fast_sdpa(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask,
               **kwargs):  # fmt: skip
    """SDPA, computed in fp32 for bf16/fp16 tensors on CPU: PyTorch's CPU SDPA runs about 5x slower in
    bf16 than in fp32 at decoding shapes (one query row), while the matmuls stay faster in bf16."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if query.device.type == "cpu" and query.dtype in (torch.bfloat16, torch.float16):
        if attention_mask is not None and attention_mask.is_floating_point():
            attention_mask = attention_mask.float()
        out, weights = sdpa_attention_forward(module, query.float(), key.float(), value.float(), attention_mask,
                                              **kwargs)  # fmt: skip
        return out.to(query.dtype), weights
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
