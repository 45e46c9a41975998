"""Data loader throughput per format x workers x batch size, against what models consume.

The library behind ``tools/bench_data.py`` and the measured column of the chapter's data-format
table. The naive baseline is the loader people write first: DataLoader workers read raw text
files and tokenize them on the fly, packing the ids into windows. The other formats read tokens
that were prepared once (``data/prepare.py``). All are timed the same way: batches pulled from a
``TrainStream`` after a warm-up batch (worker start-up is reported separately). Consumption is
each model's training tokens/s on this machine, from its FLOPs per token at the measured fp32
matmul rate (an upper bound) or from real training steps.
"""

from __future__ import annotations

import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np
import torch
from torch.utils.data import IterableDataset, get_worker_info

from common.errors import DataError
from common.measure import repeat, summarize, time_call
from common.report import markdown_table, new_figure, save_figure, write_results
from data.config import DataConfig
from data.default_corpus import list_source_files, stdlib_root
from data.loader import TrainStream, build_data
from data.prepare import PrepareOptions, prepare
from data.shards import read_dataset_meta
from data.tokenizer import build_tokenizer
from model.config import ModelConfig
from model.flops import flops_per_token
from model.gpt import GPT

CPU = torch.device("cpu")


class NaiveTextBatches(IterableDataset):
    """Read text files and tokenize them while training (worker w takes every N-th file)."""

    def __init__(self, files: list[str], tokenizer: str, seq_len: int, batch_size: int):
        self.files, self.tokenizer, self.seq_len, self.batch_size = list(files), tokenizer, seq_len, batch_size
        self.batches_per_epoch = 0  # unknown without tokenizing everything
        self.position = 0

    # The resumable-stream protocol TrainStream expects; the baseline does not resume.
    def identity(self) -> dict:
        return {"kind": "naive"}

    def initial_state(self) -> dict:
        return {}

    def set_start(self, state: dict) -> None:
        pass

    def advance(self, state: dict, cursor) -> dict:
        return state

    def __iter__(self):
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        tok = build_tokenizer(self.tokenizer)
        mine = self.files[worker::workers]
        T, rows, carry = self.seq_len, [], np.zeros(0, dtype=np.int64)
        while True:
            for path in mine:
                text = Path(path).read_text(encoding="utf-8", errors="replace")
                ids = np.concatenate([carry, tok.encode(text).astype(np.int64), [tok.eot_id]])
                count = (ids.size - 1) // T
                for k in range(count):
                    rows.append(ids[k * T : k * T + T + 1])
                    if len(rows) == self.batch_size:
                        yield torch.from_numpy(np.stack(rows)), None
                        rows = []
                carry = ids[count * T :]


def naive_stream(files: list[str], tokenizer: str, seq_len: int, batch_size: int, cfg: DataConfig) -> TrainStream:
    return TrainStream(NaiveTextBatches(files, tokenizer, seq_len, batch_size), cfg, seed=0, rank=0)


@dataclass
class Throughput:
    samples_per_s: float
    tokens_per_s: float
    first_batch_s: float  # includes starting the workers


def measure_stream(stream, batches: int) -> Throughput:
    """Time ``batches`` batches after the first one; the stream is closed afterwards."""
    counted = {"samples": 0, "tokens": 0}

    def pull_all() -> None:
        for _ in range(batches):
            x, _ = next(stream)
            counted["samples"] += x.shape[0]
            counted["tokens"] += x.numel()

    first = time_call(lambda: next(stream), CPU)
    seconds = time_call(pull_all, CPU)
    samples, tokens = counted["samples"], counted["tokens"]
    close = getattr(stream, "close", None)
    if close is not None:
        close()
    return Throughput(samples / seconds, tokens / seconds, first)


def matmul_flops_per_s(size: int = 1024, repeats: int = 5) -> float:
    """Achieved fp32 matmul FLOP/s on this CPU: an upper bound on what training can use."""
    a, b = torch.randn(size, size), torch.randn(size, size)
    times = repeat(lambda: a @ b, CPU, repeats, warmup=1)
    return 2 * size**3 / summarize(times).median


def measured_training_tokens_per_s(model_cfg, batch_size: int, seq_len: int, budget_s: float = 10.0) -> float:
    """Tokens/s of real forward + backward + AdamW steps of the GPT on this CPU (median step).

    Warm-up steps (allocations, AdamW state) are not timed; then at least 3 steps, more while
    they fit in ``budget_s`` (at most 20), so a small model gets a stable median.
    """
    torch.manual_seed(0)
    model = GPT(model_cfg)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randint(0, model_cfg.vocab_size, (batch_size, seq_len))

    def train_step() -> None:
        model(x, x).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    if time_call(train_step, CPU) < 1.0:
        train_step()
    times = repeat(train_step, CPU, 3)
    while len(times) < 20 and sum(times) < budget_s:
        times.append(time_call(train_step, CPU))
    return batch_size * seq_len / summarize(times).median


