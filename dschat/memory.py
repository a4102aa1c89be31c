"""Memory planning: estimated peak memory per device and per node for every ZeRO stage / offload /
gradient-checkpointing choice of a step, from a model *config* alone (no weights, no deepspeed).

    python train.py --estimate-memory --step 1 --actor-model facebook/opt-1.3b --deployment-type single_node

What is counted (bytes; ``P`` parameters, ``N`` devices in all, ``w`` bytes of the training dtype):

* Model states, with the formulas of DeepSpeed's own estimators for 16-bit training
  (``deepspeed.runtime.zero.stage_1_and_2.estimate_zero2_model_states_mem_needs`` and
  ``deepspeed.runtime.zero.stage3.estimate_zero3_model_states_mem_needs``, checked against them by
  ``tests/integration/test_memory_deepspeed.py``): ZeRO-1/2 ``2P + 18P/N`` per device (16-bit params,
  then 16-bit and fp32 grads, fp32 master weights and the two Adam moments, partitioned); ZeRO-3
  ``4 x largest_layer + 18P/N``; with optimizer offload (ZeRO-1/2) ``2P`` per device and
  ``P x max(4N, 16) x 1.5`` CPU bytes per node; ZeRO-3 with parameters offloaded too (dschat's
  ``--offload`` under ZeRO-3) ``4 x largest_layer`` per device and ``18P / nodes x 1.5`` CPU per node.
  ZeRO-0 keeps everything on the device: ``20P`` (the ZeRO-1/2 formula with nothing partitioned).
  In fp32 there is no separate master copy or 16-bit gradient: ``4P + 12P/N`` (ZeRO-1/2),
  ``16P/N`` (ZeRO-3), ``16P`` (ZeRO-0). Frozen parameters (a LoRA base, step 3's reference and reward
  models) cost ``wP`` (``wP/N`` under ZeRO-3; on the CPU when offloaded).
* Activations kept for the backward pass of one micro-batch ``b`` x ``s`` tokens, assuming SDPA
  attention (no ``s^2`` score matrix is stored) and no dropout masks, per decoder layer
  ``w b s (4h + 2 q + 2 kv + m f)``: two norm inputs and outputs, queries, keys and values, the
  attention output, and the MLP intermediates (``m`` = 4 for a gated SwiGLU MLP, 2 for a plain one).
  With gradient checkpointing only each layer's input (``w b s h``) is kept, plus one layer's
  activations while it is recomputed. The LM head adds ``b s V (w + 4 + 4)``: the logits, their fp32
  copy for the loss and its gradient (``b s V 8`` in fp32).
* Step 3: the four models' states, plus the largest of generation (KV cache ``2 L b (p + a) kv w``),
  the experience pass (forward-only logits ``b (p + a) V (w + 8)``) and the actor's or the critic's
  training activations.
* A fixed runtime overhead per process: the CUDA context and allocator slack on a GPU
  (:data:`GPU_RUNTIME_BYTES`, assumed), the Python + torch + transformers + DeepSpeed process on a CPU
  (:data:`CPU_RUNTIME_BYTES`, the measured peak RSS of a step-1 run of a model with almost no weights).

Checked against measured peak RSS on CPU in README ("Memory planning"). The GPU numbers follow the same
formulas but were not checked on a GPU.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dschat.engine.ds_config import frozen_stage
from dschat.utils.errors import UserError

GIB = 1024**3
GPU_RUNTIME_BYTES = 1 * GIB  # CUDA context, cuBLAS workspace, caching-allocator slack (assumed, not measured)
# interpreter + torch + transformers + deepspeed + data pipeline: the peak RSS of a step-1 run of
# builtin:micro-llama (0.14M parameters, so nearly nothing else), measured (README, bench/bench_memory.py)
CPU_RUNTIME_BYTES = int(0.55 * GIB)
ADDITIONAL_BUFFER_FACTOR = 1.5  # DeepSpeed's default headroom on CPU memory
FIT_FRACTION = 0.9  # a choice fits when its estimate is at most this share of the memory available


# ---------------------------------------------------------------------------------------------- shapes
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
            return json.loads(path.read_text()), str(path)
        except (OSError, json.JSONDecodeError) as exc:
            raise UserError(f"{flag} {name_or_path}: unreadable config ({exc})") from None
    if name_or_path.startswith("builtin:"):
        from dschat.models import builtin

        name = name_or_path[len("builtin:") :]
        if name not in builtin.BUILTIN_MODELS:
            known = ", ".join("builtin:" + n for n in builtin.BUILTIN_MODELS)
            raise UserError(f"{flag} {name_or_path}: unknown built-in model (known: {known})")
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


# ---------------------------------------------------------------------------------------------- model states
@dataclass(frozen=True)
class Choice:
    """One memory configuration of a step: ZeRO stage, CPU offload, gradient checkpointing."""

    zero_stage: int
    offload: bool
    gradient_checkpointing: bool

    def describe(self) -> str:
        what = "optimizer states and parameters" if self.zero_stage == 3 else "optimizer states"
        return (f"ZeRO-{self.zero_stage}, " + (f"{what} offloaded to CPU" if self.offload else "no offload")
                + ", gradient checkpointing " + ("on" if self.gradient_checkpointing else "off"))  # fmt: skip


# Fastest first: a higher stage costs communication, checkpointing ~1/3 more compute, offload the most.
CANDIDATES: tuple[Choice, ...] = (
    Choice(0, False, False),
    Choice(1, False, False),
    Choice(2, False, False),
    Choice(3, False, False),
    Choice(0, False, True),
    Choice(2, False, True),
    Choice(3, False, True),
    Choice(2, True, True),
    Choice(3, True, True),
)


def zero2_model_states(params: int, gpus_per_node: int, nodes: int, offload: bool) -> tuple[int, int]:
    """DeepSpeed's ZeRO-1/2 estimate for 16-bit training: ``(cpu bytes per node, gpu bytes per device)``."""
    total = gpus_per_node * nodes
    if offload:
        return int(params * max(4 * total, 16) * ADDITIONAL_BUFFER_FACTOR), 2 * params
    return int(params * 4 * gpus_per_node * ADDITIONAL_BUFFER_FACTOR), 2 * params + int(18 * params / total)


