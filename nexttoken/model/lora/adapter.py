"""Reading a PEFT LoRA adapter (adapter_config.json + adapter_model.safetensors) onto nexttoken's fused matrices.

PEFT adds `scaling * B @ A` to a linear layer's weight W (out, in): A (r, in), B (out, r), scaling lora_alpha / r
(or lora_alpha / sqrt(r) with use_rslora; per module from alpha_pattern / rank_pattern). nexttoken fuses q/k/v
into one `wqkv` and gate/up into one `w13` (weights/loader.py), so the adapter is fused the same way:

    wqkv's A = [A_q; A_k; A_v]            (r_q + r_k + r_v, in)     the A matrices stacked
    wqkv's B = blockdiag(B_q, B_k, B_v)   (q + 2 kv, r_q + r_k + r_v)  each B in its own rows and columns

so x @ A^T @ B^T gives each projection its own low-rank product, exactly, and a projection the adapter leaves
alone has zero rows in B. The scaling is folded into B at load. Phi-3's checkpoints are fused already: its
qkv_proj / gate_up_proj adapters map one to one. Everything is read with safetensors (never pickle).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from safetensors import SafetensorError, safe_open

from ...config import ModelConfig
from ...families import family
from ...errors import LoraError, MissingFileError
from ..network import checkpoint_of, own_checkpoint
from ..rope import pairs_to_halves

CONFIG_FILE, WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"
# the matrices of a block an adapter may change (w1: Nemotron-H's ungated MLP's up projection; sw13 / sw2: a sparse
# MLP's shared expert, where the modules path runs the sparse layers: Qwen3.5-MoE, Qwen3-Next)
TARGETS = ("wqkv", "wo", "w13", "w1", "w2", "sw13", "sw2")
# PEFT's module name -> (our matrix, which part of its rows: an index into _parts)
_MODULES = {
    "self_attn.q_proj": ("wqkv", 0), "self_attn.k_proj": ("wqkv", 1), "self_attn.v_proj": ("wqkv", 2),
    "self_attn.qkv_proj": ("wqkv", None), "self_attn.o_proj": ("wo", None),
    "mlp.gate_proj": ("w13", 0), "mlp.up_proj": ("w13", 1), "mlp.gate_up_proj": ("w13", None),
    "mlp.down_proj": ("w2", None), "mlp.w1": ("w1", None),
    "shared.gate_proj": ("sw13", 0), "shared.up_proj": ("sw13", 1), "shared.down_proj": ("sw2", None),
}
_KEY = re.compile(r"^base_model\.model\.model\.layers\.(\d+)\.(.+)\.lora_([AB])(?:\.[^.]+)?\.weight$")
# Options of PEFT's LoraConfig that change the arithmetic and that nexttoken does not apply: refused by name.
_REFUSED = {
    "use_dora": "DoRA (weight-decomposed LoRA) rescales the merged weight per column",
    "fan_in_fan_out": "fan_in_fan_out is for GPT-2's Conv1D layers, which these models do not have",
    "lora_bias": "lora_bias adds a trained bias to lora_B",
    "layer_replication": "layer_replication repeats base layers",
    "use_qalora": "QA-LoRA pools the activations",
}

# How an adapter source that is not a folder becomes one (a Hub id -> the downloaded snapshot). None: folders only.
Resolver = Callable[[str], Path]


@dataclass(frozen=True)
class LoraWeights:
    """One fused matrix's low-rank update: delta W = B @ A, scaling folded into B."""

    A: torch.Tensor  # (R, in) float32
    B: torch.Tensor  # (out, R) float32


@dataclass(frozen=True)
class LoraAdapter:
    """A PEFT LoRA adapter on nexttoken's matrices: weights[(layer, target)], target in TARGETS."""

    name: str
    path: Path
    rank: int  # the largest r of its modules (what --max-lora-rank bounds)
    weights: dict[tuple[int, str], LoraWeights]
    base_model: str | None  # adapter_config's base_model_name_or_path, as written

    def delta(self, layer: int, target: str) -> torch.Tensor | None:
        """(out, in) float32 update of one matrix, or None when the adapter leaves it alone."""
        w = self.weights.get((layer, target))
        return None if w is None else w.B @ w.A


