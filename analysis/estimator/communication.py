"""Communication: what each strategy puts through collectives (ZeRO paper, section 7), and the time
and bytes of the data-, tensor-, context-, pipeline- and expert-parallel exchanges."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from analysis.estimator.activations import checkpointed_layers
from analysis.estimator.job import STATE_BYTES, STRATEGIES, JobSpec, check_choice
from analysis.estimator.memory import stage_routed_parameters
from common.hardware import DeviceSpec
from model.config import ModelConfig


@dataclass(frozen=True)
class CommVolume:
    """Bytes of whole tensors entering collectives per optimizer step, and bytes each GPU sends."""

    all_reduce: float  # M of the all-reduces
    reduce_scatter: float
    all_gather: float
    world_size: int  # ranks of those collectives (the data-parallel, or HSDP shard, group)
    replica_all_reduce: float = 0.0  # HSDP: M of the all-reduce across replicas
    replicas: int = 1
    tensor_parallel: float = 0.0  # bytes each GPU sends in tensor-parallel collectives per step
    pipeline: float = 0.0  # bytes each GPU sends to its neighbouring stages per step
    expert_all_to_all: float = 0.0  # bytes each GPU sends in expert-parallel dispatch and combine per step
    expert_sharded: float = 0.0  # bytes each GPU sends gathering and reducing its experts (FSDP over dp_shard / ep)
    muon: float = 0.0  # bytes each GPU sends moving sharded Muon matrices to their owners and back

    @property
    def sent_per_gpu(self) -> float:
        extra = self.tensor_parallel + self.pipeline + self.expert_all_to_all + self.expert_sharded + self.muon
        if self.replicas > 1:
            extra += 2 * (self.replicas - 1) / self.replicas * self.replica_all_reduce
        if self.world_size <= 1:
            return extra
        frac = (self.world_size - 1) / self.world_size
        return frac * (2 * self.all_reduce + self.reduce_scatter + self.all_gather) + extra


def comm_volume(n_params: float, strategy: str, world_size: int, precision: str) -> CommVolume:
    """What each strategy puts through collectives per step (ZeRO paper, section 7)."""
    check_choice("strategy", strategy, STRATEGIES)
    per = STATE_BYTES[precision]
    grads, params = n_params * per.grad, n_params * per.param
    if strategy == "none" or world_size <= 1:
        return CommVolume(0.0, 0.0, 0.0, world_size)
    if strategy == "ddp":
        return CommVolume(grads, 0.0, 0.0, world_size)
    if strategy in ("zero1", "zero2"):
        return CommVolume(0.0, grads, params, world_size)
    return CommVolume(0.0, grads, 2 * params, world_size)  # all-gather in forward and in backward


def collective_seconds(
    nbytes: float, world_size: int, device: DeviceSpec, link_fraction: float = 0.8, *, ranks_per_node: int | None = None
) -> float:
    """One reduce-scatter or all-gather of a ``nbytes`` tensor over ``world_size`` GPUs (two-level).

    ``ranks_per_node``: how many of the group share a node (default: as many as fit, i.e. the
    group is packed); a data-parallel group strided by tensor parallelism has fewer per node.
    """
    if world_size <= 1 or nbytes == 0:
        return 0.0
    local = max(1, min(world_size, ranks_per_node or device.gpus_per_node))
    nodes = math.ceil(world_size / local)
    intra = (local - 1) / local * nbytes / (device.nvlink_one_way_gb_s * 1e9 * link_fraction)
    inter = (nodes - 1) / nodes * nbytes / local / (device.network_gb_s * 1e9 * link_fraction)
    return intra + inter


# NCCL's own cost model of a ring all-gather or reduce-scatter (its tuning model, src/graph/tuning.cc, ring
# algorithm with the Simple protocol that large messages use), microseconds: a base latency, then one step per
# rank after the first, each crossing NVLink or, for the steps that leave a node, the network.
NCCL_RING_BASE_US = 8.4
NCCL_RING_NVLINK_STEP_US = 5.7
NCCL_RING_NETWORK_STEP_US = 6.6


def ring_latency_seconds(world_size: int, ranks_per_node: int) -> float:
    """The fixed cost of one ring all-gather or reduce-scatter over ``world_size`` GPUs, whatever its size,
    as NCCL's tuning model counts it: N - 1 steps, of which nodes - 1 cross the network."""
    if world_size <= 1:
        return 0.0
    nodes = math.ceil(world_size / max(1, min(world_size, ranks_per_node)))
    steps, network = world_size - 1, nodes - 1
    return 1e-6 * (NCCL_RING_BASE_US + (steps - network) * NCCL_RING_NVLINK_STEP_US
                   + network * NCCL_RING_NETWORK_STEP_US)


