"""Errors meant for the person running the program, and the wrapper that shows them as one line."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable


class UserError(Exception):
    """Bad input that the user can fix (a flag, a file, a field). Shown as one line, exit code 2."""


EXIT_USER_ERROR = 2


def first_line(exc: BaseException) -> str:
    """An exception's message cut to its first line (200 characters) for a one-line error; its type where
    it has no message."""
    text = str(exc).strip()
    return text.splitlines()[0][:200] if text else type(exc).__name__


def run_cli(main: Callable[[], int | None]) -> None:
    """Run ``main`` and turn a :class:`UserError` into ``error: <message>`` on stderr and exit 2.

    Any other exception keeps its traceback (it is a bug, and the traceback is what a bug report needs).
    Under several ranks rank 0 prints, and each other node's first rank, naming its rank: a bad flag does
    not print the same line N times, and an error of one node alone is still seen.
    """
    try:
        code = main()
    except UserError as exc:
        # once per node: rank 0, and each other node's first rank naming itself (an error found on one node
        # alone, its node-local disk say, ended the job with an exit code and no word)
        rank = int(os.environ.get("RANK", "0"))
        if rank == 0:
            print(f"error: {exc}", file=sys.stderr, flush=True)
        elif int(os.environ.get("LOCAL_RANK", "-1")) == 0:
            print(f"error: rank {rank}: {exc}", file=sys.stderr, flush=True)
        # Alone, nothing can wait on this rank; with peers a blocking teardown could hang on a
        # rank that did not fail, so they exit as before and the launcher ends the job.
        if int(os.environ.get("WORLD_SIZE", "1")) == 1:
            _destroy_process_group(failed=True)
        sys.exit(EXIT_USER_ERROR)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr, flush=True)
        sys.exit(130)
    except BaseException as exc:
        # Several ranks interleave their output: say which one failed (the traceback follows).
        if int(os.environ.get("WORLD_SIZE", "1")) > 1 and not isinstance(exc, SystemExit):
            rank = os.environ.get("RANK", "?")
            print(
                f"error: rank {rank} failed: {type(exc).__name__}: {str(exc)[:300]}",
                file=sys.stderr,
                flush=True,
            )
        raise
    _destroy_process_group()
    sys.exit(code or 0)


def _destroy_process_group(failed: bool = False) -> None:
    """Tear down torch.distributed if it was started: NCCL otherwise prints a warning at exit
    ("destroy_process_group() was not called") after every run on a GPU."""
    if "torch" not in sys.modules:  # train.py and the quick tools never load torch: keep exit instant
        return
    import torch.distributed as torch_dist

    if torch_dist.is_available() and torch_dist.is_initialized():
        if torch_dist.get_world_size() > 1 and not failed:
            # Every rank ends here together. Without it one rank tore its gloo connections down while a
            # peer was still finishing (the writing rank exporting the model), and that peer aborted at
            # exit ("terminate called without an active exception", exit 250) after a finished run.
            torch_dist.barrier()
        torch_dist.destroy_process_group()
