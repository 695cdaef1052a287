"""The layout is the architecture (docs/architecture.md): every import points down the layers, never up."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "nexttoken"

# Each part of the package and the parts it may import (besides itself). Lower layers first.
BASE = {"errors", "families", "config"}
ALLOWED: dict[str, set[str]] = {
    "errors": set(),
    "extras": {"errors"},
    "collector": set(),  # the garbage collector paused around loads, frozen once the server has started
    "families": {"errors"},  # each model family declared once (below config, which reads configs through them)
    "config": {"errors", "families"},
    "model": BASE,
    "images": {"errors"},  # images in: their sources and each vision family's preprocessing (Pillow, numpy)
    "text": {"errors"},  # tokenizer, chat template, detokenizer, GGUF vocabulary, infill
    "generation": BASE | {"model", "text"},
    "engine": BASE | {"model", "generation", "text", "images"},
    "pretrained": BASE | {"model", "generation", "text", "images"},
    "chat": BASE | {"generation", "text", "images"},  # messages, reasoning, tool calls, the answer split
    "loadspec": BASE | {"model"},  # the load specification and its flags (no torch at import: --help reads it)
    "loading": BASE | {"model", "generation", "text", "images", "engine", "pretrained", "loadspec", "collector"},  # the one loading path
    "llm": BASE | {"model", "generation", "text", "images", "engine", "pretrained", "chat", "loadspec", "loading"},
    "server": BASE | {"model", "generation", "text", "images", "engine", "pretrained", "chat", "loadspec", "loading",
               "collector"},
}
# The shells on top may use everything: the CLI, benchmarks, the load generator, the training recipe.
TOP = {"cli", "__main__", "__init__", "bench", "loadtest", "training"}


def _part(module: str) -> str:
    """'nexttoken.engine.llm_engine' -> 'engine'; 'nexttoken.llm' -> 'llm'."""
    return module.split(".")[1] if module.count(".") >= 1 else module


def _imports(path: Path) -> set[str]:
    """Absolute names of the nexttoken modules a file imports (relative imports resolved)."""
    module = "nexttoken." + ".".join(path.relative_to(PACKAGE).with_suffix("").parts)
    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                target = f"{base}.{node.module}" if node.module else base
                names = [target] if node.module else [f"{base}.{a.name}" for a in node.names]
            else:
                names = [node.module or ""]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        else:
            continue
        found.update(n for n in names if n.startswith("nexttoken."))
    return found


FILES = sorted(p for p in PACKAGE.rglob("*.py") if _part("nexttoken." + ".".join(p.relative_to(PACKAGE).parts)
                                                           .removesuffix(".py")) not in TOP)


@pytest.mark.parametrize("path", FILES, ids=[str(p.relative_to(PACKAGE)) for p in FILES])
def test_imports_point_down(path: Path) -> None:
    part = _part("nexttoken." + ".".join(path.relative_to(PACKAGE).parts).removesuffix(".py"))
    assert part in ALLOWED, f"{path}: a new part of the package; place it in a layer (docs/architecture.md)"
    upward = sorted(m for m in _imports(path) if _part(m) != part and _part(m) not in ALLOWED[part])
    assert not upward, f"{path.relative_to(PACKAGE)} ({part}) imports {upward}: an import up the layers"


# Inside the crowded layers, the parts (a subpackage, or a module beside them) and what each may import, lower
# parts first: the same rule one level down (docs/architecture.md draws it).
ROOMS: dict[str, dict[str, set[str]]] = {
    "generation": {
        "values": set(),  # option values parsed once: below the options object and the processors both
        "option_help": set(),  # one line of help per option (the CLI's flags)
        "config": {"values"},
        "modes": {"config"},
        "stopping": set(),
        "logprobs": set(),
        "speculative": set(),
        "processors": {"values", "config"},
        "sampling": {"config", "processors"},
        "output_pipeline": {"config", "stopping"},
        "trace": {"config"},
        "decode": {"processors", "sampling", "stopping"},
        "outputs": {"decode"},
        "search": {"config", "decode", "logprobs", "outputs"},
        "generate": {"config", "decode", "logprobs", "modes", "outputs", "processors", "sampling", "search",
                     "stopping"},
        "completions": {"config", "generate", "logprobs", "output_pipeline", "processors", "stopping"},
    },
    "model": {
        "native_abi": set(),  # csrc/nt_abi.h's structs and codes, mirrored and checked; the one chooser of kinds
        "arithmetic": set(),  # the arithmetic policy a model holds (fused step, prefill precision, GGUF activations)
        "kernels": {"native_abi"}, "batch": set(), "memory": set(), "rope": set(),
        "state": {"batch"},  # the per-sequence state protocol each layer kind reads and writes
        "cache": {"batch", "memory"},
        "linear": {"kernels", "native_abi"},
        "moe": {"linear"},
        "quant": {"arithmetic", "kernels", "linear", "memory", "native_abi"},
        # PEFT adapters: read onto the fused matrices, applied per row, merged; an own network's checkpoint names
        "lora": {"network", "quant", "rope"},
        "recurrent": {"batch", "linear", "state"},  # issue 41's layer kinds that keep a state per sequence
        "layers": {"batch", "cache", "linear", "moe", "recurrent", "rope", "state"},
        "fused": {"arithmetic", "batch", "cache", "kernels", "layers", "linear", "moe", "native_abi", "quant",
                  "recurrent"},
        "llama": {"arithmetic", "batch", "cache", "fused", "layers", "linear", "recurrent", "rope", "state"},
        "gemma4": {"batch", "cache", "kernels", "layers", "linear", "llama", "rope", "state"},  # Gemma 4's own decoder
        # issue 41's hybrids with decoders of their own: Falcon-H1 (attention and Mamba2 side by side), Nemotron-H
        "falcon_h1": {"arithmetic", "batch", "layers", "llama", "recurrent", "state"},
        "nemotron_h": {"arithmetic", "batch", "layers", "linear", "llama", "moe", "recurrent", "state"},
        "network": {"arithmetic", "falcon_h1", "gemma4", "llama", "nemotron_h"},  # the network a family declares
        "parallel": {"linear", "memory", "moe", "quant"},
        "vision": {"rope"},  # issue 43: vision towers and projectors, a module per vision kind
        "weights": {"arithmetic", "gemma4", "kernels", "linear", "llama", "memory", "moe", "network", "parallel",
                    "quant", "recurrent", "rope", "vision"},  # GGUF blocks kept packed (quant/ggml.py); a GGUF
        # header's string arrays read by the native library (gguf_reader.strings)
    },
    "engine": {
        "sequence": set(),
        "embedding": set(),  # pooled final hidden states, over the model's prefill
        "block_manager": {"sequence"},
        "scheduler": {"block_manager", "sequence"},
        "postprocess": {"sequence"},
        "encoder": set(),  # issue 43: the vision tower's features cached by image hash
        "state_checkpoints": set(),  # hybrid models: recurrent states kept where cached prefixes end
        "model_runner": {"block_manager", "encoder", "scheduler", "sequence", "state_checkpoints"},
        "speculation": {"model_runner", "postprocess", "scheduler", "sequence"},
        "distributed": {"model_runner", "scheduler"},
        "launch": {"distributed"},
        "llm_engine": {"block_manager", "distributed", "embedding", "encoder", "model_runner", "postprocess",
                       "scheduler", "sequence", "speculation", "state_checkpoints"},
        "async_engine": {"embedding", "llm_engine", "sequence"},
        "fit": set(),  # the KV pool and context sized to a memory budget (llama.cpp's --fit)
    },
    "text": {"chat_template": set(), "tokenizer": {"chat_template"}, "detokenizer": {"tokenizer"},
             "infill": {"tokenizer"}, "gguf_vocab": {"tokenizer"}},
    "chat": {"messages": set(), "reasoning": set(), "tools": {"messages"}, "answer": {"reasoning", "tools"},
             # the one chat renderer: messages + tools + thinking -> the prompt, and the answer's split
             "harmony": {"answer", "reasoning", "tools"},  # gpt-oss's channels: its own answer parser
             "render": {"answer", "harmony", "messages", "reasoning", "tools"}},
    "server": {
        "settings": set(),
        "metrics": set(),
        "bodies": set(),  # what every API's body shares: null is "not given", and the JSON Schema says so
        "http": {"metrics"},  # error bodies, guards, shutdown, the SSE bridge to the engine
        "images": {"http", "settings"},  # a request's images: loaded, fetched (when allowed), checked (issue 43)
        "openai": {"bodies", "http", "images"},  # OpenAI's wire format: request bodies, prompts, options, outputs, Responses items
        "anthropic": {"http", "openai"},  # Anthropic's wire format: the Messages body, its blocks and stream events
        "llamacpp": {"bodies", "http"},  # llama.cpp's wire format: the /infill body
        "ollama": {"bodies", "catalog", "http", "openai"},  # Ollama's wire format: its bodies and their translation, its model cards
        # OpenAI's batch format, a file of requests run through the app's own routes, /v1/files and /v1/batches
        "batch": {"http"},
        "api": {"anthropic", "catalog", "http", "images", "llamacpp", "metrics", "ollama", "openai", "settings"},  # one module per API
        "webui": set(),  # the chat page (package data) and its routes
        "catalog": set(),  # the served models before loading: --model, --models-dir, the HF cache, presets
        "registry": {"catalog"},  # the models' states, loads and unloads under the memory budget
        "service": {"api", "catalog", "metrics", "settings"},  # one loaded model's engine and APIs; its loader
        # each request to the model it names; /v1/models, Ollama's /api/tags and /api/ps, admin
        "router": {"api", "http", "metrics", "ollama", "registry"},
        "app": {"anthropic", "api", "batch", "http", "llamacpp", "metrics", "ollama", "openai", "registry", "router",
                "service", "settings", "webui"},  # the request schemas for /openapi.json
        "cli": {"app", "catalog", "http", "registry", "service", "settings"},
        "run_batch": {"app", "batch", "cli", "settings"},  # `nexttoken run-batch`
    },
}


def _room_part(module: str) -> tuple[str, str] | None:
    """'nexttoken.generation.processors.chain' -> ('generation', 'processors'); None above the rooms' level."""
    parts = module.split(".")
    return (parts[1], parts[2]) if len(parts) >= 3 else None


