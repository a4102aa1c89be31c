"""Reward model and critic: a transformer body with a scalar head, scoring at the last real token.

The trained module is a Hugging Face ``AutoModelForSequenceClassification`` (``num_labels=1``) wrapped
in :class:`ScalarHeadModel`, whose forward returns one value per token (what PPO's critic needs) and
whose :meth:`ScalarHeadModel.score` picks the value at each sequence's last real token (what the
reward model is trained on). The saved directory loads with ``AutoModelForSequenceClassification``
and gives the same scores.
"""

from __future__ import annotations

import torch
from torch import nn

from dschat.losses import gather_last
from dschat.models.loading import apply_dropout, has_value_head, load_config
from dschat.utils.errors import UserError


class ScalarHeadModel(nn.Module):
    """``forward(input_ids (B,T), attention_mask (B,T)) -> values (B,T)``; ``score(...) -> (B,)``."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model  # a *ForSequenceClassification model (possibly a peft wrapper of one)

    @property
    def hf_model(self) -> nn.Module:
        base = self.model.get_base_model() if hasattr(self.model, "get_base_model") else self.model
        return base

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        hf = self.hf_model
        body = getattr(hf, hf.base_model_prefix)
        # Positions skip left padding (PPO's prompts are left-padded), as generate computes them.
        position_ids = (attention_mask.long().cumsum(-1) - 1).clamp_min(0)
        hidden = body(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False
        ).last_hidden_state
        return hf.score(hidden).squeeze(-1).float()

    def score(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        return gather_last(self(input_ids, attention_mask), attention_mask)


def load_reward_model(
    path: str,
    *,
    tokenizer=None,
    dropout: float | None = None,
    trust_remote_code: bool = False,
    require_trained_head: bool = False,
    flag: str = "--model_name_or_path",
) -> ScalarHeadModel:
    """A reward model/critic from ``path``: a trained reward model, or (unless ``require_trained_head``)
    a causal LM whose body gets a fresh scalar head."""
    from transformers import AutoModelForSequenceClassification

    if require_trained_head and not has_value_head(path):
        raise UserError(
            f"{flag} {path}: not a trained reward model (no sequence-classification value head; "
            "train one with step 2, or pass the step-2 output directory)"
        )
    config = load_config(path, trust_remote_code=trust_remote_code, flag=flag)
    apply_dropout(config, dropout)
    config.num_labels = 1
    config.id2label, config.label2id = {0: "score"}, {"score": 0}
    if tokenizer is not None:
        config.pad_token_id = tokenizer.pad_token_id
    try:
        model, info = AutoModelForSequenceClassification.from_pretrained(
            path,
            config=config,
            dtype=torch.float32,
            trust_remote_code=trust_remote_code,
            output_loading_info=True,
        )
    except ValueError as exc:
        raise UserError(
            f"{flag} {path}: cannot be loaded as a reward model ({str(exc).splitlines()[0][:200]})"
        ) from None
    # Only the head may start fresh: a body weight missing from the checkpoint would silently train from
    # random values (a tied embedding stored only under the LM head's name did exactly that).
    missing = sorted(k for k in info["missing_keys"] if k.split(".")[0] != "score")
    if missing:
        raise UserError(
            f"{flag} {path}: the checkpoint lacks {len(missing)} body weight(s) ({', '.join(missing[:3])}); "
            "they would start random"
        )
    if not hasattr(model, "score"):
        raise UserError(
            f"{flag} {path}: {type(model).__name__} has no 'score' head; this architecture is not supported"
        )
    return ScalarHeadModel(model)