def zero3_model_states(params: int, largest: int, gpus_per_node: int, nodes: int, offload_optimizer: bool,
                       offload_params: bool) -> tuple[int, int]:  # fmt: skip
    """DeepSpeed's ZeRO-3 estimate (with ``zero.Init``) for 16-bit training: ``(cpu per node, gpu per device)``."""
    total, largest_bytes = gpus_per_node * nodes, 4 * largest
    if offload_optimizer and offload_params:
        return int(params * 18 / nodes * ADDITIONAL_BUFFER_FACTOR), largest_bytes
    if offload_optimizer:
        return int(params * 16 / nodes * ADDITIONAL_BUFFER_FACTOR), largest_bytes + int(2 * params / total)
    return int(largest * 4 * gpus_per_node * ADDITIONAL_BUFFER_FACTOR), largest_bytes + int(
        18 * params / total
    )


def trained_states(params: int, largest: int, choice: Choice, dtype_bytes: int, gpus_per_node: int,
                   nodes: int) -> tuple[int, int]:  # fmt: skip
    """``(cpu bytes per node, device bytes)`` of the parameters, gradients and Adam states of a trained
    model. 16-bit: DeepSpeed's formulas; fp32: the same terms without the master copy and 16-bit grads."""
    total = gpus_per_node * nodes
    stage, offload = choice.zero_stage, choice.offload
    if dtype_bytes == 2:
        if stage == 3:
            return zero3_model_states(params, largest, gpus_per_node, nodes, offload, offload)
        if stage in (1, 2):
            return zero2_model_states(params, gpus_per_node, nodes, offload)
        return int(params * 4 * gpus_per_node * ADDITIONAL_BUFFER_FACTOR), 20 * params
    # fp32: 4 (params) + 4 (grads) + 8 (Adam moments) per parameter
    load_cpu = int(params * 4 * gpus_per_node * ADDITIONAL_BUFFER_FACTOR)
    if stage == 3:
        if offload:
            return int(params * 16 / nodes * ADDITIONAL_BUFFER_FACTOR), 4 * largest
        return int(largest * 4 * gpus_per_node * ADDITIONAL_BUFFER_FACTOR), 4 * largest + int(
            16 * params / total
        )
    if stage in (1, 2):
        if offload:
            return int(params * max(4 * total, 12) * ADDITIONAL_BUFFER_FACTOR), 4 * params
        return load_cpu, 4 * params + int(12 * params / total)
    return load_cpu, 16 * params


