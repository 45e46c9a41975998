"""The tensor- and pipeline-parallel layout in one process: where ranks sit, the layouts that cannot
run refused in one line, and the blocks each pipeline stage keeps. Training under tp and pp against
one process, on gloo ranks and through train.py: tests/integration/parallel/test_tp_pp.py (whose
model these layouts are checked with)."""

from __future__ import annotations

import pytest
import torch

from common.errors import ConfigError
from parallel.dims import ParallelDims
from parallel.layout import Layout
from tests.integration.parallel.test_tp_pp import ACCUM, MODEL, job
from training.config import load_config


def test_ranks_are_laid_out_with_tensor_parallel_innermost():
    layout = Layout(8, pp=2, dp_shard=2, tp=2)
    dims = [ParallelDims(8, 4, r, r % 4, layout=layout) for r in range(8)]
    assert [d.coordinate("tp") for d in dims] == [0, 1] * 4  # consecutive ranks, inside a node
    assert [d.coordinate("dp_shard") for d in dims] == [0, 0, 1, 1] * 2
    assert [d.coordinate("pp") for d in dims] == [0] * 4 + [1] * 4  # stages across nodes
    assert [d.dp_rank for d in dims] == [0, 0, 1, 1] * 2 and layout.dp == 2


@pytest.mark.parametrize("overrides, message", [
    ({"parallel.tp": 3}, "parallel.tp=3 must divide model.n_head=4"),
    ({"parallel.tp": 4}, "parallel.tp=4 must divide model.n_kv_head=2"),
    ({"parallel.tp": 2, "model.max_seq_len": 15}, "must divide by it"),
    ({"parallel.pp": 3}, "model.n_layer=4 must divide into"),
    ({"parallel.pp": 4, "train.grad_accum_steps": 2}, "must be >= parallel.pp=4"),
    ({"parallel.pp": 2, "parallel.pp_schedule": "interleaved_1f1b"}, "needs parallel.pp_virtual_stages >= 2"),
    ({"parallel.pp": 2, "parallel.pp_schedule": "1f1b", "parallel.pp_virtual_stages": 2}, "runs one stage per rank"),
    ({"parallel.tp": 2, "parallel.strategy": "ddp"}, "use parallel.strategy=fsdp"),
    ({"parallel.pp": 2, "parallel.strategy": "zero2"}, "use parallel.strategy=fsdp"),
    ({"parallel.tp": 2, "precision.mode": "fp16"}, "use bf16"),
    ({"parallel.tp": 2, "precision.mode": "bf16_master"}, "needs parallel.strategy=fsdp"),
    ({"parallel.tp": 2, "parallel.strategy": "fsdp", "parallel.fsdp_hybrid": True}, "set parallel.dp_replicate"),
    ({"parallel.dp_replicate": 2, "parallel.strategy": "ddp"}, "HSDP's replicate dimension"),
    # compile under tp fails in backward with every recompute policy (training/config.py)
    ({"parallel.tp": 2, "train.compile": True, "model.recompute": "full"}, "under parallel.tp > 1 fails in torch's"),
    ({"parallel.tp": 2, "train.compile": True}, "set train.compile=false"),
    ({"parallel.tp": 2, "train.compile": True, "model.recompute": "op_selective"}, "DTensor a plain gradient"),
])
def test_invalid_layouts_are_one_line_config_errors(overrides, message):
    base = {f"model.{k}": v for k, v in MODEL.items()} | {"train.grad_accum_steps": ACCUM}
    with pytest.raises(ConfigError, match=message) as info:
        load_config(None, [f"--{k}={v}" for k, v in (base | overrides).items()])
    assert "\n" not in str(info.value)


def test_pipeline_stages_keep_their_blocks_under_their_global_names():
    from model.gpt import GPT
    from parallel.pp import split_stages, stage_ids

    cfg = job().model
    torch.manual_seed(0)
    whole = GPT(cfg)
    names = set(whole.state_dict())
    parts = [p for rank in range(2) for p in split_stages(GPT(cfg), stage_ids(rank, 2, 2), 4)]
    assert [list(p.blocks) for p in parts] == [["0"], ["2"], ["1"], ["3"]]  # looped placement: r, r + pp
    assert parts[0].tok_emb is not None and parts[0].lm_head is None
    assert parts[3].tok_emb is None and parts[3].lm_head is not None
    assert set().union(*(p.state_dict() for p in parts)) == names
