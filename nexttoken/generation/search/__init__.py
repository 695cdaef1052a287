"""Search strategies that keep several candidates per row: beam search, group (diverse) beam search and
contrastive search. Each owns its state and is chosen explicitly by generation_mode."""

from .beam import beam_search
from .contrastive import contrastive_search
from .group_beam import group_beam_search

__all__ = ["beam_search", "contrastive_search", "group_beam_search"]
