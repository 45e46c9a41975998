"""The parallel layout of a run: one frozen value in the config's own words, validated in one place.

    world_size = pp x dp_replicate x dp_shard x cp x tp      (row-major over the ranks: tp varies fastest)

so a tensor-parallel group is tp consecutive ranks inside one node, a context-parallel group comes
next, then data parallelism and the pipeline stages, which span nodes (parallel/dims.py builds the
mesh from it). The words are torchtitan's:

- ``dp_shard``: the data-parallel ranks the dense weights shard over (FSDP2; ZeRO and DDP hold their
  states or replicas over them); ``dp_replicate``: HSDP's replicas of that shard group;
- ``cp``: context-parallel ranks, each holding 1/cp of every sequence; for gradients they are
  data-parallel ranks too (FSDP2 shards over dp_shard x cp);
- ``ep``: expert-parallel ranks, carved out of dp_shard x cp: each holds 1/ep of every MoE layer's
  routed experts, and FSDP2 shards those over the dp_shard x cp / ep ranks that hold the same ones.
  With cp > 1 an ep group spans whole cp groups, so ep is a multiple of cp.
- ``etp``: expert tensor parallelism, 1 or tp (torchtitan's two choices): 1 replicates every routed
  expert over the tp ranks, tp splits each expert's matrices over them as tp splits a dense MLP
  (parallel/tp.py). It adds no ranks: the tp group is the expert-tensor group, so the ranks holding
  the same experts (expert data parallelism, ``edp``) are those of the dense weights less ep.

A ``Layout`` is built once, from the parallel section and the world size (``Layout.of``), and checked
then. Every layout rule is written here and nowhere else:

- ``check_keys``: the section's own keys, which need neither the world size nor the model (a
  ``Layout`` runs them again on itself);
- ``Layout.__post_init__``: what needs the world size (the product of the degrees, ep inside
  dp_shard x cp, tensor-parallel groups inside a node);
- ``check_trainer_keys`` (and a sharded strategy needing something to shard, in ``Layout.of``):
  what this trainer's implementation composes. The estimator models other frameworks' runs and
  leaves them out of a ``Layout`` it builds; its planner applies them as train.py does, through the
  config and ``Layout.of``. ``check_section`` is both key checks: the config runs it when it is
  loaded, before the world size is known;
- ``check_model``: the layout against the model, the sequence and the micro-batches (the trainer's
  config and the estimator both call it).

The data-parallel strategy is resolved here too (``resolve_strategy``): a layout carries the strategy
the run uses, so "is it FSDP?" is answered once (``Layout.fsdp``). ``describe`` prints a layout in one
line; ``overrides`` turns it back into ``--parallel.key=value``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from common.errors import ConfigError, LayoutError

# The keys of the parallel section a layout is made of, in the order ``overrides`` writes them.
LAYOUT_KEYS = ("strategy", "dp_replicate", "dp_shard", "cp", "tp", "pp", "ep", "etp", "pp_schedule",
               "pp_virtual_stages", "sequence_parallel")
# Schedules that run several model chunks (virtual stages) per pipeline rank.
MULTI_CHUNK_SCHEDULES = ("interleaved_1f1b", "zero_bubble")
# Data-parallel strategies that cannot wrap tensor- or pipeline-parallel models (DTensor parameters, stages).
WHOLE_MODEL_STRATEGIES = ("ddp", "zero1", "zero2", "zero3")
DP_SHARD_MEANING = "dp_shard counts every data-parallel rank the dense weights shard over, the ep ranks among them"


@dataclass(frozen=True)
class Layout:
    """A run's layout, resolved and checked: ``dp_shard`` is never -1 and ``strategy`` is what runs.

    ``ranks_per_node`` (the launcher's LOCAL_WORLD_SIZE) is None where no launcher is involved (the
    estimator): the rule that keeps tensor-parallel groups inside a node is then not checked.
    """

    world_size: int = 1
    strategy: str = "none"
    dp_replicate: int = 1
    dp_shard: int = -1  # -1: the ranks the other degrees leave
    cp: int = 1
    tp: int = 1
    pp: int = 1
    ep: int = 1
    etp: int = 1  # 1: routed experts replicated over tp; tp: each split over the tp ranks
    pp_schedule: str = "1f1b"
    pp_virtual_stages: int = 1
    sequence_parallel: bool = True  # with tp > 1; the config's default
    ranks_per_node: int | None = None

    def __post_init__(self) -> None:
        check_keys(self)
        if self.world_size < 1:
            raise LayoutError(f"world size {self.world_size} must be >= 1")
        fixed = self.pp * self.dp_replicate * self.cp * self.tp
        if self.dp_shard == -1:
            if self.world_size % fixed:
                raise LayoutError(
                    f"parallel.pp={self.pp} x parallel.dp_replicate={self.dp_replicate} x parallel.cp={self.cp} x "
                    f"parallel.tp={self.tp} = {fixed} does not divide the {self.world_size} ranks; choose degrees whose "
                    "product divides it"
                )
            object.__setattr__(self, "dp_shard", self.world_size // fixed)
        if fixed * self.dp_shard != self.world_size:
            raise LayoutError(
                f"parallel.pp={self.pp} x dp_replicate={self.dp_replicate} x dp_shard={self.dp_shard} x cp={self.cp} x "
                f"tp={self.tp} = {fixed * self.dp_shard} ranks, but {self.world_size} were launched; make the product "
                f"equal the world size ({DP_SHARD_MEANING}; dp_shard=-1 takes the ranks left over)"
            )
        if self.dp_shard_cp % self.ep:
            ranks = f"dp_shard={self.dp_shard} x cp={self.cp} = {self.dp_shard_cp}" if self.cp > 1 else f"dp_shard={self.dp_shard}"
            raise LayoutError(f"parallel.ep={self.ep} must divide the {ranks} ranks it is carved out of ({DP_SHARD_MEANING}); "
                              f"choose parallel.dp_shard a multiple of {self.ep_shard}")
        if self.ranks_per_node is not None and self.tp > 1 and self.ranks_per_node % self.tp:
            raise LayoutError(
                f"parallel.tp={self.tp} must divide the {self.ranks_per_node} ranks per node: tensor-parallel "
                "groups stay inside a node, where their per-layer collectives have the bandwidth they need"
            )
        strategy, _ = resolve_strategy(self.strategy, self)
        object.__setattr__(self, "strategy", strategy)

    @classmethod
    def of(cls, parallel: Any, world_size: int, ranks_per_node: int | None = None) -> Layout:
        """The layout of a ``parallel`` config section on ``world_size`` ranks, ``ranks_per_node`` to a
        node, as this trainer runs it: its own rules too (``check_trainer_keys``, and a sharded strategy
        needs something to shard). HSDP's shorthand ``parallel.fsdp_hybrid`` becomes one replica per
        node, sharded inside it."""
        check_section(parallel)  # HSDP's shorthand among them, before it is spelled out
        keys = {key: getattr(parallel, key) for key in LAYOUT_KEYS}
        if getattr(parallel, "fsdp_hybrid", False):
            per_node = ranks_per_node or world_size
            keys |= {"dp_replicate": max(1, world_size // per_node), "dp_shard": min(per_node, world_size)}
        layout = cls(world_size=world_size, ranks_per_node=ranks_per_node, **keys)
        if layout.fsdp and world_size > 1 and layout.dp_shard_cp * layout.dp_replicate == 1:
            raise LayoutError(f"parallel.strategy=fsdp, but the layout leaves one data-parallel rank ({layout.describe()}): "
                              "nothing to shard over; use parallel.strategy=none")
        return layout

    # ----------------------------------------------------------------- derived degrees

    @property
    def dp(self) -> int:
        """Data-parallel ranks (dp_replicate x dp_shard): how many micro-batches run side by side."""
        return self.dp_replicate * self.dp_shard

    @property
    def dp_shard_cp(self) -> int:
        """The ranks that shard the dense weights and average their gradients together: dp_shard with
        the cp ranks folded in (they hold the same weights and see different tokens)."""
        return self.dp_shard * self.cp

    @property
    def ep_shard(self) -> int:
        """dp_shard ranks one expert-parallel group spans: ep, or ep / cp with cp (whose ranks are the rest)."""
        return self.ep // self.cp if self.ep > 1 and self.cp > 1 else self.ep

    @property
    def edp(self) -> int:
        """dp_shard ranks that hold the same experts (dp_shard x cp / ep): FSDP2 shards the experts over them."""
        return self.dp_shard // self.ep_shard

    @property
    def sp(self) -> bool:
        """Sequence parallelism in effect (it only means something with tp > 1)."""
        return self.tp > 1 and self.sequence_parallel

    @property
    def fsdp(self) -> bool:
        """Whether FSDP2 shards the model (over dp_shard x cp, and dp_replicate for HSDP)."""
        return self.strategy == "fsdp"

    @property
    def stages(self) -> int:
        """Pipeline stages in all: pp ranks x virtual stages each."""
        return self.pp * self.pp_virtual_stages

    # ----------------------------------------------------------------- words

    def describe(self) -> str:
        """The layout in one line of the config's words, e.g. ``strategy=fsdp dp_shard=8 tp=8 pp=1``.
        dp_replicate, ep, cp, the schedule and sequence_parallel are named only where they apply."""
        words = [f"strategy={self.strategy}"]
        if self.dp_replicate > 1:
            words.append(f"dp_replicate={self.dp_replicate}")
        words += [f"dp_shard={self.dp_shard}", f"tp={self.tp}", f"pp={self.pp}"]
        if self.ep > 1:
            words.append(f"ep={self.ep}")
        if self.etp > 1:
            words.append(f"etp={self.etp}")
        if self.pp > 1:
            words.append(f"pp_schedule={self.pp_schedule}")
            if self.pp_virtual_stages > 1:
                words.append(f"pp_virtual_stages={self.pp_virtual_stages}")
        if self.tp > 1:
            words.append(f"sequence_parallel={'true' if self.sequence_parallel else 'false'}")
        if self.cp > 1:
            words.append(f"cp={self.cp}")
        return " ".join(words)

    def overrides(self) -> list[str]:
        """The layout as ``--parallel.key=value`` overrides: on the same world size, a config loaded with
        them gives this layout back (``Layout.of``)."""
        def word(value: Any) -> str:
            return ("true" if value else "false") if isinstance(value, bool) else str(value)

        return [f"--parallel.{key}={word(getattr(self, key))}" for key in LAYOUT_KEYS]

    def strategy_note(self, requested: str) -> str | None:
        """One log line when the section asked for ``requested`` and the layout runs another strategy."""
        _, why = resolve_strategy(requested, self)
        return why


def resolve_strategy(requested: str, layout: Any) -> tuple[str, str | None]:
    """The data-parallel strategy a layout runs with, and a log line saying why when it is not the one
    requested. Strategy none on several data-parallel ranks would train unsynchronized replicas, so
    they get DDP, or FSDP2 for tensor- or pipeline-parallel models (which DDP cannot wrap); with
    expert or context parallelism, FSDP2 (their gradients are averaged through its meshes)."""
    if requested != "none":
        return requested, None
    if layout.ep > 1:
        return "fsdp", (f"parallel: strategy none with parallel.ep={layout.ep} -> fsdp (expert and dense gradients "
                        "averaged through FSDP2's meshes)")
    if layout.cp > 1:
        return "fsdp", (f"parallel: strategy none with parallel.cp={layout.cp} -> fsdp (context-parallel ranks average "
                        "gradients as data-parallel ones do)")
    dp = layout.dp_replicate * layout.dp_shard
    if dp > 1:
        strategy = "ddp" if layout.tp == 1 and layout.pp == 1 else "fsdp"
        return strategy, f"parallel: strategy none with {dp} data-parallel ranks -> {strategy} (gradients averaged)"
    return "none", None


# --------------------------------------------------------------------------- the rules


def check_section(p: Any) -> None:
    """The rules a parallel section must pass before the world size is known: its keys' own rules and
    this trainer's (the config runs them when it is loaded, ``Layout.of`` again at launch)."""
    check_keys(p)
    check_trainer_keys(p)


