"""A crafted checkpoint must not run code on load.

The payload is what an attacker would plant: a pickle whose ``__reduce__`` calls ``exec`` to
create a marker file. Each test puts it where a loader would unpickle it — DCP's ``.metadata``
index (with and without a recomputed digest), a non-tensor value inside a DCP data file, and
DeepSpeed's ZeRO files (on a gloo rank: tests/integration/parallel/test_checkpoint_security.py) —
loads, and asserts that the load stops with a one-line
``CheckpointError`` and that the marker was never created. Without the defences each of these
loads runs the payload.
"""

from __future__ import annotations

import hashlib
import json
import pickle
from pathlib import Path

import pytest
import torch

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
