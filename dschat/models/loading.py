"""Loading tokenizers and models by Hugging Face name, local path, or ``builtin:NAME``.

Safe by default: weights load from safetensors where a model has them (a model with only ``.bin`` files
loads through transformers' ``torch.load(weights_only=True)``, which runs no code) and
``trust_remote_code`` is off unless asked for.
Under ZeRO-3 call :func:`load_causal_lm` inside ``dschat.engine.zero3_loading(ds_config)`` so that
``from_pretrained`` partitions the weights while it reads them.
"""

from __future__ import annotations

import json
import logging
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from dschat.models import builtin, gguf, hub
from dschat.models.attention import use_fast_attention
from dschat.models.layers import contiguous_head_input
from dschat.utils.errors import UserError, first_line
from dschat.utils.io import INCOMPLETE_EXPORT

LOG = logging.getLogger("dschat")

DROPOUT_KEYS = (
    "dropout", "attention_dropout", "hidden_dropout", "attention_probs_dropout_prob", "hidden_dropout_prob",
    "activation_dropout", "resid_pdrop", "embd_pdrop", "attn_pdrop", "summary_first_dropout",
)  # fmt: skip


def read_config_json(path: str, flag: str = "") -> dict | None:
    """A model directory's ``config.json`` as a dict; None where there is none. A file that is not a JSON
    object (truncated by an interrupted save, say) is one line naming it."""
    cfg_path = Path(path) / "config.json"
    if (Path(path) / INCOMPLETE_EXPORT).exists():
        raise UserError(f"{flag + ' ' if flag else ''}{path}: an export into it was interrupted (its model files "
                        "are partly new, partly old): rerun the step with --resume, or export the model again")  # fmt: skip
    if not cfg_path.is_file():
        return None
    try:
        cfg = json.loads(cfg_path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        cfg, why = None, first_line(exc)
    else:
        why = f"a JSON {type(cfg).__name__}"
    if not isinstance(cfg, dict):
        raise UserError(f"{flag + ' ' if flag else ''}{cfg_path}: not a JSON object ({why})")
    return cfg


def has_value_head(path: str) -> bool:
    """True if ``path`` holds a saved sequence-classification model with one label (a reward model)."""
    cfg = read_config_json(path)
    if cfg is None:
        return False
    archs = cfg.get("architectures") or []
    return (
        any(a.endswith("ForSequenceClassification") for a in archs)
        and cfg.get("num_labels", len(cfg.get("id2label", {}))) == 1
    )


def resolve(name_or_path: str, flag: str = "--model_name_or_path") -> str:
    """A model spec -> what ``from_pretrained`` loads: ``builtin:NAME`` and GGUF files (a ``.gguf`` path, or
    a directory holding one) become model-cache directories; a hub name with an offline copy
    (:data:`dschat.models.gguf.OFFLINE_COPIES`) becomes its hub snapshot when cached or reachable, else
    its converted offline copy; anything else (a local directory, a hub name) is returned as it is."""
    if builtin.is_builtin(name_or_path):
        builtin.check_known(name_or_path, flag)
        return builtin.materialize(name_or_path)
    if name_or_path.startswith("~"):
        name_or_path = os.path.expanduser(name_or_path)
    if gguf.is_gguf_path(name_or_path):
        return gguf.convert(name_or_path, flag)
    if os.path.exists(name_or_path):
        return name_or_path
    if name_or_path in gguf.OFFLINE_COPIES:
        return gguf.resolve_offline_alias(name_or_path, flag)
    hub.check_hub_name(name_or_path, flag)  # one line now, not a minute of retries in transformers
    return name_or_path


def load_config(path: str, *, trust_remote_code: bool = False, flag: str = "--model_name_or_path"):
    from transformers import AutoConfig

    if os.path.isdir(path):
        read_config_json(path, flag)  # transformers' own errors call a broken one missing
    try:
        return AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as exc:
        raise _load_error(flag, path, exc, "a local directory without a config.json") from None


def _load_error(flag: str, path: str, exc: Exception, in_a_directory: str) -> UserError:
    """The one line for a model (or its tokenizer) that would not load: whether ``path`` is a local
    directory (then ``in_a_directory`` says what is wrong there) or neither that nor a hub model."""
    where = (
        in_a_directory
        if os.path.isdir(path)
        else "neither a local model directory nor downloadable from the Hugging Face Hub"
    )
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return UserError(f"{flag} {path}: {where} ({first[:200]})")


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
        raise _load_error(flag, path, exc, "cannot load a tokenizer from this directory") from None
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
    """``AutoModelForCausalLM.from_pretrained`` with the dropout override, SDPA computed in fp32 for
    16-bit weights on CPU (:func:`dschat.models.attention.use_fast_attention`) and, if the tokenizer has
    more tokens than the embedding, embeddings resized up to a multiple of 8."""
    from transformers import AutoModelForCausalLM

    config = load_config(path, trust_remote_code=trust_remote_code, flag=flag)
    apply_dropout(config, dropout)
    try:
        model, info = AutoModelForCausalLM.from_pretrained(
            path,
            config=config,
            dtype=dtype,
            trust_remote_code=trust_remote_code,
            use_safetensors=None,
            output_loading_info=True,
        )
    except ValueError as exc:
        raise UserError(f"{flag} {path}: not a causal language model ({first_line(exc)})") from None
    except RuntimeError as exc:  # only transformers' report of weights of other shapes (not OOM, NCCL, ...)
        if not shape_mismatch(exc):
            raise
        raise UserError(f"{flag} {path}: weights of other shapes than its config.json says") from None
    except OSError as exc:  # missing or unreadable weights
        raise UserError(f"{flag} {path}: cannot load its weights ({first_line(exc)})") from None
    # A weight the checkpoint lacks starts random, silently: a step-2 reward model (a body and a score
    # head) given as a policy trained with a random LM head. A tied head is not missing.
    missing = sorted(info["missing_keys"])
    if missing:
        raise UserError(
            f"{flag} {path}: the checkpoint lacks {len(missing)} weight(s) ({', '.join(missing[:3])}) that would "
            "start random: not a whole causal language model (a reward model or critic?)"
        )
    if tokenizer is not None and len(tokenizer) > model.get_input_embeddings().weight.shape[0] > 0:
        model.resize_token_embeddings(int(8 * math.ceil(len(tokenizer) / 8)))
    if tokenizer is not None:
        model.config.pad_token_id = tokenizer.pad_token_id
    model.config.use_cache = False  # training; generation turns it back on
    return contiguous_head_input(use_fast_attention(model))


def shape_mismatch(exc: BaseException) -> bool:
    """Whether ``from_pretrained`` raised for weights whose shapes differ from the model's config."""
    text = str(exc)
    return "ignore_mismatched_sizes" in text or "size mismatch" in text


def count_parameters(model: torch.nn.Module) -> int:
    """Parameter count that also works for ZeRO-3 partitioned parameters (``ds_numel``)."""
    return sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters())


