"""Loading tokenizers and models by Hugging Face name, local path, or ``builtin:NAME``.

Safe by default: weights load from safetensors and ``trust_remote_code`` is off unless asked for.
Under ZeRO-3 call :func:`load_causal_lm` inside ``dschat.engine.zero3_loading(ds_config)`` so that
``from_pretrained`` partitions the weights while it reads them.
"""

from __future__ import annotations

import logging
import math
import os

import torch

from dschat.models import builtin
from dschat.utils.errors import UserError

LOG = logging.getLogger("dschat")

DROPOUT_KEYS = (
    "dropout", "attention_dropout", "hidden_dropout", "attention_probs_dropout_prob", "hidden_dropout_prob",
    "activation_dropout", "resid_pdrop", "embd_pdrop", "attn_pdrop", "summary_first_dropout",
)  # fmt: skip


def resolve(name_or_path: str, flag: str = "--model_name_or_path") -> str:
    """Turn ``builtin:NAME`` into its directory; check that anything else is a model we can find."""
    if builtin.is_builtin(name_or_path):
        try:
            return builtin.materialize(name_or_path)
        except KeyError:
            known = ", ".join(builtin.BUILTIN_PREFIX + n for n in builtin.BUILTIN_MODELS)
            raise UserError(f"{flag} {name_or_path}: unknown built-in model (known: {known})") from None
    return name_or_path


def load_config(path: str, *, trust_remote_code: bool = False, flag: str = "--model_name_or_path"):
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as exc:
        where = (
            "a local directory without a config.json"
            if os.path.isdir(path)
            else "neither a local model directory nor downloadable from the Hugging Face Hub"
        )
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise UserError(f"{flag} {path}: {where} ({first[:200]})") from None


def load_tokenizer(
    path: str,
    *,
    trust_remote_code: bool = False,
    padding_side: str = "right",
    flag: str = "--model_name_or_path",
):
    """Tokenizer with a pad token (EOS when the model has none) and the given padding side."""
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as exc:
        first = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else type(exc).__name__
        raise UserError(f"{flag} {path}: cannot load a tokenizer ({first})") from None
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    tok.padding_side = padding_side
    return tok


def apply_dropout(config, dropout: float | None) -> None:
    if dropout is None:
        return
    for key in DROPOUT_KEYS:
        if hasattr(config, key):
            setattr(config, key, dropout)


def load_causal_lm(
    path: str,
    *,
    tokenizer=None,
    dropout: float | None = None,
    trust_remote_code: bool = False,
    dtype: torch.dtype = torch.float32,
    flag: str = "--model_name_or_path",
):
    """``AutoModelForCausalLM.from_pretrained`` with the dropout override and, if the tokenizer has
    more tokens than the embedding, embeddings resized up to a multiple of 8."""
    from transformers import AutoModelForCausalLM

    config = load_config(path, trust_remote_code=trust_remote_code, flag=flag)
    apply_dropout(config, dropout)
    try:
        model = AutoModelForCausalLM.from_pretrained(
            path, config=config, dtype=dtype, trust_remote_code=trust_remote_code, use_safetensors=None
        )
    except ValueError as exc:
        raise UserError(
            f"{flag} {path}: not a causal language model ({str(exc).splitlines()[0][:200]})"
        ) from None
    if tokenizer is not None and len(tokenizer) > model.get_input_embeddings().weight.shape[0] > 0:
        model.resize_token_embeddings(int(8 * math.ceil(len(tokenizer) / 8)))
    if tokenizer is not None:
        model.config.pad_token_id = tokenizer.pad_token_id
    model.config.use_cache = False  # training; generation turns it back on
    return model


def count_parameters(model: torch.nn.Module) -> int:
    """Parameter count that also works for ZeRO-3 partitioned parameters (``ds_numel``)."""
    return sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters())
