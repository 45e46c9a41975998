"""NCCL environment settings from the config, checked against NCCL's documented variables.

NCCL reads its settings from environment variables when a communicator is created and silently
ignores names it does not know, so a misspelt or invented variable (the chapter's
NCCL_INTER_NODE_CONNECTIVITY, NCCL_INTRA_NODE_CONNECTIVITY, NCCL_PROFILE) changes nothing and
says nothing. Here every name must be on the list below (from the "Environment Variables" page
of the NCCL user guide, NCCL 2.18-2.27), values are checked where NCCL accepts a fixed set, and
``apply_nccl_env`` runs before ``init_process_group``. NCCL is already topology-aware: these are
for debugging and for overriding its choices, not something a run needs by default.

This module imports nothing heavy: the config loader calls ``validate_nccl_env``.
"""

from __future__ import annotations

import difflib
import os
import re
from collections.abc import Callable, Mapping, MutableMapping
from pathlib import Path

from common.errors import ConfigError
from common.log import get_logger

log = get_logger("parallel")

_PCI_LEVELS = ("LOC", "PIX", "PXB", "PHB", "SYS")  # path distance between GPU and NIC / GPU and GPU
_ALGORITHMS = ("RING", "TREE", "COLLNETDIRECT", "COLLNETCHAIN", "NVLS", "NVLSTREE", "PAT")
_PROTOCOLS = ("LL", "LL128", "SIMPLE")
_COLLECTIVES = ("BROADCAST", "REDUCE", "ALLGATHER", "REDUCESCATTER", "ALLREDUCE")
_SUBSYSTEMS = (
    "INIT", "COLL", "P2P", "SHM", "NET", "GRAPH", "TUNING", "ENV", "ALLOC", "CALL", "PROXY",
    "NVLS", "BOOTSTRAP", "REG", "PROFILE", "RAS", "ALL",
)  # fmt: skip


def _one_of(*choices: str) -> Callable[[str], str | None]:
    def check(value: str) -> str | None:
        return None if value.upper() in choices else f"choose one of: {', '.join(choices)}"

    return check


def _integer(value: str) -> str | None:
    return None if re.fullmatch(r"-?\d+", value.strip()) else "must be an integer"


def _flag(value: str) -> str | None:
    return None if value.strip() in ("0", "1") else "must be 0 or 1"


def _level(value: str) -> str | None:
    if value.upper() in _PCI_LEVELS or re.fullmatch(r"\d+", value.strip()):
        return None
    return f"choose one of: {', '.join(_PCI_LEVELS)} (or an integer level)"


def _p2p_level(value: str) -> str | None:
    if value.upper() == "NVL":
        return None
    return _level(value) and f"choose one of: LOC, NVL, {', '.join(_PCI_LEVELS[1:])} (or an integer level)"


def _item_list(choices: tuple[str, ...], per_collective: bool) -> Callable[[str], str | None]:
    """'A,B', '^A' (all but A) and, for ALGO/PROTO, 'allreduce:tree,ring;broadcast:ring'."""

    def check(value: str) -> str | None:
        parts = value.split(";") if per_collective else [value]
        for part in parts:
            items = part
            if per_collective and ":" in part:
                func, items = part.split(":", 1)
                if func.strip().upper() not in _COLLECTIVES:
                    return f"unknown collective {func!r}; choose from: {', '.join(c.lower() for c in _COLLECTIVES)}"
            names = [n.strip().upper() for n in items.lstrip("^").split(",")]
            bad = [n for n in names if n not in choices]
            if bad:
                return f"unknown item {bad[0]!r}; choose from: {', '.join(choices)} (comma-separated, ^ excludes)"
        return None

    return check


def _free(value: str) -> str | None:
    return None if value.strip() else "must not be empty"


