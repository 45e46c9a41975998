"""train.py under torchrun with context parallelism against one process.

``torchrun --nproc_per_node=4 train.py --config configs/tiny.yaml --parallel.cp=2
--parallel.dp_shard=2 --model.max_seq_len=256`` (shortened to a few steps): two data-parallel ranks
of two cp ranks each. The loader gives the two data-parallel ranks every other window, and both cp
ranks of one data-parallel rank the same windows, so a step reads the same 2 x B windows one process
with micro-batch 2B reads; each cp rank runs half of every sequence. Losses of every step and the
validation loss agree within 1e-5 (fp32). (The document mask under cp is checked on gloo ranks, in
tests/integration/parallel/test_cp.py.)
"""

from __future__ import annotations

from tests.conftest import torchrun_matches_one_process

COMMON = {"model.max_seq_len": 256, "train.max_steps": 3, "train.eval_interval": 3, "train.eval_sequences": 5,
          "checkpoint.save_final": "false", "checkpoint.interval": 0}


def test_cp2_x_dp_shard2_trains_as_one_process(tmp_path, corpus_cache):
    torchrun_matches_one_process(tmp_path, corpus_cache, "configs/tiny.yaml", COMMON, one_batch=4, rank_batch=2,
                                 layout=["--parallel.cp=2", "--parallel.dp_shard=2"],
                                 expect=["cp=2", "holds sequence chunks (0, 3)"])