def frozen_states(params: int, largest: int, zero_stage: int, offload: bool, dtype_bytes: int,
                  gpus_per_node: int, nodes: int) -> tuple[int, int]:  # fmt: skip
    """``(cpu bytes per node, device bytes)`` of a model that is only run forward (no grads, no optimizer)."""
    total = gpus_per_node * nodes
    if zero_stage == 3:
        if offload:
            return int(params * dtype_bytes / nodes * ADDITIONAL_BUFFER_FACTOR), dtype_bytes * largest
        return 0, dtype_bytes * largest + int(dtype_bytes * params / total)
    return 0, dtype_bytes * params


# ---------------------------------------------------------------------------------------------- activations
def layer_activation_bytes(shape: ModelShape, batch: int, seq: int, dtype_bytes: int) -> int:
    """Activations one decoder layer keeps for its backward pass, for a ``batch x seq`` micro-batch."""
    m = 4 if shape.gated_mlp else 2
    per_token = 4 * shape.hidden_size + 2 * shape.q_dim + 2 * shape.kv_dim + m * shape.intermediate_size
    return dtype_bytes * batch * seq * per_token


def logits_bytes(shape: ModelShape, batch: int, seq: int, dtype_bytes: int) -> int:
    """The LM head's logits in the training dtype, their fp32 copy for the loss, and its gradient."""
    return batch * seq * shape.vocab_size * (dtype_bytes + (4 if dtype_bytes < 4 else 0) + 4)


def activation_bytes(shape: ModelShape, batch: int, seq: int, dtype_bytes: int, checkpointing: bool,
                     head: str = "lm") -> int:  # fmt: skip
    """Peak activation memory of one training micro-batch (forward kept for backward, plus the head)."""
    layer = layer_activation_bytes(shape, batch, seq, dtype_bytes)
    if checkpointing:  # each layer's input kept; one layer's activations live while it is recomputed
        body = shape.num_layers * dtype_bytes * batch * seq * shape.hidden_size + layer
    else:
        body = shape.num_layers * layer
    final_norm = 2 * dtype_bytes * batch * seq * shape.hidden_size
    head_bytes = logits_bytes(shape, batch, seq, dtype_bytes) if head == "lm" else 4 * batch * seq
    return body + final_norm + head_bytes


def kv_cache_bytes(shape: ModelShape, batch: int, seq: int, dtype_bytes: int) -> int:
    """Keys and values of every layer for ``batch`` sequences of ``seq`` tokens (generation)."""
    return 2 * shape.num_layers * batch * seq * shape.kv_dim * dtype_bytes


def forward_only_bytes(shape: ModelShape, batch: int, seq: int, dtype_bytes: int, head: str = "lm") -> int:
    """Peak of a no-grad forward pass: one layer's activations, and the logits with their fp32 log-probs."""
    head_bytes = batch * seq * shape.vocab_size * (dtype_bytes + 8) if head == "lm" else 4 * batch * seq
    return layer_activation_bytes(shape, batch, seq, dtype_bytes) + head_bytes


# ---------------------------------------------------------------------------------------------- estimates
@dataclass(frozen=True)
class Hardware:
    """Where a step runs: ``gpus_per_node`` processes on each of ``nodes`` nodes, on GPUs or CPU cores.

    ``device_bytes``: memory of one GPU (None: unknown); on CPU, the node's RAM is shared by its processes.
    """

    gpus_per_node: int
    nodes: int = 1
    on_gpu: bool = True
    device_bytes: int | None = None
    cpu_node_bytes: int | None = None

    @property
    def per_process_budget(self) -> int | None:
        if self.on_gpu:
            return self.device_bytes
        return self.cpu_node_bytes // self.gpus_per_node if self.cpu_node_bytes else None


@dataclass
class Estimate:
    """Peak bytes of one choice: per device (a GPU, or one CPU process) and CPU RAM per node."""

    choice: Choice
    device: int
    cpu_node: int
    parts: dict[str, int] = field(default_factory=dict)  # device bytes by cause

    def fits(self, hw: Hardware) -> bool | None:
        budget = hw.per_process_budget
        if budget is None:
            return None
        ok = self.device <= FIT_FRACTION * budget
        if hw.on_gpu and hw.cpu_node_bytes:
            ok = ok and self.cpu_node <= FIT_FRACTION * hw.cpu_node_bytes
        return ok