def read_adapter(name: str, source: str | Path, cfg: ModelConfig, max_rank: int | None = None,
                 resolve: Resolver | None = None) -> LoraAdapter:
    """A PEFT LoRA adapter from a folder (or, through `resolve`, another source such as a Hub id), checked
    against the base model's config: its modules, their shapes, its options; rank at most `max_rank`."""
    if not family(cfg.architecture).lora:
        raise LoraError(f"LoRA adapters are not applied to {cfg.architecture} models yet; load it without adapters")
    path = _folder(source, resolve)
    config = _config(path)
    tensors = _tensors(path)
    weights, rank = _fused(tensors, config, cfg, path)
    if max_rank is not None and rank > max_rank:
        raise LoraError(f"adapter {name!r} ({path}) has rank {rank}, above the limit {max_rank}: raise "
                        f"--max-lora-rank (max_lora_rank) to at least {rank}")
    return LoraAdapter(name, path, rank, weights, config.get("base_model_name_or_path"))


def parse_modules(specs: list[str]) -> dict[str, str]:
    """Command-line adapters, vLLM's --lora-modules forms: "name=path", or JSON {"name": ..., "path": ...}; a bare
    path is named after its folder. Names must be unique."""
    out: dict[str, str] = {}
    for spec in specs:
        if spec.lstrip().startswith("{"):
            try:
                item = json.loads(spec)
                name, path = item["name"], item["path"]
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise LoraError(f"LoRA module {spec!r}: JSON needs a name and a path ({e})") from e
        elif "=" in spec:
            name, path = spec.split("=", 1)
        else:
            name, path = Path(spec).name, spec
        if not name or not path:
            raise LoraError(f"LoRA module {spec!r}: write NAME=PATH")
        if name in out:
            raise LoraError(f"LoRA module name {name!r} is given twice")
        out[name] = path
    return out


def _folder(source: str | Path, resolve: Resolver | None) -> Path:
    path = Path(source)
    if path.is_dir():
        return path
    if resolve is not None and not path.exists():
        return resolve(str(source))
    raise MissingFileError(f"LoRA adapter folder {source} does not exist: give the folder PEFT's save_pretrained "
                           f"wrote ({CONFIG_FILE} + {WEIGHTS_FILE})")