# --------------------------------------------------------------------------- the grid (tools/bench_data.py)

FORMATS = ("naive", "mmap", "webdataset")


@dataclass
class GridOptions:
    """What the loader grid measures; tools/bench_data.py's flags, with the same defaults."""

    mb: float = 8.0  # corpus size, MB of Python source
    seq_len: int = 1024
    batch_sizes: list[int] = field(default_factory=lambda: [8, 32])
    workers: list[int] = field(default_factory=lambda: [0, 2])
    formats: list[str] = field(default_factory=lambda: list(FORMATS))
    batches: int = 40  # timed batches per configuration
    tokenizer: str = "bpe"  # bpe (trained here on the corpus) | byte | tiktoken:<enc> | hf:<tokenizer.json>
    bpe_vocab: int = 8192

    def as_flags(self) -> list[str]:
        """The tools/bench_data.py flags that measure this grid (for the command a report quotes)."""
        flags = ["--mb", f"{self.mb:g}", "--seq-len", str(self.seq_len),
                 "--batch-sizes", ",".join(map(str, self.batch_sizes)), "--workers", ",".join(map(str, self.workers)),
                 "--formats", ",".join(self.formats), "--batches", str(self.batches), "--tokenizer", self.tokenizer]
        return flags + (["--bpe-vocab", str(self.bpe_vocab)] if self.tokenizer == "bpe" else [])


@dataclass
class Corpus:
    files: list[str]  # raw text, for the naive loader
    raw_bytes: int
    tokenizer: str  # the spec the prepared shards were made with
    tokenizer_label: str  # how the report names it


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
class ConsumerModel:
    """A model whose training speed the loaders are compared with (from a job config)."""

    name: str
    model: ModelConfig
    seq_len: int
    micro_batch: int


def consumer_from_config(path: str | Path, cfg) -> ConsumerModel:
    """The model, sequence length and micro-batch of a job config (a ``training.config.JobConfig``)."""
    return ConsumerModel(Path(path).stem, cfg.model, cfg.seq_len, cfg.train.micro_batch_size)


@dataclass
class Consumer:
    name: str
    flops_per_token: float
    tokens_per_s: float
    how: str


@dataclass
class DataBenchResult:
    rows: list[Row]
    consumers: list[Consumer]
    setting: str  # seq_len, tokenizer and batches, for the table's heading


def prepare_corpora(opts: GridOptions, workdir: Path) -> Corpus:
    """Raw files for the naive loader, and the same text prepared as mmap and WebDataset."""
    root = stdlib_root()
    files = [str(root / rel) for rel, _ in list_source_files(root, int(opts.mb * 1e6))]
    tokenizer, label = opts.tokenizer, opts.tokenizer
    if opts.tokenizer == "bpe":
        tokenizer = train_bpe(files, opts.bpe_vocab, workdir / "tokenizer.json")
        label = f"byte-level BPE of {opts.bpe_vocab} ids trained on the corpus"
    shared = dict(inputs=files, tokenizer=tokenizer, workers=2, progress=False, val_fraction=0.1)
    prepare(PrepareOptions(out_dir=str(workdir / "mmap"), output="mmap", **shared))
    per_shard = max(8, int(opts.mb * 1e6 / (opts.seq_len * 16)))  # ~16 shards: enough for 2 ranks x 4 workers
    prepare(PrepareOptions(out_dir=str(workdir / "webdataset"), output="webdataset", seq_len=opts.seq_len,
                           samples_per_shard=per_shard, **shared))
    return Corpus(files, sum(Path(f).stat().st_size for f in files), tokenizer, label)


def train_bpe(files: list[str], vocab: int, path: Path) -> str:
    """A byte-level BPE trained on the corpus itself: a realistic tokenizing cost, no download."""
    try:
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers  # optional dependency
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


def storage_bytes_per_sample(fmt: str, workdir: Path, corpus: Corpus, seq_len: int) -> float:
    """Bytes read from disk per sample of seq_len tokens, from what each format stores."""
    if fmt == "naive":
        meta = read_dataset_meta(workdir / "mmap")
        tokens = meta.tokens("train") + meta.tokens("val")
        return corpus.raw_bytes / tokens * seq_len
    meta = read_dataset_meta(workdir / fmt)
    files = meta.files("train")
    size = sum(f.stat().st_size for f in files)
    if fmt == "webdataset":
        return size / sum(int(e["samples"]) for e in meta.splits["train"])
    return size / meta.tokens("train") * seq_len


