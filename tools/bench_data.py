"""Data loader throughput per format x num_workers x batch size, against what models consume.

Builds one corpus (the Python standard library's source, --mb MB) three ways: raw text read and
tokenized on the fly (the naive baseline), mmap token shards, and WebDataset tar shards, then
times batches of --seq-len tokens from each. Consumption: training tokens/s of each --models
config on this machine, estimated from its FLOPs per token at the measured fp32 matmul rate (an
upper bound), or measured with real training steps (--measure); --gpu-tflops adds what one GPU
at --mfu would consume. A loader keeps up when its tokens/s exceed the consumption. The
measuring lives in analysis/data_bench.py; this is its command line.

    python -m tools.bench_data                                  # ~1 minute on 2 cores
    python -m tools.bench_data --workers 0,1,2 --batch-sizes 8,32 --measure \
        --markdown docs/results/data.md --plot docs/results/data.png
"""

from __future__ import annotations

if not __package__:  # started as a file, where the project's packages do not import: say how to run it
    from _run_as_module import exit_with_usage

    exit_with_usage(__file__)

import argparse
import sys
from pathlib import Path

from analysis import data_bench
from common.errors import USER_FACING_ERRORS
from common.measure import provenance
from common.report import text_table
from training.config import load_config


def int_list(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 0:
        raise argparse.ArgumentTypeError(f"expected non-negative integers, got {text!r}")
    return values


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mb", type=float, default=8.0, help="corpus size in MB of Python source (default 8)")
    p.add_argument("--seq-len", type=int, default=1024, help="tokens per sample (default 1024)")
    p.add_argument("--batch-sizes", type=int_list, default=[8, 32], help="comma-separated (default 8,32)")
    p.add_argument("--workers", type=int_list, default=[0, 2], help="DataLoader workers, comma-separated (default 0,2)")
    p.add_argument("--formats", default=",".join(data_bench.FORMATS), help=f"subset of {','.join(data_bench.FORMATS)}")
    p.add_argument("--batches", type=int, default=40, help="timed batches per configuration (default 40)")
    p.add_argument("--tokenizer", default="bpe",
                   help="bpe (default: a byte-level BPE of --bpe-vocab ids trained here on the corpus) | byte | "
                        "tiktoken:<enc> (cached) | hf:<tokenizer.json>; the naive baseline pays for tokenizing")
    p.add_argument("--bpe-vocab", type=int, default=8192, help="vocabulary of the trained BPE (default 8192)")
    p.add_argument("--models", default="configs/tiny.yaml,configs/gpt2-124m.yaml",
                   help="configs whose consumption is compared")
    p.add_argument("--measure", action="store_true", help="measure model consumption with real training steps (slower)")
    p.add_argument("--gpu-tflops", type=float, default=0.0, help="also compare with one GPU of this peak TFLOP/s ...")
    p.add_argument("--mfu", type=float, default=0.4, help="... at this model FLOPs utilization (default 0.4)")
    p.add_argument("--workdir", help="where the prepared datasets go (default: a temporary directory)")
    p.add_argument("--markdown", help="also write the tables as Markdown to this path "
                        "(and the rows as JSON next to it)")
    p.add_argument("--plot", help="also write a PNG bar chart to this path")
    args = p.parse_args(argv)
    args.formats = [f.strip() for f in args.formats.split(",") if f.strip()]
    unknown = sorted(set(args.formats) - set(data_bench.FORMATS))
    if unknown:
        p.error(f"--formats: unknown {unknown}; valid: {', '.join(data_bench.FORMATS)}")
    return args


def grid_options(args: argparse.Namespace) -> data_bench.GridOptions:
    return data_bench.GridOptions(mb=args.mb, seq_len=args.seq_len, batch_sizes=args.batch_sizes,
                                  workers=args.workers, formats=args.formats, batches=args.batches,
                                  tokenizer=args.tokenizer, bpe_vocab=args.bpe_vocab)


def consumer_models(models: str) -> list[data_bench.ConsumerModel]:
    """Each config's model, sequence length and micro-batch, read through the job config."""
    return [data_bench.consumer_from_config(path, load_config(path))
            for path in [m.strip() for m in models.split(",") if m.strip()]]


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        result = data_bench.run_benchmark(grid_options(args), consumer_models(args.models), args.measure,
                                          args.gpu_tflops, args.mfu, args.workdir, log=lambda line: print(line, flush=True))
    except USER_FACING_ERRORS as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    head, body, chead, cbody = data_bench.tables(result)
    print(f"\nloader throughput ({result.setting}); 'x <model>' = loader tokens/s over the model's consumption")
    print(text_table(head, body))
    print("\nmodel consumption")
    print(text_table(chead, cbody))
    if args.markdown:
        command = "python -m tools.bench_data " + " ".join(sys.argv[1:] if argv is None else argv)
        data_bench.write_markdown(result, provenance(data_bench.CPU), Path(args.markdown), command)
    if args.plot:
        data_bench.write_plot(result, Path(args.plot))
    return 0


if __name__ == "__main__":
    sys.exit(main())
