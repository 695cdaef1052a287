"""`nexttoken generate | chat | serve | bench`: thin shells over the Python API.

Generation flags are GenerationConfig's field names (`--top-p` sets `top_p`); a flag left out leaves the model's own
default in place.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from typing import Any, Callable

from .errors import LoraError, NextTokenError
from .generation.config import GenerationConfig
from .pretrained import add_source_args, source_options

# The one table from flags to options: every scalar or id-list option of GenerationConfig is a flag of the same
# name (`top_p` -> --top-p); the values are checked by GenerationConfig, once, like every other caller's options.
_NOT_FLAGS = {"return_dict_in_generate", "output_scores", "output_logits", "bos_token_id", "pad_token_id", "trace"}
_KINDS: dict[str, tuple[Callable[[str], Any], str | None]] = {  # annotation -> (argparse type, nargs)
    "int": (int, None), "int | None": (int, None), "float": (float, None), "float | None": (float, None),
    "str": (str, None), "str | None": (str, None), "list[int] | None": (int, "+"), "list[str] | None": (str, "+"),
}
_BY_NAME = {"json_schema": (str, None)}  # a JSON Schema as JSON text (GenerationConfig turns it into a dict)
_HELP = {
    "max_new_tokens": "how many tokens to generate at most",
    "do_sample": "sample instead of taking the argmax (--no-do-sample or --greedy: argmax)",
    "temperature": "sampling temperature (with --do-sample; 0 means greedy)",
    "top_k": "keep the k most likely tokens (with --do-sample)",
    "top_p": "nucleus sampling mass (with --do-sample)",
    "min_p": "drop tokens below min_p x the top probability (with --do-sample)",
    "repetition_penalty": "penalise tokens already present (1.0 = off)",
    "seed": "seed for reproducible sampling",
}


def _option_flags() -> list[tuple[str, dict[str, Any]]]:
    """(dest, argparse keyword arguments) for every GenerationConfig field that a flag can carry."""
    flags = []
    for f in dataclasses.fields(GenerationConfig):
        if f.name in _NOT_FLAGS:
            continue
        help_text = _HELP.get(f.name, f"GenerationConfig.{f.name} (docs/decoding.md)")
        if f.type == "bool":
            flags.append((f.name, dict(action=argparse.BooleanOptionalAction, default=None, help=help_text)))
        elif f.type in _KINDS or f.name in _BY_NAME:
            kind, nargs = _BY_NAME.get(f.name) or _KINDS[f.type]
            flags.append((f.name, dict(type=kind, nargs=nargs, help=help_text)))
    return flags


def _add_model_args(p: argparse.ArgumentParser) -> None:
    add_source_args(p)
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"],
                   help="weights dtype (default on CPU: a bf16 checkpoint keeps bf16 weights with float32 activations, "
                        "anything else float32; bfloat16 on accelerators): docs/models.md#precision")
    p.add_argument("--device", help="cpu (default) or cuda")
    p.add_argument("--quantize", choices=["int8", "int4", "bf16"],
                   help="weight-only quantization of the linear layers: int8 (per row), int4 (groups of 32), or bf16 "
                        "(bfloat16 weights, float32 activations)")
    p.add_argument("--tensor-parallel-size", type=int, default=1,
                   help="shard the model over N ranks (local processes, or the ranks torchrun started)")
    p.add_argument("--lora", metavar="[NAME=]PATH",
                   help="a PEFT LoRA adapter folder to generate under (docs/lora.md)")
    p.add_argument("--merge-lora", action="store_true",
                   help="fold the --lora adapter into the weights (before --quantize, which then rounds the sum)")


def _add_generation_args(p: argparse.ArgumentParser) -> None:
    options = p.add_argument_group("generation options (GenerationConfig's names; left out: the model's default)")
    for dest, kwargs in _option_flags():
        options.add_argument("--" + dest.replace("_", "-"), dest=dest, **kwargs)
    options.add_argument("--greedy", dest="do_sample", action="store_const", const=False, help="always take the argmax")
    options.add_argument("--stop", dest="stop_strings", action="append", help="stop string (repeatable)")


def _options(args: argparse.Namespace) -> dict[str, Any]:
    names = [dest for dest, _ in _option_flags()] + ["stop_strings"]
    options = {n: getattr(args, n) for n in names if getattr(args, n) is not None}
    if getattr(args, "lora_name", None):  # set by _load: the adapter the run decodes under
        options["lora"] = args.lora_name
    return options


def _load(args: argparse.Namespace):  # noqa: ANN202
    from .llm import load

    print(f"loading {args.model or 'the packaged default model'} ...", file=sys.stderr, flush=True)
    from .model.lora import parse_modules

    lora = parse_modules([args.lora]) if args.lora else None
    if args.merge_lora and not lora:
        raise LoraError("--merge-lora folds an adapter into the weights: give it with --lora [NAME=]PATH")
    llm = load(args.model, dtype=args.dtype, device=args.device, quantize=args.quantize,
               tensor_parallel_size=args.tensor_parallel_size, lora=lora, merge=args.merge_lora,
               **source_options(args))
    args.lora_name = None if lora is None or args.merge_lora else next(iter(lora))
    return llm


def cmd_generate(args: argparse.Namespace) -> int:
    prompt = args.prompt if args.prompt is not None else sys.stdin.read()
    llm = _load(args)
    options = _options(args)
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
    from .llm import load

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
    model = args.model or trace.get("model")
    print(f"loading {model or 'the packaged default model'} ...", file=sys.stderr, flush=True)
    llm = load(model, dtype=args.dtype, device=args.device, quantize=args.quantize, **source_options(args))
    report, _ = replay(trace, llm, overrides)
    print(report.summary())
    return 0 if report.identical else 1


def cmd_chat(args: argparse.Namespace) -> int:
    llm = _load(args)
    options = _options(args)
    messages: list[dict[str, str]] = []
    if args.system:
        messages.append({"role": "system", "content": args.system})
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
        messages.append({"role": "user", "content": line})
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

    gen = sub.add_parser("generate", help="complete a prompt (from the argument or stdin), streaming")
    gen.add_argument("prompt", nargs="?", help="the prompt; read from stdin when omitted")
    gen.add_argument("--json", action="store_true", help="print the full result as JSON instead of streaming")
    gen.add_argument("--trace", metavar="PAGE.html", help="record why each token was chosen: write the explain "
                     "page there and the trace beside it as .json (see docs/tracing.md)")
    _add_model_args(gen)
    _add_generation_args(gen)
    gen.set_defaults(run=cmd_generate)

    rep = sub.add_parser("replay", help="run a trace's request again: identical, or the first step that differs")
    rep.add_argument("trace", help="a trace .json written by generate --trace, LLM.generate(trace=True) or the server")
    rep.add_argument("--option", action="append", metavar="NAME=JSON", help="change an option (what-if; repeatable)")
    _add_model_args(rep)
    rep.set_defaults(run=cmd_replay)

    chat = sub.add_parser("chat", help="multi-turn chat on the model's chat template (Ctrl-D exits)")
    chat.add_argument("--system", help="system message")
    _add_model_args(chat)
    _add_generation_args(chat)
    chat.set_defaults(run=cmd_chat)

    from .bench import add_parser as add_bench_parser

    add_bench_parser(sub)

    from .loadtest import add_parser as add_loadtest_parser
    from .server.cli import add_parser as add_serve_parser

    add_serve_parser(sub)
    add_loadtest_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.run(args)
    except NextTokenError as e:
        print(f"nexttoken: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
