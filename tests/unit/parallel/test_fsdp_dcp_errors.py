"""A sharded (DCP) checkpoint that is not there is named, in one process. Saving, resharding and
loading on gloo ranks: tests/integration/parallel/test_fsdp_dcp.py (whose tiny GPT this builds)."""

from __future__ import annotations

import pytest

from tests.integration.parallel.test_fsdp_dcp import _build, _optimizer


def test_loading_a_missing_checkpoint_names_the_directory(tmp_path):
    from common.errors import CheckpointError
    from parallel.checkpoint import load_model_optimizer

    model = _build(seed=0)
    with pytest.raises(CheckpointError, match="no sharded"):
        load_model_optimizer([(model, _optimizer(model))], tmp_path / "nothing")
