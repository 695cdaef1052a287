"""The network: configuration-driven Llama-family modules, their KV cache, and the checkpoint loader."""

from .batch import ForwardBatch
from .cache import KVCache, PagedKVCache
from .llama import Transformer
from .weights.loader import load_model

__all__ = ["ForwardBatch", "KVCache", "PagedKVCache", "Transformer", "load_model"]
