"""PEFT LoRA adapters on nexttoken's models: reading them onto the fused matrices (adapter.py), many adapters
over one base model with a low-rank product per row (layers.py), and folding one into the weights (merge.py)."""

from .adapter import LoraAdapter, Resolver, parse_modules, read_adapter
from .layers import AdapterSet, LoraLinear, attach
from .merge import merge_adapter

__all__ = ["AdapterSet", "LoraAdapter", "LoraLinear", "Resolver", "attach", "merge_adapter", "parse_modules",
           "read_adapter"]
