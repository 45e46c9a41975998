"""Loss, perplexity and bits per byte of a trained model on a dataset split, on one or many ranks;
or its scores on lm-evaluation-harness tasks (``--tasks``).

    python -m tools.evaluate runs/tiny                                  # the run's validation set
    python -m tools.evaluate runs/tiny --sequences 0                    # the whole val split
    python -m tools.evaluate runs/tiny --split train --sequences 400
    python -m tools.evaluate exported/tiny --config configs/tiny.yaml   # an export: name the data config
    torchrun --standalone --nproc_per_node=2 -m tools.evaluate runs/tiny  # each rank reads its share
    python -m tools.evaluate runs/tiny --tasks perfgpt_python_mc,perfgpt_python_gen --task-dir tests/harness_tasks
    python -m tools.evaluate runs/gpt2 --tasks hellaswag,arc_easy --num-fewshot 0 --device cuda   # needs the datasets

SOURCE is anything tools/export.py reads. The data come from a config's data section (the run's
own ``config.yaml`` next to its checkpoints, else ``--config``), with ``--data.key=value``
overrides; ``--split`` names any split of the prepared dataset. The sequences are the first
``--sequences`` windows of the split in order (of each source's, for a mixture: the loss is then
their mean by the sources' weights, as train.py's ``val_loss``, and each source's is printed) (default: the config's validation set,
``train.eval_sequences`` or ``train.eval_steps x train.micro_batch_size``; 0: all), shared out
among the ranks exactly as train.py's validation shares them (``data.bundle.ValSource``), and the
sums are all-reduced: on a checkpoint, the loss is the ``val_loss`` train.py logged at its step,
for any rank count on either side. Bits per byte divide the summed loss (in bits) by the UTF-8
bytes of the predicted tokens' text (data.tokenizer.token_byte_lengths).

With ``--tasks`` the harness (``pip install -e '.[eval]'``) scores the model through perfgpt's own
backend (training/lm_eval_backend.py: the source's tokenizer, batched requests, the KV cache for
generation) and prints its table; under torchrun each rank takes a share of the requests. Task
names are the harness's (its datasets download on first use) or those of the task YAML files in
``--task-dir``; a YAML path works too.
"""

from __future__ import annotations

if not __package__:  # started as a file, where the project's packages do not import: say how to run it
    from _run_as_module import exit_with_usage

    exit_with_usage(__file__)

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
from common.progress import track
from data.bundle import IGNORE_INDEX
from data.loader import build_data
from data.tokenizer import build_tokenizer, token_byte_lengths
from training.config import RUN_CONFIG_FILE, load_config
from training.model_io import load_source
from training.task_eval import import_lm_eval_backend


