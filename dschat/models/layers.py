"""Which parameters train: the decoder blocks of any transformers model, and freezing all but the top
``K`` of them (``--trainable_layers K``).

Freezing the embeddings and every block below the top ``K`` makes autograd stop at the first trainable
block: the backward pass, its activations and the optimizer state cover ``K`` blocks instead of all of
them (the forward pass still runs through the whole model). On 2 CPU cores this is what makes a
100M-class model trainable in minutes; the issue's measurement: the top 6 of SmolLM2's 30 layers train
at about 7x the real tokens/s of full fine-tuning with gradient checkpointing.
"""

from __future__ import annotations

import torch
from torch import nn

from dschat.utils.errors import UserError


def unwrap(model: nn.Module) -> nn.Module:
    """The module inside a DeepSpeed engine (``engine.module``), else the model itself."""
    return getattr(model, "module", model)


def accepts(model: torch.nn.Module, name: str) -> bool:
    """Whether the Hugging Face model inside ``model`` (a DeepSpeed engine, a peft wrapper or the model
    itself) takes keyword ``name`` in its forward."""
    import inspect

    inner = unwrap(model)
    inner = inner.get_base_model() if hasattr(inner, "get_base_model") else inner
    try:
        return name in inspect.signature(inner.forward).parameters
    except (TypeError, ValueError):
        return False


def decoder_layers(model: nn.Module) -> tuple[str, nn.ModuleList]:
    """``(name, blocks)``: the ``ModuleList`` of decoder blocks (``model.layers``, ``model.decoder.layers``,
    ``transformer.h``, ...), found as the list with one entry per hidden layer of the config; works on
    peft-wrapped and value-head models alike."""
    config = getattr(model, "config", None)
    n_layers = None
    for holder in (model, getattr(model, "hf_model", None), getattr(model, "model", None)):
        cfg = getattr(holder, "config", None) or config
        n_layers = getattr(cfg, "num_hidden_layers", None) or getattr(cfg, "n_layer", None)
        if n_layers:
            break
    candidates = [
        (name, m)
        for name, m in model.named_modules()
        if isinstance(m, nn.ModuleList) and len(m) > 0 and (n_layers is None or len(m) == n_layers)
    ]
    if not candidates:
        raise ValueError(f"{type(model).__name__}: no list of decoder blocks found")
    return max(candidates, key=lambda c: sum(p.numel() for p in c[1].parameters()))


def top_block_names(model: nn.Module, k: int) -> list[str]:
    """Module names of the top ``k`` decoder blocks (all of them when ``k`` is 0 or too large)."""
    name, blocks = decoder_layers(model)
    first = max(len(blocks) - k, 0) if k > 0 else 0
    return [f"{name}.{i}" for i in range(first, len(blocks))]


def input_side(module_name: str) -> bool:
    """Whether a module outside the decoder blocks runs before them, besides the embedding tables: in
    transformers' models such modules are named for the embeddings (BLOOM's ``word_embeddings_layernorm``,
    ``embed_norm``, ``embedding_layernorm`` ...) or are OPT's ``project_in`` (the embeddings projected up to
    the hidden size, as in OPT-350m)."""
    leaf = module_name.rsplit(".", 1)[-1].lower()
    return leaf == "project_in" or "emb" in leaf


def freeze_below(model: nn.Module, k: int, *, flag: str = "--trainable_layers") -> dict[str, int]:
    """Freeze the embeddings (input, output and position), what runs between them and the first block
    (:func:`input_side`) and every decoder block below the top ``k``; nothing is unfrozen (so a frozen
    LoRA base stays frozen). Returns parameter counts ``{"trainable", "total", "layers", "trainable_layers"}``."""
    name, blocks = decoder_layers(model)
    if k > len(blocks):
        raise UserError(f"{flag} {k}: the model has only {len(blocks)} decoder layers")
    first = len(blocks) - k
    frozen_blocks = {f"{name}.{i}." for i in range(first)}
    outside = {id(p) for m in model.modules() if isinstance(m, nn.Embedding) for p in m.parameters()}
    outside |= {id(p) for mname, m in model.named_modules()
                   if input_side(mname) and not mname.startswith(f"{name}.") for p in m.parameters()}  # fmt: skip
    out_emb = _output_embeddings(model)
    if out_emb is not None:
        outside |= {id(p) for p in out_emb.parameters()}
    for pname, p in model.named_parameters():
        if id(p) in outside or any(pname.startswith(b) for b in frozen_blocks):
            p.requires_grad_(False)
    return parameter_counts(model) | {"layers": len(blocks), "trainable_layers": k}


def contiguous_head_input(model: nn.Module) -> nn.Module:
    """Make the LM head's input contiguous before its matmul; returns ``model``.

    A causal LM applies its head to a slice of the hidden states (``logits_to_keep``: the last position
    when ``generate`` prefills, the response positions in PPO and SFT). On CPU, a bf16 matmul of a
    strided slice takes a slow path: 3.2 s instead of 0.1 s for 64 x 8 positions of a 576 x 49152 head
    (torch 2.13, measured), more than the whole model's forward. A copy of the slice costs nothing.
    """
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if isinstance(head, nn.Module) and not getattr(head, "_dschat_contiguous", False):
        head.register_forward_pre_hook(lambda _m, args: (args[0].contiguous(), *args[1:]))
        head._dschat_contiguous = True
    return model


def parameter_counts(model: nn.Module) -> dict[str, int]:
    """Trainable and total parameters (ZeRO-3 partitioned ones by their full size)."""
    seen: set[int] = set()
    trainable = total = 0
    for p in model.parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        n = getattr(p, "ds_numel", p.numel())
        total += n
        trainable += n if p.requires_grad else 0
    return {"trainable": trainable, "total": total}


def _output_embeddings(model: nn.Module) -> nn.Module | None:
    for holder in (model, getattr(model, "hf_model", None)):
        get = getattr(holder, "get_output_embeddings", None)
        if callable(get):
            try:
                out = get()
            except (AttributeError, NotImplementedError):
                out = None
            if isinstance(out, torch.nn.Module):
                return out
    return None