def run_grid(opts: GridOptions, workdir: Path, corpus: Corpus, log: Callable[[str], None] = print) -> list[Row]:
    rows = []
    for fmt in opts.formats:
        per_sample = storage_bytes_per_sample(fmt, workdir, corpus, opts.seq_len)
        for workers in opts.workers:
            for batch in opts.batch_sizes:
                cfg = DataConfig(format="mmap" if fmt == "naive" else fmt, path=str(workdir / fmt),
                                 num_workers=workers, persistent_workers=False, shuffle_buffer=100)
                if fmt == "naive":
                    stream = naive_stream(corpus.files, corpus.tokenizer, opts.seq_len, batch, cfg)
                else:
                    vocab = read_dataset_meta(workdir / fmt).vocab_size
                    stream = build_data(cfg, seq_len=opts.seq_len, micro_batch_size=batch, seed=0, rank=0,
                                        world_size=1, vocab_size=vocab).train
                t = measure_stream(stream, opts.batches)
                rows.append(Row(fmt, workers, batch, t.samples_per_s, t.tokens_per_s,
                                t.samples_per_s * per_sample / 1e6, t.first_batch_s))
                log(f"  {fmt:<10} workers={workers} batch={batch}: {t.tokens_per_s:,.0f} tokens/s")
    return rows


def consumers(models: list[ConsumerModel], measure: bool, gpu_tflops: float = 0.0, mfu: float = 0.4) -> list[Consumer]:
    """Tokens/s each model consumes here: FLOP-based upper bound, or real steps with ``measure``;
    with ``gpu_tflops`` also one GPU of that peak at ``mfu``."""
    rate = matmul_flops_per_s()
    out = []
    for m in models:
        fpt = flops_per_token(m.model, m.seq_len)
        if measure:
            batch = min(m.micro_batch, 16 if m.model.d_model < 512 else 1)
            tps = measured_training_tokens_per_s(m.model, batch, m.seq_len)
            out.append(Consumer(f"{m.name} (this CPU)", fpt, tps, f"measured fwd+bwd+AdamW, batch {batch}x{m.seq_len}"))
        else:
            out.append(Consumer(f"{m.name} (this CPU)", fpt, rate / fpt,
                                f"estimate: {rate / 1e9:.0f} GFLOP/s fp32 matmul / FLOPs per token (upper bound)"))
        if gpu_tflops > 0:
            gpu = gpu_tflops * 1e12 * mfu
            out.append(Consumer(f"{m.name} (GPU {gpu_tflops:g} TF @ MFU {mfu:g})", fpt, gpu / fpt, "estimate"))
    return out


def run_benchmark(opts: GridOptions, models: list[ConsumerModel], measure: bool = False, gpu_tflops: float = 0.0,
                  mfu: float = 0.4, workdir: Path | None = None, log: Callable[[str], None] = print) -> DataBenchResult:
    """Prepare the corpus three ways (in ``workdir``, else a temporary directory), time the grid,
    then what each model consumes."""
    with tempfile.TemporaryDirectory(prefix="bench_data_") as tmp:
        work = Path(workdir) if workdir else Path(tmp)
        start = time.perf_counter()
        corpus = prepare_corpora(opts, work)
        log(f"prepared {corpus.raw_bytes / 1e6:.1f} MB of text ({corpus.tokenizer_label}) as mmap and WebDataset "
            f"in {time.perf_counter() - start:.1f} s ({work})")
        rows = run_grid(opts, work, corpus, log)
    setting = f"seq_len {opts.seq_len}, tokenizer {corpus.tokenizer_label}, {opts.batches} timed batches per row"
    return DataBenchResult(rows, consumers(models, measure, gpu_tflops, mfu), setting)


# --------------------------------------------------------------------------- reports


def tables(result: DataBenchResult) -> tuple[list[str], list[list[str]], list[str], list[list[str]]]:
    """(loader header, loader rows, consumption header, consumption rows) as formatted cells."""
    rows, cons = result.rows, result.consumers
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


TITLE = "Data loader throughput vs model consumption"


def title(where: dict) -> str:
    return f"{TITLE} ({where['hardware']}, torch {where['torch']}, {where['date']})"


def markdown(result: DataBenchResult, where: dict, command: str | None = None) -> str:
    head, body, chead, cbody = tables(result)
    lines = [f"# {title(where)}", ""]
    if command:
        lines += [f"Command: `{command}`", ""]
    lines += [f"### Loader throughput ({result.setting})", "", markdown_table(head, body, left=1), "",
              "### Model consumption", "", markdown_table(chead, cbody, left=1)]
    return "\n".join(lines) + "\n"


def write_markdown(result: DataBenchResult, where: dict, path: Path, command: str | None = None) -> list[Path]:
    """The Markdown tables, and their rows as JSON next to them (same stem)."""
    return write_results(path, markdown(result, where, command), title(where), result.rows,
                         provenance=where, setting=result.setting, consumers=result.consumers, command=command)


def write_plot(result: DataBenchResult, path: Path) -> None:
    rows, cons = result.rows, result.consumers
    fig, ax = new_figure(width=max(6, len(rows) * 0.55), height=4.5)
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
    save_figure(fig, Path(path))