ROOM_FILES = [p for p in FILES if len(p.relative_to(PACKAGE).parts) >= 2
              and p.relative_to(PACKAGE).parts[0] in ROOMS and p.name != "__init__.py"
              or len(p.relative_to(PACKAGE).parts) >= 3 and p.relative_to(PACKAGE).parts[0] in ROOMS]


def _module(path: Path) -> str:
    return "nexttoken." + ".".join(path.relative_to(PACKAGE).with_suffix("").parts)


@pytest.mark.parametrize("path", ROOM_FILES, ids=[str(p.relative_to(PACKAGE)) for p in ROOM_FILES])
def test_imports_point_down_inside_a_room(path: Path) -> None:
    room, part = _room_part(_module(path))  # type: ignore[misc]
    assert part in ROOMS[room], f"{path}: a new part of {room}/; place it in ROOMS (docs/architecture.md)"
    inside = {_room_part(m)[1] for m in _imports(path) if _room_part(m) and _room_part(m)[0] == room}  # type: ignore[index]
    upward = sorted(p for p in inside if p != part and p not in ROOMS[room][part])
    assert not upward, f"{path.relative_to(PACKAGE)} ({room}/{part}) imports {upward}: an import up inside {room}/"


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle of the graph, or None."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(n: str) -> list[str] | None:
        state[n] = 1
        stack.append(n)
        for m in sorted(graph.get(n, ())):
            if state.get(m) == 1:
                return stack[stack.index(m):] + [m]
            if m not in state and (found := visit(m)):
                return found
        stack.pop()
        state[n] = 2
        return None

    for n in sorted(graph):
        if n not in state and (found := visit(n)):
            return found
    return None


