"""The layer kinds that keep a fixed-size state per sequence instead of K/V columns (issue 41), one module each:
LFM2's gated short convolution (short_conv), the gated delta rule of Qwen3.5 / Qwen3-Next (delta_rule), Mamba2's selective state space (ssd). Each reads
its rows' state through `state.slots(layer, batch)` and writes it back with `state.keep(layer, batch, tensors)`
(model/state.py); sizes.state_specs(cfg) sizes one sequence's state. Prefill runs the chunked (parallel) form,
decode the one-step recurrence; both leave the same state."""

from .delta_rule import GatedDeltaNet
from .short_conv import ShortConvolution
from .sizes import MIXERS, STATE_SHAPES, state_bytes, state_specs
from .slots import StateSlots
from .ssd import Mamba2Mixer

__all__ = ["GatedDeltaNet", "MIXERS", "Mamba2Mixer", "STATE_SHAPES", "ShortConvolution", "StateSlots", "state_bytes", "state_specs"]