def parameter_tensors(cfg: ModelConfig) -> int:
    """The parameter tensors of a dense model (model.gpt's, as Megatron-LM's GPT names them too): per
    block two norms (gain, and bias with a biased LayerNorm), the fused QKV and the output projection
    (each a weight and, if the model has them, a bias), the query/key norms, the sinks, the MLP's two
    (SwiGLU: three) matrices and their biases; outside the blocks the token table, learned positions,
    the final norm and an untied head."""
    norm = 2 if cfg.norm == "layernorm" and cfg.bias else 1
    attention = 2 + cfg.has_qkv_bias + cfg.has_proj_bias + 2 * cfg.qk_norm + cfg.attention_sinks
    mlp = (3 if cfg.mlp == "swiglu" else 2) * (1 + cfg.bias)
    outside = 1 + (cfg.position == "learned") + norm + (not cfg.tie_embeddings)
    return cfg.n_layer * (2 * norm + attention + mlp) + outside


def zero3_collective_count(job: JobSpec) -> tuple[float, float]:
    """(all-gathers, reduce-scatters) per step of each parameter tensor under
    ``zero3_collectives=per_parameter_sync``: DeepSpeed's ZeRO-3 as released in 2021 (deepspeed.zero's
    partition_parameters.py) gathers every parameter tensor in its own all-gather when a module's forward
    starts and frees it when the forward ends, gathers it again for the module's backward, and again for a
    forward recomputed in backward (Megatron-LM's activation checkpointing runs the layer's forward, hooks
    and all); each gradient is reduce-scattered on its own. Every micro-batch does this."""
    m, cfg = job.grad_accum, job.model
    redone = {"full": 1.0, "every_k": checkpointed_layers(cfg.n_layer, cfg.recompute_every_k) / cfg.n_layer}
    return (2 + redone.get(job.recompute, 0.0)) * m, float(m)


