"""Data loader throughput per format x num_workers x batch size, against what models consume.

Builds one corpus (the Python standard library's source, --mb MB) three ways: raw text read and
tokenized on the fly (the naive baseline), mmap token shards, and WebDataset tar shards, then
times batches of --seq-len tokens from each. Consumption: training tokens/s of each --models
config on this machine, estimated from its FLOPs per token at the measured fp32 matmul rate (an
upper bound), or measured with real training steps (--measure); --gpu-tflops adds what one GPU
at --mfu would consume. A loader keeps up when its tokens/s exceed the consumption.

    python tools/bench_data.py                                  # ~1 minute on 2 cores
    python tools/bench_data.py --workers 0,1,2 --batch-sizes 8,32 --measure \
        --markdown docs/results/data.md --plot docs/results/data.png
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from data.bench import matmul_flops_per_s, measure_stream, measured_training_tokens_per_s, naive_stream  # noqa: E402
from data.config import DataConfig  # noqa: E402
from data.default_corpus import list_source_files, stdlib_root  # noqa: E402
from data.errors import DataError  # noqa: E402
from data.loader import build_data  # noqa: E402
from data.prepare import PrepareOptions, prepare  # noqa: E402
from data.shards import read_meta  # noqa: E402

FORMATS = ("naive", "mmap", "webdataset")


@dataclass
class Row:
    format: str
    workers: int
    batch: int
    samples_per_s: float
    tokens_per_s: float
    mb_per_s: float
    first_batch_s: float


@dataclass
class Consumer:
    name: str
    flops_per_token: float
    tokens_per_s: float
    how: str


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
    p.add_argument("--formats", default=",".join(FORMATS), help=f"subset of {','.join(FORMATS)}")
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
    p.add_argument("--markdown", help="also write the tables as Markdown to this path")
    p.add_argument("--plot", help="also write a PNG bar chart to this path")
    args = p.parse_args(argv)
    args.formats = [f.strip() for f in args.formats.split(",") if f.strip()]
    unknown = sorted(set(args.formats) - set(FORMATS))
    if unknown:
        p.error(f"--formats: unknown {unknown}; valid: {', '.join(FORMATS)}")
    return args


def prepare_corpora(args, workdir: Path) -> dict:
    """Raw files for the naive loader, and the same text prepared as mmap and WebDataset."""
    root = stdlib_root()
    files = [str(root / rel) for rel, _ in list_source_files(root, int(args.mb * 1e6))]
    args.tokenizer_label = args.tokenizer
    if args.tokenizer == "bpe":
        args.tokenizer = train_bpe(files, args.bpe_vocab, workdir / "tokenizer.json")
        args.tokenizer_label = f"byte-level BPE of {args.bpe_vocab} ids trained on the corpus"
    common = dict(inputs=files, tokenizer=args.tokenizer, workers=2, progress=False, val_fraction=0.1)
    prepare(PrepareOptions(out_dir=str(workdir / "mmap"), output="mmap", **common))
    per_shard = max(8, int(args.mb * 1e6 / (args.seq_len * 16)))  # ~16 shards: enough for 2 ranks x 4 workers
    prepare(PrepareOptions(out_dir=str(workdir / "webdataset"), output="webdataset", seq_len=args.seq_len,
                           samples_per_shard=per_shard, **common))
    return {"files": files, "raw_bytes": sum(Path(f).stat().st_size for f in files)}


def train_bpe(files: list[str], vocab: int, path: Path) -> str:
    """A byte-level BPE trained on the corpus itself: a realistic tokenizing cost, no download."""
    try:
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    except ImportError:
        raise DataError(
            "--tokenizer bpe needs the tokenizers package (pip install tokenizers), or pass --tokenizer byte"
        ) from None
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<|endoftext|>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train(files, trainer)
    path.parent.mkdir(parents=True, exist_ok=True)
    tok.save(str(path))
    return f"hf:{path}"


def storage_bytes_per_sample(fmt: str, workdir: Path, corpus: dict, seq_len: int) -> float:
    """Bytes read from disk per sample of seq_len tokens, from what each format stores."""
    if fmt == "naive":
        meta = read_meta(workdir / "mmap")
        tokens = meta.tokens("train") + meta.tokens("val")
        return corpus["raw_bytes"] / tokens * seq_len
    meta = read_meta(workdir / fmt)
    files = meta.files("train")
    size = sum(f.stat().st_size for f in files)
    if fmt == "webdataset":
        return size / sum(int(e["samples"]) for e in meta.splits["train"])
    return size / meta.tokens("train") * seq_len


def run_grid(args, workdir: Path, corpus: dict) -> list[Row]:
    rows = []
    for fmt in args.formats:
        per_sample = storage_bytes_per_sample(fmt, workdir, corpus, args.seq_len)
        for workers in args.workers:
            for batch in args.batch_sizes:
                cfg = DataConfig(format="mmap" if fmt == "naive" else fmt, path=str(workdir / fmt),
                                 num_workers=workers, persistent_workers=False, shuffle_buffer=100)
                if fmt == "naive":
                    stream = naive_stream(corpus["files"], args.tokenizer, args.seq_len, batch, cfg)
                else:
                    vocab = read_meta(workdir / fmt).vocab_size
                    stream = build_data(cfg, seq_len=args.seq_len, micro_batch_size=batch, seed=0, rank=0,
                                        world_size=1, vocab_size=vocab).train
                t = measure_stream(stream, args.batches)
                rows.append(Row(fmt, workers, batch, t.samples_per_s, t.tokens_per_s,
                                t.samples_per_s * per_sample / 1e6, t.first_batch_s))
                print(f"  {fmt:<10} workers={workers} batch={batch}: {t.tokens_per_s:,.0f} tokens/s", flush=True)
    return rows


def consumers(args) -> list[Consumer]:
    from model.flops import flops_per_token
    from training.config import load_config

    rate = matmul_flops_per_s()
    out = []
    for path in [m.strip() for m in args.models.split(",") if m.strip()]:
        cfg = load_config(path)
        seq = cfg.data.seq_len or cfg.model.max_seq_len
        fpt = flops_per_token(cfg.model, seq)
        name = Path(path).stem
        if args.measure:
            batch = min(cfg.train.micro_batch_size, 16 if cfg.model.d_model < 512 else 1)
            tps = measured_training_tokens_per_s(cfg.model, batch, seq)
            out.append(Consumer(f"{name} (this CPU)", fpt, tps, f"measured fwd+bwd+AdamW, batch {batch}x{seq}"))
        else:
            out.append(Consumer(f"{name} (this CPU)", fpt, rate / fpt,
                                f"estimate: {rate / 1e9:.0f} GFLOP/s fp32 matmul / FLOPs per token (upper bound)"))
        if args.gpu_tflops > 0:
            gpu = args.gpu_tflops * 1e12 * args.mfu
            out.append(Consumer(f"{name} (GPU {args.gpu_tflops:g} TF @ MFU {args.mfu:g})", fpt, gpu / fpt, "estimate"))
    return out


def tables(rows: list[Row], cons: list[Consumer]) -> tuple[list[str], list[list[str]], list[str], list[list[str]]]:
    naive = {(r.workers, r.batch): r.tokens_per_s for r in rows if r.format == "naive"}
    head = ["format", "workers", "batch", "samples/s", "tokens/s", "MB/s read", "first batch s", "vs naive"]
    head += [f"x {c.name.split(' ')[0]}{' GPU' if 'GPU' in c.name else ''}" for c in cons]
    body = []
    for r in rows:
        base = naive.get((r.workers, r.batch))
        line = [r.format, str(r.workers), str(r.batch), f"{r.samples_per_s:,.0f}", f"{r.tokens_per_s:,.0f}",
                f"{r.mb_per_s:,.1f}", f"{r.first_batch_s:.2f}", f"{r.tokens_per_s / base:.1f}x" if base else "-"]
        line += [f"{r.tokens_per_s / c.tokens_per_s:,.1f}" for c in cons]
        body.append(line)
    chead = ["model", "FLOPs/token", "consumes tokens/s", "how"]
    cbody = [[c.name, f"{c.flops_per_token:.3g}", f"{c.tokens_per_s:,.0f}", c.how] for c in cons]
    return head, body, chead, cbody


def format_table(head, body) -> str:
    widths = [max(len(h), *(len(b[i]) for b in body)) if body else len(h) for i, h in enumerate(head)]
    lines = ["  ".join(h.rjust(w) for h, w in zip(head, widths))]
    lines += ["  ".join(c.rjust(w) for c, w in zip(b, widths)) for b in body]
    return "\n".join(lines)


def markdown_table(head, body) -> str:
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(b) + " |" for b in body]
    return "\n".join(lines)


def write_plot(rows: list[Row], cons: list[Consumer], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(max(6, len(rows) * 0.55), 4.5))
    colors = {"naive": "tab:gray", "mmap": "tab:blue", "webdataset": "tab:orange"}
    ax.bar(range(len(rows)), [r.tokens_per_s for r in rows], color=[colors[r.format] for r in rows])
    short = {"naive": "naive", "mmap": "mmap", "webdataset": "wds"}
    ax.set_xticks(range(len(rows)), [f"{short[r.format]}\nw{r.workers} b{r.batch}" for r in rows], fontsize=7)
    for c, style in zip(cons, ["--", ":", "-.", "-"] * 4):
        ax.axhline(c.tokens_per_s, linestyle=style, color="black", linewidth=1)
        ax.text(len(rows) - 0.5, c.tokens_per_s, c.name, ha="right", va="bottom", fontsize=7)
    ax.set_yscale("log")
    ax.set_ylabel("tokens/s (log)")
    ax.set_title("loader throughput vs model consumption")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> int:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="bench_data_") as tmp:
        workdir = Path(args.workdir) if args.workdir else Path(tmp)
        start = time.perf_counter()
        try:
            corpus = prepare_corpora(args, workdir)
        except DataError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        print(f"prepared {corpus['raw_bytes'] / 1e6:.1f} MB of text ({args.tokenizer_label}) as mmap and WebDataset in "
              f"{time.perf_counter() - start:.1f} s ({workdir})", flush=True)
        rows = run_grid(args, workdir, corpus)
    cons = consumers(args)
    head, body, chead, cbody = tables(rows, cons)
    setting = f"seq_len {args.seq_len}, tokenizer {args.tokenizer_label}, {args.batches} timed batches per row"
    print(f"\nloader throughput ({setting}); 'x <model>' = loader tokens/s over the model's consumption")
    print(format_table(head, body))
    print("\nmodel consumption")
    print(format_table(chead, cbody))
    if args.markdown:
        text = (f"### Loader throughput ({setting})\n\n{markdown_table(head, body)}\n\n"
                f"### Model consumption\n\n{markdown_table(chead, cbody)}\n")
        Path(args.markdown).parent.mkdir(parents=True, exist_ok=True)
        Path(args.markdown).write_text(text)
    if args.plot:
        Path(args.plot).parent.mkdir(parents=True, exist_ok=True)
        write_plot(rows, cons, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
