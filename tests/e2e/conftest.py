"""Tiny models with known answers for the inference-tool tests, built once per test session."""

from __future__ import annotations

import importlib.util
import json
import sys
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.tiny_chat_models import chain_model, lora_adapter, sign_reward_model

ENDLESS = " 0123456789abcdefghijklmnopqrstuvwxyz"
ENDLESS_CONTEXT = 65536


@pytest.fixture(scope="session")
def tiny(tmp_path_factory) -> SimpleNamespace:
    """``right``/``wrong``: answer every Human/Assistant prompt with " 579" / " 578" and EOS;
    ``turns``: " 0123456789" and then an invented "\\nHuman:" turn, forever; ``endless``: 37 distinct
    characters in a cycle (``ENDLESS``), with a context long enough for a reply no test waits to end;
    ``reward``: +8 for a text ending in 9, -8 for 8; ``adapter``: a LoRA adapter on ``right`` whose config
    names a base directory that no longer exists."""
    root = tmp_path_factory.mktemp("tiny-chat-models")
    ns = SimpleNamespace(
        root=root,
        right=chain_model(root / "right", " 579"),
        wrong=chain_model(root / "wrong", " 578"),
        turns=chain_model(root / "turns", " 0123456789\nHuman", end="cycle"),
        endless=chain_model(root / "endless", ENDLESS, end="cycle", context=ENDLESS_CONTEXT),
        reward=sign_reward_model(root / "reward"),
    )
    gone = chain_model(root / "gone", " 579")
    ns.adapter = lora_adapter(root / "adapter", gone)
    cfg_path = Path(ns.adapter) / "adapter_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["base_model_name_or_path"] = str(root / "deleted-base")
    cfg_path.write_text(json.dumps(cfg))
    return ns


def load_entry_main(path: str, name: str) -> Callable:
    """An entry script's ``main`` imported in this process (no interpreter start-up per test case)."""
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module.main
