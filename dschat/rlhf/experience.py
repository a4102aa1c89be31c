"""The typed container PPO passes from experience collection to training."""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch


@dataclass
class Experience:
    """One batch of rollouts with everything PPO needs. B = batch, T = prompt_len + generated length.

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

    def __len__(self) -> int:
        return self.sequences.shape[0]

    def slice(self, start: int, end: int) -> Experience:
        """Rows ``start:end`` (a PPO minibatch)."""
        kw = {f.name: getattr(self, f.name) for f in fields(self)}
        return Experience(**{k: (v[start:end] if isinstance(v, torch.Tensor) else v) for k, v in kw.items()})

    @staticmethod
    def cat(parts: list[Experience], pad_id: int) -> Experience:
        """Concatenate rollouts of different lengths: right-pad sequences and per-action tensors to the
        longest (padding has zero masks, so it changes no loss)."""
        prompt_len = parts[0].prompt_len
        if any(p.prompt_len != prompt_len for p in parts):
            raise ValueError("experiences to concatenate must share prompt_len")
        t = max(p.sequences.shape[1] for p in parts)

        def pad(x: torch.Tensor, width: int, value: float) -> torch.Tensor:
            if x.shape[1] == width:
                return x
            extra = torch.full((x.shape[0], width - x.shape[1]), value, dtype=x.dtype, device=x.device)
            return torch.cat([x, extra], dim=1)

        out = {}
        for f in fields(Experience):
            vals = [getattr(p, f.name) for p in parts]
            if f.name == "prompt_len":
                out[f.name] = prompt_len
            elif f.name == "scores":
                out[f.name] = torch.cat(vals)
            elif f.name == "sequences":
                out[f.name] = torch.cat([pad(v, t, pad_id) for v in vals])
            elif f.name == "attention_mask":
                out[f.name] = torch.cat([pad(v, t, 0) for v in vals])
            else:
                out[f.name] = torch.cat([pad(v, t - 1, 0) for v in vals])
        return Experience(**out)