def test_no_import_circle_in_any_room() -> None:
    """Module by module (a package's __init__ included), nothing imports itself back through others."""
    graph = {_module(p).removesuffix(".__init__"): {m for m in _imports(p)} for p in PACKAGE.rglob("*.py")}
    graph = {n: {m for m in ms if m in graph and m != n} for n, ms in graph.items()}
    # A package's __init__ re-exports its modules: an edge into a package is an edge into what it re-exports, so
    # only a module importing its own package's __init__ could close a circle through it.
    assert _cycle(graph) is None, f"an import circle: {' -> '.join(_cycle(graph) or [])}"
    room_graph: dict[str, set[str]] = {}
    for n, ms in graph.items():
        a = _room_part(n)
        for m in ms:
            b = _room_part(m)
            if a and b and a[0] == b[0] and a != b:
                room_graph.setdefault("/".join(a), set()).add("/".join(b))
    assert _cycle(room_graph) is None, f"parts of a room import each other: {' -> '.join(_cycle(room_graph) or [])}"


def test_the_checker_sees_a_circle_and_an_upward_import_inside_a_room() -> None:
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None
    bad = PACKAGE / "generation" / "processors" / "_probe_upward.py"
    bad.write_text("from ..search import beam_search\n")
    try:
        assert "nexttoken.generation.search" in _imports(bad)
        assert "search" not in ROOMS["generation"]["processors"]
    finally:
        bad.unlink()


