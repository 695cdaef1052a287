"""Reading checkpoints into the Transformer: a model folder's safetensors (loader.py) and one tensor-parallel
rank's slices of them (shard.py)."""

from .loader import load_model
from .shard import load_model_shard

__all__ = ["load_model", "load_model_shard"]
