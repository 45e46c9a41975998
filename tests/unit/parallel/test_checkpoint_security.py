"""A crafted checkpoint must not run code on load.

The payload is what an attacker would plant: a pickle whose ``__reduce__`` calls ``exec`` to
create a marker file. Each test puts it where a loader would unpickle it — DCP's ``.metadata``
index (with and without a recomputed digest), a non-tensor value inside a DCP data file, and
DeepSpeed's ZeRO files — loads, and asserts that the load stops with a one-line
``CheckpointError`` and that the marker was never created. Without the defences each of these
loads runs the payload.
"""

from __future__ import annotations

import hashlib
import json
import pickle
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.gloo import run_workers

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


class Payload:
    """Unpickling this creates ``marker``: the code a crafted checkpoint would run."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return exec, (f"open({self.marker!r}, 'w').close()",)


def _model_and_optimizer(seed: int):
    from model.config import ModelConfig
    from model.gpt import GPT
    from parallel.optim import OptimConfig, build_adamw, decay_groups

    torch.manual_seed(seed)
    model = GPT(ModelConfig(n_layer=1, d_model=16, n_head=2, max_seq_len=8, vocab_size=32))
    groups = decay_groups(list(model.named_parameters()), 0.1)
    optimizer = build_adamw(groups, OptimConfig(lr=1e-2), torch.device("cpu"))
    x = torch.randint(0, 32, (2, 8))
    model(x, x).backward()
    optimizer.step()
    return model, optimizer


@pytest.fixture
def dcp_checkpoint(tmp_path) -> Path:
    from parallel.checkpoint import save_model_optimizer

    path = tmp_path / "dcp"
    save_model_optimizer([_model_and_optimizer(seed=0)], path)
    return path


def _load(path: Path) -> None:
    from parallel.checkpoint import load_model_optimizer

    load_model_optimizer([_model_and_optimizer(seed=1)], path)


def _redigest(path: Path) -> None:
    """What an attacker who also rewrites the digest file does."""
    from parallel.checkpoint import DIGEST, METADATA

    digest = hashlib.sha256((path / METADATA).read_bytes()).hexdigest()
    (path / DIGEST).write_text(json.dumps({"file": METADATA, "sha256": digest}))


def _assert_one_line(exc: pytest.ExceptionInfo, *fragments: str) -> None:
    message = str(exc.value)
    assert "\n" not in message, message
    for fragment in fragments:
        assert fragment in message, message


def test_a_checkpoint_saved_here_loads_and_carries_its_digest(dcp_checkpoint):
    from parallel.checkpoint import DIGEST, load_model_optimizer

    assert (dcp_checkpoint / DIGEST).is_file()
    saved, _ = _model_and_optimizer(seed=0)
    model, optimizer = _model_and_optimizer(seed=1)
    load_model_optimizer([(model, optimizer)], dcp_checkpoint)
    for (name, a), b in zip(saved.state_dict().items(), model.state_dict().values()):
        assert torch.equal(a, b), name
    assert optimizer.param_groups[0]["lr"] == 1e-2  # a non-tensor value, read weights-only


def test_a_swapped_metadata_file_is_refused_before_it_is_unpickled(dcp_checkpoint, tmp_path):
    from common.errors import CheckpointError
    from parallel.checkpoint import METADATA

    marker = tmp_path / "pwned"
    (dcp_checkpoint / METADATA).write_bytes(pickle.dumps(Payload(marker)))
    with pytest.raises(CheckpointError) as exc:
        _load(dcp_checkpoint)
    assert not marker.exists()
    _assert_one_line(exc, "does not match the digest", "refusing")


def test_a_crafted_metadata_file_with_a_matching_digest_runs_nothing(dcp_checkpoint, tmp_path):
    from common.errors import CheckpointError
    from parallel.checkpoint import METADATA

    marker = tmp_path / "pwned"
    (dcp_checkpoint / METADATA).write_bytes(pickle.dumps(Payload(marker)))
    _redigest(dcp_checkpoint)
    with pytest.raises(CheckpointError) as exc:
        _load(dcp_checkpoint)
    assert not marker.exists()
    _assert_one_line(exc, "builtins.exec", "crafted")


def test_a_crafted_value_inside_a_data_file_runs_nothing(tmp_path):
    """DCP stores non-tensor values (here the optimizer's lr) as pickles inside the .distcp file."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from common.errors import CheckpointError
    from parallel.checkpoint import _options, _write_metadata_digest

    marker = tmp_path / "pwned"
    path = tmp_path / "dcp"
    model_state, optim_state = get_state_dict(*_model_and_optimizer(seed=0), options=_options())
    optim_state["param_groups.tok_emb.weight.lr"] = Payload(marker)
    dcp.save({"model": model_state, "optimizer": optim_state}, checkpoint_id=str(path))
    _write_metadata_digest(path)  # the index itself is genuine
    assert not marker.exists()
    with pytest.raises(CheckpointError) as exc:
        _load(path)
    assert not marker.exists()
    _assert_one_line(exc, "optimizer.param_groups.tok_emb.weight.lr", "would call exec")


def test_an_index_pointing_outside_its_directory_is_refused(dcp_checkpoint):
    from common.errors import CheckpointError
    from parallel.checkpoint import METADATA, read_verified_metadata

    metadata = read_verified_metadata(dcp_checkpoint)
    first = next(iter(metadata.storage_data.values()))
    first.relative_path = "../../elsewhere.distcp"
    (dcp_checkpoint / METADATA).write_bytes(pickle.dumps(metadata))
    _redigest(dcp_checkpoint)
    with pytest.raises(CheckpointError) as exc:
        _load(dcp_checkpoint)
    _assert_one_line(exc, "points outside its directory")


def test_a_checkpoint_without_a_digest_is_refused(dcp_checkpoint):
    from common.errors import CheckpointError
    from parallel.checkpoint import DIGEST

    (dcp_checkpoint / DIGEST).unlink()
    with pytest.raises(CheckpointError) as exc:
        _load(dcp_checkpoint)
    _assert_one_line(exc, DIGEST, "cannot be verified")


# ----------------------------------------------------------------------------- DeepSpeed ZeRO


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
