"""The Hugging Face Hub as a source of models and datasets: whether a name is in the local caches,
whether the hub may be reached (``HF_HUB_OFFLINE``, then a socket), and the one line for a hub name that
can be neither read from a cache nor downloaded. Light: no torch, transformers or datasets.

Without this check, a hub name that is not cached on a machine without a network went to transformers
or datasets, which retried (with back-off, per file) inside the step, after its start-up: 75 s for a
model and 31 s for a dataset before the one-line error (measured 2026-11-29 on a machine without a
network).
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from dschat.utils.errors import UserError

# ``name`` or ``namespace/name`` as the hub spells a repository id
TRUE = ("1", "ON", "YES", "TRUE")  # how huggingface_hub and datasets read a boolean variable
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?$")


def looks_like_hub_id(spec: str) -> bool:
    return bool(_HUB_ID.match(spec)) and ".." not in spec and not spec.endswith(".")


def hub_offline() -> bool:
    """``HF_HUB_OFFLINE`` (or ``TRANSFORMERS_OFFLINE``) as huggingface_hub reads it."""
    from huggingface_hub import is_offline_mode

    return is_offline_mode()


def hub_reachable(timeout: float = 3.0) -> bool:
    """A TCP connection to the hub's endpoint (``HF_ENDPOINT``) opens within ``timeout`` seconds."""
    import socket
    from urllib.parse import urlparse

    url = urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co"))
    try:
        with socket.create_connection((url.hostname or "huggingface.co", url.port or 443), timeout=timeout):
            return True
    except OSError:
        return False


def in_hub_cache(name: str, repo_type: str = "model") -> bool:
    """Whether the local caches hold ``name``: a model's ``config.json`` (every model repository has one)
    in the Hugging Face cache; a dataset's snapshot there, or its prepared copy in the datasets cache."""
    import huggingface_hub.constants as hub_constants
    from huggingface_hub import try_to_load_from_cache

    if repo_type == "dataset":
        snapshots = Path(hub_constants.HF_HUB_CACHE) / f"datasets--{name.replace('/', '--')}" / "snapshots"
        prepared = Path(os.environ.get("HF_DATASETS_CACHE") or Path(hub_constants.HF_HOME) / "datasets")
        return (snapshots.is_dir() and any(snapshots.iterdir())) or (
            prepared / name.replace("/", "___")
        ).is_dir()
    try:
        return isinstance(try_to_load_from_cache(name, "config.json"), str)
    except Exception:  # a name the cache layout cannot hold
        return False


def check_hub_name(spec: str, flag: str, repo_type: str = "model") -> None:
    """A spec that is not a local path and reads as a hub id must be in the local caches or downloadable:
    one line at once where it is neither (``HF_HUB_OFFLINE`` set, for a dataset also
    ``HF_DATASETS_OFFLINE``, or no connection)."""
    if not looks_like_hub_id(spec) or in_hub_cache(spec, repo_type):
        return
    datasets_offline = repo_type == "dataset" and os.environ.get("HF_DATASETS_OFFLINE", "").upper() in TRUE
    if hub_offline() or datasets_offline:
        why = (
            "HF_DATASETS_OFFLINE is set"
            if datasets_offline and not hub_offline()
            else "HF_HUB_OFFLINE is set"
        )
    elif not hub_reachable():
        why = "the hub is unreachable"
    else:
        return  # transformers or datasets downloads it, or says the hub has no such repository
    where = "no such local directory" if repo_type == "model" else "no such local file or directory"
    raise UserError(f"{flag} {spec}: {where}, not in the Hugging Face cache, and {why}")