def test_the_checker_sees_an_upward_import(tmp_path: Path) -> None:
    """The rule can fail: a generation module importing the engine is caught."""
    bad = PACKAGE / "generation" / "_probe_upward.py"
    bad.write_text("from ..engine import LLMEngine\n")
    try:
        assert "nexttoken.engine" in _imports(bad)
        assert "engine" not in ALLOWED["generation"]
    finally:
        bad.unlink()


# ---- the tests mirror the tree ------------------------------------------------------------------------------------

TESTS = Path(__file__).resolve().parent
NOT_MIRRORS = {"support", "data", "__pycache__"}  # helpers shared by the tests, recorded peer outputs


def test_test_folders_mirror_the_package() -> None:
    """tests/model/weights/ holds the tests of nexttoken/model/weights/, and so on: every test folder names a
    package of nexttoken (the tests of a top-level module sit in tests/ itself)."""
    folders = [p for p in TESTS.rglob("*") if p.is_dir() and not NOT_MIRRORS & set(p.relative_to(TESTS).parts)]
    strays = [str(p.relative_to(TESTS)) for p in folders if not (PACKAGE / p.relative_to(TESTS) / "__init__.py").is_file()]
    assert not strays, f"test folders with no nexttoken package of the same path: {strays}"


def test_no_test_module_imports_another() -> None:
    """Shared helpers live in tests/support/ and fixtures in tests/conftest.py, never in a test module that
    other test modules import (importing one re-registers its tests and fixtures in the importer)."""
    offenders = []
    for path in TESTS.rglob("test_*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[-1].startswith("test_"):
                offenders.append(f"{path.relative_to(TESTS)} imports {node.module}")
            elif isinstance(node, ast.Import):
                offenders += [f"{path.relative_to(TESTS)} imports {a.name}" for a in node.names
                              if a.name.split(".")[-1].startswith("test_")]
    assert not offenders, offenders


def test_test_modules_have_unique_names() -> None:
    """pytest imports test modules by their base name (rootdir-relative, no packages): two files with one name stop
    the whole suite at collection."""
    names = [p.name for p in (PACKAGE.parent / "tests").rglob("test_*.py")]
    assert sorted({n for n in names if names.count(n) > 1}) == []
