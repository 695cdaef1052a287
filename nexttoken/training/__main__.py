"""`python -m nexttoken.training`: rebuild nexttoken/default_model from the stories260K teacher.

Stages: corpus (teacher samples) -> BPE tokenizer -> training -> export -> held-out evaluation -> model card.
`--quick` runs every stage at toy size into runs/quick/ in a couple of minutes (a smoke test).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from dataclasses import asdict
from pathlib import Path

import tokenizers
import torch

from ..errors import MissingExtraError
from ..extras import require

try:
    require("transformers", "train", "python -m nexttoken.training")  # it trains transformers' LlamaForCausalLM
except MissingExtraError as e:
    sys.exit(f"nexttoken: error: {e}")
from . import bpe, corpus, evaluate, export, train  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
TEACHER = REPO.parent / "shared" / "models" / "stories260k"
CHAT_REQUESTS = ("Tell me a story.", "Can you tell me a story?", "Write a short story.", "Please tell me a story.",
                 "Tell me a bedtime story.", "I want a story.")
HELD_OUT_SEED = 10_000_000  # the corpus uses seeds from 1000 up; held-out stories never share one


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m nexttoken.training", description=__doc__.splitlines()[0])
    p.add_argument("--teacher", type=Path, default=TEACHER, help="teacher model folder (stories260K)")
    p.add_argument("--work", type=Path, default=REPO / "runs" / "default_model", help="corpus, logs, metrics")
    p.add_argument("--out", type=Path, default=REPO / "nexttoken" / "default_model", help="exported model folder")
    p.add_argument("--plot", type=Path, default=REPO / "docs" / "default_model_loss.png", help="loss curve PNG")
    p.add_argument("--corpus-chars", type=int, default=5_000_000, help="corpus size in characters")
    p.add_argument("--reuse-corpus", action="store_true", help="keep WORK/corpus.jsonl if it is already there")
    p.add_argument("--vocab-size", type=int, default=2048)
    p.add_argument("--hidden-size", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--intermediate-size", type=int, default=320)
    p.add_argument("--minutes", type=float, default=25.0, help="training wall-clock budget")
    p.add_argument("--lr", type=float, default=5e-3)
    p.add_argument("--bf16", action="store_true", help="bfloat16 autocast in training (faster matmuls on CPU)")
    p.add_argument("--chat-fraction", type=float, default=0.15, help="stories wrapped in the chat format")
    p.add_argument("--held-out", type=int, default=128, help="fresh teacher stories for the held-out loss")
    p.add_argument("--threads", type=int, default=2, help="torch threads for training and evaluation")
    p.add_argument("--quick", action="store_true", help="toy sizes into runs/quick/ (smoke test)")
    p.add_argument("--init", type=Path, help="continue training an exported folder (its tokenizer and weights)")
    p.add_argument("--evaluate-only", action="store_true",
                   help="skip corpus and training: re-run the held-out evaluation and model card of the exported "
                        "folder (reads WORK/train_metrics.json)")
    args = p.parse_args(argv)
    if args.quick:
        args.work, args.corpus_chars, args.vocab_size = REPO / "runs" / "quick", 150_000, 512
        args.hidden_size, args.layers, args.intermediate_size, args.minutes, args.held_out = 64, 2, 160, 0.5, 16
        if args.out == p.get_default("out"):
            args.out = args.work / "model"
        if args.plot == p.get_default("plot"):
            args.plot = args.work / "loss.png"
    return args


def documents(stories: list[corpus.Story], tok, chat_fraction: float, seed: int) -> list[list[int]]:  # noqa: ANN001
    """Token ids per story: `<s> text </s>` (no `</s>` when the teacher ran out of context mid-story); a share of
    them as a chat exchange, so `nexttoken chat` answers a request with a story."""
    rng = random.Random(seed)
    texts = [export.chat_text(rng.choice(CHAT_REQUESTS), s.text) if rng.random() < chat_fraction else s.text
             for s in stories]
    eos = tok.token_to_id(bpe.EOS)
    return [e.ids + ([eos] if s.finished else []) for s, e in zip(stories, tok.encode_batch(texts))]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.evaluate_only:
        return evaluate_and_describe(args)
    torch.manual_seed(0)
    args.work.mkdir(parents=True, exist_ok=True)
    t0 = time.time()

    corpus_file = args.work / "corpus.jsonl"
    if args.reuse_corpus and corpus_file.is_file():
        stories = corpus.read_corpus(corpus_file)
        print(f"corpus: reusing {corpus_file} ({len(stories)} stories)", flush=True)
    else:
        stories = corpus.write_corpus(args.teacher, corpus_file, args.corpus_chars)
    val_stories = stories[::50]  # every 50th story is validation data (the loss curve's second line)
    train_stories = [s for i, s in enumerate(stories) if i % 50]
    torch.set_num_threads(args.threads)

    if args.init:  # warm start: keep the folder's tokenizer so its weights stay meaningful
        tok = tokenizers.Tokenizer.from_file(str(args.init / "tokenizer.json"))
    else:
        tok = bpe.train_bpe((s.text for s in train_stories), args.vocab_size)
    train_docs = documents(train_stories, tok, args.chat_fraction, seed=1)
    val_docs = documents(val_stories, tok, 0.0, seed=2)
    train_stream, val_stream = train.pack(train_docs), train.pack(val_docs)[:16_385]
    chars = sum(len(s.text) for s in train_stories)
    print(f"tokenizer: {tok.get_vocab_size()} pieces, {chars / len(train_stream):.2f} characters per token; "
          f"{len(train_stream):,} training tokens, {len(val_stream):,} validation tokens", flush=True)

    shape = train.ModelShape(hidden_size=args.hidden_size, num_hidden_layers=args.layers,
                             intermediate_size=args.intermediate_size)
    config = train.llama_config(shape, tok.get_vocab_size(), bos=tok.token_to_id(bpe.BOS), eos=tok.token_to_id(bpe.EOS))
    model = train.LlamaForCausalLM.from_pretrained(args.init) if args.init else train.LlamaForCausalLM(config)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: {n_params:,} parameters ({asdict(shape)})", flush=True)
    settings = train.TrainSettings(minutes=args.minutes, lr=args.lr, bf16=args.bf16)
    log = train.train(model, train_stream, val_stream, settings)
    args.plot.parent.mkdir(parents=True, exist_ok=True)
    train.plot_losses(log, args.plot, f"default model: {n_params / 1e6:.2f}M parameters, {args.minutes:g} min on CPU")

    export.export(model, tok, args.out, export.word_list([s.text for s in stories]))
    metrics = {
        "command": "python -m nexttoken.training " + " ".join(argv if argv is not None else sys.argv[1:]),
        "parameters": n_params, "shape": asdict(shape), "vocab_size": tok.get_vocab_size(),
        "corpus": {"stories": len(stories), "characters": sum(len(s.text) for s in stories),
                   "training_tokens": len(train_stream)},
        "train": {"steps": log.steps[-1], "minutes": log.seconds / 60, "tokens_seen": log.steps[-1] * settings.batch
                  * settings.seq_len, "final_val_nats_per_token": log.val_loss[-1], **asdict(settings)},
        "minutes_to_export": (time.time() - t0) / 60,
    }
    (args.work / "train_metrics.json").write_text(json.dumps(metrics, indent=2) + "\n")
    (args.work / "train_log.json").write_text(json.dumps(asdict(log)) + "\n")
    return evaluate_and_describe(args)


def evaluate_and_describe(args: argparse.Namespace) -> int:
    """Held-out loss of the exported model and of the teacher on fresh teacher stories; then the model card."""
    torch.set_num_threads(args.threads)
    metrics = json.loads((args.work / "train_metrics.json").read_text())
    texts = evaluate.held_out_texts(args.teacher, args.held_out, HELD_OUT_SEED)
    eos = json.loads((args.out / "config.json").read_text())["eos_token_id"]
    ours = evaluate.score(args.out, texts, end_id=eos)
    teacher = evaluate.score(args.teacher, texts, end_id=1)
    metrics["held_out"] = {"ours": asdict(ours), "stories260k": asdict(teacher)}
    metrics["greedy_once_upon_a_time"] = greedy_sample(args.out, "Once upon a time")
    (args.work / "metrics.json").write_text(json.dumps(metrics, indent=2) + "\n")
    (args.out / "README.md").write_text(model_card(metrics, args.out))
    print(json.dumps(metrics["held_out"], indent=2))
    print(f"greedy: {metrics['greedy_once_upon_a_time']}")
    print(f"done: {args.out}", flush=True)
    return 0


def greedy_sample(model_dir: Path, prompt: str, max_new_tokens: int = 60) -> str:
    """Prompt plus greedy continuation, decoded together (a completion decoded alone loses its leading space)."""
    from ..llm import load

    llm = load(model_dir)
    out = llm.generate(prompt, do_sample=False, max_new_tokens=max_new_tokens)
    return llm.tokenizer.decode(out.prompt_token_ids + out.token_ids, skip_special_tokens=True)


def model_card(m: dict, out: Path) -> str:
    size_mb = sum(f.stat().st_size for f in out.iterdir() if f.is_file()) / 1e6
    ours, teacher = m["held_out"]["ours"], m["held_out"]["stories260k"]
    s = m["shape"]
    return f"""# nexttoken default model