# name -> value check (None when the value is free text: interface names, paths, HCA lists)
DOCUMENTED: dict[str, Callable[[str], str | None]] = {
    # debugging and logging
    "NCCL_DEBUG": _one_of("VERSION", "WARN", "INFO", "TRACE"),
    "NCCL_DEBUG_SUBSYS": _item_list(_SUBSYSTEMS, per_collective=False),
    "NCCL_DEBUG_FILE": _free,
    "NCCL_CONF_FILE": _free,
    "NCCL_SET_THREAD_NAME": _flag,
    "NCCL_CHECKS_DISABLE": _flag,
    "NCCL_CHECK_POINTERS": _flag,
    # algorithm and protocol selection, channels, buffers
    "NCCL_ALGO": _item_list(_ALGORITHMS, per_collective=True),
    "NCCL_PROTO": _item_list(_PROTOCOLS, per_collective=True),
    "NCCL_MIN_NCHANNELS": _integer,
    "NCCL_MAX_NCHANNELS": _integer,
    "NCCL_MIN_CTAS": _integer,
    "NCCL_MAX_CTAS": _integer,
    "NCCL_CGA_CLUSTER_SIZE": _integer,
    "NCCL_NTHREADS": _one_of("64", "128", "256", "512"),
    "NCCL_BUFFSIZE": _integer,
    "NCCL_LAUNCH_MODE": _one_of("PARALLEL", "GROUP"),
    "NCCL_COMM_BLOCKING": _flag,
    "NCCL_WORK_FIFO_DEPTH": _integer,
    "NCCL_NCHANNELS_PER_NET_PEER": _integer,
    "NCCL_RUNTIME_CONNECT": _flag,
    "NCCL_GRAPH_MIXING_SUPPORT": _flag,
    "NCCL_SET_STACK_SIZE": _flag,
    # topology and transports
    "NCCL_TOPO_FILE": _free,
    "NCCL_TOPO_DUMP_FILE": _free,
    "NCCL_IGNORE_CPU_AFFINITY": _flag,
    "NCCL_P2P_DISABLE": _flag,
    "NCCL_P2P_LEVEL": _p2p_level,
    "NCCL_P2P_DIRECT_DISABLE": _flag,
    "NCCL_P2P_NET_CHUNKSIZE": _integer,
    "NCCL_P2P_PCI_CHUNKSIZE": _integer,
    "NCCL_P2P_NVL_CHUNKSIZE": _integer,
    "NCCL_P2P_LL_THRESHOLD": _integer,
    "NCCL_SHM_DISABLE": _flag,
    "NCCL_SHM_USE_CUDA_MEMCPY": _flag,
    "NCCL_NVB_DISABLE": _flag,
    "NCCL_PXN_DISABLE": _flag,
    "NCCL_P2P_PXN_LEVEL": _one_of("0", "1", "2"),
    "NCCL_NVLS_ENABLE": _one_of("0", "1", "2"),
    "NCCL_NVLS_CHUNKSIZE": _integer,
    "NCCL_MNNVL_ENABLE": _one_of("0", "1", "2"),
    "NCCL_CUMEM_ENABLE": _flag,
    "NCCL_CUMEM_HOST_ENABLE": _flag,
    "NCCL_DMABUF_ENABLE": _flag,
    "NCCL_GRAPH_REGISTER": _flag,
    "NCCL_LOCAL_REGISTER": _flag,
    "NCCL_LEGACY_CUDA_REGISTER": _flag,
    "NCCL_MEM_SYNC_DOMAIN": _integer,
    # network
    "NCCL_NET": _free,
    "NCCL_NET_PLUGIN": _free,
    "NCCL_TUNER_PLUGIN": _free,
    "NCCL_PROFILER_PLUGIN": _free,
    "NCCL_NET_GDR_LEVEL": _level,
    "NCCL_NET_GDR_READ": _flag,
    "NCCL_NET_SHARED_BUFFERS": _flag,
    "NCCL_NET_SHARED_COMMS": _flag,
    "NCCL_NET_FORCE_FLUSH": _flag,
    "NCCL_CROSS_NIC": _one_of("0", "1", "2"),
    "NCCL_ALLOC_P2P_NET_LL_BUFFERS": _flag,
    "NCCL_COLLNET_ENABLE": _flag,
    "NCCL_COLLNET_NODE_THRESHOLD": _integer,
    "NCCL_SOCKET_IFNAME": _free,
    "NCCL_SOCKET_FAMILY": _one_of("AF_INET", "AF_INET6"),
    "NCCL_SOCKET_NTHREADS": _integer,
    "NCCL_NSOCKS_PERTHREAD": _integer,
    "NCCL_SOCKET_RETRY_CNT": _integer,
    "NCCL_SOCKET_RETRY_SLEEP_MSEC": _integer,
    "NCCL_OOB_NET_ENABLE": _flag,
    "NCCL_OOB_NET_IFNAME": _free,
    "NCCL_UID_STAGGER_THRESHOLD": _integer,
    "NCCL_UID_STAGGER_RATE": _integer,
    "NCCL_HOSTID": _free,
    "NCCL_IB_DISABLE": _flag,
    "NCCL_IB_HCA": _free,
    "NCCL_IB_TIMEOUT": _integer,
    "NCCL_IB_RETRY_CNT": _integer,
    "NCCL_IB_GID_INDEX": _integer,
    "NCCL_IB_ADDR_FAMILY": _one_of("AF_INET", "AF_INET6"),
    "NCCL_IB_ADDR_RANGE": _free,
    "NCCL_IB_ROCE_VERSION_NUM": _integer,
    "NCCL_IB_SL": _integer,
    "NCCL_IB_TC": _integer,
    "NCCL_IB_FIFO_TC": _integer,
    "NCCL_IB_RETURN_ASYNC_EVENTS": _flag,
    "NCCL_IB_AR_THRESHOLD": _integer,
    "NCCL_IB_QPS_PER_CONNECTION": _integer,
    "NCCL_IB_SPLIT_DATA_ON_QPS": _flag,
    "NCCL_IB_PCI_RELAXED_ORDERING": _one_of("0", "1", "2"),
    "NCCL_IB_ADAPTIVE_ROUTING": _flag,
    "NCCL_IB_ECE_ENABLE": _flag,
    "NCCL_IB_MERGE_NICS": _flag,
    "NCCL_RAS_ENABLE": _flag,
    "NCCL_RAS_ADDR": _free,
}