def check_keys(p: Any) -> None:
    """The rules on the parallel section's own keys (``p``: the section, or a ``Layout``), which need
    neither the world size nor the model; a ConfigError naming the key otherwise."""
    for key in ("tp", "pp", "cp", "ep", "etp", "dp_replicate", "pp_virtual_stages"):
        if getattr(p, key) < 1:
            raise ConfigError(f"parallel.{key} must be >= 1 (got {getattr(p, key)})")
    if p.dp_shard != -1 and p.dp_shard < 1:
        raise ConfigError(f"parallel.dp_shard must be >= 1, or -1 for the ranks left over (got {p.dp_shard})")
    if p.pp == 1:  # pipeline keys without a pipeline would be ignored: say so instead
        unused = [f"pp_schedule={p.pp_schedule}" if p.pp_schedule != "1f1b" else "",
                  f"pp_virtual_stages={p.pp_virtual_stages}" if p.pp_virtual_stages != 1 else ""]
        unused = [u for u in unused if u]
        if unused:
            raise ConfigError(f"parallel.{unused[0]} has no effect with parallel.pp=1 (no pipeline): set "
                              "parallel.pp > 1, or leave the pipeline keys at their defaults")
    if p.pp_schedule not in MULTI_CHUNK_SCHEDULES and p.pp_virtual_stages != 1:
        raise ConfigError(f"parallel.pp_schedule={p.pp_schedule} runs one stage per rank; set "
                          "parallel.pp_virtual_stages=1 or an interleaved schedule")
    if p.pp_schedule == "interleaved_1f1b" and p.pp > 1 and p.pp_virtual_stages < 2:
        raise ConfigError("parallel.pp_schedule=interleaved_1f1b needs parallel.pp_virtual_stages >= 2 "
                          "(with one stage per rank it is 1f1b)")
    if p.ep > 1 and p.cp > 1 and p.ep % p.cp:
        raise ConfigError(f"parallel.ep={p.ep} with parallel.cp={p.cp}: an expert-parallel group spans whole "
                          "context-parallel groups, so ep must be a multiple of cp; choose ep = cp x n")
    if p.etp not in (1, p.tp):
        raise ConfigError(f"parallel.etp={p.etp} splits each routed expert over the tensor-parallel ranks: it must be "
                          f"1 (experts replicated over tp) or parallel.tp={p.tp}; set parallel.etp=1"
                          + ("" if p.tp > 1 else f" or parallel.tp={p.etp}"))
    hybrid = getattr(p, "fsdp_hybrid", False)  # a section key; a Layout has it spelled out
    if hybrid and p.ep > 1:
        raise ConfigError(f"parallel.ep={p.ep} with parallel.fsdp_hybrid: set parallel.dp_replicate and "
                          "parallel.dp_shard instead")
    if hybrid and (p.tp > 1 or p.pp > 1 or p.cp > 1 or p.dp_replicate != 1):
        raise ConfigError("parallel.fsdp_hybrid is the shorthand for dp_replicate=<nodes> without tp or pp; "
                          "set parallel.dp_replicate (and dp_shard) instead")
    if p.dp_replicate > 1 and p.strategy != "fsdp":
        raise ConfigError(f"parallel.dp_replicate={p.dp_replicate} is HSDP's replicate dimension: it needs "
                          f"parallel.strategy=fsdp (got {p.strategy}); other strategies replicate over dp_shard")


