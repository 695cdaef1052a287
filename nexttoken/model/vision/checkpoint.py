"""A tower's weights from its checkpoint tensors, checked: what every vision kind's loader ends with."""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from ...errors import ModelLoadError


def assign(tower: nn.Module, state: Mapping[str, torch.Tensor], what: str, extra_ok: bool = True) -> nn.Module:
    """Copy `state` (the tower's own parameter names) into `tower` in float32 and return it in eval mode.

    Every parameter must be there with its config's shape; `extra_ok=False` also refuses names the tower does not
    have (a state already filtered to the tower's prefixes, where an extra name means another layout)."""
    want = tower.state_dict()
    missing = sorted(set(want) - set(state))
    unexpected = [] if extra_ok else sorted(set(state) - set(want))
    if missing or unexpected:
        raise ModelLoadError(f"{what}: the checkpoint's tensors do not match its config: missing {missing[:4]}, "
                             f"unexpected {unexpected[:4]}")
    try:
        tower.load_state_dict({k: state[k].float() for k in want}, strict=True)
    except RuntimeError as e:  # a tensor of another shape than the config's
        raise ModelLoadError(f"{what}: the checkpoint's tensors do not match its config: {e}") from None
    return tower.eval()
