"""Models and the tokenizer that the project builds in code: the embedded default, no downloads.

``builtin:NAME`` resolves to a directory (config, tokenizer, safetensors weights) materialised once
under ``~/.cache/dschat/models`` and then loaded through the ordinary ``from_pretrained`` path, so the
default model exercises exactly the code a real Hugging Face model does.
"""

from __future__ import annotations

from dschat.models.cache import build_once, models_dir, write_model_dir
from dschat.utils.errors import UserError

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


def check_known(name_or_path: str, flag: str) -> None:
    """A ``builtin:NAME`` that names no built-in model: one line naming ``flag`` and the known ones."""
    if name_or_path.removeprefix(BUILTIN_PREFIX) not in BUILTIN_MODELS:
        known = ", ".join(BUILTIN_PREFIX + n for n in BUILTIN_MODELS)
        raise UserError(f"{flag} {name_or_path}: unknown built-in model (known: {known})")


def materialize(name_or_path: str, seed: int = 0) -> str:
    """Directory of builtin model ``name_or_path`` (``builtin:tiny-llama``), created on first use.

    Built once per cache by whichever process gets there first, the others waiting (see
    :func:`dschat.models.cache.build_once`), so concurrent ranks never see half a model.
    """
    name = name_or_path[len(BUILTIN_PREFIX) :]
    if name not in BUILTIN_MODELS:
        raise KeyError(name)

    def build(tmp) -> dict:
        import torch
        from transformers import LlamaForCausalLM

        tokenizer = build_tokenizer()
        config = build_config(name, len(tokenizer))
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = LlamaForCausalLM(config)
        write_model_dir(model, tokenizer, tmp)
        return {"builtin": name, "seed": seed}

    return str(build_once(models_dir() / f"{name}-v1-seed{seed}", build))
