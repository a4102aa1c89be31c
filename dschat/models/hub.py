"""The Hugging Face Hub as a source of models and datasets: whether a name is in the local caches,
whether the hub may be reached (``HF_HUB_OFFLINE``, then a HEAD request), and the one line for a hub name that
can be neither read from a cache nor downloaded. Light: no torch, transformers or datasets.

Without this check, a hub name that is not cached on a machine without a network went to transformers
or datasets, which retried (with back-off, per file) inside the step, after its start-up: 75 s for a
model and 31 s for a dataset before the one-line error (measured 2026-11-29 on a machine without a
network).
"""

from __future__ import annotations

import os
import re
import threading
from pathlib import Path

from dschat.utils.errors import UserError

TRUE = ("1", "ON", "YES", "TRUE")  # how huggingface_hub and datasets read a boolean variable
# ``name`` or ``namespace/name`` as the hub spells a repository id
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?$")


def looks_like_hub_id(spec: str) -> bool:
    return bool(_HUB_ID.match(spec)) and ".." not in spec and not spec.endswith(".")


def hub_offline() -> bool:
    """``HF_HUB_OFFLINE`` (or ``TRANSFORMERS_OFFLINE``): as huggingface_hub read it when imported, or as
    the environment holds it now (set later in this process, it still means offline to the user)."""
    from huggingface_hub import is_offline_mode

    now = os.environ.get("HF_HUB_OFFLINE") or os.environ.get("TRANSFORMERS_OFFLINE") or ""
    return is_offline_mode() or now.upper() in TRUE


def hub_reachable(timeout: float = 3.0) -> bool:
    """The hub's endpoint (``HF_ENDPOINT``) answers a HEAD request within ``timeout`` seconds, through
    huggingface_hub's own HTTP session (its proxies and scheme, as a download would go); any HTTP status
    counts as an answer. The request runs in a daemon thread that is given up on at ``timeout``: name
    resolution (``getaddrinfo``, a dead DNS server) blocks outside any HTTP timeout."""
    import huggingface_hub
    import huggingface_hub.constants as hub_constants

    answered: list[bool] = []

    def probe() -> None:
        try:
            huggingface_hub.get_session().head(hub_constants.ENDPOINT, timeout=timeout)
        except Exception:  # no route, no name, a refused or timed-out connection, a proxy that fails
            answered.append(False)
        else:
            answered.append(True)

    thread = threading.Thread(target=probe, name="dschat-hub-probe", daemon=True)
    thread.start()
    thread.join(timeout)
    return bool(answered and answered[0])


def in_hub_cache(name: str, repo_type: str = "model") -> bool:
    """Whether the local caches hold what loading ``name`` offline reads: a model's ``config.json`` (every
    model repository has one) in the Hugging Face cache; for a dataset, the copy ``datasets`` prepared
    (``HF_DATASETS_CACHE/namespace___name``: offline, ``load_dataset`` reads that, not the hub cache's
    raw files)."""
    import huggingface_hub.constants as hub_constants
    from huggingface_hub import try_to_load_from_cache

    if repo_type == "dataset":
        prepared = Path(os.environ.get("HF_DATASETS_CACHE") or Path(hub_constants.HF_HOME) / "datasets")
        found = prepared / name.replace("/", "___")
        return found.is_dir() and any(found.iterdir())
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
    if hub_offline():
        why = "HF_HUB_OFFLINE is set"
    elif datasets_offline:
        why = "HF_DATASETS_OFFLINE is set"
    elif not hub_reachable():
        why = "the hub is unreachable"
    else:
        return  # transformers or datasets downloads it, or says the hub has no such repository
    if repo_type == "model":
        raise UserError(f"{flag} {spec}: no such local directory, not in the Hugging Face cache, and {why}")
    raise UserError(f"{flag} {spec}: not in the datasets cache, and {why}")
