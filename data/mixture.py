"""A weighted mixture of sources (``data.sources``) as one training stream, resumable exactly and in
any rank layout.

The global stream
    Sample ``i`` of the run (counting over all data-parallel ranks) comes from the source the plan
    drew for it (``data/schedule.py``: a pure function of the seed, the step ``i // G`` and the
    global batch ``G`` = micro-batch x grad-accum x data-parallel ranks), and is that source's
    next sample: the ``n``-th sample taken from a source is its sample ``n`` (``data/sources.py``,
    ``data/hf_source.py``). Global micro-batch ``k`` is samples ``[k·B·W, (k+1)·B·W)``; rank ``r``
    of ``W`` takes ``[k·B·W + r·B, k·B·W + (r+1)·B)``. So the stream is the same for every split
    of the same global batch (2 ranks of B or 1 rank of 2B see the same samples in each step), and
    one source reaching the end of an epoch changes nothing for the others.

State
    ``{"sample": i, "taken": [n per source], "readers": {name: position}}`` after the last batch
    handed to the caller: the next global sample, how many samples each source has given (over
    all ranks: what the log reports as samples and tokens per source, and the checkpoint keeps),
    and where each forward-only (streaming) source stands. Every rank computes every sample's
    source, so all ranks hold the same state, and a checkpoint written by ``W`` ranks resumes in
    any layout with the same global batch (``layout_free``; train.py does so under
    ``checkpoint.reshard=true``). DataLoader worker ``w`` of ``N`` makes local micro-batches
    ``w, w + N, ...`` and steps its copy of the state through the others; a streaming source is
    then read by every worker (tokenized N times), so ``data.num_workers=1`` is the setting that
    moves such a mixture off the training thread without repeating work.
"""

from __future__ import annotations

import copy

import numpy as np
import torch
from torch.utils.data import IterableDataset, get_worker_info

from common.errors import DataError
from data.bundle import DataBundle, TrainStream, ValSource
from data.config import DataConfig, SourceConfig
from data.default_corpus import ensure_default_corpus
from data.hf_source import HFSource
from data.remote import RemotePolicy
from data.schedule import MixturePlan
from data.sources import MmapSource, WebDatasetSource

START = {"epoch": 0, "doc": 0, "offset": 0}  # a streaming source's position before its first sample


