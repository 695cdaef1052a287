"""`nexttoken generate | chat | replay | serve | run-batch | bench | loadtest`: thin shells over the Python API.

Generation flags are GenerationConfig's field names (`--top-p` sets `top_p`), each with its line from
generation/option_help.py; a flag left out leaves the model's own default in place. Loading flags are LoadSpec's
fields (loadspec.py), and every command loads through loading.load. This module and the parsers import no torch:
each command imports what it runs when it runs (`nexttoken --help` answers at once).
"""

from __future__ import annotations

import argparse
import atexit
import dataclasses
import gc
import json
import sys
from typing import Any, Callable

from .errors import NextTokenError
from .generation.config import GenerationConfig
from .generation.option_help import OPTION_HELP
from .loadspec import PRECISION, SOURCE, DefaultsHelpFormatter, LoadSpec, add_load_args

# The one table from flags to options: every scalar or id-list option of GenerationConfig is a flag of the same
# name (`top_p` -> --top-p); the values are checked by GenerationConfig, once, like every other caller's options.
_NOT_FLAGS = {"return_dict_in_generate", "output_scores", "output_logits", "bos_token_id", "pad_token_id", "trace"}
_KINDS: dict[str, tuple[Callable[[str], Any], str | None]] = {  # annotation -> (argparse type, nargs)
    "int": (int, None), "int | None": (int, None), "float": (float, None), "float | None": (float, None),
    "str": (str, None), "str | None": (str, None), "list[int] | None": (int, "+"), "list[str] | None": (str, "+"),
}
_BY_NAME = {"json_schema": (str, None)}  # a JSON Schema as JSON text (GenerationConfig turns it into a dict)
# What a flag left out means where GenerationConfig's own default is not the whole story.
_SHOWN = {
    "max_new_tokens": "until the end of the turn (EOS) or the model's context is full, unless the model's "
                      "generation_config.json sets a limit",
    "seed": "a random seed",
    "eos_token_id": "the model's",
    "stop_strings": "none",
}
# The model and loading flags of generate, chat and replay (LoadSpec's fields; serve adds its own).
MODEL_FLAGS = SOURCE + PRECISION + ("tensor_parallel_size", "threads", "lora", "merge_lora", "draft_model")


def _option_flags() -> list[tuple[str, dict[str, Any]]]:
    """(dest, argparse keyword arguments) for every GenerationConfig field that a flag can carry."""
    flags = []
    for f in dataclasses.fields(GenerationConfig):
        if f.name in _NOT_FLAGS:
            continue
        shown = _SHOWN.get(f.name, f"the model's generation_config.json, else {_default_text(f.default)}")
        help_text = f"{OPTION_HELP[f.name]} (default: {shown})"
        if f.type == "bool":
            flags.append((f.name, dict(action=argparse.BooleanOptionalAction, default=None, help=help_text)))
        elif f.type in _KINDS or f.name in _BY_NAME:
            kind, nargs = _BY_NAME.get(f.name) or _KINDS[f.type]
            flags.append((f.name, dict(type=kind, nargs=nargs, help=help_text)))
    return flags


def _default_text(value: Any) -> str:
    if value is None:
        return "none"
    if isinstance(value, bool):
        return "on" if value else "off"
    return str(value)


def _add_model_args(p: argparse.ArgumentParser) -> None:
    group = p.add_argument_group("model and loading (nexttoken.LoadSpec's fields)")
    add_load_args(group, MODEL_FLAGS, lora={"action": "store"})


def _add_generation_args(p: argparse.ArgumentParser) -> None:
    options = p.add_argument_group("generation options (GenerationConfig's names; left out: the model's default)")
    for dest, kwargs in _option_flags():
        options.add_argument("--" + dest.replace("_", "-"), dest=dest, **kwargs)
    options.add_argument("--greedy", dest="do_sample", action="store_const", const=False,
                         help="always take the argmax (default: the model's generation_config.json, else greedy)")
    options.add_argument("--stop", dest="stop_strings", action="append",
                         help="stop string (repeatable; default: none)")


