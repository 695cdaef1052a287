"""`nexttoken generate | chat | serve | bench`: thin shells over the Python API.

Flags mirror GenerationConfig's field names; a flag left out leaves the model's own default in place.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from typing import Any, Callable

from .errors import NextTokenError

# (flag, GenerationConfig field, type, help)
_OPTION_FLAGS: list[tuple[str, str, Callable[[str], Any], str]] = [
    ("--max-new-tokens", "max_new_tokens", int, "how many tokens to generate at most"),
    ("--temperature", "temperature", float, "sampling temperature (with --do-sample)"),
    ("--top-k", "top_k", int, "keep the k most likely tokens (with --do-sample)"),
    ("--top-p", "top_p", float, "nucleus sampling mass (with --do-sample)"),
    ("--min-p", "min_p", float, "drop tokens below min_p x the top probability (with --do-sample)"),
    ("--repetition-penalty", "repetition_penalty", float, "penalise tokens already present (1.0 = off)"),
    ("--seed", "seed", int, "seed for reproducible sampling"),
]


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", help="Hugging Face model folder (default: the model packaged with nexttoken)")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], help="weights dtype (default float32 on CPU)")
    p.add_argument("--device", help="cpu (default) or cuda")
    p.add_argument("--quantize", choices=["int8"], help="weight-only int8 quantization of the linear layers")


def _add_generation_args(p: argparse.ArgumentParser) -> None:
    for flag, field, kind, help_text in _OPTION_FLAGS:
        p.add_argument(flag, dest=field, type=kind, help=help_text)
    p.add_argument("--do-sample", dest="do_sample", action="store_const", const=True, help="sample instead of greedy")
    p.add_argument("--greedy", dest="do_sample", action="store_const", const=False, help="always take the argmax")
    p.add_argument("--stop", dest="stop_strings", action="append", help="stop string (repeatable)")


def _options(args: argparse.Namespace) -> dict[str, Any]:
    names = [f for _, f, _, _ in _OPTION_FLAGS] + ["do_sample", "stop_strings"]
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
