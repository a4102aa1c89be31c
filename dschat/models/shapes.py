"""The shape of a decoder-only transformer read from a model *config* alone (no weights): layers,
widths, heads, vocabulary; enough to count parameters and activations for the memory planner
(:mod:`dschat.memory`). Configs come from a local directory, ``builtin:NAME``, the hub cache, or a
table of well-known models, so planning works offline."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dschat.utils.errors import UserError


@dataclass(frozen=True)
class ModelShape:
    """The shape of a decoder-only transformer, enough to count parameters and activations."""

    model_type: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    gated_mlp: bool  # SwiGLU: gate, up and down projections (Llama, Mistral, Qwen2)
    tie_embeddings: bool
    position_rows: int = 0  # rows of a learned position table (OPT, GPT-2); 0 for rotary embeddings
    qkv_bias: bool = False  # q/k/v projections have a bias (OPT, GPT-2, Qwen2)
    out_bias: bool = False  # the attention output projection has a bias (OPT, GPT-2)
    mlp_bias: bool = False  # the MLP projections have biases (OPT, GPT-2)
    norm_bias: bool = False  # LayerNorm (weight + bias) rather than RMSNorm (weight)
    embed_dim: int = 0  # OPT's word_embed_proj_dim when it differs from hidden_size (opt-350m)
    final_norm: bool = True

    @property
    def q_dim(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.num_kv_heads * self.head_dim

    def linears(self) -> list[tuple[int, int, bool]]:
        """(in, out, has_bias) of every Linear of one decoder layer."""
        h, f, b, qkv = self.hidden_size, self.intermediate_size, self.mlp_bias, self.qkv_bias
        attn = [
            (h, self.q_dim, qkv),
            (h, self.kv_dim, qkv),
            (h, self.kv_dim, qkv),
            (self.q_dim, h, self.out_bias),
        ]
        mlp = [(h, f, b), (h, f, b), (f, h, b)] if self.gated_mlp else [(h, f, b), (f, h, b)]
        return attn + mlp

    def layer_params(self) -> int:
        norm = self.hidden_size * (2 if self.norm_bias else 1)
        return sum(i * o + (o if bias else 0) for i, o, bias in self.linears()) + 2 * norm

    def parameters(self, head: str = "lm") -> int:
        """All parameters of the causal LM (``head="lm"``) or of a reward model / critic (``"score"``:
        the LM head replaced by one output without bias, as ``AutoModelForSequenceClassification``)."""
        h, e = self.hidden_size, self.embed_dim or self.hidden_size
        total = self.vocab_size * e + self.position_rows * h + self.num_layers * self.layer_params()
        if e != h:  # OPT's project_in / project_out
            total += 2 * e * h
        if self.final_norm:
            total += h * (2 if self.norm_bias else 1)
        if head == "lm" and not self.tie_embeddings:
            total += self.vocab_size * e
        if head == "score":
            total += self.score_params
        return total

    @property
    def score_params(self) -> int:
        """The reward model's / critic's scalar head: one output over the last hidden states (OPT projects
        them back to ``word_embed_proj_dim`` first)."""
        return self.embed_dim or self.hidden_size

    def largest_layer_params(self, head: str = "lm") -> int:
        """Parameters of the largest single module (DeepSpeed's ``largest_layer_params``)."""
        linear = max(i * o + (o if bias else 0) for i, o, bias in self.linears())
        embedding = self.vocab_size * (self.embed_dim or self.hidden_size)
        return max(linear, embedding)

    def lora_params(self, rank: int) -> int:
        """LoRA matrices (A: in x r, B: r x out) on every Linear of every decoder layer (dschat's default
        ``--lora_module_name layers.``)."""
        return self.num_layers * sum(rank * (i + o) for i, o, _ in self.linears()) if rank else 0


def shape_from_config(cfg: dict[str, Any], where: str = "config") -> ModelShape:
    """A :class:`ModelShape` from a Hugging Face ``config.json`` dictionary.

    Llama, Mistral, Qwen2 (and unknown types with Llama's field names, approximated as Llama), OPT
    and GPT-2 are understood.
    """
    kind = str(cfg.get("model_type", "llama"))

    def need(*names: str) -> int:
        for n in names:
            if cfg.get(n) is not None:
                return int(cfg[n])
        raise UserError(f"{where}: model config has no '{names[0]}' (model_type {kind})")

    if kind == "opt":
        h = need("hidden_size")
        heads = need("num_attention_heads")
        return ModelShape(
            kind, need("vocab_size"), h, need("num_hidden_layers"), heads, heads, h // heads, need("ffn_dim"),
            gated_mlp=False, tie_embeddings=True, position_rows=need("max_position_embeddings") + 2,
            qkv_bias=bool(cfg.get("enable_bias", True)), out_bias=bool(cfg.get("enable_bias", True)),
            mlp_bias=bool(cfg.get("enable_bias", True)), norm_bias=True,
            embed_dim=int(cfg.get("word_embed_proj_dim") or h),
            final_norm=bool(cfg.get("do_layer_norm_before", True)) and not cfg.get("_remove_final_layer_norm"),
        )  # fmt: skip
    if kind == "gpt2":
        h = need("n_embd", "hidden_size")
        heads = need("n_head", "num_attention_heads")
        return ModelShape(
            kind, need("vocab_size"), h, need("n_layer", "num_hidden_layers"), heads, heads, h // heads,
            int(cfg.get("n_inner") or 4 * h), gated_mlp=False, tie_embeddings=True,
            position_rows=need("n_positions", "max_position_embeddings"), qkv_bias=True, out_bias=True,
            mlp_bias=True, norm_bias=True,
        )  # fmt: skip
    h = need("hidden_size")
    heads = need("num_attention_heads")
    head_dim = int(cfg.get("head_dim") or h // heads)
    return ModelShape(
        kind, need("vocab_size"), h, need("num_hidden_layers"), heads,
        int(cfg.get("num_key_value_heads") or heads), head_dim, need("intermediate_size"), gated_mlp=True,
        tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        qkv_bias=kind == "qwen2" or bool(cfg.get("attention_bias", False)),
        out_bias=bool(cfg.get("attention_bias", False)), mlp_bias=bool(cfg.get("mlp_bias", False)),
    )  # fmt: skip


# Shapes of well-known models (fields copied from their public config.json), so that planning works
# offline for the models DeepSpeed-Chat's scripts and dschat's presets name.
def _opt(h: int, layers: int, heads: int, embed: int | None = None, pre_norm: bool = True) -> dict[str, Any]:
    return {"model_type": "opt", "vocab_size": 50272, "hidden_size": h, "num_hidden_layers": layers,
            "num_attention_heads": heads, "ffn_dim": 4 * h, "max_position_embeddings": 2048,
            "word_embed_proj_dim": embed or h, "do_layer_norm_before": pre_norm}  # fmt: skip


def _llama(h: int, f: int, layers: int, heads: int, kv: int, vocab: int = 32000, tie: bool = False,
           kind: str = "llama", **extra: Any) -> dict[str, Any]:  # fmt: skip
    return {"model_type": kind, "vocab_size": vocab, "hidden_size": h, "intermediate_size": f,
            "num_hidden_layers": layers, "num_attention_heads": heads, "num_key_value_heads": kv,
            "tie_word_embeddings": tie, **extra}  # fmt: skip


KNOWN_CONFIGS: dict[str, dict[str, Any]] = {
    "facebook/opt-125m": _opt(768, 12, 12),
    "facebook/opt-350m": _opt(1024, 24, 16, embed=512, pre_norm=False),
    "facebook/opt-1.3b": _opt(2048, 24, 32),
    "facebook/opt-2.7b": _opt(2560, 32, 32),
    "facebook/opt-6.7b": _opt(4096, 32, 32),
    "facebook/opt-13b": _opt(5120, 40, 40),
    "facebook/opt-30b": _opt(7168, 48, 56),
    "facebook/opt-66b": _opt(9216, 64, 72),
    "meta-llama/Llama-2-7b-hf": _llama(4096, 11008, 32, 32, 32),
    "meta-llama/Llama-2-13b-hf": _llama(5120, 13824, 40, 40, 40),
    "meta-llama/Llama-2-70b-hf": _llama(8192, 28672, 80, 64, 8),
    "meta-llama/Llama-3.2-1B": _llama(2048, 8192, 16, 32, 8, vocab=128256, tie=True, head_dim=64),
    "meta-llama/Meta-Llama-3-8B": _llama(4096, 14336, 32, 32, 8, vocab=128256),
    "mistralai/Mistral-7B-v0.1": _llama(4096, 14336, 32, 32, 8, kind="mistral"),
    "Qwen/Qwen2.5-0.5B": _llama(896, 4864, 24, 14, 2, vocab=151936, tie=True, kind="qwen2"),
    "HuggingFaceTB/SmolLM2-135M-Instruct": _llama(576, 1536, 30, 9, 3, vocab=49152, tie=True),
    "openai-community/gpt2": {
        "model_type": "gpt2",
        "vocab_size": 50257,
        "n_embd": 768,
        "n_layer": 12,
        "n_head": 12,
        "n_positions": 1024,
    },
}
# DeepSpeed-Chat's examples spell the Llama-2 chat variants too; same shapes.
for _size in ("7b", "13b", "70b"):
    KNOWN_CONFIGS[f"meta-llama/Llama-2-{_size}-chat-hf"] = KNOWN_CONFIGS[f"meta-llama/Llama-2-{_size}-hf"]


def load_model_config(name_or_path: str, flag: str = "--actor-model") -> tuple[dict[str, Any], str]:
    """``(config dict, where it came from)`` for a local directory or ``config.json``, a GGUF file (its
    metadata), ``builtin:NAME``, a model of :data:`KNOWN_CONFIGS`, or a hub name whose config is in the
    local Hugging Face cache."""
    from dschat.models import gguf

    path = Path(name_or_path).expanduser()
    if gguf.is_gguf_path(name_or_path):
        return gguf.gguf_config(gguf.gguf_file_of(name_or_path, flag), flag), "GGUF metadata"
    if path.is_dir() and (path / "config.json").is_file():
        path = path / "config.json"
    if path.is_file():
        try:
            return json.loads(path.read_text(encoding="utf-8")), str(path)
        except UnicodeDecodeError:  # a weights file or other binary named where a config or model is
            raise UserError(f"{flag} {name_or_path}: not a model directory, config.json or GGUF file (binary, "
                            "not JSON)") from None  # fmt: skip
        except (OSError, json.JSONDecodeError) as exc:
            raise UserError(f"{flag} {name_or_path}: unreadable config ({exc})") from None
    if name_or_path.startswith("builtin:"):
        from dschat.models import builtin

        builtin.check_known(name_or_path, flag)
        name = name_or_path.removeprefix(builtin.BUILTIN_PREFIX)
        return builtin.build_config(name, len(builtin.build_tokenizer())).to_dict(), "built-in model"
    for known, cfg in KNOWN_CONFIGS.items():
        if known.lower() == name_or_path.lower():
            return dict(cfg), "dschat's table of well-known configs"
    if path.is_dir():
        raise UserError(f"{flag} {name_or_path}: directory without a config.json")
    try:
        from transformers import AutoConfig

        return AutoConfig.from_pretrained(name_or_path).to_dict(), "Hugging Face cache"
    except Exception:
        raise UserError(
            f"{flag} {name_or_path}: no config available offline (not a local directory, builtin:NAME, a cached "
            f"hub model, or one of {len(KNOWN_CONFIGS)} well-known models such as facebook/opt-1.3b)"
        ) from None
