"""Where a training step's time goes, and what to switch: the bottleneck doctor behind tools/diagnose.py.

``attribute`` splits the measured wall time of profiled steps into shares:

- data wait: time the step blocked on the next batch (the engine measures it around each fetch);
- optimizer: the optimizer step (the profiler's ``Optimizer.step#...`` ranges);
- communication, exposed: collective and point-to-point ops on the training thread, which it
  waits for (common/comm_names.py decides which profiled names are communication); overlapped: the same ops on other threads (DDP's bucketed all-reduces run from the
  autograd thread during backward), which cost nothing while compute continues;
- host overhead: wall time not covered by any operator on the training thread (Python, launch
  gaps, the framework's own bookkeeping);
- compute: the remainder (forward, backward, recompute inside them).

``verdicts`` turns the shares and the job's settings into plain-language findings, worst first,
each with the section of the chapter it comes from and the exact config switch to try; the first
is the verdict. The thresholds are the points where, in our measurements, the switch starts to
pay for its own cost; they are stated in each message.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from common.comm_names import is_communication
from common.measure import union_length
from model.recompute import no_gain_note

OPTIMIZER = "Optimizer.step#"

DATA_WAIT_LIMIT = 0.15
EXPOSED_COMM_LIMIT = 0.25
HOST_LIMIT = 0.30
OPTIMIZER_LIMIT = 0.20
HEADROOM_LIMIT = 0.10


@dataclass
class Span:
    """One profiled operator range: name, thread, start and end in microseconds."""

    name: str
    thread: int
    start_us: float
    end_us: float
    top_level: bool = True  # not inside another profiled range of its thread


@dataclass
class Breakdown:
    wall_s: float
    data_wait_s: float
    optimizer_s: float
    comm_exposed_s: float
    comm_overlapped_s: float
    host_s: float
    compute_s: float = field(init=False)

    def __post_init__(self) -> None:
        self.compute_s = max(0.0, self.wall_s - self.data_wait_s - self.optimizer_s - self.comm_exposed_s - self.host_s)

    def share(self, name: str) -> float:
        return getattr(self, f"{name}_s") / self.wall_s if self.wall_s > 0 else 0.0

    def rows(self) -> list[tuple[str, float, float]]:
        """(category, seconds per step-set, share of wall); overlapped communication is not part of the wall."""
        names = ("compute", "data_wait", "optimizer", "comm_exposed", "host")
        out = [(n.replace("_", " "), getattr(self, f"{n}_s"), self.share(n)) for n in names]
        out.append(("comm overlapped (hidden)", self.comm_overlapped_s, self.share("comm_overlapped")))
        return out


def attribute(spans: list[Span], main_thread: int, wall_s: float, data_wait_s: float) -> Breakdown:
    """Split ``wall_s`` (all profiled steps) using the operator spans the profiler recorded."""
    main = [s for s in spans if s.thread == main_thread]
    optimizer = union_length([(s.start_us, s.end_us) for s in main if s.name.startswith(OPTIMIZER)])
    # Collectives are often nested (inside FSDP's or autograd's ranges): every level counts.
    comm = [s for s in spans if is_communication(s.name)]
    comm_main = union_length([(s.start_us, s.end_us) for s in comm if s.thread == main_thread])
    comm_other = union_length([(s.start_us, s.end_us) for s in comm if s.thread != main_thread])
    covered = union_length([(s.start_us, s.end_us) for s in main if s.top_level])
    host = max(0.0, wall_s - data_wait_s - covered / 1e6)
    return Breakdown(wall_s=wall_s, data_wait_s=data_wait_s, optimizer_s=optimizer / 1e6,
                     comm_exposed_s=comm_main / 1e6, comm_overlapped_s=comm_other / 1e6, host_s=host)


@dataclass
class Job:
    """The settings the verdicts look at."""

    num_workers: int
    world_size: int
    strategy: str
    recompute: str
    attention: str  # the backend the build chose
    compile: bool
    fused_optimizer: bool
    peak_memory_gib: float | None
    memory_budget_gib: float | None
    device: str  # "cuda" or "cpu": on a CPU Triton runs only in its interpreter and compile is no remedy
    tp: int = 1  # under tensor parallelism the trainer refuses compile
    zero_bubble: bool = False  # a pipeline on the zero_bubble schedule, which compiled blocks do not run


def compile_switch(job: Job) -> list[str] | None:
    """The overrides that turn compile on and that the trainer accepts for this job (training/config.py
    refuses compile under tp and with zero_bubble); None if none."""
    if job.compile or job.device != "cuda" or job.zero_bubble or job.tp > 1:
        return None
    return ["--train.compile=true"]


@dataclass
class Verdict:
    severity: float  # the share of the step at stake; findings are sorted by it
    text: str
    overrides: list[str]  # what --try runs against the current config ([] if nothing to try)


def verdicts(b: Breakdown, job: Job) -> list[Verdict]:
    out = []
    wait = b.share("data_wait")
    if wait > DATA_WAIT_LIMIT:
        out.append(Verdict(wait, f"data wait {wait:.0%} of step time (> {DATA_WAIT_LIMIT:.0%}): the loader cannot keep "
                           f"up; raise data.num_workers (now {job.num_workers}) and keep data.prefetch_factor >= 2 "
                           "(chapter 8.4)", [f"--data.num_workers={max(2, 2 * job.num_workers)}"]))
    exposed = b.share("comm_exposed")
    if exposed > EXPOSED_COMM_LIMIT:
        switch = ("raise parallel.ddp_bucket_cap_mb so buckets overlap backward, or a compression hook "
                  "(parallel.ddp_comm_hook=bf16)" if job.strategy in ("ddp", "none") else
                  "parallel.fsdp_hybrid=true (HSDP: shard inside a node, replicate across) or fewer, larger shards")
        out.append(Verdict(exposed, f"exposed communication {exposed:.0%} of step time (> {EXPOSED_COMM_LIMIT:.0%}, "
                           f"overlapped {b.share('comm_overlapped'):.0%} hidden behind compute): {switch} "
                           "(chapter 8.3)", ["--parallel.ddp_bucket_cap_mb=100"] if job.strategy == "ddp" else []))
    recompute_note = no_gain_note(job.recompute, job.attention)
    if recompute_note:
        out.append(Verdict(max(b.share("compute") * 0.1, 0.05), f"{recompute_note} (chapter 8.2)",
                           ["--model.recompute=none"]))
    if job.peak_memory_gib is not None and job.memory_budget_gib:
        headroom = 1 - job.peak_memory_gib / job.memory_budget_gib
        if headroom < HEADROOM_LIMIT:
            switch = ("model.recompute=full (or selective with the materialized attention)"
                      if job.recompute in ("none", "selective") else "a larger parallel.strategy shard (fsdp)")
            out.append(Verdict(1 - max(headroom, 0), f"memory: peak {job.peak_memory_gib:.2f} GiB of a "
                               f"{job.memory_budget_gib:.2f} GiB budget ({headroom:.0%} headroom, < "
                               f"{HEADROOM_LIMIT:.0%}): {switch}, or a smaller train.micro_batch_size with more "
                               "train.grad_accum_steps (chapter 8.2)",
                               ["--model.recompute=full"] if job.recompute in ("none", "selective") else []))
    host = b.share("host")
    if host > HOST_LIMIT:
        switch = compile_switch(job)
        remedy = ("raise train.micro_batch_size so each launch does more work" if switch is None else
                  "train.compile=true fuses them")
        out.append(Verdict(host, f"host overhead {host:.0%} of step time (> {HOST_LIMIT:.0%}: Python and launch "
                           f"gaps between operators): {remedy} (chapter 8.5)", switch or []))
    opt = b.share("optimizer")
    sharded = job.strategy in ("fsdp", "zero1", "zero2", "zero3")
    if opt > OPTIMIZER_LIMIT and not (job.fused_optimizer and sharded):
        out.append(Verdict(opt, f"optimizer step {opt:.0%} of step time (> {OPTIMIZER_LIMIT:.0%}): "
                           + ("optim.fused=on runs AdamW as one kernel per step" if not job.fused_optimizer else
                              "a sharded strategy (parallel.strategy=fsdp or zero1) splits it across ranks")
                           + " (chapter 8.2)", [] if job.fused_optimizer else ["--optim.fused=on"]))
    out.sort(key=lambda v: -v.severity)
    if not out:
        gains = ("lower precision (precision.mode=bf16, fp8) and fused kernels (kernels.backend=triton, "
                 "train.compile=true) (chapters 8.1, 8.5)" if job.device == "cuda" else
                 "on a GPU: there lower precision and the fused Triton kernels pay off; on a CPU Triton runs only in "
                 "its interpreter (chapters 8.1, 8.5)")
        out.append(Verdict(b.share("compute"), f"compute-bound: {b.share('compute'):.0%} of step time in forward and "
                           f"backward; the next gains are {gains}", []))
    return out