# ---------------------------------------------------------------- models for the inference tools
ADAPTER_CONFIG = "adapter_config.json"


def is_lora_adapter(path: str) -> bool:
    """True for a peft adapter directory (``adapter_config.json``, no full model weights needed)."""
    return os.path.isfile(os.path.join(path, ADAPTER_CONFIG))


def inference_dtype(name: str, device: str, flag: str = "--dtype") -> torch.dtype:
    """``auto`` -> bf16 (fp16 without bf16) on a GPU; on CPU what training's ``--dtype auto`` picks there
    (:func:`dschat.engine.core.auto_dtype`: bf16 where the CPU computes it in hardware, AVX512-BF16 or AMX,
    about 2.3x faster greedy answers from SmolLM2 on 2 cores, else fp32); fp16 on CPU is refused."""
    cuda = device.startswith("cuda")
    if name == "auto":
        if not cuda:
            from dschat.engine.core import auto_dtype  # torch only; no deepspeed import

            return torch.bfloat16 if auto_dtype() == "bf16" else torch.float32
        return torch.bfloat16 if torch.cuda.is_bf16_supported(including_emulation=False) else torch.float16
    if name == "fp16" and not cuda:
        raise UserError(f"{flag} fp16: half precision needs a GPU here (use bf16 or fp32 on CPU)")
    try:
        return {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[name]
    except KeyError:
        raise UserError(f"{flag} {name}: choose auto, fp32, bf16 or fp16") from None


def _check_model_dir(path: str, flag: str) -> None:
    """One line for the usual mistakes: a file, a step directory holding models, a reward model."""

    if os.path.isfile(path):
        raise UserError(f"{flag} {path}: is a file, not a model directory")
    if os.path.isdir(path) and not os.path.isfile(os.path.join(path, "config.json")):
        inside = sorted(d for d in os.listdir(path) if os.path.isfile(os.path.join(path, d, "config.json")))
        hint = f" (model directories inside: {', '.join(inside)})" if inside else ""
        raise UserError(f"{flag} {path}: no config.json, not a model directory{hint}")
    if has_value_head(path):
        raise UserError(
            f"{flag} {path}: is a reward model (sequence classification), not a language model that generates"
        )
    require_weights(path, flag)


# What a saved model's weights are called (a shard index counts: its shards are checked by the loader)
WEIGHT_SUFFIXES = (
    ".safetensors",
    ".bin",
    ".safetensors.index.json",
    ".bin.index.json",
    ".pth",
    ".msgpack",
    ".h5",
)


def require_weights(path: str, flag: str) -> None:
    """One line, before any slow work, for a local model directory holding a config but no weights (an
    interrupted save, a copy of the config alone); hub names and non-directories pass."""
    if not os.path.isdir(path) or not os.path.isfile(os.path.join(path, "config.json")):
        return
    if not any(name.endswith(WEIGHT_SUFFIXES) for name in os.listdir(path)):
        raise UserError(f"{flag} {path}: holds config.json but no weights (model.safetensors or "
                        "pytorch_model.bin): an interrupted save? Export or copy the model again")  # fmt: skip


def check_for_generation(
    name_or_path: str, *, base_model: str | None = None, trust_remote_code: bool = False, flag: str = "--path"
) -> tuple[str, str | None, Any]:
    """``(path, base_path, config)`` of a model to generate with, checked before anything loads: a causal
    LM (``base_path`` None), or a peft LoRA adapter directory and its base (``base_model`` or the adapter's
    ``base_model_name_or_path``), with the (base) model's config. The usual mistakes (a reward model, a step directory holding models, a
    directory without weights, an adapter without a base) are one line naming ``flag``."""
    from dschat.inputs import check_model  # a local path that is not there: said so, not a hub-name complaint

    check_model(name_or_path, flag)
    path = resolve(name_or_path, flag)
    if not is_lora_adapter(path):
        if base_model:  # it would be ignored: another model than the one meant would answer
            raise UserError(f"--base_model {base_model}: {flag} {name_or_path} is a whole model, not a LoRA "
                            "adapter; --base_model names an adapter's base")  # fmt: skip
        if os.path.exists(path):
            _check_model_dir(path, flag)
        return (
            path,
            None,
            load_config(path, trust_remote_code=trust_remote_code, flag=flag),
        )  # its error names the path
    try:
        with open(os.path.join(path, ADAPTER_CONFIG), encoding="utf-8") as f:
            adapter_cfg = json.load(f)
    except (OSError, ValueError) as exc:
        raise UserError(f"{flag} {path}: unreadable {ADAPTER_CONFIG} ({exc})") from None
    base = base_model or adapter_cfg.get("base_model_name_or_path")
    if not base:
        raise UserError(f"{flag} {path}: a LoRA adapter that does not name its base model; pass --base_model")
    where = f"{flag} {path}: the LoRA adapter's base model"
    # named as the user gave it: --base_model, or the adapter's own config
    base_path = resolve(base, "--base_model" if base_model else f"{where} (its {ADAPTER_CONFIG})")
    try:
        if os.path.exists(base_path):
            _check_model_dir(base_path, where)
        config = load_config(base_path, trust_remote_code=trust_remote_code, flag=where)
    except UserError as exc:
        raise UserError(f"{exc}; pass --base_model PATH") from None
    return path, base_path, config


@dataclass
class GenerationSource:
    """A model to generate with, checked and read up to its weights: what the inference tools check their
    flags against (prompt format, context) before the slow load."""

    path: str
    base_path: str | None  # a LoRA adapter's base model (merged in at load), else None
    tokenizer: Any  # pads on the left (batched generation)
    config: Any  # the (base) model's config: its context length
    flag: str


def open_for_generation(
    name_or_path: str, *, base_model: str | None = None, trust_remote_code: bool = False, flag: str = "--path"
) -> GenerationSource:
    """:func:`check_for_generation`, then the tokenizer (an adapter's own where it has one, else its base's)
    and the config; no weights."""
    path, base_path, config = check_for_generation(name_or_path, base_model=base_model,
                                                   trust_remote_code=trust_remote_code, flag=flag)  # fmt: skip
    tok_dir = path
    if base_path is not None and not any(
        os.path.isfile(os.path.join(path, f)) for f in ("tokenizer.json", "tokenizer_config.json")
    ):
        tok_dir = base_path
    tokenizer = load_tokenizer(tok_dir, trust_remote_code=trust_remote_code, padding_side="left", flag=flag)
    return GenerationSource(path, base_path, tokenizer, config, flag)


def load_for_generation(
    source: str | GenerationSource,
    *,
    base_model: str | None = None,
    device: str = "cpu",
    dtype: torch.dtype = torch.float32,
    trust_remote_code: bool = False,
    flag: str = "--path",
):
    """``(model, tokenizer)`` ready to generate: a causal LM by name/path/``builtin:NAME``, or a peft LoRA
    adapter directory, whose base (``base_model`` or the adapter's ``base_model_name_or_path``) is loaded
    and the adapter merged in (``source`` opened by :func:`open_for_generation`, or a name it opens). The
    model is in eval mode on ``device`` with the KV cache on; the tokenizer pads on the left."""
    src = source if isinstance(source, GenerationSource) else open_for_generation(
        source, base_model=base_model, trust_remote_code=trust_remote_code, flag=flag
    )  # fmt: skip
    path, base_path, tokenizer, flag = src.path, src.base_path, src.tokenizer, src.flag
    if base_path is not None:
        where = f"{flag} {path}: the LoRA adapter's base model"
        model = load_causal_lm(base_path, tokenizer=tokenizer, dtype=dtype,
                               trust_remote_code=trust_remote_code, flag=where)  # fmt: skip
        from peft import PeftModel

        try:
            model = PeftModel.from_pretrained(model, path).merge_and_unload()
        except (OSError, ValueError, RuntimeError, KeyError) as exc:
            raise UserError(
                f"{flag} {path}: the LoRA adapter does not fit base model {base_path} ({first_line(exc)})"
            ) from None
    else:
        model = load_causal_lm(path, tokenizer=tokenizer, dtype=dtype, trust_remote_code=trust_remote_code,
                               flag=flag)  # fmt: skip
    model.config.use_cache = True
    return model.to(device).eval(), tokenizer


def check_same_tokenizer(path: str, flag: str, tokenizer, *, owner: str, owner_path: str = "",
                         trust_remote_code: bool = False) -> None:  # fmt: skip
    """Raise :class:`UserError` unless the model at ``path`` shares ``tokenizer``'s vocabulary: a model
    that scores another model's token ids (a reference, a reward model, a judge) would otherwise read
    different words. ``owner`` names whose token ids they are (``"policy"``, ``"actor"``), ``owner_path``
    where that model comes from."""
    other = load_tokenizer(path, trust_remote_code=trust_remote_code, flag=flag)
    if other.get_vocab() != tokenizer.get_vocab():
        whose = f"the {owner}'s" + (f" ({owner_path})" if owner_path else "")
        raise UserError(f"{flag} {path}: its tokenizer differs from {whose}: {len(other)} vs {len(tokenizer)} "
                        f"tokens or other ids; it scores the {owner}'s token ids, so it must share the {owner}'s "
                        "vocabulary")  # fmt: skip
