"""Many adapters over one base model: every row of a forward applies its own adapter's low-rank product.

`wrap(model, max_loras, max_rank)` wraps each stock block's wqkv / wo / w13 / w2 in a `LoraLinear`: the base
layer (float, bf16, int8 or int4: whatever it is) computes the shared product, and the wrapper adds

    y[b] += (x[b] @ A[slot_b]^T) @ B[slot_b]^T        (float32, on the activations)

for every row b whose adapter slot is >= 0 (the products of vLLM / Punica's BGMV, grouped): the rows of each adapter
are multiplied by its A and B, held in a preallocated stack of `max_loras` slots padded with zeros to a fixed width
(max_rank per part of the fused matrix), by one batched matmul per product with the adapter's matrices broadcast
over its rows (no copies). Each row's numbers are the same whatever its batch-mates: a batched matmul computes
every batch element alone, at a width fixed by the engine's limits.

Which slot each row uses travels in the forward's ForwardBatch (`lora`: (B,) int64, -1 for the base alone);
`AdapterSet.rows` hands it to the wrappers for the length of one forward (llama.py). Which adapter a slot holds is
the registry's choice (registry.py): it writes a slot in place between engine steps, and only a slot no running
sequence uses, so a running batch never sees a half-written adapter.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch
from torch import nn

from ...errors import LoraError
from ...families import family
from .adapter import TARGETS, LoraAdapter

_PARTS = {"wqkv": 3, "w13": 2, "wo": 1, "w1": 1, "w2": 1, "sw13": 2, "sw2": 1}  # parts of each fused matrix: its A stacks one r per part


class LoraLinear(nn.Module):
    """A base linear layer (`inner`: what model/fused.py reads for the native step) plus the low-rank products of
    the adapters in `adapters`' slots, applied to the rows that ask for them."""

    def __init__(self, inner: nn.Module, adapters: "AdapterSet", width: int) -> None:
        super().__init__()
        self.inner, self.adapters = inner, adapters
        out, inp = _shape(inner)
        n = adapters.max_loras
        self.in_features, self.out_features = inp, out
        self.register_buffer("lora_A", torch.zeros(n, width, inp), persistent=False)  # (slots, R, in) float32
        self.register_buffer("lora_Bt", torch.zeros(n, width, out), persistent=False)  # (slots, R, out): B^T

    @property
    def weight(self) -> torch.Tensor:
        return self.inner.weight

    @property
    def bias(self) -> torch.Tensor | None:
        return self.inner.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.inner(x)  # (B, T, out) the shared base product
        rows = self.adapters.selected
        if rows is None:
            return y
        index, groups = rows
        if index is None:  # every row has an adapter
            return y + self.delta(x, groups).to(y.dtype)
        d = self.delta(x.index_select(0, index), groups)  # only the rows with an adapter do any work
        return y.index_add_(0, index, d.to(y.dtype))  # y is this call's own tensor: row r += d, as y + d would

    def delta(self, x: torch.Tensor, groups: list[tuple[int, torch.Tensor | None]]) -> torch.Tensor:
        """x (n, T, in) -> (n, T, out) float32 low-rank products: each group (slot, its rows of x; None: all)
        multiplies its rows by its adapter's A and B, one batched matmul per product with the adapter's matrices
        broadcast over the rows (no copies), so each row is computed alone."""
        n = x.shape[0]
        x = x.reshape(n, -1, self.in_features).float()  # (n, T, in)
        if len(groups) == 1:
            return self._product(x, groups[0][0])
        out = torch.empty((n, x.shape[1], self.out_features), dtype=torch.float32, device=x.device)
        for slot, rows in groups:
            out.index_copy_(0, rows, self._product(x.index_select(0, rows), slot))
        return out

    def _product(self, x: torch.Tensor, slot: int) -> torch.Tensor:
        """x (m, T, in) -> (m, T, out): (x @ A^T) @ B^T of one slot."""
        m = x.shape[0]
        h = torch.bmm(x, self.lora_A[slot].T.expand(m, -1, -1))  # (m, T, R)
        return torch.bmm(h, self.lora_Bt[slot].expand(m, -1, -1))  # (m, T, out)

    def write(self, slot: int, A: torch.Tensor | None, B: torch.Tensor | None) -> None:
        """Slot `slot` holds A (r, in) and B (out, r) (r <= width), or nothing (zeros)."""
        self.lora_A[slot].zero_()
        self.lora_Bt[slot].zero_()
        if A is not None:
            self.lora_A[slot, : A.shape[0]] = A
            self.lora_Bt[slot, : A.shape[0]] = B.T


def _shape(linear: nn.Module) -> tuple[int, int]:
    return linear.out_features, linear.in_features


