"""Run logging: ``training.log`` + console, ``metrics.jsonl`` always, TensorBoard and W&B when asked.

Only rank 0 writes; other ranks get a logger that drops everything, so call sites need no rank checks.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import sys
from pathlib import Path
from typing import Any

from dschat.utils import dist
from dschat.utils.io import atomic_write_text

LOG = logging.getLogger("dschat")


def mean_std(total: float, sq_total: float, n: float) -> tuple[float, float]:
    """Mean and (population) standard deviation from a weighted sum, sum of squares and weight, the
    sums that ranks all-reduce; 0 where ``n`` is 0 or rounding leaves a negative variance."""
    n = max(n, 1e-12)
    mean = total / n
    return mean, max(sq_total / n - mean * mean, 0.0) ** 0.5


def setup_logging(output_dir: str | None, *, log_file: bool = True) -> logging.Logger:
    """Console logging on rank 0 (warnings only elsewhere) and ``output_dir/training.log`` on rank 0.

    When the orchestrator (``train.py``) already captures the whole process output into
    ``training.log`` it sets ``DSCHAT_LOG_CAPTURED=1`` and the file handler is skipped.
    """
    LOG.handlers.clear()
    LOG.propagate = False
    LOG.setLevel(logging.INFO if dist.is_main() else logging.WARNING)
    fmt = logging.Formatter("%(asctime)s %(levelname)s %(message)s", "%H:%M:%S")
    console = logging.StreamHandler(sys.stdout)
    console.setFormatter(fmt)
    LOG.addHandler(console)
    if output_dir and log_file and dist.is_main() and not os.environ.get("DSCHAT_LOG_CAPTURED"):
        Path(output_dir).mkdir(parents=True, exist_ok=True)
        fh = logging.FileHandler(Path(output_dir) / "training.log", encoding="utf-8")
        fh.setFormatter(fmt)
        LOG.addHandler(fh)
    return LOG


def _step_of(line: str) -> float:
    """The step of one metrics.jsonl row; a torn last line (the process died writing it) sorts last."""
    try:
        return json.loads(line)["step"]
    except (ValueError, KeyError, TypeError):
        return float("inf")


def new_wandb_run_id() -> str:
    """A fresh W&B run id (8 characters of [0-9a-f], a form W&B accepts): chosen when a run starts and
    kept in its checkpoints, so that a resumed run goes on logging to the same W&B run."""
    return secrets.token_hex(4)


class MetricsLogger:
    """One place every metric goes through: jsonl line, TensorBoard scalar, W&B log.

    ``log({"loss": 1.2}, step=10, split="train")`` writes ``{"step": 10, "split": "train", "loss": 1.2}``.
    """

    def __init__(
        self,
        output_dir: str,
        *,
        config: dict[str, Any],
        enable_tensorboard: bool = False,
        tensorboard_path: str | None = None,
        enable_wandb: bool = False,
        wandb_project: str = "dschat",
        run_name: str | None = None,
        wandb_run_id: str | None = None,
        append: bool = False,
        keep_through: int | None = None,
    ) -> None:
        """``append``: add to an earlier process's metrics.jsonl (a resumed run). ``keep_through``: with
        ``append``, first drop its rows after that step: a run resumed from the checkpoint of step N logs
        the steps after N again, and rows the interrupted run wrote after its last checkpoint would stay
        beside them twice. ``wandb_run_id``: the W&B run to log to, the same one when a run is resumed
        (:func:`new_wandb_run_id`, kept in the checkpoints)."""
        self.active = dist.is_main()
        self._tb = None
        self._wandb = None
        self._file = None
        if not self.active:
            return
        Path(output_dir).mkdir(parents=True, exist_ok=True)
        path = Path(output_dir) / "metrics.jsonl"
        if append and keep_through is not None and path.exists():
            kept = [line for line in path.read_text(encoding="utf-8").splitlines(keepends=True)
                    if _step_of(line) <= keep_through]  # fmt: skip
            atomic_write_text(path, "".join(kept))
        self._file = open(path, "a" if append else "w", encoding="utf-8")  # noqa: SIM115
        if enable_tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            # a resumed run: the interrupted run's points after the checkpoint go (as its jsonl rows do)
            purge = keep_through + 1 if append and keep_through is not None else None
            # a --tensorboard_path several steps share (train.py passes it to each): one run per step there,
            # named as the step's output directory (as DeepSpeed-Chat names each step's job)
            where = (
                Path(tensorboard_path) / Path(output_dir).name
                if tensorboard_path
                else Path(output_dir) / "tensorboard"
            )
            self._tb = SummaryWriter(str(where), purge_step=purge)
        if enable_wandb:
            import wandb

            # Offline mode works with no network; WANDB_MODE from the environment wins.
            os.environ.setdefault("WANDB_DIR", str(output_dir))
            self._wandb = wandb.init(
                project=wandb_project, name=run_name, id=wandb_run_id, config=config, dir=str(output_dir), resume="allow"
            )  # fmt: skip

    def log(self, metrics: dict[str, Any], *, step: int, split: str) -> None:
        if not self.active:
            return
        row = {"step": step, "split": split, **metrics}
        self._file.write(json.dumps(row, default=float) + "\n")
        self._file.flush()
        numeric = {
            k: v for k, v in metrics.items() if isinstance(v, (int, float)) and not isinstance(v, bool)
        }
        if self._tb is not None:
            for k, v in numeric.items():
                self._tb.add_scalar(f"{split}/{k}", v, step)
        if self._wandb is not None:
            self._wandb.log({f"{split}/{k}": v for k, v in numeric.items()}, step=step)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()