def _config(path: Path) -> dict:
    file = path / CONFIG_FILE
    if not file.is_file():
        raise MissingFileError(f"{path} has no {CONFIG_FILE}: not a PEFT adapter folder")
    try:
        config = json.loads(file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise LoraError(f"{file} is not valid JSON ({e}): re-save the adapter with PEFT") from e
    if not isinstance(config, dict) or config.get("peft_type", "LORA") != "LORA":
        kind = config.get("peft_type") if isinstance(config, dict) else type(config).__name__
        raise LoraError(f"{file}: peft_type {kind!r} is not LORA; nexttoken applies LoRA adapters only")
    for key, why in _REFUSED.items():
        if config.get(key):
            raise LoraError(f"{file}: {key} is set ({why}); nexttoken applies plain LoRA only")
    if config.get("bias", "none") != "none":
        raise LoraError(f"{file}: bias={config['bias']!r} trains the base layers' biases; nexttoken applies "
                        "adapters with bias='none' only")
    if config.get("modules_to_save"):
        raise LoraError(f"{file}: modules_to_save {config['modules_to_save']} (whole copies of layers such as the "
                        "embedding or the LM head) are not applied: nexttoken serves one embedding and head for "
                        "every adapter. Train without modules_to_save, or merge the adapter into a model folder "
                        "with PEFT's merge_and_unload and load that")
    if config.get("trainable_token_indices"):
        raise LoraError(f"{file}: trainable_token_indices changes embedding rows, which nexttoken does not apply")
    for key in ("r", "lora_alpha"):
        if not isinstance(config.get(key), (int, float)) or isinstance(config.get(key), bool) or config[key] <= 0:
            raise LoraError(f"{file}: {key} must be a positive number, got {config.get(key)!r}")
    return config


def _tensors(path: Path) -> dict[str, torch.Tensor]:
    file = path / WEIGHTS_FILE
    if not file.is_file():
        pickled = [p.name for p in path.glob("*.bin")] + [p.name for p in path.glob("*.pt")]
        if pickled:
            raise MissingFileError(
                f"{path} has only {', '.join(pickled)} (a pickle file, which can run code), no {WEIGHTS_FILE}: "
                "nexttoken reads safetensors only. Re-save with PEFT: model.save_pretrained(dir, "
                "safe_serialization=True)")
        raise MissingFileError(f"{path} has no {WEIGHTS_FILE}")
    try:
        with safe_open(str(file), framework="pt", device="cpu") as f:
            return {k: f.get_tensor(k) for k in f.keys()}
    except (SafetensorError, OSError, ValueError, RuntimeError) as e:
        raise LoraError(f"{file} is not a readable safetensors file ({e}): the adapter is damaged; re-download "
                        "or re-save it") from e


def _module_scaling(module: str, r: int, config: dict) -> float:
    """PEFT's scaling for one module: alpha (alpha_pattern's match, else lora_alpha) over r or sqrt(r)."""
    alpha = config["lora_alpha"]
    for pattern, value in (config.get("alpha_pattern") or {}).items():
        if re.match(rf"(.*\.)?({pattern})$", module):  # PEFT's get_pattern_key
            alpha = value
            break
    return alpha / math.sqrt(r) if config.get("use_rslora") else alpha / r


def _fused(tensors: dict[str, torch.Tensor], config: dict, cfg: ModelConfig,
           path: Path) -> tuple[dict[tuple[int, str], LoraWeights], int]:
    """The adapter's (A, B) pairs fused onto wqkv / wo / w13 / w2, checked against the model's shapes."""
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    renames = [(re.compile(a), b) for a, b in family(cfg.architecture).renames]
    own = _own_modules(cfg) if own_checkpoint(cfg) else None
    for key, t in tensors.items():
        m = _KEY.match(_renamed(key, renames) if own is None else _own_key(key, own, renames))
        module = None if m is None else m.group(2)
        if m is not None and cfg.moe and int(m.group(1)) < cfg.num_hidden_layers \
                and cfg.moe.sparse_layers[int(m.group(1))] and module.startswith("mlp."):
            module = _shared(cfg, module)
            if module is None:
                raise LoraError(f"{path}: tensor {key} adapts layer {m.group(1)}'s MLP, a mixture of experts (its "
                                "experts or router); nexttoken applies LoRA to the attention, the dense MLPs and, "
                                "where the modules run the sparse layers, the shared expert")
        if m is None or module not in _MODULES:
            what = "an embedding or the LM head" if any(s in key for s in ("embed", "lm_head")) else "a module"
            raise LoraError(f"{path}: tensor {key} adapts {what} nexttoken does not apply LoRA to; adapters may "
                            f"target {', '.join(sorted({k.split('.')[-1] for k in _MODULES}))} of each layer")
        layer = int(m.group(1))
        if layer >= cfg.num_hidden_layers:
            raise LoraError(f"{path}: tensor {key} is for layer {layer}, but the base model has "
                            f"{cfg.num_hidden_layers} layers: the adapter belongs to another model")
        if own is None and not cfg.layer(layer).keeps_kv and module.startswith("self_attn."):
            raise LoraError(f"{path}: tensor {key} adapts layer {layer}'s attention, but that layer of "
                            f"{cfg.architecture} is a {cfg.layer(layer).mixer} layer")
        pairs.setdefault((layer, module), {})[m.group(3)] = t
    if not pairs:
        raise LoraError(f"{path}/{WEIGHTS_FILE} holds no lora_A / lora_B weights")
    parts = _parts(cfg)
    pieces: dict[tuple[int, str], list[tuple[int | None, torch.Tensor, torch.Tensor]]] = {}
    rank = 0
    for (layer, module), ab in sorted(pairs.items()):
        if set(ab) != {"A", "B"}:
            raise LoraError(f"{path}: layer {layer} {module} has lora_{''.join(ab)} without its pair")
        if cfg.moe and cfg.moe.sparse_layers[layer] and module.startswith("mlp."):
            raise LoraError(f"{path}: layer {layer}'s MLP is a mixture of experts; nexttoken applies LoRA to its "
                            "attention only")
        target, part = _MODULES[module]
        if module not in (_checkpoint_modules(cfg) if own is None else {m for _, m in own.values()}):
            raise LoraError(f"{path}: {module} is not a module of {cfg.architecture}")
        A, B = ab["A"].float(), ab["B"].float()
        rows = parts[target][part] if part is not None else sum(parts[target])
        cols = {"w2": cfg.intermediate_size, "sw2": cfg.moe.shared_intermediate_size if cfg.moe else 0}.get(
            target, cfg.hidden_size)
        if target == "wo":
            cols = cfg.num_attention_heads * cfg.head_dim
        r = A.shape[0]
        if A.dim() != 2 or B.dim() != 2 or A.shape[1] != cols or B.shape != (rows, r):
            raise LoraError(f"{path}: layer {layer} {module} has lora_A {tuple(A.shape)} and lora_B "
                            f"{tuple(B.shape)}; the base model needs ({r}, {cols}) and ({rows}, {r}): the adapter "
                            "belongs to another model")
        rank = max(rank, r)
        name = next((k for k, v in (own or {}).items() if v == (layer, module)), f"model.layers.{layer}.{module}")
        name = name.replace(".shared.", f".mlp.{family(cfg.architecture).shared_expert}.")
        scaling = _module_scaling(name, r, config)
        if target == "wqkv" and part in (0, 1) and family(cfg.architecture).rope_pairs:
            B = pairs_to_halves(B, cfg.head_dim)  # ERNIE 4.5: q / k rows as the loader reordered the base's
        scaling *= _mup_scale(cfg, target, part)
        pieces.setdefault((layer, target), []).append((part, A, B * scaling))
    return {key: _stack(key[1], ps, parts) for key, ps in pieces.items()}, rank


# an own network's matrix -> the decoder's PEFT module of each of its parts, in row order
_OWN = {"attention.wqkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
        "attention.wo": ("self_attn.o_proj",), "mlp.w13": ("mlp.gate_proj", "mlp.up_proj"),
        "mlp.w2": ("mlp.down_proj",), "mlp.w1": ("mlp.w1",)}
_OURS = re.compile(r"^layers\.(\d+)\.(attention\.wqkv|attention\.wo|mlp\.w13|mlp\.w1|mlp\.w2)\.weight$")


def _own_modules(cfg: ModelConfig) -> dict[str, tuple[int, str]]:
    """A network of its own (Falcon-H1, Nemotron-H): the checkpoint's module paths whose matrices take adapters ->
    (our layer, the decoder's module name), from the network's checkpoint_parts: Falcon-H1's layer i attention and
    MLP are our block i's; Nemotron-H's backbone.layers.{i}.mixer.* are the block its mixer or MLP sits in. A
    module must end as the decoder's does (q_proj, ..., down_proj; Nemotron-H's up_proj is its MLP's w1): a
    Mamba2 mixer's out_proj, which its block holds where attention sits, is none of them."""
    out = {}
    for ours, names in checkpoint_of(cfg).checkpoint_parts(cfg).items():
        m = _OURS.match(ours)
        if m is None or len(names) != len(_OWN[m.group(2)]):
            continue
        for name, module in zip(names, _OWN[m.group(2)]):
            leaf = name[: -len(".weight")].rsplit(".", 1)[-1]
            if leaf == module.rsplit(".", 1)[-1] or (module == "mlp.w1" and leaf == "up_proj"):
                out[name[: -len(".weight")]] = (int(m.group(1)), module)
    return out


def _own_key(key: str, own: dict[str, tuple[int, str]], renames: list[tuple[re.Pattern, str]]) -> str:
    """A PEFT key of an own network's checkpoint (its module path renamed as the family declares: Nemotron-H's
    model.layers -> backbone.layers) in the decoder's form (base_model.model.model.layers.{ours}...)."""
    m = re.match(r"^base_model\.model\.(.+)\.(lora_[AB](?:\.[^.]+)?\.weight)$", key)
    path = None if m is None else _renamed("base_model.model." + m.group(1), renames)[len("base_model.model."):]
    if path not in own:
        return key
    layer, module = own[path]
    return f"base_model.model.model.layers.{layer}.{module}.{m.group(2)}"


def _mup_scale(cfg: ModelConfig, target: str, part: int | None) -> float:
    """Falcon-H1's µP multipliers of projections' outputs, which its blocks fold into the base rows (the key's,
    the MLP gate's, the MLP down's): the adapter's rows take them too, as PEFT's product passes through them."""
    mup = cfg.mup
    if mup is None:
        return 1.0
    return {("wqkv", 1): mup.key, ("w13", 0): mup.mlp[0], ("w2", None): mup.mlp[1]}.get((target, part), 1.0)


def _shared(cfg: ModelConfig, module: str) -> str | None:
    """A sparse layer's module (mlp.*) as its shared expert's ("shared.gate_proj", ...), or None: an expert, the
    router, or a shared expert the fused native step runs (it adds no adapter there: the families whose native step
    computes sparse layers keep it refused)."""
    fam = family(cfg.architecture)
    if cfg.moe is None or not cfg.moe.shared_intermediate_size or fam.native_step:
        return None
    leaf = module.removeprefix(f"mlp.{fam.shared_expert}.")
    return "shared." + leaf if leaf != module and leaf in ("gate_proj", "up_proj", "down_proj") else None


def _renamed(key: str, renames: list[tuple[re.Pattern, str]]) -> str:
    """A PEFT key with the family's checkpoint renames applied to its module path (LFM2's feed_forward.w1 ->
    mlp.gate_proj, Granite 4.0-H's shared_mlp.input_linear -> mlp.gate_up_proj, ...)."""
    prefix = "base_model.model."
    if not key.startswith(prefix):
        return key
    name = key[len(prefix):]
    for pattern, replacement in renames:
        name = pattern.sub(replacement, name)
    return prefix + name


def _checkpoint_modules(cfg: ModelConfig) -> set[str]:
    """The PEFT module names (after renames) of the family's checkpoints: q/k/v and gate/up apart, or fused
    (Phi-3's qkv_proj / gate_up_proj; Granite 4.0-H's MLP is one [gate; up] matrix)."""
    fam = family(cfg.architecture)
    fused_mlp = fam.fused_checkpoint or any(".mlp.gate_up_proj." in b for _, b in fam.renames)
    names = {"self_attn.o_proj", "mlp.down_proj"}
    names |= {"self_attn.qkv_proj"} if fam.fused_checkpoint else {"self_attn.q_proj", "self_attn.k_proj",
                                                                  "self_attn.v_proj"}
    names |= {"mlp.gate_up_proj"} if fused_mlp else {"mlp.gate_proj", "mlp.up_proj"}
    if cfg.moe is not None and cfg.moe.shared_intermediate_size:
        names |= {"shared.gate_proj", "shared.up_proj", "shared.down_proj"}
    return names


def _parts(cfg: ModelConfig) -> dict[str, list[int]]:
    """Row counts of each fused matrix's parts: wqkv = q, k, v (q with Qwen3.5's output gate rows); w13 = gate,
    up."""
    q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    q *= 2 if cfg.attention_output_gate else 1
    return {"wqkv": [q, kv, kv], "w13": [cfg.intermediate_size] * 2, "wo": [cfg.hidden_size],
            "w1": [cfg.intermediate_size], "w2": [cfg.hidden_size],
            "sw13": [cfg.moe.shared_intermediate_size if cfg.moe else 0] * 2, "sw2": [cfg.hidden_size]}


def _stack(target: str, pieces: list[tuple[int | None, torch.Tensor, torch.Tensor]],
           parts: dict[str, list[int]]) -> LoraWeights:
    """A fused matrix's A (sum of r, in) and block-diagonal B (out, sum of r) from its parts' pairs."""
    if pieces[0][0] is None:  # a whole matrix (o, down, Phi-3's fused ones)
        return LoraWeights(pieces[0][1].contiguous(), pieces[0][2].contiguous())
    offsets = [0]
    for n in parts[target]:
        offsets.append(offsets[-1] + n)
    R = sum(A.shape[0] for _, A, _ in pieces)
    B = torch.zeros(offsets[-1], R)  # (out, R): zeros outside each part's block
    col = 0
    for part, A, b in sorted(pieces, key=lambda p: p[0]):
        B[offsets[part] : offsets[part + 1], col : col + A.shape[0]] = b
        col += A.shape[0]
    A = torch.cat([A for _, A, _ in sorted(pieces, key=lambda p: p[0])])  # (R, in)
    return LoraWeights(A.contiguous(), B)
