"""Write small F32 GGUF files from Hugging Face Llama directories, so GGUF loading is testable offline.

A minimal, hand-written HF -> GGUF mapping for the Llama layout (not llama.cpp's converter): the
``llama.*`` hyper-parameters, the ``blk.N.*`` tensor names, the q/k row permutation llama.cpp applies
for its rotary embedding, and a ``gpt2`` (byte-level BPE) tokenizer. transformers' GGUF reader
(``modeling_gguf_pytorch_utils.load_gguf_checkpoint`` and ``integrations/gguf``) reads the result back
to the same weights and the same token ids::

    path = write_gguf(model_dir, tmp_path / "model.gguf")
    model = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=path.name)
    tokenizer = AutoTokenizer.from_pretrained(tmp_path, gguf_file=path.name)

Put the file in a directory of its own: next to the HF tokenizer files ``AutoTokenizer`` builds the
tokenizer from ``tokenizer.json`` and ignores the GGUF's.

Known differences of the tokenizer transformers 5.23 rebuilds from a GGUF (not fixable from the file):
it appends ``<|endoftext|>`` as an extra special token (``GPT2Tokenizer``'s default unk/bos/eos) when the
vocabulary lacks it, so ``len(tokenizer)`` is one larger than the model's vocabulary; a text pair gets
BOS before each sequence (``<s> A <s> B``); ``model_max_length`` is unset.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

# llama.cpp's token types (gguf.TokenType); only these three occur in the tokenizers we convert.
_NORMAL, _CONTROL, _USER_DEFINED = 1, 3, 4
# llama.cpp's file type for "every tensor stored as F32" (gguf.LlamaFileType.ALL_F32).
_ALL_F32 = 0

# HF parameter suffix in layer N -> GGUF tensor suffix in blk.N (see gguf.MODEL_TENSORS for llama).
_LAYER_TENSORS = {
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
}


def _permute_rotary(weight: np.ndarray, n_head: int) -> np.ndarray:
    """Reorder q/k projection rows from HF's rotate-half layout to llama.cpp's interleaved pairs.

    HF rotates dimension i with i + head_dim/2 inside each head; llama.cpp rotates 2i with 2i+1. So
    per head the rows [first half | second half] become interleaved (a0, b0, a1, b1, ...).
    transformers' ``LlamaTensorProcessor._reverse_permute_weights`` undoes exactly this, with the
    query head count for attn_q and the key/value head count for attn_k.
    """
    half = weight.shape[0] // n_head // 2
    return weight.reshape(n_head, 2, half, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def _load_state_dict(model_dir: Path) -> dict[str, np.ndarray]:
    """The checkpoint's tensors as float32 numpy arrays (via torch, since numpy has no bfloat16)."""
    from safetensors.torch import load_file

    files = sorted(model_dir.glob("model*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no model*.safetensors in {model_dir}")
    state: dict[str, np.ndarray] = {}
    for file in files:
        for name, tensor in load_file(str(file)).items():
            state[name] = tensor.float().numpy()
    return state


def _rope_theta(config) -> float:
    """rope_theta from a transformers 5 ``rope_parameters`` dict, or the older flat attribute."""
    params = getattr(config, "rope_parameters", None) or {}
    if params.get("rope_type", "default") != "default":
        # GGUF has keys for scaled rope, but this fixture only writes plain rope; fail rather than be wrong.
        raise NotImplementedError(f"rope scaling {params!r} is not supported by this fixture")
    theta = params.get("rope_theta", getattr(config, "rope_theta", None))
    return float(theta if theta is not None else 10000.0)


def _add_hparams(writer, config, name: str) -> None:
    """general.* and llama.* keys, the ones transformers maps onto LlamaConfig (GGUF_CONFIG_MAPPING)."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    writer.add_name(name)
    writer.add_file_type(_ALL_F32)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads or config.num_attention_heads)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(_rope_theta(config))
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    # Stated explicitly so the config does not depend on the token list (absent without a tokenizer).
    writer.add_vocab_size(config.vocab_size)


def _add_tensors(writer, state: dict[str, np.ndarray], config) -> None:
    """Every tensor under its GGUF name; ``output.weight`` only when the embeddings are untied."""
    n_head = config.num_attention_heads
    n_kv_head = config.num_key_value_heads or n_head
    writer.add_tensor("token_embd.weight", state["model.embed_tokens.weight"])
    for layer in range(config.num_hidden_layers):
        for hf_suffix, gguf_suffix in _LAYER_TENSORS.items():
            weight = state[f"model.layers.{layer}.{hf_suffix}"]
            if gguf_suffix == "attn_q.weight":
                weight = _permute_rotary(weight, n_head)
            elif gguf_suffix == "attn_k.weight":
                weight = _permute_rotary(weight, n_kv_head)
            writer.add_tensor(f"blk.{layer}.{gguf_suffix}", np.ascontiguousarray(weight))
    writer.add_tensor("output_norm.weight", state["model.norm.weight"])
    # transformers sets tie_word_embeddings from the absence of output.weight, as llama.cpp writes it.
    if not config.tie_word_embeddings:
        if "lm_head.weight" not in state:
            raise KeyError("untied config but no lm_head.weight in the checkpoint")
        writer.add_tensor("output.weight", state["lm_head.weight"])


def _add_scores_for_no_merges(writer, tokens: list[str]) -> None:
    """Stand in for an empty merge list, which GGUF cannot hold.

    gguf-py drops (``add_array``) or rejects (``_pack_val``) an empty array, and transformers, finding
    no ``tokenizer.ggml.merges``, derives merges from ``tokenizer.ggml.scores`` instead: one for every
    token that splits into two vocabulary tokens. For a byte alphabet plus specials like ``<pad>``
    that derivation yields no merge at all, i.e. exactly the source tokenizer; otherwise it would
    invent merges the source does not have, so refuse.
    """
    vocab = set(tokens)
    for token in tokens:
        if any(token[:i] in vocab and token[i:] in vocab for i in range(1, len(token))):
            raise NotImplementedError(f"token {token!r} would get a derived merge; the source has none")
    # Rank order as score (earlier = preferred), the order a derived merge list would follow.
    writer.add_token_scores([-float(index) for index in range(len(tokens))])


def _add_tokenizer(writer, model_dir: Path) -> None:
    """tokenizer.* keys for a byte-level BPE tokenizer (llama.cpp's ``gpt2`` model).

    Tokens are written in their byte-level spelling, exactly as tokenizer.json stores them, which is
    what transformers' ``byte_level_tokenizer`` expects. Special tokens become CONTROL so transformers
    adds them back as special (unsplit) tokens; whether BOS/EOS is added is measured on the source
    tokenizer rather than read from its post-processor, so any template shape maps to the two flags.
    """
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    backend = json.loads(tokenizer.backend_tokenizer.to_str())
    if backend["model"]["type"] != "BPE":
        raise NotImplementedError(f"only BPE tokenizers are supported, not {backend['model']['type']}")

    size = len(tokenizer)
    tokens = tokenizer.convert_ids_to_tokens(list(range(size)))
    if any(token is None for token in tokens):
        raise ValueError("token ids are not contiguous; GGUF needs one token per id")
    special = set(tokenizer.all_special_ids)
    added = {entry["id"]: entry for entry in backend.get("added_tokens", [])}
    types = []
    for index in range(size):
        if index in special or added.get(index, {}).get("special"):
            types.append(_CONTROL)
        elif index in added:
            types.append(_USER_DEFINED)
        else:
            types.append(_NORMAL)
    # tokenizer.json holds merges as "a b" strings (older files) or [a, b] pairs (newer ones).
    merges = [m if isinstance(m, str) else " ".join(m) for m in backend["model"].get("merges", [])]

    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    if merges:
        writer.add_token_merges(merges)
    else:
        _add_scores_for_no_merges(writer, tokens)
    for token_id, add in (
        (tokenizer.bos_token_id, writer.add_bos_token_id),
        (tokenizer.eos_token_id, writer.add_eos_token_id),
        (tokenizer.pad_token_id, writer.add_pad_token_id),
        (tokenizer.unk_token_id, writer.add_unk_token_id),
    ):
        if token_id is not None:
            add(token_id)

    probe = "a"
    with_specials = tokenizer(probe)["input_ids"]
    plain = tokenizer(probe, add_special_tokens=False)["input_ids"]
    bos, eos = tokenizer.bos_token_id, tokenizer.eos_token_id
    adds_bos = bos is not None and with_specials[:1] == [bos] and plain[:1] != [bos]
    adds_eos = eos is not None and with_specials[-1:] == [eos] and plain[-1:] != [eos]
    writer.add_add_bos_token(adds_bos)
    writer.add_add_eos_token(adds_eos)
    if isinstance(tokenizer.chat_template, str):
        writer.add_chat_template(tokenizer.chat_template)


def write_gguf(
    model_dir: str | Path,
    out_path: str | Path,
    *,
    architecture: str = "llama",
    with_tokenizer: bool = True,
) -> Path:
    """Write the Hugging Face Llama model in ``model_dir`` as an F32 GGUF file at ``out_path``.

    ``model_dir`` holds config.json, model*.safetensors and a tokenizer saved with ``save_pretrained``.
    transformers reads the file back (``from_pretrained(dir, gguf_file=name)``) to identical weights,
    hence identical fp32 logits, and to a tokenizer giving the same ids.

    Args:
        model_dir: the Hugging Face model directory.
        out_path: where to write the ``.gguf`` file (its parent directory is created).
        architecture: written as ``general.architecture`` and as the prefix of the hyper-parameter
            keys; anything but ``"llama"`` (e.g. ``"mamba-like-unknown"``) gives a file transformers
            refuses to load, for testing that error path.
        with_tokenizer: ``False`` omits every ``tokenizer.*`` key, giving a GGUF with no tokenizer.

    Returns:
        ``out_path`` as a :class:`~pathlib.Path`.
    """
    from gguf import GGUFWriter
    from transformers import AutoConfig

    model_dir, out_path = Path(model_dir), Path(out_path)
    config = AutoConfig.from_pretrained(model_dir)
    if config.model_type != "llama":
        raise NotImplementedError(f"only Llama models are supported, not {config.model_type!r}")
    state = _load_state_dict(model_dir)

    out_path.parent.mkdir(parents=True, exist_ok=True)
    writer = GGUFWriter(out_path, architecture)
    # general.name must not contain "mistral": transformers then reads a llama file as Mistral.
    _add_hparams(writer, config, model_dir.name)
    if with_tokenizer:
        _add_tokenizer(writer, model_dir)
    _add_tensors(writer, state, config)

    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out_path
