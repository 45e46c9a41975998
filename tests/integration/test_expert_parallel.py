"""train.py under torchrun with expert parallelism against one process.

``torchrun --nproc_per_node=4 train.py --config configs/tiny-moe.yaml --parallel.ep=2
--parallel.dp_shard=4`` (shortened to a few steps): four data-parallel ranks for the dense weights,
each MoE layer's 16 experts split 8 + 8 over the two ranks of each ep group, the experts' weights
sharded over the two ranks holding the same experts. The loader gives the four ranks every fourth
window, so a step reads the windows one process with micro-batch 4B reads. The Switch auxiliary loss
is off here: it is computed over the tokens of one micro-batch, so B tokens on each of four ranks and
4B in one process give different (equally valid) losses; the in-process tests (tests/unit/parallel/
test_ep.py) check it on, against one process stepping on the same micro-batches.
"""

from __future__ import annotations

from tests.conftest import torchrun_matches_one_process

COMMON = {"train.max_steps": 3, "train.eval_interval": 3, "train.eval_sequences": 4, "model.moe.aux_loss": 0,
          "checkpoint.save_final": "false", "checkpoint.interval": 0}


def test_ep2_of_dp_shard4_trains_as_one_process(tmp_path, corpus_cache):
    torchrun_matches_one_process(tmp_path, corpus_cache, "configs/tiny-moe.yaml", COMMON, one_batch=8, rank_batch=2,
                                 layout=["--parallel.ep=2", "--parallel.dp_shard=4"],
                                 expect=["layout: strategy=fsdp dp_shard=4 tp=1 pp=1 ep=2 (4 ranks)",
                                         "holds 1/2 of each MoE layer's experts"])
