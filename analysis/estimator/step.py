"""One optimizer step's estimate: memory, communication and time together, and whether it fits."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from analysis.estimator.communication import (
    CommVolume,
    _dp_and_expert_comm,
    expert_all_to_all,
    pp_comm_seconds,
    tp_comm_seconds,
)
from analysis.estimator.job import GIB, JobSpec
from analysis.estimator.memory import MemoryEstimate, edge_stages, estimate_memory
from analysis.estimator.time import TimeEstimate, estimate_time, largest_stage_parameters, muon_step
from common.report import gib
from model.flops import count_parameters, flops_per_token


@dataclass(frozen=True)
class Estimate:
    job: JobSpec
    n_params: int
    flops_per_token: float
    memory: MemoryEstimate
    time: TimeEstimate
    comm: CommVolume
    problems: tuple[str, ...]  # empty when the job fits

    @property
    def fits(self) -> bool:
        return not self.problems


def estimate(job: JobSpec) -> Estimate:
    """Memory, communication and time of one optimizer step of ``job``, and why it does not fit."""
    return estimate_with(job, estimate_memory(job))


def estimate_with(job: JobSpec, memory: MemoryEstimate) -> Estimate:
    n_params = count_parameters(job.model)
    comm, _ = _dp_and_expert_comm(job, largest_stage_parameters(job))
    tp_bytes = job.grad_accum * max(tp_comm_seconds(job, i)[1] for i in edge_stages(job))
    comm = dataclasses.replace(comm, tensor_parallel=tp_bytes, pipeline=job.grad_accum * pp_comm_seconds(job)[1],
                               expert_all_to_all=job.grad_accum * expert_all_to_all(job)[1], muon=muon_step(job)[0])
    time = estimate_time(job, memory.states)
    return Estimate(job, n_params, flops_per_token(job.model, job.seq_len), memory, time, comm,
                    memory_problems(job, memory))


def memory_problems(job: JobSpec, memory: MemoryEstimate) -> tuple[str, ...]:
    """Why ``memory`` does not fit on ``job.device`` (empty when it does)."""
    problems = []
    where = f" (pipeline stage {memory.stage})" if job.layout.pp > 1 else ""
    if memory.total > job.device.hbm_gib * GIB:
        problems.append(f"needs {gib(memory.total)} per GPU{where}, {job.device.name} has {job.device.hbm_gib:g} GiB")
    if memory.host > job.device.host_mem_gib * GIB:
        problems.append(
            f"offload needs {gib(memory.host)} of host memory per GPU, a node has ~{job.device.host_mem_gib:g} GiB per GPU"
        )
    return tuple(problems)


def describe_estimate(result: Estimate) -> str:
    mem, t = result.memory, result.time
    mfu = f", MFU {t.mfu:.0%}" if t.mfu is not None else ""
    return (
        f"{gib(mem.total)} of {result.job.device.hbm_gib:g} GiB per GPU "
        f"(model states {gib(mem.states)}, activations {gib(mem.activations + mem.logits)}); "
        f"predicted {t.step_s:,.3g} s/step{mfu}"
    )
