"""The only package that imports deepspeed: distributed setup, engines, checkpoints, ZeRO-3 helpers."""

from dschat.engine.core import (
    init_distributed,
    initialize_engine,
    resolve_dtype,
    zero3_loading,
)

__all__ = ["init_distributed", "initialize_engine", "resolve_dtype", "zero3_loading"]
