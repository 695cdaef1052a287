"""The network a family's declaration names (families/base.py's Family.network): the shared decoder
(llama.Transformer) for every family but those with a decoder of their own (Gemma 4: gemma4.Gemma4Transformer;
Falcon-H1: falcon_h1.FalconH1Transformer; Nemotron-H: nemotron_h.NemotronHTransformer), and that network's checkpoint tensors (names, shapes, the ones left out:
the module's checkpoint_parts / checkpoint_shapes / ignored)."""

from __future__ import annotations

from ..config import ModelConfig
from ..families import family
from types import ModuleType

from . import falcon_h1, gemma4, nemotron_h
from .arithmetic import Arithmetic
from .llama import Transformer

_NETWORKS = {"decoder": Transformer, "gemma4": gemma4.Gemma4Transformer, "falcon_h1": falcon_h1.FalconH1Transformer,
             "nemotron_h": nemotron_h.NemotronHTransformer}
# the networks that read their checkpoints by names of their own: their modules
_CHECKPOINTS = {"gemma4": gemma4, "falcon_h1": falcon_h1, "nemotron_h": nemotron_h}


def network(cfg: ModelConfig, arithmetic: Arithmetic | None = None) -> Transformer:
    """The declared network of `cfg`, built on the current device (the loaders: under torch.device("meta"))."""
    return _NETWORKS[family(cfg.architecture).network](cfg, arithmetic)


def own_checkpoint(cfg: ModelConfig) -> bool:
    """Whether the network reads its checkpoint by its own names (gemma4.checkpoint_parts), not the decoder's."""
    return family(cfg.architecture).network in _CHECKPOINTS


def checkpoint_of(cfg: ModelConfig) -> ModuleType:
    """The module whose checkpoint_parts / checkpoint_shapes / ignored read an own_checkpoint network's tensors."""
    return _CHECKPOINTS[family(cfg.architecture).network]
