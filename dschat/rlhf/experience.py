"""The typed container PPO passes from experience collection to training."""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

import torch

from dschat.data.packing import PackedRollouts, rollout_rows
from dschat.models.trunk import Trunk


@dataclass
class Experience:
    """One batch of rollouts with everything PPO needs. B = batch, T = prompt_len + generated length
    (after :meth:`cat`, the widest prompt_len and the longest row).

    Positions t = 0..T-2 index *actions*: the token at t+1 chosen after seeing tokens 0..t.
    """

    sequences: torch.Tensor  # (B, T) long: prompt left-padded to prompt_len, then the response
    attention_mask: torch.Tensor  # (B, T) 0/1: prompt tokens and response tokens up to the first EOS
    action_mask: torch.Tensor  # (B, T-1) float: 1 where token t+1 is a response token (EOS included)
    logprobs: torch.Tensor  # (B, T-1) actor log-probs at generation time (the "old" policy)
    ref_logprobs: torch.Tensor  # (B, T-1) reference-model log-probs
    values: torch.Tensor  # (B, T-1) critic values at generation time
    rewards: torch.Tensor  # (B, T-1) KL-shaped per-token rewards (score added on the last action)
    advantages: torch.Tensor  # (B, T-1) GAE advantages (possibly whitened)
    returns: torch.Tensor  # (B, T-1) advantages + values: the critic's regression target
    scores: torch.Tensor  # (B,) reward score of each full sequence (before clipping)
    prompt_len: int  # width of the left-padded prompt block
    # The rows as the actor's experience pass ran them, kept for the update: packed by prompt (None:
    # separate rows), and the hidden states after the actor's frozen bottom blocks over those rows
    # ((G, L, H) packed, (B, T, H) separate; None without frozen blocks). Dropped by cat.
    packed: PackedRollouts | None = None
    trunk: Trunk | None = None
    # (B, T-1) the actor's log-probs with their autograd graph: the round's one update reuses the
    # experience pass (PPOHyper.one_update_per_round); None otherwise. Dropped by cat.
    actor_graph: torch.Tensor | None = None
    # (B, T-1) the critic's values with their graph, the same for the value update
    # (PPOHyper.critic_one_update_per_round); None otherwise. Dropped by cat.
    critic_graph: torch.Tensor | None = None

    def __len__(self) -> int:
        return self.sequences.shape[0]

    def slice(self, start: int, end: int) -> Experience:
        """Rows ``start:end`` (a PPO minibatch); its packed rows and trunk where the range keeps whole
        prompt groups, else none (the update packs and computes them anew); the actor's graph only where
        the range is every row."""
        kw = {f.name: getattr(self, f.name) for f in fields(self)}
        out = Experience(**{k: (v[start:end] if isinstance(v, torch.Tensor) else v) for k, v in kw.items()})
        if start > 0 or end < len(self):  # a part of the round: its graph serves one update of all of it
            out = replace(out, actor_graph=None, critic_graph=None)
        if self.packed is None:
            return replace(out, trunk=self.trunk.rows(start, end) if self.trunk is not None else None)
        whole = rollout_rows(self.packed, start, end)
        if whole is None:
            return replace(out, packed=None, trunk=None)
        packed, g0, g1 = whole
        return replace(out, packed=packed, trunk=self.trunk.rows(g0, g1) if self.trunk is not None else None)

    @staticmethod
    def cat(parts: list[Experience], pad_id: int) -> Experience:
        """Concatenate rollouts of any prompt and response widths (``--generation_batches``: each round's
        prompts are padded to that round's longest).

        Each part's prompt block is left-padded to the widest ``prompt_len`` P and its end right-padded
        to the longest sequence: sequences with ``pad_id``, masks and per-action tensors with 0. Action t
        predicts token t+1, so shifting a part's tokens by ``P - prompt_len`` shifts its actions by as
        much. Padding is masked out of every loss, and positions come from the attention mask
        (``position_ids_from_mask``), so the extra left padding changes no log-prob either.
        """
        if len(parts) == 1:  # one round: as it is, with its packed rows and trunk
            return parts[0]
        prompt_len = max(p.prompt_len for p in parts)
        t = max(prompt_len - p.prompt_len + p.sequences.shape[1] for p in parts)

        def pad(x: torch.Tensor, left: int, width: int, value: float) -> torch.Tensor:
            """(B, n) -> (B, width): ``left`` columns of ``value`` before ``x``, the rest after it."""
            if left == 0 and x.shape[1] == width:
                return x
            out = torch.full((x.shape[0], width), value, dtype=x.dtype, device=x.device)
            out[:, left : left + x.shape[1]] = x
            return out

        out = {}
        for f in fields(Experience):
            if f.name == "prompt_len":
                out[f.name] = prompt_len
                continue
            # one round's own state: rounds packed apart are packed anew by the update, which also runs
            # the actor's and critic's forwards itself (a part of several rounds is never one update)
            if f.name in ("packed", "trunk", "actor_graph", "critic_graph"):
                continue
            vals = []
            for p in parts:
                v, left = getattr(p, f.name), prompt_len - p.prompt_len
                if f.name == "sequences":
                    v = pad(v, left, t, pad_id)
                elif f.name == "attention_mask":
                    v = pad(v, left, t, 0)
                elif f.name != "scores":  # per-action: (B, T-1)
                    v = pad(v, left, t - 1, 0)
                vals.append(v)
            out[f.name] = torch.cat(vals)
        return Experience(**out)
