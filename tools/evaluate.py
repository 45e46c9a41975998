"""Loss, perplexity and bits per byte of a trained model on a dataset split, on one or many ranks.

    python -m tools.evaluate runs/tiny                                  # the run's own dataset, val split
    python -m tools.evaluate runs/tiny --split train --batches 50
    python -m tools.evaluate exported/tiny --config configs/tiny.yaml   # an export: name the data config
    torchrun --standalone --nproc_per_node=2 -m tools.evaluate runs/tiny  # each rank reads its share

SOURCE is anything tools/export.py reads. The data come from a config's data section (the run's
own ``config.yaml`` next to its checkpoints, else ``--config``), with ``--data.key=value``
overrides; ``--split`` names any split of the prepared dataset. Every rank evaluates its share of
the split's windows (the same split into ranks as training's validation) and the sums are
all-reduced, so the figures do not depend on the rank count beyond the windows a rank count
leaves out at the end (the total is printed). Bits per byte divide the summed loss (in bits)
by the UTF-8 bytes of the predicted tokens' text (data.tokenizer.token_byte_lengths).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from common.errors import USER_FACING_ERRORS, ConfigError
from data.loader import build_data
from data.tokenizer import build_tokenizer, token_byte_lengths
from training.config import load_config
from training.model_io import load_source


def parse_args(argv: list[str] | None) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("source", type=Path)
    parser.add_argument("--config", type=Path, help="YAML whose data section names the dataset (default: the run's)")
    parser.add_argument("--split", default="val", help="dataset split (default val)")
    parser.add_argument("--batches", type=int, default=0, help="batches per rank (default 0: the whole split)")
    parser.add_argument("--batch-size", type=int, default=8, help="sequences per batch")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    return parser.parse_known_args(argv)


def run_config(source: Path) -> Path | None:
    """The config.yaml train.py wrote into the run directory that holds ``source``, if any."""
    for parent in [source, *source.parents][:4]:
        if (parent / "config.yaml").is_file():
            return parent / "config.yaml"
    return None


def evaluate(args: argparse.Namespace, overrides: list[str]) -> dict:
    bad = [o for o in overrides if not o.startswith("--data.")]
    if bad:
        raise ConfigError(f"unknown argument {bad[0]}; only --data.key=value overrides are read here")
    source = load_source(args.source)
    config = args.config or run_config(args.source)
    if config is None:
        raise ConfigError(f"{args.source} is not inside a run directory; pass --config with the dataset's data section")
    cfg = load_config(config, overrides)
    if args.batch_size < 1 or args.batches < 0:
        raise ConfigError("--batch-size must be >= 1 and --batches >= 0")
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    seq_len = min(cfg.seq_len, source.cfg.max_seq_len)
    data = build_data(cfg.data, seq_len=seq_len, micro_batch_size=args.batch_size, seed=cfg.train.seed, rank=rank,
                      world_size=world, vocab_size=source.cfg.vocab_size, eval_split=args.split)
    tokenizer = build_tokenizer(data.tokenizer)
    lengths = torch.as_tensor(token_byte_lengths(tokenizer, source.cfg.vocab_size))
    device = torch.device(args.device)
    model = source.build(device)
    n = args.batches or data.val.num_batches
    sums = torch.zeros(3, dtype=torch.float64)  # nats, tokens, bytes
    with torch.no_grad():
        for x, y in data.val.batches(n):
            logits = model(x.to(device))
            nats = F.cross_entropy(logits.float().flatten(0, 1), y.to(device).flatten(), reduction="sum")
            sums += torch.tensor([float(nats), y.numel(), float(lengths[y].sum())], dtype=torch.float64)
    if dist.is_initialized():
        dist.all_reduce(sums)
    nats, tokens, n_bytes = sums.tolist()
    if tokens == 0:
        raise ConfigError(f"split {args.split!r} gave no batch of {args.batch_size} x {seq_len} tokens per rank; "
                          "lower --batch-size")
    loss = nats / tokens
    return {"source": source.origin, "split": args.split, "ranks": world, "tokens": int(tokens), "bytes": int(n_bytes),
            "loss": loss, "perplexity": math.exp(loss), "bits_per_byte": nats / math.log(2) / max(n_bytes, 1)}


def main(argv: list[str] | None = None) -> int:
    args, overrides = parse_args(argv)
    if args.json is not None and (args.json.is_dir() or not args.json.parent.is_dir()):
        # checked before the evaluation, not after it
        where = "is a directory" if args.json.is_dir() else f"is in {args.json.parent}, which does not exist"
        print(f"error: --json {args.json} {where}; give a file path in an existing directory", file=sys.stderr)
        return 2
    distributed = int(os.environ.get("WORLD_SIZE", "1")) > 1
    if distributed:
        dist.init_process_group("nccl" if args.device.startswith("cuda") else "gloo")
    try:
        result = evaluate(args, overrides)
    except USER_FACING_ERRORS as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    finally:
        if distributed:
            dist.destroy_process_group()
    if result["ranks"] == 1 or int(os.environ.get("RANK", "0")) == 0:
        print(f"{result['source']}\nsplit {result['split']} on {result['ranks']} rank(s): {result['tokens']:,} tokens "
              f"({result['bytes']:,} bytes) | loss {result['loss']:.4f} | perplexity {result['perplexity']:.3f} | "
              f"bits/byte {result['bits_per_byte']:.4f}")
        if args.json:
            try:
                args.json.write_text(json.dumps(result, indent=2) + "\n")
            except OSError as exc:
                print(f"error: cannot write --json {args.json}: {exc.strerror or exc}", file=sys.stderr)
                return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