def _per_node(job: JobSpec, stride: int, group: int) -> int:
    """Ranks of a mesh group whose members sit ``stride`` ranks apart that share one node."""
    return max(1, min(group, job.device.gpus_per_node // stride))


def tp_comm_seconds(job: JobSpec, stage: int = 0) -> tuple[float, float]:
    """(seconds, bytes sent per GPU) of tensor-parallel collectives for one micro-batch on ``stage``.

    Per layer 8 reduce-scatter/all-gather-equivalents of the s*b*h activation (4 forward, 4
    backward; an all-reduce counts as two), 4 more for a layer recomputed in full; the embedding
    and the LM head one each way on their stages (module docstring). With expert tensor parallelism
    a MoE layer's MLP half counts ``expert_tp_collectives`` instead of a dense MLP's 2 + 2 (the
    stage's mean share of MoE layers, as the rest of the estimator averages blocks).
    """
    t = job.layout.tp
    if t == 1:
        return 0.0, 0.0
    cfg = job.model
    activation = job.activation_dtype_bytes * job.local_seq_len * job.micro_batch * cfg.d_model
    one = collective_seconds(activation, t, job.device, job.assumptions.link_fraction,
                             ranks_per_node=_per_node(job, 1, t))
    layers = cfg.n_layer // job.layout.pp
    recomputed = {"full": layers, "every_k": checkpointed_layers(cfg.n_layer, cfg.recompute_every_k) / job.layout.pp}
    redone = recomputed.get(job.recompute, 0)
    count = 8 * layers + 4 * redone
    if job.layout.etp > 1:
        forward, backward = expert_tp_collectives(job)
        moe_share = cfg.n_moe_layers / cfg.n_layer
        count += moe_share * (layers * (forward + backward - 4) + redone * (forward - 2))
    count += 2 * (stage == 0) + 2 * (stage == job.layout.pp - 1)
    return count * one, count * (t - 1) / t * activation


def expert_tp_collectives(job: JobSpec) -> tuple[float, float]:
    """(forward, backward) reduce-scatter/all-gather-equivalents of the s*b*h activation in one MoE
    layer's MLP half under expert tensor parallelism (parallel/tp.py ``split_moe``), as the trainer
    runs them. Forward: the layer input all-gathered (sequence parallelism; its backward is a
    local slice), the routed experts' partial outputs all-reduced (k rows per token: 2k, dropless),
    the shared experts' all-reduced (2). Backward: the output's gradient all-gathered (sequence
    parallelism; its forward was a local slice), the routed rows' gradients all-reduced (2k), and
    one all-reduce per column-parallel shared projection (2 each: gate and up for SwiGLU)."""
    cfg, sp = job.model, job.layout.sp
    routed = 2 * cfg.moe.top_k
    shared = 1 if cfg.moe.shared_experts else 0
    gated = 2 if cfg.mlp == "swiglu" else 1
    return sp + routed + 2 * shared, sp + routed + 2 * gated * shared


def kv_gather_bytes(model_cfg: ModelConfig, seq_len: int, micro_batch: int, dtype_bytes: int, tp: int = 1) -> float:
    """Bytes of one layer's gathered keys and values on one cp GPU: the whole sequence's K and V of
    the KV heads it holds (kv_dim / tp wide); latent attention gathers what it makes them from
    instead, its latent and rotary key (kv_lora_rank + qk_rope_head_dim, the same on every tp rank).
    The all-gather brings in (cp - 1) / cp of them, and each GPU sends its own share to the cp - 1
    others: (cp - 1) / cp of this, per layer and direction."""
    if model_cfg.is_mla:
        return dtype_bytes * micro_batch * seq_len * (model_cfg.kv_lora_rank + model_cfg.qk_rope_head_dim)
    return dtype_bytes * micro_batch * seq_len * 2 * model_cfg.kv_dim / tp


def cp_comm_seconds(job: JobSpec) -> tuple[float, float]:
    """(seconds, bytes sent per GPU) of context-parallel collectives for one micro-batch: per layer
    one all-gather of K and V forward and one reduce-scatter of their gradients backward, and one
    more all-gather for a layer whose core is recomputed (selective, full, every_k's layers; latent
    attention gathers before its core, so selective recompute does not gather again). Counted as not
    overlapped with compute (the trainer issues them in line)."""
    cp, cfg = job.layout.cp, job.model
    if cp == 1:
        return 0.0, 0.0
    nbytes = kv_gather_bytes(cfg, job.seq_len, job.micro_batch, job.activation_dtype_bytes, job.layout.tp)
    layers = cfg.n_layer // job.layout.pp
    recomputed = {"selective": 0 if cfg.is_mla else layers, "full": layers,
                  "every_k": checkpointed_layers(cfg.n_layer, cfg.recompute_every_k) / job.layout.pp}
    count = 2 * layers + recomputed.get(job.recompute, 0)
    # cp groups sit inside tp on the mesh (dims.py): members tp ranks apart
    one = collective_seconds(nbytes, cp, job.device, job.assumptions.link_fraction,
                             ranks_per_node=_per_node(job, job.layout.tp, cp))
    return count * one, count * (cp - 1) / cp * nbytes


def pp_comm_seconds(job: JobSpec) -> tuple[float, float]:
    """(seconds, bytes sent per GPU) of one micro-batch's activations and gradients between stages:
    one of each per model chunk (``pp_virtual_stages`` of them on an interleaved GPU). Under context
    parallelism each cp rank sends its seq_len / cp tokens to the same cp rank of the next stage."""
    if job.layout.pp == 1:
        return 0.0, 0.0
    cfg, frac = job.model, job.assumptions.link_fraction
    # Each tensor-parallel rank sends 1/t of the activation: its sequence shard under sequence
    # parallelism, or its slice of the replicated tensor (Megatron's scatter/gather, which re-gathers it
    # over NVLink on the receiving stage).
    nbytes = job.activation_dtype_bytes * job.local_seq_len * job.micro_batch * cfg.d_model / job.layout.tp
    same_node = job.layout.world_size <= job.device.gpus_per_node  # stages are the outermost mesh dimension
    link = job.device.nvlink_one_way_gb_s if same_node else job.device.network_gb_s
    sent = 2 * job.layout.pp_virtual_stages * nbytes
    return sent / (link * 1e9 * frac), sent


def fsdp_collectives(job: JobSpec) -> tuple[int, int]:
    """(all-gathers, reduce-scatters) of its parameters that a ZeRO-3/FSDP GPU runs per optimizer step.

    Without pp every micro-batch gathers in forward and again in backward (once, when
    ``fsdp_reshard_after_forward`` keeps the forward's copy) and reduce-scatters its gradients. Under pp,
    torch.distributed.pipelining keeps gradients unreduced and parameters gathered after the first
    backward until the step ends; with reshard_after_forward every micro-batch's forward gathers again
    (m forwards + 1 backward gather), without it the first gather serves the whole step."""
    m = job.grad_accum
    if job.zero3_collectives == "per_parameter_sync":
        return zero3_collective_count(job)
    if job.layout.pp == 1:
        return (2 if job.fsdp_reshard_after_forward else 1) * m, m
    return (m + 1 if reshards_after_forward(job) else 1), 1


def reshards_after_forward(job: JobSpec) -> bool:
    """Whether the trainer's FSDP2 blocks free their gathered weights after forward: the setting,
    except in a zero_bubble pipeline, which keeps them for its weight-gradient pass
    (ParallelConfig.reshard_blocks_after_forward)."""
    return job.fsdp_reshard_after_forward and not (job.layout.pp > 1 and job.layout.pp_schedule == "zero_bubble")


def gradient_reductions(job: JobSpec) -> int:
    """Gradient reductions per optimizer step of DDP and ZeRO-1/2: one, at the accumulation boundary,
    except where the framework reduces every micro-batch's gradients. DeepSpeed's ZeRO-2 does (its
    backward hooks reduce each bucket as it fills and the reduced partition accumulates; its engine
    says "ZeRO stage >= 2 communicates during non gradient accumulation boundaries as well"), and
    so does DDP without ``no_sync`` (``ddp_no_sync=False``); DeepSpeed's ZeRO-1, the trainer's DDP
    and Megatron's distributed optimizer reduce once."""
    strategy, m = job.layout.strategy, job.grad_accum
    if strategy == "zero2" and job.zero_reduction == "deepspeed":
        return m
    if strategy == "ddp" and not job.ddp_no_sync:
        return m
    return 1


def dp_volume(job: JobSpec, n_params: float, shard: int | None = None) -> CommVolume:
    """What a GPU holding ``n_params`` of the job's weights puts through data-parallel collectives per
    step (``_dp_comm``): for ZeRO-1/2 as the framework runs them (``JobSpec.zero_reduction``:
    DeepSpeed all-reduces the gradients, ``gradient_reductions`` times, and all-gathers the updated
    partitions; a reduce-scatter implementation reduce-scatters instead), for FSDP
    ``fsdp_collectives``' gathers and reduce-scatters."""
    return _dp_comm(job, n_params, shard)[0]


def _dp_comm(job: JobSpec, n_params: float, shard: int | None = None) -> tuple[CommVolume, float]:
    """Data-parallel traffic of one GPU holding ``n_params`` per step, and its time (before overlap).
    ``shard``: the GPUs that shard these parameters together (default: the dense weights', dp_shard x cp;
    cp ranks average gradients with the data-parallel ones); HSDP replicates them dp_replicate times."""
    frac = job.assumptions.link_fraction
    group = shard or job.layout.dp_shard_cp
    volume = comm_volume(n_params, job.layout.strategy, group, job.precision)
    if job.layout.dp_replicate > 1:  # HSDP: FSDP inside the shard group, then the reduced shard is all-reduced across replicas
        grads = n_params * STATE_BYTES[job.precision].grad / group
        volume = dataclasses.replace(volume, replica_all_reduce=grads, replicas=job.layout.dp_replicate)
    per = STATE_BYTES[job.precision]
    if job.layout.strategy in ("zero3", "fsdp") and group > 1:
        gathers, scatters = fsdp_collectives(job)
        volume = dataclasses.replace(volume, all_gather=gathers * n_params * per.param,
                                     reduce_scatter=scatters * n_params * per.grad)
    elif job.layout.strategy in ("ddp", "zero1", "zero2") and group > 1:
        reductions = gradient_reductions(job)
        if job.layout.strategy == "ddp" or job.zero_reduction == "deepspeed":
            volume = dataclasses.replace(volume, all_reduce=reductions * n_params * per.grad, reduce_scatter=0.0)
        else:
            volume = dataclasses.replace(volume, reduce_scatter=reductions * n_params * per.grad)
    link = dict(ranks_per_node=_per_node(job, job.layout.tp, group))
    seconds = (
        2 * collective_seconds(volume.all_reduce, group, job.device, frac, **link)
        + collective_seconds(volume.reduce_scatter, group, job.device, frac, **link)
        + collective_seconds(volume.all_gather, group, job.device, frac, **link)
    )
    if job.layout.strategy in ("zero3", "fsdp") and group > 1 and job.zero3_collectives == "per_parameter_sync":
        # one collective per parameter tensor: each pays NCCL's fixed ring cost, which grows with the ranks
        seconds += sum(zero3_collective_count(job)) * parameter_tensors(job.model) * ring_latency_seconds(
            group, link["ranks_per_node"])
    if volume.replicas > 1:
        outer = dict(ranks_per_node=_per_node(job, job.layout.tp * group, volume.replicas))
        seconds += 2 * collective_seconds(volume.replica_all_reduce, volume.replicas, job.device, frac, **outer)
    return volume, seconds


def expert_exchanges(job: JobSpec) -> float:
    """All-to-alls of token rows per micro-batch on a stage (the mean stage): per MoE layer the
    dispatch and the combine in forward and their gradients in backward (4), and the forward's two
    again in backward for a layer whose forward is recomputed. That is every layer under ``full``, and
    under ``op_selective`` too (its policy caches the GEMM and attention outputs only, so the
    collectives run again); under ``every_k`` the MoE layers whose 1-based index k divides."""
    cfg = job.model
    if job.recompute in ("full", "op_selective"):
        recomputed = cfg.n_moe_layers
    elif job.recompute == "every_k":
        k = cfg.recompute_every_k
        recomputed = sum(1 for i in range(cfg.n_layer) if cfg.is_moe_layer(i) and (i + 1) % k == 0)
    else:
        recomputed = 0
    return (4 * cfg.n_moe_layers + 2 * recomputed) / job.layout.pp


def expert_all_to_all(job: JobSpec) -> tuple[float, float]:
    """(seconds, bytes sent per GPU) of one micro-batch's expert-parallel all-to-alls on a stage.

    ``expert_exchanges`` of them, each of the micro-batch's top-k token copies (d values each);
    each GPU keeps the 1/ep of its copies routed to its own experts (balanced routing) and sends the
    rest. An all-to-all is modelled as an all-gather of the same bytes (``collective_seconds``);
    across nodes it is slower than that (many small messages), which this does not count.
    """
    cfg = job.model
    if job.layout.ep == 1:
        return 0.0, 0.0
    # Each tp GPU exchanges the copies of the positions it routes: its own s/t under sequence
    # parallelism with experts replicated over tp, all of them without it or with expert tensor
    # parallelism (every tp GPU routes the whole sequence); a cp rank routes its chunks only.
    split = job.layout.tp if job.layout.sp and job.layout.etp == 1 else 1
    copies = job.seq_len * job.micro_batch * cfg.moe.top_k / (split * job.layout.cp)
    nbytes = copies * cfg.d_model * job.activation_dtype_bytes
    count = expert_exchanges(job)
    one = collective_seconds(nbytes, job.layout.ep, job.device, job.assumptions.link_fraction,
                             ranks_per_node=_per_node(job, job.layout.tp, job.layout.ep))
    return count * one, count * (job.layout.ep - 1) / job.layout.ep * nbytes


def _dp_and_expert_comm(job: JobSpec, n_params: float) -> tuple[CommVolume, float]:
    """``_dp_comm`` of a stage holding ``n_params``; with ep > 1 its routed experts travel apart, over
    the dp_shard / ep GPUs holding the same experts (each holding 1/ep of them)."""
    if job.layout.ep == 1:
        return _dp_comm(job, n_params)
    # n_params is the largest stage's: the last when it holds multi-token-prediction modules
    routed = stage_routed_parameters(job, job.layout.pp - 1 if job.model.mtp_depth else 0)
    dense, dense_s = _dp_comm(job, n_params - routed)
    # The GPUs holding the same experts: the shard group over ep (cp ranks are inside the ep group).
    experts, experts_s = _dp_comm(job, routed / job.layout.ep, shard=job.layout.dp_shard_cp // job.layout.ep)
    return dataclasses.replace(dense, expert_sharded=experts.sent_per_gpu), dense_s + experts_s
