"""Data: sources -> one schema (:class:`Sample`) -> per-step split -> tokenized, cached -> collated batches."""

from dschat.data.schema import Sample

__all__ = ["Sample"]
