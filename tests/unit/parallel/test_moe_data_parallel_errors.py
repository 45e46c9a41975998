"""A MoE layout the trainer cannot run is refused in one line, in one process. The MoE GPT under
DDP, FSDP2, ep, tp and pp against one process, on gloo ranks:
tests/integration/parallel/test_moe_data_parallel.py (whose overrides this loads)."""

from __future__ import annotations

import pytest

from common.errors import ConfigError
from tests.integration.parallel.test_moe_data_parallel import OVERRIDES
from training.config import load_config


def test_routing_bias_with_a_pipeline_is_refused():
    # torch's pipeline stages run one extra forward on their first step to infer shapes, which
    # would count in the load the bias moves by
    with pytest.raises(ConfigError, match="model.moe.bias_update_rate=0.02 with parallel.pp=2") as err:
        load_config("configs/tiny-moe.yaml", OVERRIDES + ["--parallel.pp=2", "--train.grad_accum_steps=2"])
    assert "\n" not in str(err.value)
