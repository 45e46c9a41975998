"""A three-source mixture's loader against what models consume: the library behind tools/bench_mixture.py.

The mixture is the one a pre-training run reads from several places at once: a local mmap
dataset, a local WebDataset and a WebDataset served over HTTP by a separate ``http.server``
process on this machine (a real socket, every shard fetched whole per epoch), drawn by weight
(``data/mixture.py``). Each source holds a third of a corpus of Python standard-library source
(byte tokens, prepared once with ``data/prepare.py``).

Measured, each over ``rounds`` rounds taken in turn (A B A B, so drift on a shared machine hits
every setting alike) and reported as median, min and max:

- loader tokens/s at each model's sequence length and micro-batch, for each number of DataLoader
  workers, from a fresh stream per round (its first batch, which fetches and opens shards, is
  timed apart);
- the data wait of real training steps of the first model (forward, backward, AdamW on this CPU):
  the share of the loop's wall time spent waiting in ``next()`` for a batch, which is what
  train.py logs as ``data wait``;
- the realised share of each source after ``steps`` steps against its weight, in standard errors
  of a multinomial draw (``sqrt(n p (1 - p))``).

Consumption is each model's training tokens/s on this machine, measured with real steps
(``analysis/data_bench.py``).
"""

from __future__ import annotations

import contextlib
import math
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from analysis.data_bench import ConsumerModel, measure_stream, measured_training_tokens_per_s
from common.errors import DataError
from common.measure import machine_load, summarize
from common.report import markdown_table, new_figure, save_figure, write_results
from data.config import DataConfig, SourceConfig
from data.default_corpus import list_source_files, stdlib_root
from data.loader import build_data
from data.prepare import PrepareOptions, prepare
from model.gpt import GPT

SOURCES = ("local-mmap", "local-wds", "http-wds")


@dataclass
class MixtureOptions:
    """tools/bench_mixture.py's flags, with the same defaults."""

    mb: float = 6.0  # corpus size (MB of Python source), a third per source
    weights: tuple[float, ...] = (0.5, 0.3, 0.2)  # of SOURCES
    workers: list[int] = field(default_factory=lambda: [0, 1])
    rounds: int = 3
    batches: int = 30  # timed batches per round
    wait_steps: int = 20  # training steps per round for the data wait
    steps: int = 2000  # steps of the first model's global batch for the realised proportions

    def as_flags(self) -> list[str]:
        return ["--mb", f"{self.mb:g}", "--weights", ",".join(f"{w:g}" for w in self.weights),
                "--workers", ",".join(map(str, self.workers)), "--rounds", str(self.rounds),
                "--batches", str(self.batches), "--wait-steps", str(self.wait_steps), "--steps", str(self.steps)]


@dataclass
class LoaderRow:
    model: str
    seq_len: int
    batch: int
    workers: int
    tokens_per_s: list[float]  # one per round
    first_batch_s: list[float]
    consumes_tokens_per_s: float


@dataclass
class WaitRow:
    model: str
    workers: int
    steps: int
    wait_fraction: list[float]  # one per round
    tokens_per_s: list[float]


@dataclass
class ShareRow:
    source: str
    weight: float
    samples: int
    share: float
    standard_errors: float  # (realised - expected samples) / sqrt(n p (1 - p))


@dataclass
class MixtureBenchResult:
    loader: list[LoaderRow]
    waits: list[WaitRow]
    shares: list[ShareRow]
    setting: str


# --------------------------------------------------------------------------- the sources


def prepare_sources(mb: float, seq_lens: list[int], workdir: Path) -> dict[str, Path]:
    """A third of the corpus each: mmap, and WebDataset cut for each sequence length (twice: one
    served over HTTP). Returns name -> directory (the HTTP one relative to ``workdir / "site"``)."""
    root = stdlib_root()
    files = [str(root / rel) for rel, _ in list_source_files(root, int(mb * 1e6))]
    parts = [files[i::3] for i in range(3)]
    shared = dict(tokenizer="byte", workers=1, progress=False, val_fraction=0.05, text_split="paragraph")
    out = {"local-mmap": workdir / "mmap"}
    prepare(PrepareOptions(inputs=parts[0], out_dir=str(out["local-mmap"]), output="mmap", **shared))
    for seq_len in seq_lens:
        per_shard = max(16, int(mb * 1e6 / 3 / (seq_len + 1) / 12))  # about 12 shards per source
        for name, part, where in (("local-wds", parts[1], workdir / f"wds-{seq_len}"),
                                  ("http-wds", parts[2], workdir / "site" / f"wds-{seq_len}")):
            prepare(PrepareOptions(inputs=part, out_dir=str(where), output="webdataset", seq_len=seq_len,
                                   samples_per_shard=per_shard, **shared))
    return out


