"""LoRA injection through peft: which layers get adapters, what trains, and merged == unmerged."""

from __future__ import annotations

import pytest
import torch

from dschat.models.builtin import build_config
from dschat.models.lora import inject_lora, lora_target_modules
from dschat.utils.errors import UserError


def tiny_model(seed: int = 0):
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    return LlamaForCausalLM(build_config("micro-llama", vocab_size=64)).eval()


def test_targets_are_linear_layers_inside_the_named_modules():
    model = tiny_model()
    targets = lora_target_modules(model, "layers.")
    # 2 layers x (q, k, v, o, gate, up, down)
    assert len(targets) == 14
    assert all(".layers." in t for t in targets)
    assert "lm_head" not in targets
    assert lora_target_modules(model, "self_attn.q_proj") == [
        "model.layers.0.self_attn.q_proj",
        "model.layers.1.self_attn.q_proj",
    ]


def test_unknown_module_name_is_a_user_error():
    with pytest.raises(UserError, match=r"--lora_module_name 'decoder\.layers\.' matches no Linear"):
        inject_lora(tiny_model(), dim=4, module_name="decoder.layers.")


@pytest.mark.parametrize("only_lora", [True, False])
def test_trainable_parameters(only_lora):
    model = inject_lora(tiny_model(), dim=4, only_optimize_lora=only_lora)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    lora = {n for n in trainable if "lora_" in n}
    assert len(lora) == 28  # A and B for each of the 14 layers
    if only_lora:
        assert trainable == lora
    else:
        assert trainable == {n for n, _ in model.named_parameters()}


def test_a_scalar_head_model_takes_lora_and_keeps_its_head():
    """A reward model or critic (no generation hooks): peft's causal-LM wrapper failed on it."""
    from transformers import LlamaForSequenceClassification

    torch.manual_seed(0)
    config = build_config("micro-llama", vocab_size=64)
    config.num_labels = 1
    base = LlamaForSequenceClassification(config).eval()
    ids = torch.randint(3, 64, (2, 9))
    with torch.no_grad():
        reference = base(input_ids=ids).logits.clone()
    model = inject_lora(base, dim=4, only_optimize_lora=True)
    assert model.get_base_model() is base
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids).logits, reference)
    # The head is the model's own module, not a modules_to_save copy: the saved names do not change.
    assert "score.weight" in {n.removeprefix("base_model.model.") for n, _ in model.named_parameters()}
    assert type(inject_lora(tiny_model(), dim=4)).__name__ == "PeftModelForCausalLM"  # causal LMs keep it


def test_fresh_lora_is_identity_and_merged_equals_unmerged():
    base = tiny_model()
    ids = torch.randint(3, 64, (2, 9))
    with torch.no_grad():
        reference = base(input_ids=ids).logits.clone()
    model = inject_lora(base, dim=4, alpha=8)
    with torch.no_grad():
        # B starts at zero: a fresh adapter must not change the function.
        torch.testing.assert_close(model(input_ids=ids).logits, reference)
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)
        unmerged = model(input_ids=ids).logits.clone()
        assert not torch.allclose(unmerged, reference, atol=1e-4)
        merged = model.merge_and_unload()
        assert not any("lora_" in n for n, _ in merged.named_parameters())
        torch.testing.assert_close(merged(input_ids=ids).logits, unmerged, rtol=1e-4, atol=1e-5)