def _options(args: argparse.Namespace, llm: Any) -> dict[str, Any]:
    """The generation options the flags give; with no length flag and no limit in the model's defaults, the run
    goes on to EOS / the end of the turn or the context's end (llama.cpp's and vLLM's default), not
    transformers' 20 new tokens."""
    names = [dest for dest, _ in _option_flags()] + ["stop_strings"]
    options = {n: getattr(args, n) for n in names if getattr(args, n) is not None}
    defaults = llm.generation_config
    if "max_new_tokens" not in options and "max_length" not in options and defaults.max_new_tokens is None \
            and defaults.max_length is None:
        options["max_length"] = llm.model.config.max_position_embeddings  # prompt + output up to the context
    return options


def _load(args: argparse.Namespace, **overrides: Any) -> tuple[Any, dict[str, Any]]:
    """The model the flags name, loaded through the one loading path, and the per-call options it implies (the
    adapter the run decodes under, the draft model of speculative decoding)."""
    spec = LoadSpec.from_args(args, **overrides)  # every loading flag checked here, before a file is read
    from .llm import LLM
    from .loading import load

    print(f"loading {spec.model or 'the packaged default model'} ...", file=sys.stderr, flush=True)
    loaded = load(spec)
    llm = LLM.from_loaded(loaded)
    implied: dict[str, Any] = {}
    if spec.adapter_name is not None:
        implied["lora"] = spec.adapter_name
    if loaded.draft is not None:
        implied["assistant_model"] = LLM.from_pretrained(loaded.draft)
    return llm, implied


def cmd_generate(args: argparse.Namespace) -> int:
    prompt = args.prompt if args.prompt is not None else sys.stdin.read()
    llm, implied = _load(args)
    options = {**_options(args, llm), **implied}
    if args.image:  # issue 43: the prompt marks each image's place with the model's placeholder
        options["images"] = args.image
    if args.trace:
        return _generate_traced(llm, prompt, options, args.trace)
    if args.json:
        result = llm.generate(prompt, **options)
        print(json.dumps(dataclasses.asdict(result), ensure_ascii=False, indent=2))
        return 0
    sys.stdout.write(prompt)
    for delta in llm.stream(prompt, **options):
        sys.stdout.write(delta)
        sys.stdout.flush()
    sys.stdout.write("\n")
    return 0


def _generate_traced(llm: Any, prompt: str, options: dict[str, Any], page: str) -> int:
    """Generate with a trace; write the explain page and, beside it, the trace as JSON (for `nexttoken replay`)."""
    from pathlib import Path

    from .generation.trace.recorder import to_json
    from .generation.trace.page import render_page

    result = llm.generate(prompt, **options, trace=True)
    html = Path(page)
    html.parent.mkdir(parents=True, exist_ok=True)
    data = html.with_suffix(".json") if html.suffix != ".json" else html.with_suffix(".trace.json")
    html.write_text(render_page(result.trace, f"nexttoken trace: {llm.name}"), encoding="utf-8")
    data.write_text(to_json(result.trace, indent=1), encoding="utf-8")
    print(prompt + result.text)
    print(f"trace: {html} (explain page), {data} (for nexttoken replay)", file=sys.stderr)
    return 0