@contextlib.contextmanager
def http_server(root: Path, timeout_s: float = 30.0):
    """``python -m http.server`` serving ``root`` on a free local port, in its own process; yields its URL."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1",
                             "--directory", str(root)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                urllib.request.urlopen(url, timeout=1).close()
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise DataError(f"the benchmark's HTTP server on port {port} did not start") from None
                time.sleep(0.1)
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def mixture_config(dirs: dict[str, Path], url: str, seq_len: int, weights: tuple[float, ...], workers: int,
                   cache_dir: Path) -> DataConfig:
    paths = {"local-mmap": str(dirs["local-mmap"]), "local-wds": str(dirs["local-mmap"].parent / f"wds-{seq_len}"),
             "http-wds": f"{url}/wds-{seq_len}"}
    sources = [SourceConfig(name=name, path=paths[name], format="mmap" if name == "local-mmap" else "webdataset",
                            weight=w) for name, w in zip(SOURCES, weights)]
    return DataConfig(sources=sources, num_workers=workers, persistent_workers=False, cache_dir=str(cache_dir))


def open_stream(cfg: DataConfig, seq_len: int, batch: int, seed: int = 0):
    return build_data(cfg, seq_len=seq_len, micro_batch_size=batch, seed=seed, rank=0, world_size=1,
                      vocab_size=256).train


# --------------------------------------------------------------------------- measurements


def training_wait(model: ConsumerModel, stream, steps: int) -> tuple[float, float]:
    """(share of wall time waiting for batches, tokens/s) over ``steps`` real training steps
    (after two untimed ones)."""
    torch.manual_seed(0)
    gpt = GPT(model.model)
    optimizer = torch.optim.AdamW(gpt.parameters(), lr=1e-4)
    waited, start = 0.0, None
    for i in range(steps + 2):
        if i == 2:
            waited, start = 0.0, time.perf_counter()
        t0 = time.perf_counter()
        x, y = next(stream)
        waited += time.perf_counter() - t0
        gpt(x, y).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    elapsed = time.perf_counter() - start
    stream.close()
    return waited / elapsed, steps * model.micro_batch * model.seq_len / elapsed


def realised_shares(cfg: DataConfig, seq_len: int, batch: int, steps: int, weights: tuple[float, ...]) -> list[ShareRow]:
    stream = open_stream(cfg, seq_len, batch, seed=1)
    for _ in range(steps):
        next(stream)
    taken = stream.state_dict()["taken"]
    stream.close()
    n, total = sum(taken), sum(weights)
    rows = []
    for name, count, w in zip(SOURCES, taken, weights):
        p = w / total
        rows.append(ShareRow(name, p, count, count / n, (count - n * p) / math.sqrt(n * p * (1 - p))))
    return rows


def run_benchmark(opts: MixtureOptions, models: list[ConsumerModel], workdir: Path | None = None,
                  log: Callable[[str], None] = print) -> MixtureBenchResult:
    seq_lens = sorted({m.seq_len for m in models})
    consumption = {}
    for m in models:
        batch = min(m.micro_batch, 16 if m.model.d_model < 512 else 1)
        consumption[m.name] = measured_training_tokens_per_s(m.model, batch, m.seq_len)
        log(f"{m.name}: consumes {consumption[m.name]:,.0f} tokens/s (fwd+bwd+AdamW, batch {batch}x{m.seq_len})")
    with tempfile.TemporaryDirectory(prefix="bench_mixture_") as tmp:
        work = Path(workdir) if workdir else Path(tmp)
        start = time.perf_counter()
        dirs = prepare_sources(opts.mb, seq_lens, work)
        log(f"prepared 3 sources from {opts.mb:g} MB of Python source in {time.perf_counter() - start:.1f} s ({work})")
        with http_server(work / "site") as url:
            def config(seq_len: int, workers: int) -> DataConfig:
                return mixture_config(dirs, url, seq_len, opts.weights, workers, work / "cache")

            loader = {(m.name, w): LoaderRow(m.name, m.seq_len, m.micro_batch, w, [], [], consumption[m.name])
                      for m in models for w in opts.workers}
            first = models[0]
            waits = {w: WaitRow(first.name, w, opts.wait_steps, [], []) for w in opts.workers}
            for r in range(opts.rounds):
                for m in models:
                    for w in opts.workers:
                        t = measure_stream(open_stream(config(m.seq_len, w), m.seq_len, m.micro_batch),
                                           opts.batches)
                        row = loader[(m.name, w)]
                        row.tokens_per_s.append(t.tokens_per_s)
                        row.first_batch_s.append(t.first_batch_s)
                        log(f"  round {r + 1}: {m.name} workers={w}: {t.tokens_per_s:,.0f} tokens/s")
                for w in opts.workers:
                    frac, tps = training_wait(first, open_stream(config(first.seq_len, w), first.seq_len,
                                                                 first.micro_batch), opts.wait_steps)
                    waits[w].wait_fraction.append(frac)
                    waits[w].tokens_per_s.append(tps)
                    log(f"  round {r + 1}: {first.name} training, workers={w}: data wait {frac:.2%}")
            shares = realised_shares(config(first.seq_len, 0), first.seq_len, first.micro_batch, opts.steps,
                                     opts.weights)
    setting = (f"sources {', '.join(f'{n} {w:g}' for n, w in zip(SOURCES, opts.weights))}; byte tokens; "
               f"{opts.rounds} rounds, {opts.batches} timed batches per round; {machine_load()} at the end")
    return MixtureBenchResult(list(loader.values()), list(waits.values()), shares, setting)


# --------------------------------------------------------------------------- reports


def _spread(values: list[float], fmt: str) -> str:
    s = summarize(values)
    return f"{format(s.median, fmt)} ({format(s.min, fmt)}-{format(s.max, fmt)})"


def tables(result: MixtureBenchResult) -> list[tuple[str, list[str], list[list[str]]]]:
    """(heading, header, rows) of each table, as formatted cells."""
    loader = [[r.model, str(r.seq_len), str(r.batch), str(r.workers), _spread(r.tokens_per_s, ",.0f"),
               _spread(r.first_batch_s, ".2f"), f"{r.consumes_tokens_per_s:,.0f}",
               f"{summarize(r.tokens_per_s).median / r.consumes_tokens_per_s:,.1f}x"] for r in result.loader]
    waits = [[r.model, str(r.workers), str(r.steps), _spread([100 * f for f in r.wait_fraction], ".2f"),
              _spread(r.tokens_per_s, ",.0f")] for r in result.waits]
    shares = [[r.source, f"{r.weight:.3f}", f"{r.samples:,}", f"{r.share:.4f}", f"{r.standard_errors:+.2f}"]
              for r in result.shares]
    n = sum(r.samples for r in result.shares)
    return [
        (f"Loader throughput vs consumption ({result.setting}); median (min-max)",
         ["model", "seq_len", "batch", "workers", "loader tokens/s", "first batch s", "model consumes tokens/s",
          "loader / consumption"], loader),
        ("Data wait of real training steps (share of step time spent in next(); train.py's `data wait`)",
         ["model", "workers", "steps/round", "data wait %", "training tokens/s"], waits),
        (f"Realised mixture after {n:,} samples vs the weights",
         ["source", "weight", "samples", "realised share", "(realised - expected) / SE"], shares),
    ]


TITLE = "Three-source mixture loader vs model consumption"
NOTES = [
    "first batch s: building the stream and its first batch, which fetches and decodes one shard of each "
    "WebDataset source (over HTTP for http-wds). A stream fetches the next shard of a source when it reaches it, "
    "so a long run pays about that much once per shard of each source; the timed rounds and training steps "
    "after the first batch may include none, and the data wait of a long run is higher by about first batch s "
    "divided by the training time a shard lasts.",
    "Every rate was taken on a shared machine (the load average is in the first heading): absolute rates are "
    "low and wide, the loader-to-consumption ratios and the shares are the point.",
]


def markdown(result: MixtureBenchResult, where: dict, command: str | None = None) -> str:
    lines = [f"# {TITLE} ({where['hardware']}, torch {where['torch']}, {where['date']})", ""]
    if command:
        lines += [f"Command: `{command}`", ""]
    for heading, head, rows in tables(result):
        lines += [f"### {heading}", "", markdown_table(head, rows, left=1), ""]
    lines += ["### Notes", ""] + [f"- {note}" for note in NOTES] + [""]
    return "\n".join(lines)


def write_markdown(result: MixtureBenchResult, where: dict, path: Path, command: str | None = None) -> list[Path]:
    return write_results(path, markdown(result, where, command), TITLE, result.loader, provenance=where,
                         setting=result.setting, waits=result.waits, shares=result.shares, command=command)


def write_plot(result: MixtureBenchResult, path: Path) -> None:
    rows = result.loader
    fig, ax = new_figure(width=max(6, len(rows) * 1.1), height=4.5)
    medians = [summarize(r.tokens_per_s) for r in rows]
    ax.bar(range(len(rows)), [s.median for s in medians],
           yerr=[[s.median - s.min for s in medians], [s.max - s.median for s in medians]], color="tab:blue")
    for i, r in enumerate(rows):
        ax.hlines(r.consumes_tokens_per_s, i - 0.4, i + 0.4, color="black", linestyle="--")
    ax.set_xticks(range(len(rows)), [f"{r.model}\nT{r.seq_len} b{r.batch} w{r.workers}" for r in rows], fontsize=7)
    ax.set_yscale("log")
    ax.set_ylabel("tokens/s (log); dashes: the model's consumption")
    ax.set_title("3-source mixture loader (local mmap + local wds + HTTP wds)")
    save_figure(fig, Path(path))
