"""NCCL settings: only documented variables, checked values, never silently overriding the shell."""

from __future__ import annotations

import logging

import pytest

from common.errors import ConfigError
from parallel.nccl import apply_flight_recorder_env, apply_nccl_env, validate_nccl_env


@pytest.mark.parametrize("name", ["NCCL_INTER_NODE_CONNECTIVITY", "NCCL_INTRA_NODE_CONNECTIVITY", "NCCL_PROFILE"])
def test_the_chapters_invented_variables_are_rejected(name):
    with pytest.raises(ConfigError) as info:
        validate_nccl_env({name: "ring"})
    message = str(info.value)
    assert f"parallel.nccl.{name}" in message
    assert "not a documented NCCL environment variable" in message and "silently ignores" in message


def test_a_typo_gets_a_suggestion():
    with pytest.raises(ConfigError, match="did you mean NCCL_MIN_NCHANNELS"):
        validate_nccl_env({"NCCL_MIN_NCHANNEL": "4"})


def test_retired_names_say_what_replaced_them():
    with pytest.raises(ConfigError, match="use NCCL_PROTO"):
        validate_nccl_env({"NCCL_LL_THRESHOLD": "0"})


def test_torch_settings_are_not_nccl_variables():
    with pytest.raises(ConfigError, match="TORCH_NCCL"):
        validate_nccl_env({"TORCH_NCCL_BLOCKING_WAIT": "1"})


@pytest.mark.parametrize(
    "name, value",
    [
        ("NCCL_NET_GDR_LEVEL", "PHB"),
        ("NCCL_NET_GDR_LEVEL", "sys"),
        ("NCCL_NET_GDR_LEVEL", "2"),  # the chapter's value: the legacy integer form
        ("NCCL_P2P_LEVEL", "NVL"),
        ("NCCL_ALGO", "Ring,Tree"),
        ("NCCL_ALGO", "^NVLS"),
        ("NCCL_ALGO", "allreduce:tree,ring;broadcast:ring"),
        ("NCCL_PROTO", "LL128,Simple"),
        ("NCCL_MIN_NCHANNELS", "4"),
        ("NCCL_DEBUG", "INFO"),
        ("NCCL_DEBUG_SUBSYS", "INIT,NET"),
        ("NCCL_IB_HCA", "mlx5_0:1,mlx5_1:1"),
        ("NCCL_P2P_DISABLE", "1"),
    ],
)
def test_valid_settings_pass(name, value):
    validate_nccl_env({name: value})


@pytest.mark.parametrize(
    "name, value, fragment",
    [
        ("NCCL_NET_GDR_LEVEL", "NVLINK", "LOC, PIX, PXB, PHB, SYS"),
        ("NCCL_ALGO", "ring,butterfly", "'BUTTERFLY'"),
        ("NCCL_ALGO", "gather:ring", "unknown collective"),
        ("NCCL_PROTO", "LL256", "LL, LL128, SIMPLE"),
        ("NCCL_MIN_NCHANNELS", "four", "integer"),
        ("NCCL_P2P_DISABLE", "yes", "0 or 1"),
        ("NCCL_DEBUG", "LOUD", "VERSION, WARN, INFO, TRACE"),
        ("NCCL_SOCKET_IFNAME", "", "empty"),
    ],
)
def test_invalid_values_name_the_key_and_choices(name, value, fragment):
    with pytest.raises(ConfigError) as info:
        validate_nccl_env({name: value})
    assert f"parallel.nccl.{name}={value!r}" in str(info.value) and fragment in str(info.value)


def test_apply_sets_unset_variables_and_keeps_existing_ones(caplog):
    environ = {"NCCL_DEBUG": "WARN", "NCCL_ALGO": "Ring"}
    with caplog.at_level(logging.INFO, logger="parallel.nccl"):
        apply_nccl_env({"NCCL_DEBUG": "INFO", "NCCL_ALGO": "Ring", "NCCL_MIN_NCHANNELS": "4"}, environ)
    assert environ == {"NCCL_DEBUG": "WARN", "NCCL_ALGO": "Ring", "NCCL_MIN_NCHANNELS": "4"}
    kept = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(kept) == 1 and "NCCL_DEBUG=WARN is already set" in kept[0].getMessage()
    assert "INFO" in kept[0].getMessage()


def test_apply_validates_before_touching_the_environment():
    environ: dict[str, str] = {}
    with pytest.raises(ConfigError):
        apply_nccl_env({"NCCL_DEBUG": "INFO", "NCCL_PROFILE": "1"}, environ)
    assert environ == {}


def test_the_config_section_validates_nccl():
    from parallel.config import ParallelConfig

    ParallelConfig(nccl={"NCCL_NET_GDR_LEVEL": "PHB"}).validate()
    with pytest.raises(ConfigError, match="parallel.nccl.NCCL_INTER_NODE_CONNECTIVITY"):
        ParallelConfig(nccl={"NCCL_INTER_NODE_CONNECTIVITY": "ring"}).validate()


def test_the_loader_coerces_numbers_to_strings():
    from training.config import load_config

    cfg = load_config(None, ["--parallel.nccl={NCCL_MIN_NCHANNELS: 4}"])
    assert cfg.parallel.nccl == {"NCCL_MIN_NCHANNELS": "4"}


def test_the_flight_recorder_switch_sets_the_documented_variables_before_the_group_starts(tmp_path):
    environ = {"TORCH_NCCL_TRACE_BUFFER_SIZE": "100"}  # what the shell set wins
    prefix = str(tmp_path / "run" / "flight_recorder" / "rank_")
    line = apply_flight_recorder_env(prefix, environ)
    assert environ == {"TORCH_NCCL_TRACE_BUFFER_SIZE": "100", "TORCH_FR_BUFFER_SIZE": "2000",
                       "TORCH_NCCL_DUMP_ON_TIMEOUT": "1", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": prefix,
                       "TORCH_FR_DUMP_TEMP_FILE": prefix}
    assert (tmp_path / "run" / "flight_recorder").is_dir()  # the dumps' directory exists before any dump
    assert f"to {prefix}<rank>" in line and "kept from the environment: TORCH_NCCL_TRACE_BUFFER_SIZE=100" in line


def test_train_py_turns_the_flight_recorder_on_from_the_config(tmp_path, monkeypatch):
    import os

    import train
    from training.config import load_config

    for name in ("TORCH_FR_BUFFER_SIZE", "TORCH_FR_DUMP_TEMP_FILE", "TORCH_NCCL_DUMP_ON_TIMEOUT",
                 "TORCH_NCCL_TRACE_BUFFER_SIZE", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE"):
        monkeypatch.delenv(name, raising=False)
    seen = {}

    def stop_at_the_process_group(device, parallel_cfg):
        seen.update(os.environ)
        raise ConfigError("stop here")

    monkeypatch.setattr(train, "init_distributed", stop_at_the_process_group)
    cfg = load_config(None, [f"--logging.run_dir={tmp_path}/{{name}}", "--parallel.flight_recorder=true"])
    with pytest.raises(ConfigError, match="stop here"):
        train.run(cfg, None)
    assert seen["TORCH_FR_DUMP_TEMP_FILE"] == str(tmp_path / cfg.name / "flight_recorder" / "rank_")
    assert seen["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1" and int(seen["TORCH_FR_BUFFER_SIZE"]) > 0
