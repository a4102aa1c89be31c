"""Which parameters train under --trainable_layers: found for causal LMs and reward models, tied or not."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, LlamaForSequenceClassification

from dschat.models.layers import decoder_layers, freeze_below, top_block_names
from dschat.models.lora import inject_lora
from dschat.utils.errors import UserError


def llama(cls=LlamaForCausalLM, tied: bool = False, layers: int = 3):
    cfg = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=layers,
                      num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=tied, num_labels=1,
                      pad_token_id=0)  # fmt: skip
    torch.manual_seed(0)
    return cls(cfg)


def trainable(model) -> set[str]:
    return {n for n, p in model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("tied", [False, True])
def test_top_layers_of_a_causal_lm(tied):
    model = llama(tied=tied)
    counts = freeze_below(model, 2)
    names = trainable(model)
    assert all(
        n.startswith(("model.layers.1.", "model.layers.2.")) or n == "model.norm.weight" for n in names
    )
    assert any(n.startswith("model.layers.1.") for n in names) and "model.norm.weight" in names
    assert not model.model.embed_tokens.weight.requires_grad and not model.lm_head.weight.requires_grad
    per_layer = sum(p.numel() for p in model.model.layers[0].parameters())
    assert counts == {"trainable": 2 * per_layer + 16, "total": sum(p.numel() for p in set(model.parameters())),
                      "layers": 3, "trainable_layers": 2}  # fmt: skip


def test_reward_model_keeps_its_score_head():
    model = llama(LlamaForSequenceClassification)
    freeze_below(model, 1)
    assert trainable(model) == {"score.weight", "model.norm.weight"} | {
        n for n, _ in model.named_parameters() if n.startswith("model.layers.2.")
    }


def test_backward_stops_at_the_first_trainable_layer():
    model = llama()
    freeze_below(model, 1)
    seen = []
    for i, block in enumerate(model.model.layers):
        block.register_full_backward_hook(lambda m, gi, go, i=i: seen.append(i))
    model(input_ids=torch.tensor([[1, 2, 3]])).logits.sum().backward()
    assert seen == [2]  # no gradient flows into the frozen blocks below


def test_what_runs_before_the_first_block_is_frozen_too():
    """OPT-350m's projection of the embeddings up to the hidden size and BLOOM's layer norm of the
    embeddings run before block 0: left trainable, a weight below the top K trained and the backward pass
    ran through every frozen block. Their final norm (and OPT's projection back down) run after the blocks
    and train."""
    from transformers import BloomConfig, BloomForCausalLM, OPTConfig, OPTForCausalLM

    torch.manual_seed(0)
    opt = OPTForCausalLM(OPTConfig(vocab_size=64, hidden_size=16, word_embed_proj_dim=8, ffn_dim=32,
                                   num_hidden_layers=3, num_attention_heads=2, max_position_embeddings=32))  # fmt: skip
    freeze_below(opt, 1)
    names = trainable(opt)
    assert "model.decoder.project_in.weight" not in names and "model.decoder.project_out.weight" in names
    assert "model.decoder.final_layer_norm.weight" in names
    assert not [n for n in names if n.startswith(("model.decoder.layers.0.", "model.decoder.layers.1."))]
    bloom = BloomForCausalLM(BloomConfig(vocab_size=64, hidden_size=16, n_layer=3, n_head=2))
    freeze_below(bloom, 1)
    names = trainable(bloom)
    assert not [n for n in names if "word_embeddings_layernorm" in n] and "transformer.ln_f.weight" in names
    seen = []
    for i, block in enumerate(bloom.transformer.h):
        block.register_full_backward_hook(lambda m, gi, go, i=i: seen.append(i))
    bloom(input_ids=torch.tensor([[1, 2, 3]])).logits.sum().backward()
    assert seen == [2]


def test_lora_goes_into_the_top_layers_only():
    model = llama()
    peft = inject_lora(model, dim=2, only_optimize_lora=True, within=top_block_names(model, 1))
    freeze_below(peft, 1)
    names = trainable(peft)
    assert names and all(".layers.2." in n and "lora_" in n for n in names)
    assert decoder_layers(peft)[0].endswith("model.layers")


def test_more_layers_than_the_model_has_is_one_line():
    with pytest.raises(UserError, match="--actor_trainable_layers 5: the model has only 3 decoder layers"):
        freeze_below(llama(), 5, flag="--actor_trainable_layers")
