"""Models and the tokenizer that the project builds in code: the embedded default, no downloads.

``builtin:NAME`` resolves to a directory (config, tokenizer, safetensors weights) materialised once
under ``~/.cache/dschat/models`` and then loaded through the ordinary ``from_pretrained`` path, so the
default model exercises exactly the code a real Hugging Face model does.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

BUILTIN_PREFIX = "builtin:"

# name -> Llama shape. tiny-llama is the default (fast enough to learn the built-in tasks on 2 CPU cores
# in minutes); micro-llama keeps tests fast; llama-100m is the benchmark's ~100M-parameter config.
BUILTIN_MODELS: dict[str, dict[str, int]] = {
    "micro-llama": {
        "hidden_size": 64,
        "intermediate_size": 192,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
    },
    "tiny-llama": {
        "hidden_size": 256,
        "intermediate_size": 768,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
    },
    "small-llama": {
        "hidden_size": 512,
        "intermediate_size": 1536,
        "num_hidden_layers": 8,
        "num_attention_heads": 8,
    },
    "llama-100m": {
        "hidden_size": 768,
        "intermediate_size": 2560,
        "num_hidden_layers": 12,
        "num_attention_heads": 12,
    },
}
MAX_POSITIONS = 1024
SPECIALS = ["<pad>", "<s>", "</s>"]


def cache_root() -> Path:
    return Path(os.environ.get("DSCHAT_CACHE", Path.home() / ".cache" / "dschat"))


def build_tokenizer():
    """A byte-level tokenizer (every UTF-8 text encodes, no unknown token) with pad/bos/eos specials.

    Built deterministically from the 256-symbol byte alphabet with no merges: one token per byte,
    which suits the digit and letter manipulations of the built-in tasks.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {tok: i for i, tok in enumerate(SPECIALS)}
    for ch in alphabet:
        vocab[ch] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A $B", special_tokens=[("<s>", 1)]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        model_max_length=MAX_POSITIONS,
    )


def build_config(name: str, vocab_size: int):
    from transformers import LlamaConfig

    shape = BUILTIN_MODELS[name]
    return LlamaConfig(
        vocab_size=vocab_size,
        max_position_embeddings=MAX_POSITIONS,
        num_key_value_heads=shape["num_attention_heads"],
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
        **shape,
    )


def is_builtin(name_or_path: str) -> bool:
    return name_or_path.startswith(BUILTIN_PREFIX)


def materialize(name_or_path: str, seed: int = 0) -> str:
    """Directory of builtin model ``name_or_path`` (``builtin:tiny-llama``), created on first use.

    Creation writes a temporary directory and renames it, so concurrent ranks never see half a model.
    """
    import torch
    from transformers import LlamaForCausalLM

    name = name_or_path[len(BUILTIN_PREFIX) :]
    if name not in BUILTIN_MODELS:
        raise KeyError(name)
    final = cache_root() / "models" / f"{name}-v1-seed{seed}"
    if (final / "config.json").exists():
        return str(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.with_name(f".{final.name}.{os.getpid()}.tmp")
    tokenizer = build_tokenizer()
    config = build_config(name, len(tokenizer))
    devnull_state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    torch.random.set_rng_state(devnull_state)
    from transformers.utils import logging as hf_logging

    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # no "Writing model shards" bar on stderr for a one-off cache write
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
    finally:
        if bars:
            hf_logging.enable_progress_bar()
    try:
        os.rename(tmp, final)
    except OSError:  # another process won the race; its copy is identical
        shutil.rmtree(tmp, ignore_errors=True)
    return str(final)
