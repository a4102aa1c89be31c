"""Exponential moving average of the actor (``--enable_ema``), kept in fp32 on rank 0's CPU."""

from __future__ import annotations

from collections.abc import Callable

import torch

from dschat.engine.checkpoint import gather_full_state_dict, write_hf_model
from dschat.utils import dist
from dschat.utils.errors import UserError

CHECKPOINT_NAME = "actor_ema"  # its file in a step-3 checkpoint: actor_ema.safetensors


class EMA:
    """``ema <- decay * ema + (1 - decay) * weights`` after every PPO update (a collective under ZeRO-3)."""

    def __init__(self, module: torch.nn.Module, decay: float) -> None:
        self.decay = decay
        state = gather_full_state_dict(module)
        self.state = {k: v.float() for k, v in state.items()} if state is not None else None

    def restore(self, load: Callable[[], dict[str, torch.Tensor] | None], where: str) -> None:
        """The average a checkpoint kept (:func:`dschat.engine.checkpoint.save_checkpoint`'s ``tensors``), read
        by ``load`` on the ranks that keep an average only: a resumed run goes on averaging from it, not from
        the weights it resumes with. A collective: every rank refuses a checkpoint without it together."""
        saved = load() if self.state is not None else None
        missing = self.state is not None and (saved is None or saved.keys() != self.state.keys())
        if dist.all_reduce_sum([float(missing)])[0]:
            raise UserError(f"--resume: {where} holds no EMA of this actor (a checkpoint of an earlier dschat, "
                            "which did not save it); start over with --overwrite")  # fmt: skip
        if saved is not None:
            self.state = {k: v.float() for k, v in saved.items()}

    @torch.no_grad()
    def update(self, module: torch.nn.Module) -> None:
        current = gather_full_state_dict(module)
        if self.state is None or current is None:
            return
        for k, v in current.items():
            self.state[k].mul_(self.decay).add_(v.float(), alpha=1.0 - self.decay)

    def export(self, module: torch.nn.Module, tokenizer, out_dir) -> None:
        write_hf_model(module, self.state, tokenizer, out_dir)
        dist.barrier()
