"""JSON's whitespace under a schema, compared on the schema corpus with a real chat model: the compact layout
(json.dumps' only) against the flexible one (JSON's whitespace, bounded per gap), both greedy.

For each schema of bench/schemas.py the model is asked, through its chat template, for a JSON value matching the
schema, shown in the prompt inline (json.dumps) or indented (as instructor's JSON mode shows it), and answers under
it in each layout. Reported per layout: how many answers end by themselves (EOS where the
grammar is complete) within the budget, how many are valid under the schema (`jsonschema`), the mean log-prob per
token the model gave its own answer (how far the mask pushed it off its preferences), and how often the two layouts
give the same JSON value. docs/structured_output.md has the figures for SmolLM2-135M-Instruct:

    python -m nexttoken.bench.json_layout MODEL_DIR [--max-new-tokens 160] [--out result.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from typing import Any

from .schemas import SCHEMAS

LAYOUTS = ("compact", "flexible")


PROMPTS = {"inline": None, "indented": 2}  # the schema in the prompt: json.dumps' indent


def ask(schema: dict, indent: int | None) -> list[dict[str, str]]:
    return [{"role": "user", "content": "Answer with a JSON value that matches this JSON Schema, with realistic "
                                        f"values:\n{json.dumps(schema, indent=indent)}"}]


def compare(llm: Any, max_new_tokens: int = 160, progress: Any = print) -> dict:
    """Per prompt style and layout: answers that ended, valid answers, mean log-prob per token, mean tokens; and
    answers equal across the layouts."""
    return {style: _compare(llm, indent, max_new_tokens, progress) for style, indent in PROMPTS.items()}


def _compare(llm: Any, indent: int | None, max_new_tokens: int, progress: Any) -> dict:
    import jsonschema

    rows = []
    for name, schema in SCHEMAS.items():
        row: dict[str, Any] = {"schema": name}
        for layout in LAYOUTS:
            c = llm.chat(ask(schema, indent), json_schema=schema, structured_whitespace=layout, do_sample=False,
                         max_new_tokens=max_new_tokens)
            try:
                value = json.loads(c.text)
                jsonschema.validate(value, schema)
                valid = True
            except (json.JSONDecodeError, jsonschema.ValidationError):
                value, valid = None, False
            row[layout] = {"ended": c.finish_reason == "stop", "valid": valid and c.finish_reason == "stop",
                           "tokens": len(c.token_ids), "logprob": statistics.fmean(c.logprobs) if c.logprobs else 0.0,
                           "value": value, "text": c.text}
        row["same_value"] = row["compact"]["valid"] and row["compact"]["value"] == row["flexible"]["value"]
        progress(f"{name}: " + ", ".join(f"{lay} {'valid' if row[lay]['valid'] else 'INVALID'} "
                                         f"{row[lay]['tokens']} tok {row[lay]['logprob']:.2f}" for lay in LAYOUTS))
        rows.append(row)
    summary = {layout: {"ended": sum(r[layout]["ended"] for r in rows), "valid": sum(r[layout]["valid"] for r in rows),
                        "mean_logprob": statistics.fmean(r[layout]["logprob"] for r in rows),
                        "mean_tokens": statistics.fmean(r[layout]["tokens"] for r in rows)} for layout in LAYOUTS}
    summary["schemas"] = len(rows)
    summary["same_value"] = sum(r["same_value"] for r in rows)
    return {"summary": summary, "rows": rows, "max_new_tokens": max_new_tokens}


def main(argv: list[str] | None = None) -> int:
    import nexttoken

    p = argparse.ArgumentParser(prog="python -m nexttoken.bench.json_layout", description=__doc__.split("\n")[0])
    p.add_argument("model")
    p.add_argument("--max-new-tokens", type=int, default=160)
    p.add_argument("--out")
    args = p.parse_args(argv)
    result = compare(nexttoken.load(args.model), args.max_new_tokens, lambda line: print(line, file=sys.stderr))
    print(json.dumps({style: r["summary"] for style, r in result.items()}, indent=2))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