A {m['parameters'] / 1e6:.2f}M-parameter Llama (`LlamaForCausalLM`) that writes short children's stories. It ships
inside the package so `nexttoken generate "Once upon a time"` and `nexttoken.load()` work with no download.

## Origin and license

Distilled from **llama2.c `stories260K`** by **Andrej Karpathy** (MIT License), itself trained on TinyStories
(Eldan & Li, 2023). No teacher file is copied here: the teacher only *wrote the training text*. nexttoken sampled
{m['corpus']['stories']:,} stories ({m['corpus']['characters'] / 1e6:.1f}M characters) from it, and the tokenizer
and weights in this folder were trained from scratch on those stories. MIT License, like the teacher.

## How it was made

    {m['command']}

(run from the repository root; the teacher is read from `../shared/models/stories260k`). `--reuse-corpus` keeps
`runs/default_model/corpus.jsonl` from an earlier run of the same command (without it the corpus is sampled
first: about 25 minutes for 30M characters on an idle 2-core machine; seeds 1000 and up, so it is the same corpus). The script
(`nexttoken/training/`) samples the corpus with nexttoken at temperatures 0.8-1.1, trains a byte-fallback BPE
tokenizer ({m['vocab_size']} pieces) with `tokenizers`, trains the model with AdamW and a cosine schedule on
{m['train']['minutes']:.1f} minutes of CPU time ({m['train']['steps']:,} steps of {m['train']['batch']}x{m['train']['seq_len']} tokens,
{m['train']['tokens_seen'] / 1e6:.1f}M tokens seen), and exports this folder. The schedule runs over a wall-clock
budget, so the step count depends on the machine's speed.

