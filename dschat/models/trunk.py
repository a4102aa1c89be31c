"""A frozen trunk shared by several models: their common bottom layers computed once.

With ``--trainable_layers K`` a model trains only its top ``K`` decoder blocks; its embeddings and the
blocks below never change. In step 3 of the main job the actor (top 8 of SmolLM2's 30 blocks trained),
the reference (the step-1 model the actor starts from) and the reward model (trained from the step-1
model with its own top 8) therefore hold the same bottom 22 blocks, and the experience pass feeds all
three the same rows. The hidden states after block 22 are one tensor: the actor computes them
(:func:`capture`), the others start from them (:func:`replay`) and run only their own top blocks.

Which blocks are shared is read off the weights (:func:`shared_depth`: frozen everywhere and equal in
every model, and so must be whatever runs before block 0, traced once). The stand-ins keep the block
list's length, so a model that picks a layer's attention by its position runs as it does in full. A
caller still compares the first batch against the full computation, as the shared prompt does: a model
may do what no weight comparison sees.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
from collections.abc import Collection, Iterator
from dataclasses import dataclass

import torch
from torch import nn

from dschat.lm import within_rounding
from dschat.models.layers import decoder_layers, unwrap

LOG = logging.getLogger("dschat")


def _body(model: nn.Module) -> tuple[nn.Module, str, nn.ModuleList]:
    """``(body, attribute, blocks)``: the module holding the decoder blocks (a ``LlamaModel``, an OPT
    decoder), the blocks' attribute on it, and the blocks. What runs before block 0 is named relative to
    the body, the same in a causal LM and in a value-head model of the same architecture."""
    name, blocks = decoder_layers(model)
    parent, _, attr = name.rpartition(".")
    return (model.get_submodule(parent) if parent else model), attr, blocks


def _frozen_equal(a: list[nn.Module], b: list[nn.Module], *, recurse: bool = True) -> bool:
    """Same parameter shapes and values, none of them trainable, on both sides."""
    pa = [p for m in a for p in m.parameters(recurse=recurse)]
    pb = [p for m in b for p in m.parameters(recurse=recurse)]
    if len(pa) != len(pb) or any(p.requires_grad for p in pa + pb):
        return False
    return all(x.shape == y.shape and x.dtype == y.dtype and torch.equal(x, y) for x, y in zip(pa, pb))


@torch.no_grad()
def _before_blocks(model: nn.Module) -> list[str] | None:
    """Names (relative to the body) of the modules with parameters that run before block 0, traced on
    a one-token forward of the causal LM ``model``: the embeddings, and whatever else the architecture
    computes there (OPT-350m's ``project_in``). None where the forward cannot be traced that way."""
    body, _, blocks = _body(model)
    names = {id(m): n for n, m in body.named_modules()}
    seen: list[str | None] = []
    entered = [False]

    def note(module: nn.Module, _args) -> None:
        if module is blocks[0]:
            entered[0] = True
        elif not entered[0] and next(module.parameters(recurse=False), None) is not None:
            seen.append(names.get(id(module)))  # None: outside the body

    handle = torch.nn.modules.module.register_module_forward_pre_hook(note)
    try:
        device = next(model.parameters()).device
        ids = torch.ones((1, 1), dtype=torch.long, device=device)
        model(input_ids=ids, attention_mask=torch.ones_like(ids))  # a value-head model needs the mask
    except Exception:
        return None
    finally:
        handle.remove()
    return None if not entered[0] or None in seen else list(dict.fromkeys(seen))


def shared_depth(models: list[nn.Module]) -> int:
    """How many bottom decoder blocks every model shares, with everything that runs before them: frozen
    and equal in all. 0 where they share none, where something before the blocks trains or differs
    (traced on the first model, a causal LM), or where a model is partitioned (ZeRO-3) or may skip blocks
    (layerdrop). One model: its own frozen bottom (what its training forward can start above)."""
    mods = [unwrap(m) for m in models]
    try:
        bodies = [_body(m) for m in mods]
    except ValueError:
        return 0
    if any(hasattr(p, "ds_id") for m in mods for p in m.parameters()):
        return 0  # ZeRO-3 partitions hold no local values to compare or reuse
    if any(getattr(getattr(m, "config", None), "layerdrop", 0) for m in mods):
        return 0
    before = _before_blocks(mods[0])
    if before is None:
        return 0
    for name in before:
        try:
            first, *others = [body.get_submodule(name) for body, _, _ in bodies]
        except AttributeError:
            return 0
        if not all(_frozen_equal([first], [o], recurse=False) for o in [first, *others]):
            return 0
    blocks = [b for _, _, b in bodies]
    depth = 0
    while depth < min(len(b) for b in blocks) - 1:  # the top block always runs in each model
        if not all(_frozen_equal([blocks[0][depth]], [b[depth]]) for b in blocks):
            break
        depth += 1
    return depth


@dataclass
class Trunk:
    """The hidden states ``(B, L, H)`` after the shared blocks, for one batch of rows (None until
    captured, or when the blocks return something else than a tensor)."""

    depth: int
    hidden: torch.Tensor | None = None

    def rows(self, start: int, end: int) -> Trunk:
        """The hidden states of rows ``start:end`` (packed rows: groups)."""
        return Trunk(self.depth, None if self.hidden is None else self.hidden[start:end])


@contextlib.contextmanager
def capture(model: nn.Module, depths: Collection[int]) -> Iterator[dict[int, Trunk]]:
    """Record the output of block ``d - 1`` for each depth ``d`` during the forward passes inside the
    block (the last pass wins): ``{d: Trunk}``. No depths: records nothing."""
    trunks = {d: Trunk(d) for d in depths if d > 0}
    blocks = decoder_layers(unwrap(model))[1] if trunks else []
    handles = []

    def keeper(trunk: Trunk):
        def keep(_module, _args, output) -> None:
            # a block returning a tuple (older architectures): nothing to replay
            trunk.hidden = output.detach() if isinstance(output, torch.Tensor) else None

        return keep

    for d, trunk in trunks.items():
        handles.append(blocks[d - 1].register_forward_hook(keeper(trunk)))
    try:
        yield trunks
    finally:
        for h in handles:
            h.remove()


class _Replay(nn.Module):
    """Stands in for the last shared block: returns (a copy of) the captured hidden states, whatever it
    is given."""

    def __init__(self, hidden: torch.Tensor) -> None:
        super().__init__()
        self.hidden = hidden

    def forward(self, hidden_states: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        if hidden_states.shape != self.hidden.shape:
            raise RuntimeError(
                f"replayed trunk {tuple(self.hidden.shape)} for rows {tuple(hidden_states.shape)}"
            )
        return self.hidden.clone()  # the kept tensor stays intact whatever the next block does in place


class _Pass(nn.Module):
    """Stands in for a shared block below the last one: hands its input on (no computation)."""

    def forward(self, hidden_states: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        return hidden_states


@contextlib.contextmanager
def replay(model: nn.Module, trunk: Trunk | None) -> Iterator[None]:
    """Inside the block, ``model``'s forward starts at block ``trunk.depth`` from ``trunk.hidden`` (its
    embeddings' output is discarded); a no-op without a captured trunk. The list of blocks keeps its
    length, so a model that picks each layer's attention type or rotary embedding by its position in
    the loop (Gemma 2 and 3, Qwen 2 with a sliding window) picks the same ones. The model's own blocks
    are put back on exit."""
    if trunk is None or trunk.hidden is None:
        yield
        return
    parent, attr, blocks = _body(unwrap(model))
    stand_ins = [_Pass() for _ in range(trunk.depth - 1)] + [_Replay(trunk.hidden)]
    setattr(parent, attr, nn.ModuleList([*stand_ins, *list(blocks)[trunk.depth :]]))
    try:
        yield
    finally:
        setattr(parent, attr, blocks)


def replay_agrees(replayed: torch.Tensor, full: torch.Tensor, model: nn.Module) -> tuple[bool, float]:
    """Whether values computed from a replayed trunk equal the full pass's within ``model``'s rounding on
    every rank (:func:`dschat.lm.within_rounding`, collective), and the largest difference."""
    diff = float((replayed.float() - full.float()).abs().max()) if full.numel() else 0.0
    return within_rounding(diff, next(unwrap(model).parameters()).dtype)


class EvalMemo:
    """``model`` (an engine or a module) for evaluations that score the same batches again and again: the
    first forward of a batch records the hidden states above the model's frozen bottom (its own
    :func:`shared_depth`), and every later forward of that batch starts there and runs only the trained top
    blocks. Keyed by the content of the call's tensors; everything else is ``model``'s (``memo.eval()``,
    ``memo.device``). Each evaluation runs inside ``with memo.evaluation():``. The first evaluation replays
    nothing (a batch met twice in it runs twice); the first batch of the second is replayed and also run in
    full and compared (:func:`dschat.lm.within_rounding`, collective: every rank reaches that batch
    together, where a rank's first repeated batch could come in its first evaluation while its peers had
    none); where they differ the memo stops, with a warning. No frozen bottom (or ZeRO-3): every forward
    runs in full.

    Memory: one ``(rows, T, hidden)`` tensor per distinct batch, in the model's dtype."""

    def __init__(self, model, what: str) -> None:
        self.model, self.what = model, what
        self.depth = shared_depth([model])
        self.kept: dict[bytes, Trunk] = {}
        self.evaluations = 0  # begun
        self.checked = False
        self.first_call = False  # the next call is its evaluation's first

    @contextlib.contextmanager
    def evaluation(self) -> Iterator[None]:
        """One evaluation's forwards (every rank runs the same number of evaluations)."""
        self.evaluations += 1
        self.first_call = True
        try:
            yield
        finally:
            self.first_call = False

    def __getattr__(self, name: str):  # only for names not set in __init__
        if name == "model":
            raise AttributeError(name)
        return getattr(self.model, name)

    @staticmethod
    def _key(args: tuple, kwargs: dict) -> bytes:
        h = hashlib.blake2b(digest_size=16)
        for v in [*args, *(kwargs[k] for k in sorted(kwargs))]:
            if isinstance(v, torch.Tensor):
                h.update(repr((v.shape, v.dtype)).encode())
                h.update(v.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
            else:
                h.update(repr(v).encode())
        return h.digest()

    def __call__(self, *args, **kwargs):
        first, self.first_call = self.first_call, False
        if not self.depth:
            return self.model(*args, **kwargs)
        key = self._key(args, kwargs)
        trunk = self.kept.get(key)
        if not self.checked and first and self.evaluations > 1:
            self.checked = True  # every rank, at the second evaluation's first batch
            replayed = None
            if trunk is not None:
                with replay(self.model, trunk):
                    replayed = self.model(*args, **kwargs)
            return self._check(replayed, self.model(*args, **kwargs))
        if trunk is None:
            with capture(self.model, [self.depth]) as trunks:
                out = self.model(*args, **kwargs)
            if trunks[self.depth].hidden is not None:
                self.kept[key] = trunks[self.depth]
            return out
        if not self.checked:  # met again before the check: in full
            return self.model(*args, **kwargs)
        with replay(self.model, trunk):
            return self.model(*args, **kwargs)

    def _check(self, replayed: torch.Tensor | None, full: torch.Tensor) -> torch.Tensor:
        """``replayed`` None: this rank had not kept the batch (nothing to compare; the memo stops)."""
        if replayed is None:  # still collective: the peers decide with this rank
            ok, diff = within_rounding(float("inf"), next(unwrap(self.model).parameters()).dtype)
        else:
            ok, diff = replay_agrees(replayed, full, self.model)
        if ok:
            LOG.info("%s: repeated batches start above the frozen bottom %d blocks (max difference %.1e)",
                     self.what, self.depth, diff)  # fmt: skip
            return replayed
        LOG.warning("%s: the kept hidden states differ from the full pass by %.3g (on some rank); computing it "
                    "in full", self.what, diff)  # fmt: skip
        self.depth, self.kept = 0, {}
        return full
