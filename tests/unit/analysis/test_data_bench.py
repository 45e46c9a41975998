"""tools/bench_data.py: the naive baseline yields the right windows. The CLI run as a user runs it:
tests/integration/analysis/test_data_bench.py."""

from pathlib import Path

import numpy as np

from analysis.data_bench import naive_stream
from data.config import DataConfig

ROOT = Path(__file__).resolve().parents[3]


def test_naive_baseline_packs_the_file_bytes_into_windows(tmp_path):
    files = []
    for i, text in enumerate(["abcdefghij", "klmnopqrstuvwxyz"]):
        files.append(tmp_path / f"{i}.txt")
        files[-1].write_text(text)
    stream = naive_stream([str(f) for f in files], "byte", seq_len=4, batch_size=2, cfg=DataConfig(num_workers=0))
    x, y = next(stream)
    x2, _ = next(stream)
    tokens = np.frombuffer(b"abcdefghij\0klmnopqrstuvwxyz\0", dtype=np.uint8)
    assert x.tolist() == [tokens[0:4].tolist(), tokens[4:8].tolist()]
    assert y[0].tolist() == tokens[1:5].tolist()
    assert x2.tolist() == [tokens[8:12].tolist(), tokens[12:16].tolist()]
