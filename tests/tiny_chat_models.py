"""Tiny models with known behaviour for the chat and prompt-comparison tests, built in well under a second.

A *chain model* is a micro Llama whose layers add nothing to the residual stream (``o_proj`` and
``down_proj`` zeroed), so the logits at a position depend only on that position's token. Its
embeddings give each character of a chain its own basis direction and its output head maps that
direction to the next character, so greedy (and, with logits near 80, practically any sampling)
continuation of a prompt ending in ``:`` spells the chain out: ``chain_model(d, " 579", end="eos")``
answers every Human/Assistant prompt with `` 579`` and then EOS. ``end="cycle"`` makes the last
character lead back to ``:``, so the reply repeats ``chain + ":"`` until ``--max_new_tokens``.

A *sign reward model* scores a text by its last token: +8 if it is ``plus``, -8 if ``minus``,
roughly standard normal otherwise (same zeroed layers, score head along one embedding direction).
"""

from __future__ import annotations

from pathlib import Path

import torch

from dschat.models.builtin import build_config, build_tokenizer

SCALE = 10.0


def _token_id(tokenizer, ch: str) -> int:
    ids = tokenizer.encode(ch, add_special_tokens=False)
    assert len(ids) == 1, (ch, ids)
    return ids[0]


def _silent_layers(model) -> None:
    """Zero what every layer writes to the residual stream: hidden state = embedding of the token."""
    for layer in model.model.layers:
        layer.self_attn.o_proj.weight.data.zero_()
        layer.mlp.down_proj.weight.data.zero_()


def chain_model(out_dir: str | Path, chain: str, *, end: str = "eos", context: int | None = None) -> Path:
    """Save a causal LM that continues ``...:`` with ``chain`` (then EOS, or ``:`` and the chain again);
    ``context`` overrides the maximum sequence length (rotary positions: no weights depend on it)."""
    from transformers import LlamaForCausalLM

    assert end in ("eos", "cycle")
    tokenizer = build_tokenizer()
    torch.manual_seed(0)
    config = build_config("micro-llama", len(tokenizer))
    if context is not None:
        config.max_position_embeddings = tokenizer.model_max_length = context
    model = LlamaForCausalLM(config).eval()
    _silent_layers(model)
    seq = [":", *chain]
    assert len(set(seq)) == len(seq), "a first-order chain needs distinct characters"
    emb = model.model.embed_tokens.weight.data
    head = model.lm_head.weight.data
    head.zero_()
    ids = [_token_id(tokenizer, ch) for ch in seq]
    for i, tid in enumerate(ids):
        emb[tid] = 0.0
        emb[tid, i] = SCALE
    for i in range(len(ids)):
        nxt = ids[i + 1] if i + 1 < len(ids) else (tokenizer.eos_token_id if end == "eos" else ids[0])
        head[nxt, i] = SCALE
    out_dir = Path(out_dir)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return out_dir


def sign_reward_model(out_dir: str | Path, plus: str = "9", minus: str = "8") -> Path:
    """Save a 1-label sequence-classification model: +8 for a text ending in ``plus``, -8 for ``minus``."""
    from transformers import LlamaForSequenceClassification

    tokenizer = build_tokenizer()
    config = build_config("micro-llama", len(tokenizer))
    config.num_labels = 1
    torch.manual_seed(0)
    model = LlamaForSequenceClassification(config).eval()
    _silent_layers(model)
    emb = model.model.embed_tokens.weight.data
    emb[_token_id(tokenizer, plus)] = 0.0
    emb[_token_id(tokenizer, plus), 0] = SCALE
    emb[_token_id(tokenizer, minus)] = 0.0
    emb[_token_id(tokenizer, minus), 0] = -SCALE
    model.score.weight.data.zero_()
    model.score.weight.data[0, 0] = 1.0  # RMSNorm turns +-SCALE e_0 into +-sqrt(64) = +-8
    out_dir = Path(out_dir)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return out_dir


def lora_adapter(out_dir: str | Path, base_dir: str | Path, *, seed: int = 0) -> Path:
    """Save a peft LoRA adapter (non-zero, so it changes the model) for the causal LM in ``base_dir``."""
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaForCausalLM

    base = LlamaForCausalLM.from_pretrained(base_dir)
    torch.manual_seed(seed)
    cfg = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    peft_model = get_peft_model(base, cfg)
    out_dir = Path(out_dir)
    peft_model.save_pretrained(out_dir)
    return out_dir