def check_trainer_keys(p: Any) -> None:
    """The rules of this trainer's implementation on the section's keys (``p``: the section, or a
    ``Layout``): which data-parallel strategy composes with which dimension here. The estimator
    models other frameworks' runs too and does not apply them to a ``Layout``; its planner, which
    proposes only what train.py runs, applies them through the trainer's config."""
    if (p.tp > 1 or p.pp > 1) and p.strategy in WHOLE_MODEL_STRATEGIES:
        raise ConfigError(f"parallel.strategy={p.strategy} cannot wrap tensor- or pipeline-parallel models "
                          "(DTensor parameters, stages); use parallel.strategy=fsdp for their data parallelism")
    if p.cp > 1 and p.strategy not in ("none", "fsdp"):
        raise ConfigError(f"parallel.cp={p.cp} with parallel.strategy={p.strategy} is not supported: context-"
                          "parallel ranks reduce gradients through FSDP2's mesh; use parallel.strategy=fsdp")
    if p.ep > 1 and p.strategy not in ("none", "fsdp"):
        raise ConfigError(f"parallel.ep={p.ep} with parallel.strategy={p.strategy} is not supported: expert "
                          "parameters are sharded by FSDP2 over the ranks left after ep; use parallel.strategy=fsdp")


def check_model(p: Any, model: Any, *, seq_len: int, micro_batches: int, seq_key: str = "data.seq_len") -> None:
    """The rules that tie a layout (``p``: the parallel section or a ``Layout``) to the model
    (a ``ModelConfig``), the sequence length (named ``seq_key`` in errors) and the micro-batches per
    step (train.grad_accum_steps): what splitting heads, layers, sequences and experts needs. The
    trainer's config and the estimator both run them; a ConfigError naming the keys otherwise."""
    experts = model.moe.experts
    if p.ep > 1 and experts is None:
        raise ConfigError(f"parallel.ep={p.ep} shards routed experts, but the model has none: set model.moe.experts "
                          "or parallel.ep=1")
    if p.ep > 1 and experts % p.ep:
        raise ConfigError(f"parallel.ep={p.ep} must divide model.moe.experts={experts} (each ep rank holds "
                          "moe.experts / ep of them)")
    if p.etp > 1:
        if experts is None:
            raise ConfigError(f"parallel.etp={p.etp} splits routed experts over the tp ranks, but the model has none: "
                              "set model.moe.experts or parallel.etp=1")
        if model.expert_d_ff % p.etp:
            raise ConfigError(f"parallel.etp={p.etp} must divide the experts' width model.moe.d_ff={model.expert_d_ff} "
                              "(each tp rank holds 1/etp of every expert's columns); choose model.moe.d_ff a multiple "
                              "of it or parallel.etp=1")
        if model.moe.bias:
            raise ConfigError(f"parallel.etp={p.etp} with model.moe.bias is not supported yet (each expert's output "
                              "bias would be added once per tp rank); set parallel.etp=1")
    if p.tp > 1:
        for key, value in (("n_head", model.n_head), ("n_kv_head", model.kv_heads), ("d_ff", model.d_ff),
                           ("vocab_size", model.vocab_size)):
            if value % p.tp:
                raise ConfigError(f"parallel.tp={p.tp} must divide model.{key}={value} (each rank holds 1/tp of it)")
        if p.sequence_parallel and seq_len % p.tp:
            raise ConfigError(f"parallel.sequence_parallel splits the sequence over parallel.tp={p.tp} ranks: "
                              f"{seq_key}={seq_len} must divide by it")
    if p.pp > 1:
        stages = p.pp * p.pp_virtual_stages
        if model.n_layer % stages:
            raise ConfigError(f"model.n_layer={model.n_layer} must divide into parallel.pp x pp_virtual_stages = "
                              f"{stages} pipeline stages of equal size")
        problem = microbatch_problem(p, micro_batches)
        if problem:
            raise ConfigError(problem)
    if p.cp > 1:
        if seq_len % (2 * p.cp):
            raise ConfigError(f"parallel.cp={p.cp} splits each sequence into 2 x cp = {2 * p.cp} equal chunks: "
                              f"{seq_key}={seq_len} must divide by {2 * p.cp}")
        if p.tp > 1 and p.sequence_parallel and (seq_len // p.cp) % p.tp:
            raise ConfigError(f"parallel.sequence_parallel splits each cp rank's {seq_len // p.cp} tokens over "
                              f"parallel.tp={p.tp}: {seq_key} / parallel.cp must divide by parallel.tp")


def microbatch_problem(p: Any, micro_batches: int) -> str | None:
    """Why the pipeline of ``p`` cannot run ``micro_batches`` micro-batches per step, or None: every
    stage needs one (torch's schedules check it), and the multi-chunk schedules run them in rounds of pp."""
    if p.pp == 1:
        return None
    if micro_batches < p.pp:
        return (f"train.grad_accum_steps={micro_batches} is the number of pipeline micro-batches: it must be >= "
                f"parallel.pp={p.pp} to keep every stage busy")
    if p.pp_schedule in MULTI_CHUNK_SCHEDULES and micro_batches % p.pp:
        return (f"parallel.pp_schedule={p.pp_schedule} needs train.grad_accum_steps (micro-batches) divisible by "
                f"parallel.pp={p.pp}")
    return None