def parse_args(argv: list[str] | None) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("source", type=Path)
    parser.add_argument("--config", type=Path, help="YAML whose data section names the dataset (default: the run's)")
    parser.add_argument("--split", default="val", help="dataset split (default val)")
    parser.add_argument("--sequences", type=int, help="the first N windows of the split (default: the config's "
                        "validation set, as train.py evaluates it; 0: the whole split)")
    parser.add_argument("--batch-size", type=int, help="sequences per batch and rank (default: train.micro_batch_size)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    tasks = parser.add_argument_group("lm-evaluation-harness (pip install -e '.[eval]')")
    tasks.add_argument("--tasks", help="comma-separated harness task names or task YAML paths: score these instead")
    tasks.add_argument("--task-dir", type=Path, help="a directory of task YAML files searched first (a task's "
                       "'!function' runs Python from it: use folders you trust)")
    tasks.add_argument("--num-fewshot", type=int, help="few-shot examples per prompt (default: each task's own)")
    tasks.add_argument("--limit", type=int, help="at most this many examples per task")
    tasks.add_argument("--tokenizer", help="byte | tiktoken:<encoding> | hf:<tokenizer.json> (default: the source's)")
    tasks.add_argument("--dtype", default="float32", help="float32 | bfloat16 | float16")
    tasks.add_argument("--max-gen-toks", type=int, help="tokens generated at most where a task does not say")
    return parser.parse_known_args(argv)


def run_config(source: Path) -> Path | None:
    """The config.yaml train.py wrote into the run directory that holds ``source``, if any."""
    for parent in [source, *source.parents][:4]:
        if (parent / RUN_CONFIG_FILE).is_file():
            return parent / RUN_CONFIG_FILE
    return None


def evaluate(args: argparse.Namespace, overrides: list[str]) -> dict:
    bad = [o for o in overrides if not o.startswith("--data.")]
    if bad:
        raise ConfigError(f"unknown argument {bad[0]}; only --data.key=value overrides are read here")
    source = load_source(args.source)
    if int(os.environ.get("RANK", "0")) == 0:
        for line in source.warnings:
            print(f"warning: {line}", file=sys.stderr)
    config = args.config or run_config(args.source)
    if config is None:
        raise ConfigError(f"{args.source} is not inside a run directory; pass --config with the dataset's data section")
    cfg = load_config(config, overrides, saved=args.config is None)  # a run's own config.yaml may predate a rename
    batch_size = cfg.train.micro_batch_size if args.batch_size is None else args.batch_size
    sequences = cfg.train.validation_sequences if args.sequences is None else args.sequences
    if batch_size < 1 or sequences < 0:
        raise ConfigError("--batch-size must be >= 1 and --sequences >= 0")
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    seq_len = min(cfg.seq_len, source.cfg.max_seq_len)
    data = build_data(cfg.data, seq_len=seq_len, micro_batch_size=batch_size, seed=cfg.train.seed, rank=rank,
                      world_size=world, vocab_size=source.cfg.vocab_size, eval_split=args.split)
    tokenizer = build_tokenizer(data.tokenizer)
    lengths = torch.as_tensor(token_byte_lengths(tokenizer, source.cfg.vocab_size))
    device = torch.device(args.device)
    model = source.build(device)
    figures = {}
    for name, val in (data.val_sources or {"": data.val}).items():
        label = f"evaluate {args.split}" + (f" of {name}" if name else "")
        figures[name] = split_figures(model, val, sequences, lengths, device, progress=label if rank == 0 else None)
    result = {"source": source.origin, "split": args.split, "ranks": world}
    if data.mixture is None:
        return result | figures[""]
    # A mixture: each source's figures, and train.py's val_loss (their mean by the sources' weights).
    weights = data.mixture.configured_weights()
    loss = sum(weights[name] * f["loss"] for name, f in figures.items())
    totals = {key: sum(f[key] for f in figures.values()) for key in ("sequences", "tokens", "bytes")}
    return result | totals | {"loss": loss, "perplexity": math.exp(loss), "sources": figures,
                              "bits_per_byte": sum(weights[name] * f["bits_per_byte"] for name, f in figures.items())}


def split_figures(model, val, sequences: int, lengths: torch.Tensor, device: torch.device,
                  progress: str | None = None) -> dict:
    """Loss, perplexity and bits per byte over one validation set, summed over the ranks; ``progress``
    names the batches' progress on stderr (rank 0's)."""
    sums = torch.zeros(4, dtype=torch.float64)  # nats, targets, bytes, sequences
    batches = track(val.batches(sequences), val.num_batches(sequences), progress or "", "batch",
                    enabled=progress is not None)
    with torch.no_grad():
        for x, y in batches:
            real = y[y != IGNORE_INDEX]  # padding rows (ValSource) are not counted
            logits = model(x.to(device))
            nats = F.cross_entropy(logits.float().flatten(0, 1), y.to(device).flatten(), reduction="sum",
                                   ignore_index=IGNORE_INDEX)
            sums += torch.tensor([float(nats), real.numel(), float(lengths[real].sum()),
                                  float((y[:, 0] != IGNORE_INDEX).sum())], dtype=torch.float64)
    if dist.is_initialized():
        dist.all_reduce(sums)
    nats, tokens, n_bytes, n_sequences = sums.tolist()
    loss = nats / tokens
    return {"sequences": int(n_sequences), "tokens": int(tokens), "bytes": int(n_bytes), "loss": loss,
            "perplexity": math.exp(loss), "bits_per_byte": nats / math.log(2) / max(n_bytes, 1)}


def score_tasks(args: argparse.Namespace, overrides: list[str]) -> dict | None:
    """The harness's results for ``--tasks`` (on rank 0; None on the others)."""
    if overrides:
        raise ConfigError(f"unknown argument {overrides[0]}; --data.key=value overrides do not apply to --tasks")
    names = [name.strip() for name in args.tasks.split(",") if name.strip()]
    if not names:
        raise ConfigError("--tasks needs at least one task name")
    if args.limit is not None and args.limit < 1 or args.num_fewshot is not None and args.num_fewshot < 0:
        raise ConfigError("--limit must be >= 1 and --num-fewshot >= 0")
    backend = import_lm_eval_backend("--tasks")
    tasks = backend.load_tasks(names, args.task_dir)  # before the model loads: a bad name costs nothing
    batch_size = 8 if args.batch_size is None else args.batch_size  # harness requests per batch
    lm = backend.PerfGPTLM(str(args.source), tokenizer=args.tokenizer, batch_size=batch_size,
                           device=args.device, dtype=args.dtype, max_gen_toks=args.max_gen_toks)
    return backend.run_tasks(lm, tasks, limit=args.limit, num_fewshot=args.num_fewshot)


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
        result = score_tasks(args, overrides) if args.tasks is not None else evaluate(args, overrides)
    except USER_FACING_ERRORS as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    finally:
        if distributed:
            dist.destroy_process_group()
    if args.tasks is not None:
        return print_scores(args, result)
    if result["ranks"] == 1 or int(os.environ.get("RANK", "0")) == 0:
        print(f"{result['source']}\nsplit {result['split']} on {result['ranks']} rank(s): {result['sequences']:,} "
              f"sequences, {result['tokens']:,} tokens "
              f"({result['bytes']:,} bytes) | loss {result['loss']:.4f} | perplexity {result['perplexity']:.3f} | "
              f"bits/byte {result['bits_per_byte']:.4f}")
        for name, f in result.get("sources", {}).items():
            print(f"  {name}: {f['sequences']:,} sequences | loss {f['loss']:.4f} | bits/byte {f['bits_per_byte']:.4f}")
        if args.json:
            return write_json(args.json, result)
    return 0


def write_json(path: Path, body: dict) -> int:
    try:
        path.write_text(json.dumps(body, indent=2, default=str) + "\n")
    except OSError as exc:
        print(f"error: cannot write --json {path}: {exc.strerror or exc}", file=sys.stderr)
        return 2
    return 0


def print_scores(args: argparse.Namespace, results: dict | None) -> int:
    if results is None:  # not rank 0: rank 0 prints
        return 0
    backend = import_lm_eval_backend("--tasks")  # imported already by score_tasks
    print(f"{args.source}\n{backend.results_table(results)}")
    if args.json:
        return write_json(args.json, {"source": str(args.source), "ranks": max(1, int(os.environ.get("WORLD_SIZE", "1"))),
                                      "scores": backend.scores(results), "n_samples": results.get("n-samples", {}),
                                      "n_shot": results.get("n-shot", {}), "versions": results.get("versions", {})})
    return 0


if __name__ == "__main__":
    sys.exit(main())