# Names NCCL documents as removed or deprecated, with what replaced them.
RETIRED: dict[str, str] = {
    "NCCL_LL_THRESHOLD": "removed in NCCL 2.5; use NCCL_PROTO",
    "NCCL_TREE_THRESHOLD": "removed in NCCL 2.5; use NCCL_ALGO",
    "NCCL_SINGLE_RING_THRESHOLD": "deprecated; use NCCL_ALGO / NCCL_PROTO",
    "NCCL_MIN_NRINGS": "renamed NCCL_MIN_NCHANNELS",
    "NCCL_MAX_NRINGS": "renamed NCCL_MAX_NCHANNELS",
    "NCCL_IB_CUDA_SUPPORT": "replaced by NCCL_NET_GDR_LEVEL",
}


def validate_nccl_env(nccl: Mapping[str, str], key_prefix: str = "parallel.nccl") -> None:
    """Raise ConfigError for the first undocumented name or invalid value."""
    for name, value in nccl.items():
        _check_one(name, str(value), f"{key_prefix}.{name}")


def _check_one(name: str, value: str, key: str) -> None:
    if name in RETIRED:
        raise ConfigError(f"{key}: {name} is {RETIRED[name]}")
    if name not in DOCUMENTED:
        close = difflib.get_close_matches(name, DOCUMENTED, n=2, cutoff=0.75)
        hint = f"; did you mean {' or '.join(close)}?" if close else ""
        if not name.startswith("NCCL_"):
            hint = " (PyTorch's own TORCH_NCCL_* settings are not NCCL variables; export them instead)"
        raise ConfigError(
            f"{key}: {name} is not a documented NCCL environment variable, and NCCL silently ignores "
            f"unknown names{hint} (a real variable newer than this list can be exported in the shell)"
        )
    problem = DOCUMENTED[name](value)
    if problem:
        raise ConfigError(f"{key}={value!r} is not valid: {problem}")


def apply_nccl_env(nccl: Mapping[str, str], environ: MutableMapping[str, str] | None = None) -> None:
    """Export the validated settings; call before the process group (and its communicators) exist.

    A variable already set in the environment wins — the launcher or the user put it there on
    purpose — and a differing config value is reported in the log rather than silently dropped.
    """
    validate_nccl_env(nccl)
    environ = os.environ if environ is None else environ
    if nccl and _process_group_exists():
        log.warning(
            "NCCL settings applied after the process group was created; NCCL may have read its environment already"
        )
    for name, value in nccl.items():
        value = str(value)
        current = environ.get(name)
        if current is None:
            environ[name] = value
            log.info("set %s=%s", name, value)
        elif current != value:
            log.warning(
                "%s=%s is already set in the environment; keeping it (config asked for %s)", name, current, value
            )


def _process_group_exists() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


# PyTorch's Flight Recorder (ProcessGroupNCCL): a ring buffer of each rank's recent collectives,
# dumped per rank on a watchdog timeout. torch 2.6-2.8 read the TORCH_NCCL_* names, newer
# releases the TORCH_FR_* ones (and still the old ones as fallbacks): both are set.
FLIGHT_RECORDER_ENTRIES = 2000


def flight_recorder_env(dump_prefix: str, entries: int = FLIGHT_RECORDER_ENTRIES) -> dict[str, str]:
    """The environment that turns the Flight Recorder on; dumps go to ``<dump_prefix><rank>``."""
    return {
        "TORCH_NCCL_TRACE_BUFFER_SIZE": str(entries),
        "TORCH_FR_BUFFER_SIZE": str(entries),
        "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
        "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": dump_prefix,
        "TORCH_FR_DUMP_TEMP_FILE": dump_prefix,
    }


def apply_flight_recorder_env(dump_prefix: str, environ: MutableMapping[str, str] | None = None) -> str:
    """Export ``flight_recorder_env`` (a variable already set wins, as in ``apply_nccl_env``); returns
    a log line saying where the dumps go and how to read them. Creates the dumps' directory."""
    environ = os.environ if environ is None else environ
    Path(dump_prefix).parent.mkdir(parents=True, exist_ok=True)
    if _process_group_exists():
        log.warning("Flight Recorder settings applied after the process group was created; they may not take effect")
    kept = []
    for name, value in flight_recorder_env(dump_prefix).items():
        if environ.setdefault(name, value) != value:
            kept.append(f"{name}={environ[name]}")
    where = environ["TORCH_FR_DUMP_TEMP_FILE"]
    line = (f"flight recorder: on (NCCL); on a collective timeout each rank dumps its last "
            f"{environ['TORCH_FR_BUFFER_SIZE']} collectives to {where}<rank>; read them with "
            f"`python -m torch.distributed.flight_recorder.fr_trace {Path(where).parent} -p {Path(where).name}`")
    return line + (f" (kept from the environment: {', '.join(kept)})" if kept else "")
