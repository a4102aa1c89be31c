"""The only package that imports deepspeed: distributed setup, engines, checkpoints, ZeRO-3 helpers."""

from dschat.engine.core import (
    gather_zero3,
    init_distributed,
    initialize_engine,
    resolve_dtype,
    zero3_loading,
)

__all__ = ["gather_zero3", "init_distributed", "initialize_engine", "resolve_dtype", "zero3_loading"]
