"""Tokenize text, folders, JSONL or Parquet into a perfgpt dataset (mmap shards or WebDataset tars).

Examples:
  python -m tools.prepare_data corpus.txt --out data/shakespeare --text-split paragraph
  python -m tools.prepare_data docs/ --glob '**/*.md' --out data/md --tokenizer tiktoken:gpt2
  python -m tools.prepare_data shard.parquet --out data/wds --output webdataset --seq-len 256
  python -m tools.prepare_data c4/ --glob '*.json' --out data/c4 --tokenizer hf:path/to/Llama-3 --bos
It prints the train.py command for the result (with the model vocabulary the tokenizer needs).
An interrupted run continues with --resume; a run that fails on its input leaves --out as it was.
"""

from __future__ import annotations

if not __package__:  # started as a file, where the project's packages do not import: say how to run it
    from _run_as_module import exit_with_usage

    exit_with_usage(__file__)

import argparse
import os
import sys
import time
from pathlib import Path

from common.errors import DataError
from data.prepare import OUTPUTS, PARTIAL, TEXT_SPLITS, UTF8_POLICIES, PrepareOptions, Utf8Report, prepare
from data.shards import DEFAULT_CHUNK_TOKENS, read_dataset_meta
from training.config import load_config

TRAIN_CONFIG = "configs/tiny.yaml"  # the config the printed command trains (relative to the repository root)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("inputs", nargs="+", help="text files, folders, .jsonl or .parquet files (in this order)")
    p.add_argument("--out", required=True, help="output dataset directory (created; must be new or empty)")
    p.add_argument("--output", choices=OUTPUTS, default="mmap", help="mmap shards (default) or WebDataset tar shards")
    p.add_argument("--tokenizer", default="byte",
                   help="byte (default, vocab 256) | tiktoken:<encoding> (in the local cache, TIKTOKEN_CACHE_DIR) | "
                        "hf:<tokenizer.json, or a model directory holding one>")
    p.add_argument("--bos", action="store_true",
                   help="put the tokenizer's beginning-of-sequence token before each document (the end-of-text "
                        "token always follows each one)")
    p.add_argument("--val-fraction", type=float, default=0.05, help="share of documents held out for validation")
    p.add_argument("--text-field", default="text", help="JSONL field / Parquet column holding the text")
    p.add_argument("--text-split", choices=TEXT_SPLITS, default="file",
                   help="plain text: one document per file, per blank-line paragraph, or per line")
    p.add_argument("--glob", default="**/*.txt", help="files taken from folder inputs (default **/*.txt)")
    p.add_argument("--workers", type=int, default=max(1, (os.cpu_count() or 2) - 1),
                   help="tokenizer processes (the output is the same for any number)")
    p.add_argument("--shard-tokens", type=int, default=100_000_000, help="mmap: max tokens per shard file")
    p.add_argument("--seq-len", type=int, default=1024, help="webdataset: tokens per sample is seq-len + 1")
    p.add_argument("--samples-per-shard", type=int, default=10_000, help="webdataset: samples per tar shard")
    p.add_argument("--wds-encoding", choices=("raw", "npy"), default="raw",
                   help="webdataset: raw little-endian tokens (.u16/.u32) or .npy")
    p.add_argument("--on-invalid-utf8", choices=UTF8_POLICIES, default="replace",
                   help="text/JSONL bytes that are not UTF-8: replace each bad sequence with U+FFFD and report the "
                        "count and places (default), or stop with the file and byte offset")
    p.add_argument("--crc-chunk-tokens", type=int, default=DEFAULT_CHUNK_TOKENS,
                   help=f"mmap: tokens per CRC chunk, the unit data.verify=lazy checks on first read "
                        f"(default {DEFAULT_CHUNK_TOKENS})")
    p.add_argument("--overwrite", action="store_true", help="replace a dataset already in --out")
    p.add_argument("--resume", action="store_true",
                   help=f"continue an interrupted preparation (its {PARTIAL}/ in --out) with the same inputs and options")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    opts = PrepareOptions(
        inputs=args.inputs, out_dir=args.out, output=args.output, tokenizer=args.tokenizer,
        val_fraction=args.val_fraction, text_field=args.text_field, text_split=args.text_split, glob=args.glob,
        workers=args.workers, shard_tokens=args.shard_tokens, seq_len=args.seq_len,
        samples_per_shard=args.samples_per_shard, wds_encoding=args.wds_encoding, overwrite=args.overwrite,
        progress=not args.no_progress, on_invalid_utf8=args.on_invalid_utf8, chunk_tokens=args.crc_chunk_tokens,
        resume=args.resume, bos=args.bos,
    )
    start = time.perf_counter()
    utf8 = Utf8Report()
    try:
        summary = prepare(opts, utf8)
    except DataError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"interrupted: continue with the same command and --resume (the work so far is in {args.out}/{PARTIAL})",
              file=sys.stderr)
        return 130
    seconds = time.perf_counter() - start
    print(f"{'split':<6} {'documents':>10} {'tokens':>14} {'shards':>7} {'samples':>10}")
    for split, s in summary.items():
        samples = f"{s.samples:,}" if args.output == "webdataset" else "-"
        print(f"{split:<6} {s.documents:>10,} {s.tokens:>14,} {s.shards:>7} {samples:>10}")
    total = sum(s.tokens for s in summary.values())
    rate = total / max(seconds, 1e-9)
    if utf8.replacements:
        print(f"warning: {utf8.summary()}", file=sys.stderr)
    print(f"wrote {args.out} ({args.output}, tokenizer {args.tokenizer}) in {seconds:.1f} s, {rate:,.0f} tokens/s")
    print(f"train with: {train_command(args.out)}")
    return 0


def train_command(out: str) -> str:
    """A train.py command that runs on the dataset as written: the model's vocabulary widened to the
    tokenizer's (rounded up to a multiple of 128, as GPT-2's 50257 becomes 50304) and the sequence
    no longer than WebDataset samples were cut for."""
    meta = read_dataset_meta(out)
    cfg = load_config(Path(__file__).resolve().parents[1] / TRAIN_CONFIG)
    flags = [f"--data.format={meta.format}", f"--data.path={out}"]
    if meta.vocab_size > cfg.model.vocab_size:
        flags.append(f"--model.vocab_size={-(-meta.vocab_size // 128) * 128}")
    prepared = meta.extra.get("seq_len")
    if meta.format == "webdataset" and int(prepared) < cfg.seq_len:
        flags.append(f"--data.seq_len={prepared}")
    return f"python train.py --config {TRAIN_CONFIG} " + " ".join(flags)


if __name__ == "__main__":
    sys.exit(main())
