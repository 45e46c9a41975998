"""Tokenize text, folders, JSONL or Parquet into a perfgpt dataset (mmap shards or WebDataset tars).

Examples:
  python -m tools.prepare_data corpus.txt --out data/shakespeare --text-split paragraph
  python -m tools.prepare_data docs/ --glob '**/*.md' --out data/md --tokenizer tiktoken:gpt2
  python -m tools.prepare_data shard.parquet --out data/wds --output webdataset --seq-len 256
Then train with: python train.py --config configs/tiny.yaml --data.format=<mmap|webdataset> --data.path=<out>
"""

from __future__ import annotations

if not __package__:  # started as a file, where the project's packages do not import: say how to run it
    from _run_as_module import exit_with_usage

    exit_with_usage(__file__)

import argparse
import os
import sys
import time

from common.errors import DataError
from data.prepare import OUTPUTS, TEXT_SPLITS, UTF8_POLICIES, PrepareOptions, Utf8Report, prepare
from data.shards import DEFAULT_CHUNK_TOKENS


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("inputs", nargs="+", help="text files, folders, .jsonl or .parquet files (in this order)")
    p.add_argument("--out", required=True, help="output dataset directory (created; must be new or empty)")
    p.add_argument("--output", choices=OUTPUTS, default="mmap", help="mmap shards (default) or WebDataset tar shards")
    p.add_argument("--tokenizer", default="byte",
                   help="byte (default, vocab 256) | tiktoken:<encoding> (must be in the local cache) | "
                        "hf:<tokenizer.json>")
    p.add_argument("--val-fraction", type=float, default=0.05, help="share of documents held out for validation")
    p.add_argument("--text-field", default="text", help="JSONL field / Parquet column holding the text")
    p.add_argument("--text-split", choices=TEXT_SPLITS, default="file",
                   help="plain text: one document per file, per blank-line paragraph, or per line")
    p.add_argument("--glob", default="**/*.txt", help="files taken from folder inputs (default **/*.txt)")
    p.add_argument("--workers", type=int, default=max(1, (os.cpu_count() or 2) - 1), help="tokenizer processes")
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
    )
    start = time.perf_counter()
    utf8 = Utf8Report()
    try:
        summary = prepare(opts, utf8)
    except DataError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
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
    print(f"train with: python train.py --config configs/tiny.yaml --data.format={args.output} --data.path={args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
