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

from .errors import NextTokenError
from .generation.config import GenerationConfig

# The one table from flags to options: every scalar or id-list option of GenerationConfig is a flag of the same
# name (`top_p` -> --top-p); the values are checked by GenerationConfig, once, like every other caller's options.
_NOT_FLAGS = {"return_dict_in_generate", "output_scores", "output_logits", "bos_token_id", "pad_token_id"}
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
    p.add_argument("--model", help="Hugging Face model folder (default: the model packaged with nexttoken)")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], help="weights dtype (default float32 on CPU)")
    p.add_argument("--device", help="cpu (default) or cuda")
    p.add_argument("--quantize", choices=["int8", "int4", "bf16"],
                   help="weight-only quantization of the linear layers: int8 (per row), int4 (groups of 32), or bf16 "
                        "(bfloat16 weights, float32 activations)")


def _add_generation_args(p: argparse.ArgumentParser) -> None:
    options = p.add_argument_group("generation options (GenerationConfig's names; left out: the model's default)")
    for dest, kwargs in _option_flags():
        options.add_argument("--" + dest.replace("_", "-"), dest=dest, **kwargs)
    options.add_argument("--greedy", dest="do_sample", action="store_const", const=False, help="always take the argmax")
    options.add_argument("--stop", dest="stop_strings", action="append", help="stop string (repeatable)")


def _options(args: argparse.Namespace) -> dict[str, Any]:
    names = [dest for dest, _ in _option_flags()] + ["stop_strings"]
    return {n: getattr(args, n) for n in names if getattr(args, n) is not None}


def _load(args: argparse.Namespace):  # noqa: ANN202
    from .llm import load

    print(f"loading {args.model or 'the packaged default model'} ...", file=sys.stderr, flush=True)
    return load(args.model, dtype=args.dtype, device=args.device, quantize=args.quantize)


def cmd_generate(args: argparse.Namespace) -> int:
    prompt = args.prompt if args.prompt is not None else sys.stdin.read()
    llm = _load(args)
    options = _options(args)
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
    _add_model_args(gen)
    _add_generation_args(gen)
    gen.set_defaults(run=cmd_generate)

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