@dataclass(frozen=True)
class TrainWorkload:
    """Step 1 (``head="lm"``), step 2's reward model (``head="score"``, ``pairs``) or step 2 as DPO
    (``head="lm"``, ``pairs``, and ``reference`` when the reference is another model)."""

    shape: ModelShape
    batch: int  # per-device micro-batch of sequences (step 2: pairs)
    seq: int  # longest sequence (--max_seq_len)
    dtype_bytes: int
    head: str = "lm"
    lora_dim: int = 0
    only_lora: bool = False
    pairs: bool = False  # chosen and rejected in one batch of 2b sequences (step 2)
    # DPO's --ref_model_name_or_path: before training, a plain frozen copy on every rank scores the pairs
    # (forward only) beside the policy's states, and is freed when training starts.
    reference: ModelShape | None = None


def _split_params(shape: ModelShape, head: str, lora_dim: int, only_lora: bool) -> tuple[int, int]:
    """(trainable, frozen) parameter counts."""
    base, lora = shape.parameters(head), shape.lora_params(lora_dim)
    if only_lora and lora_dim:  # the base is frozen; a new scalar head still trains
        head_params = shape.score_params if head == "score" else 0
        return lora + head_params, base - head_params
    return base + lora, 0


def _model(shape: ModelShape, head: str, lora_dim: int, only_lora: bool, choice: Choice, dtype_bytes: int,
           hw: Hardware) -> tuple[int, int]:  # fmt: skip
    """(cpu per node, device) states of a trained model, a frozen LoRA base included."""
    trainable, frozen = _split_params(shape, head, lora_dim, only_lora)
    largest = shape.largest_layer_params(head)
    # With a frozen base the ZeRO-3 gather buffer of the largest layer is counted with the frozen part.
    cpu, dev = trained_states(
        trainable, 0 if frozen else largest, choice, dtype_bytes, hw.gpus_per_node, hw.nodes
    )
    if frozen:
        fcpu, fdev = frozen_states(frozen, largest, choice.zero_stage, choice.offload, dtype_bytes,
                                   hw.gpus_per_node, hw.nodes)  # fmt: skip
        cpu, dev = cpu + fcpu, dev + fdev
    return cpu, dev


def _finish(choice: Choice, parts: dict[str, int], cpu_node: int, hw: Hardware) -> Estimate:
    parts = dict(parts)
    parts["runtime"] = GPU_RUNTIME_BYTES if hw.on_gpu else CPU_RUNTIME_BYTES
    device = sum(parts.values())
    if not hw.on_gpu:  # everything is in RAM already: the node holds every process and the CPU states
        cpu_node = device * hw.gpus_per_node + cpu_node if choice.offload else device * hw.gpus_per_node
    return Estimate(choice, device, cpu_node, parts)


def estimate_train(work: TrainWorkload, choice: Choice, hw: Hardware) -> Estimate:
    """Peak memory of step 1 or step 2 under ``choice``: the policy's states plus the larger of its
    training activations and, for DPO with a separate reference, the reference pass before training."""
    cpu, states = _model(work.shape, work.head, work.lora_dim, work.only_lora, choice, work.dtype_bytes, hw)
    batch = work.batch * (2 if work.pairs else 1)
    acts = activation_bytes(work.shape, batch, work.seq, work.dtype_bytes, choice.gradient_checkpointing,
                            work.head)  # fmt: skip
    parts = {"model states": states, "activations": acts}
    if work.reference is not None:
        ref = work.reference.parameters("lm") * work.dtype_bytes + forward_only_bytes(
            work.reference, batch, work.seq, work.dtype_bytes
        )
        if ref > acts:
            parts = {"model states": states, "reference pass": ref}
    return _finish(choice, parts, cpu, hw)


