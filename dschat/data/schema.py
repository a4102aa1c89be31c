"""The one schema every data source is mapped to."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Sample:
    """A prompt and its preferred response, plus the dispreferred one for preference data.

    SFT uses ``prompt + chosen``; reward modelling uses ``(prompt + chosen, prompt + rejected)``;
    PPO uses ``prompt`` alone.
    """

    prompt: str
    chosen: str
    rejected: str | None = None
    source: str = ""
