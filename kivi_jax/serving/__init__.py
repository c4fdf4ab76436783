"""Continuous batching over the KIVI state: `Engine` serves requests as they arrive
(docs/serving.md)."""

from kivi_jax.serving.engine import Engine, EngineStats
from kivi_jax.serving.handle import EngineError, QueueFullError, RequestHandle

__all__ = ["Engine", "EngineError", "EngineStats", "QueueFullError", "RequestHandle"]
