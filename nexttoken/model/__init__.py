"""The network: configuration-driven Llama-family modules, their KV cache, and the checkpoint loader."""

from .batch import ForwardBatch
from .cache import KVCache
from .llama import Transformer
from .weights.loader import load_model

__all__ = ["ForwardBatch", "KVCache", "Transformer", "load_model"]