class AdapterSet:
    """The model's `max_loras` preallocated adapter slots of rank at most `max_rank`: the wrapped matrices
    (`layers`), what each slot holds (`write`), and which slot each row of a forward applies (`rows`). Which adapter
    sits in which slot is the registry's to decide (registry.py)."""

    def __init__(self, max_loras: int, max_rank: int) -> None:
        if isinstance(max_loras, bool) or not isinstance(max_loras, int) or max_loras < 1:
            raise LoraError(f"max_loras must be an integer >= 1, got {max_loras!r}")
        if isinstance(max_rank, bool) or not isinstance(max_rank, int) or max_rank < 1:
            raise LoraError(f"max_lora_rank must be an integer >= 1, got {max_rank!r}")
        self.max_loras, self.max_rank = max_loras, max_rank
        self.layers: dict[tuple[int, str], LoraLinear] = {}
        # The running forward's rows with an adapter: (their indices (n,), or None when all B rows have one; their
        # groups: (slot, the group's positions among those n rows, None when it is all of them)); None outside a
        # forward with adapters.
        self.selected: tuple[torch.Tensor | None, list[tuple[int, torch.Tensor | None]]] | None = None

    def check(self, adapter: LoraAdapter) -> None:
        """Refuse an adapter the slots cannot hold: a rank above max_rank, or a matrix the blocks do not expose."""
        if adapter.rank > self.max_rank:
            raise LoraError(f"adapter {adapter.name!r} has rank {adapter.rank}, above the limit {self.max_rank}: "
                            f"raise --max-lora-rank (max_lora_rank) to at least {adapter.rank}")
        missing = set(adapter.weights) - set(self.layers)
        if missing:
            layer, target = sorted(missing)[0]
            raise LoraError(f"adapter {adapter.name!r} changes layer {layer}'s {target}, which this model's blocks "
                            "do not expose to adapters (a mixture-of-experts MLP)")

    def write(self, slot: int, adapter: LoraAdapter | None) -> None:
        """Slot `slot` holds `adapter`'s matrices (checked), or zeros (None)."""
        for (layer, target), linear in self.layers.items():
            w = None if adapter is None else adapter.weights.get((layer, target))
            linear.write(slot, None if w is None else w.A, None if w is None else w.B)

    @contextlib.contextmanager
    def rows(self, slots: torch.Tensor | None) -> Iterator[None]:
        """The wrappers apply slots[b] to row b (none for -1) for the forward run inside this block."""
        chosen = None
        if slots is not None:
            has = slots >= 0
            index = None if bool(has.all()) else has.nonzero().flatten()
            used = slots if index is None else slots.index_select(0, index)  # (n,)
            chosen = None if used.numel() == 0 else (index, _groups(used))
        before, self.selected = self.selected, chosen
        try:
            yield
        finally:
            self.selected = before


def _groups(slots: torch.Tensor) -> list[tuple[int, torch.Tensor | None]]:
    """(slot, positions in `slots` holding it) per distinct slot; one slot: [(slot, None)]."""
    distinct = slots.unique().tolist()
    if len(distinct) == 1:
        return [(distinct[0], None)]
    return [(slot, (slots == slot).nonzero().flatten()) for slot in distinct]


def owners_of(model: nn.Module, block: nn.Module) -> dict[str, tuple[nn.Module | None, str]]:
    """Each target's (module, attribute) in a block: a sparse MLP's shared expert only where the modules run the
    sparse layers (adapter._shared; the family's native step off)."""
    mlp = block.mlp
    shared = getattr(mlp, "shared", None) if mlp.__class__.__name__ == "MoE" else None
    if shared is not None and family(model.config.architecture).native_step:
        shared = None
    return {"wqkv": (block.attention, "wqkv"), "wo": (block.attention, "wo"), "w13": (mlp, "w13"),
            "w1": (mlp, "w1"), "w2": (mlp, "w2"), "sw13": (shared, "w13"), "sw2": (shared, "w2")}


def wrap(model: nn.Module, max_loras: int, max_rank: int) -> AdapterSet:
    """Wrap the model's block matrices for adapters and return their slots (registry.attach calls this once per
    model). Mixture-of-experts MLPs keep their experts unwrapped (their attention takes adapters)."""
    if getattr(model, "parallel", None) is not None or getattr(model, "cluster", None) is not None:
        raise LoraError("LoRA adapters do not run on a tensor-parallel model yet: load it with "
                        "tensor_parallel_size=1, or merge the adapter (merge=True)")
    adapters = AdapterSet(max_loras, max_rank)
    for i, block in enumerate(model.layers):
        owners = owners_of(model, block)
        if hasattr(block.attention, "state_shapes"):  # a recurrent mixer (issue 41): its matrices take none
            owners["wqkv"] = owners["wo"] = (None, "")
        for target in TARGETS:
            owner, attr = owners[target]
            inner = getattr(owner, attr, None)
            if inner is None or not isinstance(inner, nn.Module) or owner.__class__.__name__ == "MoE":
                continue
            wrapped = LoraLinear(inner, adapters, _PARTS[target] * max_rank).to(device=model.device)
            setattr(owner, attr, wrapped)
            adapters.layers[(i, target)] = wrapped
    return adapters
