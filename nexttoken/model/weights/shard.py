"""One rank's part of a tensor-parallel Transformer, read from the checkpoint (parallel.py says how it is cut):
safetensors' get_slice reads only this rank's bytes."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from ...config import ModelConfig
from ...errors import ModelLoadError
from ..llama import Transformer
from ...families import family
from ..rope import pairs_to_halves
from .loader import (_IGNORED_SUFFIXES, _open_folder, _owned, check_tensors, resolve_dtype, safetensors_files,
                     to_state_dict)
from ..memory import release_freed_memory
from ..parallel import ParallelInfo, Shards, shard_modules


def read_shard(files: list[Path], cfg: ModelConfig, shards: Shards) -> dict[str, torch.Tensor]:
    """One rank's slices of the checkpoint (safetensors' get_slice reads only those bytes), by checkpoint name.
    Shapes are checked against config.json first, on the full tensors' headers."""
    assert isinstance(shards, Shards)
    shapes: dict[str, torch.Tensor] = {}
    where: dict[str, Path] = {}
    try:
        for f in files:
            with safe_open(str(f), framework="pt", device="cpu") as sf:
                for name in sf.keys():
                    if not name.endswith(_IGNORED_SUFFIXES):
                        shapes[name] = torch.empty(sf.get_slice(name).get_shape(), device="meta")
                        where[name] = f
    except (SafetensorError, OSError, ValueError, RuntimeError) as e:
        raise ModelLoadError(f"{files[0].parent} has an unreadable safetensors file ({e}); re-download it") from e
    check_tensors(cfg, shapes, files[0].parent)
    rows = {"q_proj": shards.q, "k_proj": shards.kv, "v_proj": shards.kv, "gate_proj": shards.mlp,
            "up_proj": shards.mlp}
    columns = {"o_proj": shards.q, "down_proj": shards.mlp}
    # MoE experts (Mixtral's w1 / w3 / w2, Qwen's gate_proj / up_proj / down_proj) and Qwen2-MoE's shared expert
    # split like the dense MLP, each by its own width; the router and the shared expert's gate are held whole.
    expert_rows = {"w1": shards.expert, "w3": shards.expert, "gate_proj": shards.expert, "up_proj": shards.expert}
    expert_columns = {"w2": shards.expert, "down_proj": shards.expert}
    shared_rows = {"gate_proj": shards.shared, "up_proj": shards.shared}
    shared_columns = {"down_proj": shards.shared}
    # Phi-3's fused [q; k; v] and [gate; up] rows: this rank's rows of each part, cut out and stacked again.
    q_size, kv_size = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    fused_rows = {"qkv_proj": [shards.q, (q_size + shards.kv[0], q_size + shards.kv[1]),
                               (q_size + kv_size + shards.kv[0], q_size + kv_size + shards.kv[1])],
                  "gate_up_proj": [shards.mlp, (cfg.intermediate_size + shards.mlp[0],
                                                cfg.intermediate_size + shards.mlp[1])]}
    pairs = family(cfg.architecture).rope_pairs
    out: dict[str, torch.Tensor] = {}
    for f in files:
        with safe_open(str(f), framework="pt", device="cpu") as sf:
            for name in (n for n, p in where.items() if p == f):
                part, kind = name.split(".")[-2:]  # e.g. ("q_proj", "weight")
                piece = sf.get_slice(name)
                if ".experts." in name:
                    r, c = expert_rows, expert_columns
                elif ".shared_expert." in name or ".shared_experts." in name:  # Qwen2-MoE's, GLM-4 MoE's
                    r, c = shared_rows, shared_columns
                else:
                    r, c = rows, columns
                if name in ("model.embed_tokens.weight", "lm_head.weight"):
                    a, b = shards.vocab
                    t = piece[a:b]
                    if t.shape[0] < shards.vocab_rows:  # the last rank's rows run short: zero rows, never read
                        t = torch.cat([t, t.new_zeros(shards.vocab_rows - t.shape[0], t.shape[1])])
                elif part in fused_rows:
                    t = torch.cat([piece[a:b] for a, b in fused_rows[part]])
                elif part in r:
                    t = piece[r[part][0] : r[part][1]]
                elif part in c and kind == "weight":
                    t = piece[:, c[part][0] : c[part][1]]
                elif part in ("q_norm", "k_norm") and cfg.qk_norm == "projection" and shards.size > 1:
                    a, b = shards.q if part == "q_norm" else shards.kv
                    t = piece[a:b]
                else:  # norms, per-head q/k norms, o/down biases: every rank holds them whole
                    t = piece[:]
                if pairs and part in ("q_proj", "k_proj"):  # ERNIE 4.5: this rank's whole heads, pairs to halves
                    t = pairs_to_halves(t, cfg.head_dim)
                out[name] = t
    return out


def load_model_shard(
    path: str | Path, ranks, dtype: str | torch.dtype | None = None,  # noqa: ANN001
    device: str | torch.device | None = None,
) -> Transformer:
    """This rank's part of a tensor-parallel Transformer (model/parallel.py): only its slices are read."""
    path, device, cfg = _open_folder(path, device)
    torch_dtype = resolve_dtype(dtype, device)  # a bf16 checkpoint widened by default: the shards' int8 starts here
    shards = Shards.plan(cfg, ranks.rank, ranks.size)
    tensors = read_shard(safetensors_files(path), cfg, shards)
    state = to_state_dict(cfg, tensors)
    state["lm_head.inner.weight"] = state.pop("lm_head.weight")
    for name in [n for n in state if ".attention.wo." in n or ".mlp.w2." in n]:
        if name.endswith(".weight"):
            state[name.replace(".weight", ".inner.weight")] = state.pop(name)
    state = _owned(state, device, torch_dtype)
    with torch.device("meta"):
        model = Transformer(shards.local_config(cfg))
    shard_modules(model, cfg, shards, ranks)
    model.load_state_dict(state, assign=True, strict=True)
    if cfg.tie_word_embeddings:
        model.lm_head.inner.weight = model.embed.weight
    model.parallel = ParallelInfo(ranks, shards, cfg)
    del tensors, state
    release_freed_memory()
    return model.to(device).eval()
