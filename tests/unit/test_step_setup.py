"""dschat.step_setup.check_context: --max_seq_len against what the model attends to."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from dschat.step_setup import check_context
from dschat.utils.errors import UserError

NO_LIMIT = int(1e30)  # what transformers puts in model_max_length when a tokenizer names none


def test_beyond_the_position_table_or_the_tokenizers_limit_is_refused():
    with pytest.raises(UserError, match=r"^--max_seq_len 2048: beyond the 1024 tokens m attends to$"):
        check_context(
            2048,
            SimpleNamespace(max_position_embeddings=1024),
            SimpleNamespace(model_max_length=NO_LIMIT),
            "m",
        )
    with pytest.raises(UserError, match="beyond the 512 tokens"):
        check_context(
            600, SimpleNamespace(max_position_embeddings=1024), SimpleNamespace(model_max_length=512), "m"
        )
    check_context(
        1024, SimpleNamespace(max_position_embeddings=1024), SimpleNamespace(model_max_length=NO_LIMIT), "m"
    )


def test_a_model_without_a_position_limit_takes_any_length():
    """ALiBi models (Bloom, MPT) have no position table: the 2048 that generation assumes is no limit."""
    check_context(8192, SimpleNamespace(), SimpleNamespace(model_max_length=NO_LIMIT), "bloom")
