"""A crafted DeepSpeed ZeRO file must not run code on load, and a genuine one loads (a ZeRO engine
on a gloo rank of its own). The payload, and the DCP cases in one process:
tests/unit/parallel/test_checkpoint_security.py."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.gloo import run_workers
from tests.unit.parallel.test_checkpoint_security import Payload

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


def _zero_engine(seed: int, rank: int, world: int):
    from model.gpt import GPT
    from parallel.precision import precision_policy
    from parallel.zero import apply_zero
    from tests.gloo import gloo_context
    from training.config import load_config

    # zero1 + bf16_master writes all three DeepSpeed classes the loader allows (loss scaler,
    # stage enum, bf16 fragment addresses), so a clean load proves the allow-list is complete.
    cfg = load_config("configs/tiny.yaml", ["--parallel.strategy=zero1", "--precision.mode=bf16_master",
                                            "--model.n_layer=1", "--model.d_model=32", "--model.max_seq_len=16",
                                            "--train.micro_batch_size=2"])
    torch.manual_seed(seed)
    model = GPT(cfg.model).to(torch.bfloat16)
    ctx = gloo_context(rank, world)
    policy = precision_policy(cfg.precision, cfg.parallel.strategy)
    return apply_zero(model, cfg.parallel, policy, cfg.optim, micro_batch_size=cfg.train.micro_batch_size,
                      grad_accum_steps=cfg.train.grad_accum_steps, world_size=ctx.world_size, device=ctx.device)


def _zero_worker(rank: int, world: int, root: str, marker: str) -> dict[str, Any]:
    from common.errors import CheckpointError

    g = torch.Generator().manual_seed(0)
    x, y = torch.randint(0, 256, (2, 16), generator=g), torch.randint(0, 256, (2, 16), generator=g)
    saved = _zero_engine(seed=0, rank=rank, world=world)
    saved.forward_backward(x, y, True, 1)
    saved.optimizer_step(1e-3, torch.zeros(()))
    saved.save(Path(root), rank)
    loaded = _zero_engine(seed=1, rank=rank, world=world)
    loaded.load(Path(root))
    out: dict[str, Any] = {"same_loss": float(saved.eval_loss(x, y)) == float(loaded.eval_loss(x, y))}
    files = sorted(p for p in (Path(root) / "deepspeed").glob("*.pt"))
    out["files"] = [f.name for f in files]
    for kind in ("model_states", "optim_states"):
        target = next(f for f in files if kind in f.name)
        original = target.read_bytes()
        torch.save({"payload": Payload(Path(marker))}, target)
        try:
            loaded.load(Path(root))
            out[kind] = "loaded"
        except CheckpointError as exc:
            out[kind] = str(exc)
        target.write_bytes(original)
    out["marker_after"] = Path(marker).exists()
    return out


@pytest.mark.timeout(240)
def test_a_crafted_deepspeed_file_runs_nothing_and_a_real_one_loads(tmp_path):
    marker = tmp_path / "pwned"
    (out,) = run_workers(_zero_worker, 1, str(tmp_path / "ckpt"), str(marker))
    assert out["same_loss"], "the genuine ZeRO checkpoint did not restore the model"
    assert any("optim_states" in f for f in out["files"]) and any("model_states" in f for f in out["files"])
    for kind in ("model_states", "optim_states"):
        message = out[kind]
        assert "refusing to load" in message and "would call exec" in message and "\n" not in message, message
    assert not out["marker_after"] and not marker.exists()
