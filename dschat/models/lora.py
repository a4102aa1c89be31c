"""LoRA through peft: injection by module-name substring (DeepSpeed-Chat's ``--lora_module_name``)."""

from __future__ import annotations

from torch import nn

from dschat.utils.errors import UserError


def lora_target_modules(model: nn.Module, module_name: str, within: list[str] | None = None) -> list[str]:
    """Full names of the ``nn.Linear`` modules whose name contains ``module_name`` (and, with ``within``,
    that sit inside one of those modules)."""
    return [
        name
        for name, m in model.named_modules()
        if isinstance(m, nn.Linear)
        and module_name in name
        and (within is None or any(name.startswith(w + ".") for w in within))
    ]


def inject_lora(
    model: nn.Module,
    *,
    dim: int,
    alpha: float = 0.0,
    dropout: float = 0.0,
    module_name: str = "layers.",
    only_optimize_lora: bool = False,
    flag_prefix: str = "",
    within: list[str] | None = None,
):
    """Wrap ``model`` in a peft ``PeftModel`` with rank-``dim`` LoRA on the matching Linear layers.

    peft freezes the base weights; unless ``only_optimize_lora`` they are unfrozen again so that LoRA
    is an added capacity (DeepSpeed-Chat's semantics) rather than the only trainable part. ``within``
    (module names, e.g. the top decoder blocks) limits where LoRA goes.
    """
    from peft import LoraConfig, get_peft_model

    targets = lora_target_modules(model, module_name, within)
    if not targets:
        raise UserError(
            f"--{flag_prefix}lora_module_name {module_name!r} matches no Linear layer of the model"
        )
    cfg = LoraConfig(
        r=dim,
        lora_alpha=alpha or dim,
        lora_dropout=dropout,
        target_modules=targets,
        bias="none",
        # peft's causal-LM wrapper hooks into generation, which a reward model or critic
        # (*ForSequenceClassification) lacks: it fails on them. Its SEQ_CLS wrapper would copy the head into
        # modules_to_save under new names; the plain PeftModel wraps the body and leaves the head as it is.
        task_type="CAUSAL_LM" if model.can_generate() else None,
    )
    peft_model = get_peft_model(model, cfg)
    if not only_optimize_lora:
        for p in peft_model.parameters():
            p.requires_grad_(True)
    return peft_model


def is_lora_param(name: str) -> bool:
    return "lora_" in name