def cmd_replay(args: argparse.Namespace) -> int:
    """Run a trace's request again; 0 when identical, 1 with the first divergence."""
    from pathlib import Path

    from .errors import GenerationConfigError
    from .generation.trace.replay import replay

    try:
        trace = json.loads(Path(args.trace).read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as e:
        raise GenerationConfigError(f"cannot read the trace {args.trace!r}: {e}") from e
    if not isinstance(trace, dict):
        raise GenerationConfigError(f"{args.trace!r} is not a nexttoken trace (a JSON object)")
    overrides = {}
    for item in args.option or []:
        name, sep, value = item.partition("=")
        if not sep:
            raise GenerationConfigError(f"--option takes NAME=JSON (e.g. top_k=5), got {item!r}")
        try:
            overrides[name] = json.loads(value)
        except json.JSONDecodeError:
            overrides[name] = value  # a bare string
    llm, _ = _load(args, model=args.model or trace.get("model"))
    report, _ = replay(trace, llm, overrides)
    print(report.summary())
    return 0 if report.identical else 1


def cmd_chat(args: argparse.Namespace) -> int:
    llm, implied = _load(args)
    options = {**_options(args, llm), **implied}
    messages: list[dict[str, Any]] = []
    if args.system:
        messages.append({"role": "system", "content": args.system})
    images = [{"type": "image", "image": path} for path in args.image or []]  # issue 43: with the first message
    interactive = sys.stdin.isatty()
    if interactive:
        print("chat: type a message and press Enter; Ctrl-D exits.", file=sys.stderr)
    while True:
        try:
            line = input("you> " if interactive else "")
        except EOFError:
            if interactive:
                print(file=sys.stderr)
            return 0
        if not line.strip():
            continue
        content: Any = [*images, {"type": "text", "text": line}] if images else line
        images = []
        messages.append({"role": "user", "content": content})
        sys.stdout.write("assistant> " if interactive else "")
        reply = ""
        for delta in llm.stream_chat(messages, **options):
            reply += delta
            sys.stdout.write(delta)
            sys.stdout.flush()
        sys.stdout.write("\n")
        messages.append({"role": "assistant", "content": reply})


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="nexttoken", description="Text generation with decoder-only LMs")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="complete a prompt (from the argument or stdin), streaming",
                         description="Complete a prompt, streaming. The completion runs to EOS or the end of the "
                                     "model's context unless --max-new-tokens (or the model's generation_config.json) "
                                     "limits it.")
    gen.add_argument("prompt", nargs="?", help="the prompt; read from stdin when omitted")
    gen.add_argument("--json", action="store_true", help="print the full result as JSON instead of streaming")
    gen.add_argument("--trace", metavar="PAGE.html", help="record why each token was chosen: write the explain "
                     "page there and the trace beside it as .json (see docs/tracing.md)")
    gen.add_argument("--image", action="append", metavar="PATH", help="an image for a vision-language model "
                     "(repeatable, in order); the prompt marks each one's place with the model's placeholder "
                     "(Gemma 3: <start_of_image>)")
    _add_model_args(gen)
    _add_generation_args(gen)
    gen.set_defaults(run=cmd_generate)

    rep = sub.add_parser("replay", help="run a trace's request again: identical, or the first step that differs")
    rep.add_argument("trace", help="a trace .json written by generate --trace, LLM.generate(trace=True) or the server")
    rep.add_argument("--option", action="append", metavar="NAME=JSON", help="change an option (what-if; repeatable)")
    _add_model_args(rep)
    rep.set_defaults(run=cmd_replay)

    chat = sub.add_parser("chat", help="multi-turn chat on the model's chat template (Ctrl-D exits)",
                          description="Multi-turn chat on the model's chat template, one message per line of input "
                                      "(Ctrl-D exits). Each answer runs to the end of the turn (or the end of the "
                                      "model's context) unless --max-new-tokens limits it.")
    chat.add_argument("--system", help="system message")
    chat.add_argument("--image", action="append", metavar="PATH", help="an image sent with the first message, "
                      "before its text (repeatable; a vision-language model)")
    _add_model_args(chat)
    _add_generation_args(chat)
    chat.set_defaults(run=cmd_chat)

    from .bench import add_parser as add_bench_parser

    add_bench_parser(sub)

    from .loadtest import add_parser as add_loadtest_parser
    from .server.cli import add_parser as add_serve_parser
    from .server.run_batch import add_parser as add_run_batch_parser

    add_serve_parser(sub)
    add_run_batch_parser(sub)
    add_loadtest_parser(sub)
    for command in sub.choices.values():  # every option's help ends with its default
        command.formatter_class = DefaultsHelpFormatter
    return parser


def main(argv: list[str] | None = None) -> int:
    exit_without_collecting()
    args = build_parser().parse_args(argv)
    try:
        return args.run(args)
    except NextTokenError as e:
        print(f"nexttoken: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


def exit_without_collecting() -> None:
    """At exit, freeze the heap instead of collecting it: the interpreter's last collection walks every object
    torch made (~0.3 s on an idle 2-core machine, seconds on a busy one) only to free memory the OS takes back
    anyway. Registered once per process (atexit callbacks still run; nothing is skipped but the collection)."""
    atexit.unregister(gc.freeze)
    atexit.register(gc.freeze)


if __name__ == "__main__":
    sys.exit(main())