## Size

hidden {s['hidden_size']}, {s['num_hidden_layers']} layers, {s['num_attention_heads']} heads ({s['num_key_value_heads']} KV heads),
MLP {s['intermediate_size']}, vocabulary {m['vocab_size']}, context {s['max_position_embeddings']}, tied embeddings, float32:
{m['parameters']:,} parameters, {size_mb:.1f} MB on disk.

## Held-out loss

{ours['stories']} fresh stories sampled from stories260K at temperature 1 (seeds the corpus never used), scored by
transformers as `<s> story <end>`; summed loss divided by the stories' UTF-8 bytes, since the two models
cut text into different tokens:

| model | bits per byte | nats per own token |
| --- | --- | --- |
| this model | {ours['bits_per_byte']:.4f} | {ours['nats_per_token']:.4f} |
| stories260K (teacher) | {teacher['bits_per_byte']:.4f} | {teacher['nats_per_token']:.4f} |

The gap to the teacher is a matter of training compute: the loss was still falling when the time budget ran
out (see `docs/default_model.md`); `--minutes` buys more.

## Generation defaults

`generation_config.json`: sampling at temperature 0.8, top-p 0.95, up to 256 new tokens, stop at `</s>`.
Greedy "Once upon a time" gives:

> {m['greedy_once_upon_a_time'].replace(chr(10), chr(10) + '> ')}

`words.txt` lists the words seen at least 3 times in the corpus (the tests check generations against it).
"""


if __name__ == "__main__":
    sys.exit(main())
