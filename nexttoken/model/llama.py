"""The decoder of every supported family (Llama, Mistral, Qwen, OLMo 2, Granite, Gemma, Phi-3, the MoEs) as plain
PyTorch modules: one block whose switches come from ModelConfig (docs/models.md).

q/k/v and gate/up projections are fused into one matrix each (the loader concatenates the checkpoint's
tensors) so a decode step runs two matmuls per block instead of five.
"""

from __future__ import annotations

import torch
from torch import nn

from ..config import ModelConfig
from . import fused
from .arithmetic import Arithmetic, running
from .batch import ForwardBatch
from .cache import KVCache
from .layers import Block, RMSNorm
from .linear import Linear
from .recurrent import StateSlots, state_specs
from .rope import inverse_frequencies, longrope_inv_freq, mrope_cos_sin, rope_cos_sin
from .state import SequenceState


class Transformer(nn.Module):
    """Token ids in, next-token logits out; all sequence state lives in the state passed to forward (state.py's
    SequenceState: a KVCache, or the engine's views of its paged pool), each layer reading and writing its own."""

    native_step = True  # fused.py may run its decode steps natively (it checks the layers; a stand-in model lacks this)
    adapters = None  # lora.AdapterRegistry once adapters are attached (lora.attach): rows choose slots (batch.lora)
    vision = None  # issue 43: the checkpoint's vision tower (model/vision/), set by the loader; None: text only

    def __init__(self, cfg: ModelConfig, arithmetic: Arithmetic | None = None) -> None:
        super().__init__()
        self.config = cfg
        # The loader builds this under torch.device("meta") and assigns the checkpoint's weights; nn.Embedding's own
        # normal_ init on a meta tensor would import torch._dynamo and sympy (~70 MB resident) for nothing.
        table = torch.empty(cfg.vocab_size, cfg.hidden_size)
        if table.device.type != "meta":
            nn.init.normal_(table)
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size, _weight=table)
        self.layers = nn.ModuleList(Block(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.norm_plus_one)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.inv_freq = inverse_frequencies(cfg.rope, cfg.rotary_dim or cfg.head_dim)  # (D/2,) float32, never cast
        # Gemma 3's sliding layers rotate with a RoPE of their own (another base); None: one RoPE for all layers.
        self.local_inv_freq = None if cfg.rope_local is None else inverse_frequencies(cfg.rope_local, cfg.head_dim)
        # Phi-3's LongRoPE: a second set for sequences beyond the original context; None: one set.
        longrope = cfg.rope.type == "longrope"
        self.long_inv_freq = inverse_frequencies(cfg.rope, cfg.head_dim, long=True) if longrope else None
        self.arithmetic = Arithmetic.from_env() if arithmetic is None else arithmetic

    @property
    def arithmetic(self) -> Arithmetic:
        """How this model computes (model/arithmetic.py): the fused decode step, the prefill products'
        precision, the GGUF products' activations. Assigning a new policy hands it to the layers that hold a
        choice of their own (a GGUF layer's activations) and drops the native step's description."""
        return self.__dict__["_arithmetic"]

    @arithmetic.setter
    def arithmetic(self, policy: Arithmetic) -> None:
        if not isinstance(policy, Arithmetic):
            raise TypeError(f"model.arithmetic must be an Arithmetic, not {type(policy).__name__}")
        self.__dict__["_arithmetic"] = policy
        for m in self.modules():
            use = getattr(type(m), "use_arithmetic", None)
            if use is not None:
                use(m, policy)
        self.__dict__.pop("_fused_plan", None)

    def _apply(self, fn, recurse=True):  # type: ignore[no-untyped-def]
        # .to(dtype) must not round the RoPE frequencies to bf16; they follow the weights' device only.
        super()._apply(fn, recurse)
        cfg, device = self.config, self.embed.weight.device
        self.inv_freq = inverse_frequencies(cfg.rope, cfg.rotary_dim or cfg.head_dim).to(device)
        if cfg.rope_local is not None:
            self.local_inv_freq = inverse_frequencies(cfg.rope_local, cfg.head_dim).to(device)
        if cfg.rope.type == "longrope":
            self.long_inv_freq = inverse_frequencies(cfg.rope, cfg.head_dim, long=True).to(device)
        return self

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.embed.weight.device

    def new_cache(self, batch_size: int, max_len: int) -> KVCache:
        """generate()'s state: K/V columns for the attention layers, a state slot per row for the recurrent ones."""
        cfg = self.config
        cache = KVCache(
            cfg.num_hidden_layers, batch_size, cfg.num_key_value_heads, max_len, cfg.head_dim, self.dtype, self.device
        )
        specs = state_specs(cfg)
        if specs:
            cache.states = StateSlots(specs, batch_size, self.dtype, self.device)
        return cache

    def forward(self, input_ids: torch.Tensor, batch: ForwardBatch, cache: SequenceState) -> torch.Tensor:
        """input_ids (B, T) -> logits (B, V) when batch.last_only, else (B, T, V); in the weights' dtype.
        Rows with an adapter slot in batch.lora add that adapter's low-rank products (model/lora/layers.py)."""
        with running(self.arithmetic):  # this model's policy for its layers (quant/tiles.py's prefill)
            if batch.lora is not None:
                assert self.adapters is not None, "batch.lora names adapter slots, and this model has none attached"
                with self.adapters.rows(batch.lora):
                    return self._forward(input_ids, batch, cache)
            return self._forward(input_ids, batch, cache)

    def _forward(self, input_ids: torch.Tensor, batch: ForwardBatch, cache: SequenceState) -> torch.Tensor:
        if fused.applies(self, input_ids, batch, cache):  # a plain float32 CPU decode step: one native call
            logits = fused.decode_step(self, input_ids, batch, cache)
            if logits is not None:
                return logits
        x = self._trunk(input_ids, batch, cache)  # (B, T, C)
        if batch.last_only:
            x = x[:, -1]
        logits = self.lm_head(self.norm(x))
        cfg = self.config
        if cfg.final_logit_softcapping is not None:  # Gemma: cap * tanh(logits / cap)
            logits = torch.tanh(logits / cfg.final_logit_softcapping) * cfg.final_logit_softcapping
        return logits / cfg.logits_scaling if cfg.logits_scaling != 1.0 else logits

    def last_hidden_state(self, input_ids: torch.Tensor, batch: ForwardBatch, cache: SequenceState) -> torch.Tensor:
        """input_ids (B, T) -> (B, T, C): the final norm's output at every position (transformers'
        `last_hidden_state`), what embeddings pool."""
        with running(self.arithmetic):
            return self.norm(self._trunk(input_ids, batch, cache))

    def _trunk(self, input_ids: torch.Tensor, batch: ForwardBatch, cache: SequenceState) -> torch.Tensor:
        """input_ids (B, T) -> (B, T, C): the embedding and every layer, before the final norm."""
        cfg = self.config
        if batch.embeds is not None:  # an image's placeholder ids may lie past the table: embedded as 0, then replaced
            input_ids = input_ids.masked_fill(batch.embeds[0], 0)
        x = self.embed(input_ids)  # (B, T, C)
        if cfg.embedding_multiplier != 1.0:
            x = x * cfg.embedding_multiplier
        if cfg.embed_scale is not None:  # Gemma: x sqrt(hidden), the factor rounded to the dtype as transformers does
            x = x * torch.tensor(cfg.embed_scale, dtype=x.dtype)
        deepstack: list[torch.Tensor] = []
        if batch.embeds is not None:  # images (issue 43): the encoder's rows replace their placeholders' embeddings
            where, rows = batch.embeds
            if rows.shape[1] != x.shape[-1]:  # Qwen3-VL: each row also holds k DeepStack rows, added after layer i < k
                rows, *deepstack = rows.to(x.dtype).split(x.shape[-1], dim=1)
            x = x.masked_scatter(where[..., None], rows.to(x.dtype))
        inv_freq = longrope_inv_freq(cfg.rope, self.inv_freq, self.long_inv_freq, batch.positions)
        if batch.mrope_positions is not None and cfg.rope.mrope_section:  # Qwen2.5-VL's image tokens
            cos, sin = mrope_cos_sin(inv_freq, batch.mrope_positions, x.dtype, cfg.rope.mrope_section,
                                     cfg.rope.mrope_interleaved)
        else:
            cos, sin = rope_cos_sin(inv_freq, batch.positions, x.dtype, cfg.rope.attention_factor)
        local = None if self.local_inv_freq is None else rope_cos_sin(self.local_inv_freq, batch.positions, x.dtype)
        # each layer rotates with the RoPE its kind names: the model's, the sliding layers' own, or none (NoPE)
        tables = {"global": (cos, sin), "local": local or (cos, sin), None: (None, None)}
        for i, block in enumerate(self.layers):
            x = block(x, batch, cache, *tables[block.attention.kind.rope])  # a recurrent kind's rope is None
            if i < len(deepstack):  # as transformers' _deepstack_process: x[image tokens] += the layer's rows
                x = x.clone()
                x[batch.embeds[0]] = x[batch.embeds[0]] + deepstack[i]
        return x