class MixtureBatches(IterableDataset):
    """This rank's micro-batches of the mixture; see the module docstring."""

    layout_free = True

    def __init__(self, sources: list, plan: MixturePlan, *, seq_len: int, batch_size: int, rank: int,
                 world_size: int, vocab_size: int):
        self.sources, self.plan = sources, plan
        self.seq_len, self.batch_size, self.rank, self.world_size = seq_len, batch_size, rank, world_size
        self.vocab_size = vocab_size
        self.micro = batch_size * world_size  # samples of one global micro-batch
        if plan.samples_per_step % self.micro:
            raise DataError(f"a step of {plan.samples_per_step} samples is not whole micro-batches of {self.micro}")
        known = [s.samples_per_epoch for s in sources if s.samples_per_epoch]
        self.batches_per_epoch = max(1, min(known) // self.micro) if known else 0  # of the smallest known source
        self._start = self.initial_state()

    def identity(self) -> dict:
        """What the state's meaning depends on: not the ranks, only the global batch."""
        return {"kind": "mixture", "seed": self.plan.seed, "seq_len": self.seq_len,
                "samples_per_step": self.plan.samples_per_step, "sources": list(self.plan.names)}

    def initial_state(self) -> dict:
        return {"sample": 0, "taken": [0] * len(self.sources), "readers": {}}

    def set_start(self, state: dict) -> None:
        self._start = copy.deepcopy(state)

    def advance(self, state: dict, cursor: dict) -> dict:
        return cursor

    def _restore_readers(self, taken: np.ndarray, readers: dict) -> None:
        for s, source in enumerate(self.sources):
            if not source.sequential:
                continue
            if taken[s] and source.name not in readers:
                raise DataError(f"the saved data state has no reading position for streaming source {source.name}")
            source.restore(int(taken[s]), readers.get(source.name, START))

    def _rows(self, picks: np.ndarray, taken: np.ndarray) -> torch.Tensor:
        """This rank's rows of the global micro-batch whose sources are ``picks``."""
        index = np.empty(len(picks), dtype=np.int64)  # each sample's number within its source
        for s in range(len(self.sources)):
            at = np.flatnonzero(picks == s)
            index[at] = taken[s] + np.arange(len(at))
        B, r = self.batch_size, self.rank
        rows = np.empty((B, self.seq_len + 1), dtype=np.int64)
        for row, j in enumerate(range(r * B, (r + 1) * B)):
            rows[row] = self.sources[picks[j]].sample(int(index[j]))
        if rows.max() >= self.vocab_size or rows.min() < 0:
            bad = int(np.argmax((rows >= self.vocab_size).any(axis=1) | (rows < 0).any(axis=1)))
            source = self.sources[picks[r * B + bad]]
            raise DataError(f"source {source.name}: token id {int(rows[bad].max())} is outside "
                            f"model.vocab_size={self.vocab_size} (a dataset prepared with another tokenizer?)")
        return torch.from_numpy(rows)

    def __iter__(self):
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        sample = int(self._start["sample"])
        taken = np.asarray(self._start["taken"], dtype=np.int64)
        self._restore_readers(taken, self._start.get("readers", {}))
        streaming = [(s, src) for s, src in enumerate(self.sources) if src.sequential]
        k = 0
        while True:  # the trainer decides when to stop
            step, offset = divmod(sample, self.plan.samples_per_step)
            picks = self.plan.choices(step)[offset : offset + self.micro]
            rows = self._rows(picks, taken) if k % workers == worker else None
            taken = taken + np.bincount(picks, minlength=len(self.sources))
            sample += self.micro
            for s, source in streaming:  # past the samples the other ranks took: every rank stands alike
                source.skip_to(int(taken[s]))
            if rows is not None:
                yield rows, {"sample": sample, "taken": taken.tolist(),
                             "readers": {src.name: src.position() for _, src in streaming}}
            k += 1


def open_source(cfg: DataConfig, source: SourceConfig, index: int, *, seq_len: int, seed: int, vocab_size: int,
                eval_split: str, val_limit: int):
    """One source, opened and checked (reachable, not empty, its vocabulary inside the model's)."""
    policy = RemotePolicy(retries=cfg.retries, timeout=cfg.request_timeout)
    common = dict(seq_len=seq_len, seed=seed, vocab_size=vocab_size)
    if source.format in ("mmap", "default"):
        location = source.path
        if source.format == "default":
            location = str(ensure_default_corpus(cfg.cache_dir, cfg.default_corpus_max_mb, cfg.val_fraction))
        return MmapSource(source.label, index, location, verify=cfg.verify, on_bad_shard=cfg.on_bad_shard,
                          eval_split=eval_split, policy=policy, cache_dir=cfg.cache_dir, **common)
    if source.format == "webdataset":
        return WebDatasetSource(source.label, index, source.path, eval_split=eval_split, policy=policy, **common)
    return HFSource(source, index, shuffle_buffer=cfg.shuffle_buffer, val_limit=val_limit, **common)


def same_tokenizer(a: dict, b: dict) -> bool:
    """By the definition hash where both record one; else by name and size (older datasets)."""
    if a.get("sha256") and b.get("sha256"):
        return a["sha256"] == b["sha256"]
    return a["name"] == b["name"] and a["vocab_size"] == b["vocab_size"]


def checked_windows(windows, source: str, vocab_size: int):
    for window in windows:
        if window.size and int(window.max()) >= vocab_size:
            raise DataError(f"source {source}: validation token id {int(window.max())} is outside "
                            f"model.vocab_size={vocab_size}")
        yield window


def build_mixture_data(cfg: DataConfig, *, seq_len: int, micro_batch_size: int, seed: int, rank: int,
                       world_size: int, vocab_size: int, grad_accum_steps: int, eval_split: str,
                       val_limit: int) -> DataBundle:
    sources = [open_source(cfg, s, i, seq_len=seq_len, seed=seed, vocab_size=vocab_size, eval_split=eval_split,
                           val_limit=val_limit) for i, s in enumerate(cfg.sources)]
    first = sources[0]
    for other in sources[1:]:
        if not same_tokenizer(first.tokenizer, other.tokenizer):
            raise DataError(f"sources {first.name} and {other.name} use different tokenizers ({first.tokenizer['name']} "
                            f"vs {other.tokenizer['name']}); every source of a mixture needs the same one")
    plan = MixturePlan.from_config(cfg, seed=seed, samples_per_step=micro_batch_size * grad_accum_steps * world_size)
    train_set = MixtureBatches(sources, plan, seq_len=seq_len, batch_size=micro_batch_size, rank=rank,
                               world_size=world_size, vocab_size=vocab_size)
    val_sources = {
        s.name: ValSource(lambda s=s: checked_windows(s.val_windows(), s.name, vocab_size), available=s.val_available,
                          seq_len=seq_len, batch_size=micro_batch_size, rank=rank, world_size=world_size,
                          split=f"{s.name}/{s.val_split_name if s.sequential else eval_split}")
        for s in sources
    }
    weights = plan.weights_by_name(0)
    parts = [f"{s.name} {weights[s.name]:.3g}: {s.describe()}" for s in sources]
    tok = first.tokenizer
    description = (f"data: mixture of {len(sources)} source(s), {plan.samples_per_step} samples/step drawn by weight "
                   f"(seed {seed}) | " + " | ".join(parts)
                   + f" | tokenizer {tok['name']} (vocab {tok['vocab_size']}, eot {tok['eot_id']}) | "
                   f"workers={cfg.num_workers}")
    for entry in cfg.schedule:
        change = ", ".join(f"{k} {v:g}" for k, v in entry.weights.items())
        how = f" over {entry.blend_steps} steps" if entry.blend_steps else ""
        description += f" | from step {entry.from_step}: {change}{how}"
    skipped = [line for s in sources for line in getattr(s, "skipped", [])]
    return DataBundle(train=TrainStream(train_set, cfg, seed=seed, rank=rank), val=next(iter(val_sources.values())),
                      description=description, skipped_shards=skipped, tokenizer=tok["name"], eot_id=tok["eot_id"],
                      tokenizer_sha256=next((s.tokenizer.get("sha256") for s in sources if s.tokenizer.get("sha256")),
                                            None),
                      val_sources=val_sources, mixture=plan, seq_len=seq_len)