@dataclass(frozen=True)
class RLHFWorkload:
    """Step 3: actor (+ frozen reference) from step 1, critic (+ frozen reward model) from step 2."""

    actor: ModelShape
    critic: ModelShape
    generation_batch: int  # prompts per device per round
    training_batch: int  # PPO micro-batch per device
    prompt_len: int
    answer_len: int
    dtype_bytes: int
    actor_lora_dim: int = 0
    critic_lora_dim: int = 0
    only_lora: bool = False
    reference: bool = True  # False with --share_reference_with_actor
    reward_model: bool = True  # False with --reward_fn ... --reward_fn_mode replace
    offload_reference: bool = False  # --offload_reference_model (with ZeRO-3)
    offload_reward: bool = False  # --offload_reward_model (with ZeRO-3)


def estimate_rlhf(work: RLHFWorkload, choice: Choice, hw: Hardware) -> Estimate:
    """Peak memory of step 3 under ``choice`` (same stage for actor and critic; offload also moves the
    ZeRO-3 reference and reward models to CPU, as --offload_reference_model / --offload_reward_model)."""
    w, s = work.dtype_bytes, work.prompt_len + work.answer_len
    stage_of_frozen = frozen_stage(choice.zero_stage)
    parts: dict[str, int] = {}
    cpu = 0
    c, parts["actor states"] = _model(work.actor, "lm", work.actor_lora_dim, work.only_lora, choice, w, hw)
    cpu += c
    c, parts["critic states"] = _model(
        work.critic, "score", work.critic_lora_dim, work.only_lora, choice, w, hw
    )
    cpu += c
    for present, name, shape, head, off in (
        (work.reference, "reference", work.actor, "lm", work.offload_reference),
        (work.reward_model, "reward model", work.critic, "score", work.offload_reward),
    ):
        if present:
            c, parts[name] = frozen_states(shape.parameters(head), shape.largest_layer_params(head), stage_of_frozen,
                                           choice.offload or off, w, hw.gpus_per_node, hw.nodes)  # fmt: skip
            cpu += c
    gc = choice.gradient_checkpointing
    phases = {
        "generation (KV cache)": kv_cache_bytes(work.actor, work.generation_batch, s, w),
        "experience (forward passes)": forward_only_bytes(work.actor, work.generation_batch, s, w),
        "actor training": activation_bytes(work.actor, work.training_batch, s, w, gc, "lm"),
        "critic training": activation_bytes(work.critic, work.training_batch, s, w, gc, "score"),
    }
    peak = max(phases, key=lambda k: phases[k])
    parts[f"activations: {peak}"] = phases[peak]
    return _finish(choice, parts, cpu, hw)


def plan(
    estimates: list[Estimate], hw: Hardware, fixed: dict[str, Any] | None = None
) -> tuple[Estimate | None, str]:
    """The first estimate (``estimates`` are in order of preference) that agrees with the ``fixed``
    choice fields the user set and fits ``hw``, and a one-line reason."""
    fixed = fixed or {}
    allowed = [e for e in estimates if all(getattr(e.choice, k) == v for k, v in fixed.items())]
    if not allowed:
        return None, "no configuration matches the flags given"
    if hw.per_process_budget is None:
        return allowed[0], "memory of the devices unknown: the fastest configuration"
    budget = hw.per_process_budget
    what = "GPU" if hw.on_gpu else f"process (RAM / {hw.gpus_per_node})"
    for e in allowed:
        if e.fits(hw):
            return e, (f"the fastest that fits: {gib(e.device)} of {gib(budget)} GiB per {what} "
                       f"(limit {FIT_FRACTION:.0%})")  # fmt: skip
    best = min(allowed, key=lambda e: e.device)
    return best, (f"nothing fits {gib(budget)} GiB per {what} (limit {FIT_FRACTION:.0%}); the smallest needs "
                  f"{gib(best.device)} GiB")  # fmt: skip


def gib(n: float) -> str:
    """Bytes as GiB with 2 significant decimals (``1.25``)."""
    return f"{n / GIB:.2f}" if n < 100 * GIB else f"{n / GIB:.0f}"


def candidates(on_gpu: bool) -> list[Choice]:
    """Choices worth trying: offload moves memory from GPU to CPU, which is no help when the device is
    the CPU."""
    return [c for c in CANDIDATES if on_gpu or not c.offload]


def dtype_bytes(dtype: str) -> int:
    return 4 if dtype == "fp32" else 2


def human_params(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.1f}M"
