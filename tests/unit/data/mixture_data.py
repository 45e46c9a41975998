"""Small prepared datasets whose tokens say where they came from, for the mixture tests.

Token ids count up from a per-dataset ``first_id``, so the first token of a window names its
dataset and its place: mmap window ``w`` starts with ``first_id + w * T``, WebDataset sample ``k``
with ``first_id + k * T``. Validation windows start at ``first_id + VAL_OFFSET``.
"""

from __future__ import annotations

import numpy as np

from data.shards import TokenShardWriter, write_meta
from data.wds_format import TokenSampleWriter

VOCAB, EOT = 65536, 65535
T = 8
VAL_OFFSET = 20_000


def mmap_dir(root, first_id: int, windows: int, val_windows: int = 6, shards: int = 1):
    """``windows`` training windows (over ``shards`` shards) and ``val_windows`` validation ones."""
    root.mkdir(parents=True)
    splits = {"train": [], "val": []}
    per = -(-windows // shards)
    plan = [("train", first_id + i * per * T, min(per, windows - i * per), i) for i in range(shards)]
    plan.append(("val", first_id + VAL_OFFSET, val_windows, 0))
    for split, start, count, i in plan:
        name = f"{split}-{i:06d}.bin"
        writer = TokenShardWriter(root / name, VOCAB, EOT)
        writer.add_document(np.arange(start, start + count * T))  # + EOT: count * T + 1 tokens
        writer.close()
        splits[split].append({"file": name, "tokens": count * T + 1})
    write_meta(root, format="mmap", tokenizer="test", vocab_size=VOCAB, eot_id=EOT, splits=splits)
    return root


def wds_dir(root, first_id: int, samples: int, per_shard: int = 5, val_samples: int = 6):
    splits = {}
    for split, start, n in (("train", first_id, samples), ("val", first_id + VAL_OFFSET, val_samples)):
        writer = TokenSampleWriter(root / split, seq_len=T, vocab_size=VOCAB, samples_per_shard=per_shard)
        writer.add_document(np.arange(start, start + n * T), EOT)
        splits[split], _ = writer.close()
    write_meta(root, format="webdataset", tokenizer="test", vocab_size=VOCAB, eot_id=EOT, splits=splits, seq_len=T,
               encoding="raw")
    return root
