"""PEFT LoRA adapters on nexttoken's models: reading them onto the fused matrices (adapter.py), many adapters
over one base model with a low-rank product per row in preallocated slots (layers.py), the one registry of their
names and which slot each sits in (registry.py), and folding one into the weights (merge.py)."""

from .adapter import LoraAdapter, Resolver, parse_modules, read_adapter
from .layers import AdapterSet, LoraLinear, wrap
from .merge import merge_adapter
from .registry import AdapterRegistry, attach, registry_of

__all__ = ["AdapterRegistry", "AdapterSet", "LoraAdapter", "LoraLinear", "Resolver", "attach", "merge_adapter",
           "parse_modules", "read_adapter", "registry_of", "wrap"]
