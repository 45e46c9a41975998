"""Memory per GPU: model states (ZeRO paper, section 5), what a pipeline stage holds, saved activations
with the micro-batches in flight, logits, gathered FSDP layers, and the fullest stage's peak."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from analysis.estimator.activations import activation_bytes_per_layer, checkpointed_layers, tp_split
from analysis.estimator.job import (
    GIB,
    PP_SCHEDULES,
    PRECISION_MODES,
    STATE_BYTES,
    STRATEGIES,
    JobSpec,
    StateBytes,
    check_choice,
)
from model.config import ModelConfig
from model.flops import block_parameters, blocks_parameters, moe_parameters


def model_state_bytes(n_params: float, strategy: str, world_size: int, precision: str) -> StateBytes:
    """Bytes per GPU of weights, gradients and optimizer state (ZeRO paper, section 5).

    ``n_params`` is what one GPU holds before data-parallel sharding (all of it without tensor or
    pipeline parallelism, ``stage_parameters`` with them); ``world_size`` the ranks it is sharded over.
    """
    check_choice("strategy", strategy, STRATEGIES)
    check_choice("precision", precision, PRECISION_MODES)
    per = STATE_BYTES[precision]
    n = 1 if strategy in ("none", "ddp") else world_size
    shard_opt = strategy in ("zero1", "zero2", "zero3", "fsdp")
    shard_grad = strategy in ("zero2", "zero3", "fsdp")
    shard_param = strategy in ("zero3", "fsdp")
    return StateBytes(
        param=n_params * per.param / (n if shard_param else 1),
        grad=n_params * per.grad / (n if shard_grad else 1),
        optimizer=n_params * per.optimizer / (n if shard_opt else 1),
    )


def block_parameters_per_gpu(cfg: ModelConfig, tp: int = 1, etp: int = 1) -> float:
    """One block's parameters on one of ``tp`` GPUs: the matmul weights (and column-parallel
    biases) are split; norm gains and the two row-parallel output biases are whole (Megatron-LM).
    A MoE layer is whole (router and experts replicated over the tp GPUs, parallel/tp.py), but with
    expert tensor parallelism (``etp`` = tp) only its router (and the shared experts' output bias)
    is: the routed and shared experts are split as a dense MLP. Latent attention's down projections
    and latent norms are whole too (``_latent_whole``). A MoE model's blocks differ (dense and MoE
    layers): their mean, every expert included."""
    block = blocks_parameters(cfg) / cfg.n_layer
    if tp == 1:
        return block
    norm = cfg.d_model * (2 if cfg.norm == "layernorm" and cfg.bias else 1)
    out_bias = cfg.d_model if cfg.bias else 0
    moe_share = cfg.n_moe_layers / cfg.n_layer if cfg.moe.experts is not None else 0.0
    mlp_whole = moe_share * _moe_whole(cfg, etp) + (1 - moe_share) * out_bias
    whole = 2 * norm + out_bias + _latent_whole(cfg) + mlp_whole
    return (block - whole) / tp + whole


def _moe_whole(cfg: ModelConfig, etp: int) -> float:
    """A MoE layer's parameters every tp GPU holds whole: all of them with experts replicated over tp
    (etp = 1), only the router and the shared experts' output bias with expert tensor parallelism."""
    if cfg.moe.experts is None:
        return 0.0
    if etp == 1:
        return moe_parameters(cfg)
    router = (cfg.d_model + (1 if cfg.moe.bias else 0)) * cfg.moe.experts
    return router + (cfg.d_model if cfg.bias and cfg.moe.shared_experts else 0)


def _latent_whole(cfg: ModelConfig) -> int:
    """Latent attention's parameters every tp GPU holds whole (Megatron-LM's latent attention): the
    down projections of the query and of the key/value latent with its rotary key, their biases, and
    the two latent norms; 0 for grouped-query attention."""
    if not cfg.is_mla:
        return 0
    q_rank, kv_down = cfg.q_lora_rank or 0, cfg.kv_lora_rank + cfg.qk_rope_head_dim
    bias = cfg.has_qkv_bias
    query = (cfg.d_model * q_rank + (q_rank if bias else 0) + q_rank) if q_rank else 0
    return query + cfg.d_model * kv_down + (kv_down if bias else 0) + cfg.kv_lora_rank


def mtp_parameters_per_gpu(cfg: ModelConfig, tp: int = 1, etp: int = 1) -> float:
    """The multi-token-prediction modules' parameters on one of ``tp`` GPUs (model.gpt.MTPModule; the
    pipeline's last stage holds them): each module's block split as a block of its kind is (its MoE
    layer as ``_moe_whole`` says, latent attention's down projections whole), its 2d -> d projection
    split, its three norms whole. At tp = 1, ``mtp_parameters``."""
    d = cfg.d_model
    norm = d * (2 if cfg.norm == "layernorm" and cfg.bias else 1)
    out_bias = d if cfg.bias else 0
    total = 0.0
    for k in range(cfg.mtp_depth):
        layer = cfg.n_layer + k
        block = block_parameters(cfg, layer)
        mlp_whole = _moe_whole(cfg, etp) if cfg.is_moe_layer(layer) else out_bias
        whole = 2 * norm + out_bias + _latent_whole(cfg) + mlp_whole
        total += 3 * norm + 2 * d * d / tp + (block - whole) / tp + whole
    return total


def mtp_routed_parameters(cfg: ModelConfig) -> float:
    """Routed expert weights of the multi-token-prediction modules' blocks (before ep splits them)."""
    if cfg.moe.experts is None:
        return 0.0
    matrices = 3 if cfg.mlp == "swiglu" else 2
    moe_blocks = sum(cfg.is_moe_layer(cfg.n_layer + k) for k in range(cfg.mtp_depth))
    return moe_blocks * cfg.moe.experts * matrices * cfg.d_model * cfg.expert_d_ff


def stage_parameters(cfg: ModelConfig, tp: int = 1, pp: int = 1, stage: int = 0, etp: int = 1) -> float:
    """Parameters one GPU of pipeline stage ``stage`` holds under tensor parallelism ``tp`` (and
    expert tensor parallelism ``etp``: ``block_parameters_per_gpu``).

    Each of its L/p blocks counts ``block_parameters_per_gpu``. The first stage holds
    the vocab-parallel token table (1/t) and the learned positions (whole), the last stage the
    final norm and the vocab-parallel LM head. Tied embeddings share one table when one stage
    holds both ends; with p > 1 the last stage keeps its own copy (Megatron-LM keeps the two in
    sync by all-reducing their gradients), and the multi-token-prediction modules
    (``mtp_parameters_per_gpu``). At tp = pp = 1 this is ``count_parameters(cfg)``.
    """
    d, v = cfg.d_model, cfg.vocab_size
    norm = d * (2 if cfg.norm == "layernorm" and cfg.bias else 1)
    n = cfg.n_layer // pp * block_parameters_per_gpu(cfg, tp, etp)
    table = v * d if tp == 1 else v * d / tp
    if stage == 0:
        n += table + (cfg.max_seq_len * d if cfg.position == "learned" else 0)
    if stage == pp - 1:
        head = 0 if cfg.tie_embeddings and pp == 1 else table
        n += norm + head + mtp_parameters_per_gpu(cfg, tp, etp)
    return n


def pipeline_in_flight(schedule: str, stages: int, microbatches: int, virtual_stages: int = 1, stage: int = 0) -> float:
    """Micro-batches' worth of its own layers' activations stage ``stage`` holds at its peak.

    Counts forwards whose backward has not run yet, in units of the whole stage (an interleaved
    GPU runs ``virtual_stages`` chunks, each 1/v of its layers). The warm-up counts are those of
    torch.distributed.pipelining's schedules (see the module docstring); without a pipeline one
    micro-batch is in flight (gradient accumulation frees each before the next).
    """
    check_choice("pp_schedule", schedule, PP_SCHEDULES)
    p, m, v, i = stages, microbatches, virtual_stages, stage
    if p == 1:
        return 1.0
    if schedule == "gpipe":
        return float(m)
    if schedule == "1f1b":
        return float(min(p - i, m))
    per_round = m // max(1, m // p)
    hops = 2 * (p - 1 - i) if schedule == "interleaved_1f1b" else p - 1 - i
    chunks = min((v - 1) * per_round + hops + 1, m * v)
    return chunks / v


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes per GPU at the peak of a step (forward end / backward start), on the fullest stage.

    ``total`` is what the device holds (what nvidia-smi shows, and what must fit); ``reserved`` is
    what PyTorch's caching allocator holds (``torch.cuda.max_memory_reserved``): the total less the
    CUDA context and the communicators' buffers, which live outside it.
    """

    params: float
    grads: float
    optimizer: float
    activations: float  # saved for backward by all layers, plus one layer's recompute working set
    logits: float
    unsharded_params: float  # ZeRO-3/FSDP gathered layers and their unreduced gradients
    overhead: float  # CUDA context and communicator buffers, outside the allocator
    host: float  # offloaded activations, in host memory (not part of total)
    stage: int = 0  # the pipeline stage these figures belong to (the one with the largest total)
    fragmentation: float = 0.0  # the allocator's reserve above the allocated peak

    @property
    def states(self) -> float:
        return self.params + self.grads + self.optimizer

    @property
    def allocated(self) -> float:
        """Bytes of live tensors at the peak (``torch.cuda.max_memory_allocated``)."""
        return self.states + self.activations + self.logits + self.unsharded_params

    @property
    def reserved(self) -> float:
        return self.allocated + self.fragmentation

    @property
    def total(self) -> float:
        return self.reserved + self.overhead


def layer_bytes(job: JobSpec, recompute: str) -> float:
    return activation_bytes_per_layer(
        job.model, job.local_seq_len, job.micro_batch, recompute, job.activation_dtype_bytes,
        attention=job.attention, tp=job.layout.tp, sequence_parallel=job.layout.sp,
        op_selective_saves=job.op_selective_saves, expert_tp=job.layout.etp > 1,
    ) + cp_attention_bytes_per_layer(job, recompute)


def cp_attention_bytes_per_layer(job: JobSpec, recompute: str) -> float:
    """What a cp GPU's attention keeps beyond a layer of seq_len / cp tokens: the keys and values
    gathered from the other cp ranks (saved by the attention kernel), and with a materialized core
    the scores of its queries against those keys. Rank i's chunks i and 2cp-1-i (c = s / 2cp tokens
    each) see (i + 1) c and (2cp - i) c keys: c^2 (2cp + 1) scores per head, where a layer of s / cp
    tokens counts (s / cp)^2. Selective and full recompute rebuild the core, gather included, in
    backward; every_k keeps it in the layers it does not recompute."""
    cp, cfg = job.layout.cp, job.model
    if cp == 1 or recompute in ("selective", "full", "offload"):
        return 0.0
    s, b, p = job.seq_len, job.micro_batch, job.activation_dtype_bytes
    kv = p * b * 2 * cfg.kv_dim * (s - s // cp)  # inside the tensor-parallel region: KV heads split over tp
    scores = 0.0
    if job.attention == "materialized":
        c = s // (2 * cp)
        per_score = 2 * p + 1 if cfg.dropout > 0 else p
        seen = sum(cp_chunk_keys(s, cp, cfg.window_of(i)) for i in range(cfg.n_layer)) / cfg.n_layer
        scores = per_score * cfg.n_head * b * (c * seen - (s // cp) ** 2)
    extra = (kv + scores) / job.layout.tp
    if recompute == "every_k":
        kept = checkpointed_layers(cfg.n_layer, cfg.recompute_every_k)
        return extra * (cfg.n_layer - kept) / cfg.n_layer
    return extra


def cp_chunk_keys(seq_len: int, cp: int, window: int | None) -> int:
    """Keys the two chunks of the fullest cp rank attend to together (parallel/cp.py): chunk g sees
    the keys up to its end, (g + 1) c of them, or with a window of W tokens only the c + W - 1 from
    W - 1 before its start on. Without a window every rank's pair sees (2cp + 1) c."""
    c = seq_len // (2 * cp)
    span = [(g + 1) * c if window is None else min((g + 1) * c, c + window - 1) for g in range(2 * cp)]
    return max(span[i] + span[2 * cp - 1 - i] for i in range(cp))


def kv_cache_bytes(cfg: ModelConfig, context: int, batch: int = 1, dtype_bytes: int = 2) -> float:
    """Bytes of the KV cache model/generate.py allocates for ``batch`` sequences of ``context``
    positions (model/attention.py's KVCache): per layer and position, grouped-query attention holds the
    keys and values of its KV heads (2 * kv_dim numbers), latent attention its latent and its shared
    rotary key (kv_lora_rank + qk_rope_head_dim, whatever the head count); a layer with a sliding window
    of W tokens holds only its last W - 1 positions, however long the context."""
    if cfg.is_mla:
        return float(dtype_bytes * batch * context * cfg.n_layer * (cfg.kv_lora_rank + cfg.qk_rope_head_dim))
    windows = (cfg.window_of(i) for i in range(cfg.n_layer))
    held = sum(context if w is None else min(context, w - 1) for w in windows)
    return float(dtype_bytes * batch * held * 2 * cfg.kv_dim)


def _in_flight(job: JobSpec, stage: int) -> float:
    return pipeline_in_flight(job.layout.pp_schedule, job.layout.pp, job.grad_accum, job.layout.pp_virtual_stages, stage)


@dataclass(frozen=True)
class _LayerActivations:
    """Per-layer bytes of a job, the same on every stage: computed once per estimate."""

    kept: float  # what the recompute policy keeps per layer and micro-batch (on the host for offload)
    rebuilt: float  # one layer's recompute (or reload) working set at the peak
    embeddings: float  # the embedding output, on the first stage
    mtp: float = 0.0  # the multi-token-prediction modules', on the last stage (on the device whatever the policy)


def _layer_activations(job: JobSpec) -> _LayerActivations:
    cfg = job.model
    none = layer_bytes(job, "none")
    d_wide = tp_split(job.activation_dtype_bytes * job.local_seq_len * job.micro_batch * cfg.d_model, 0,
                      tp=job.layout.tp, sequence_parallel=job.layout.sp)
    embeddings = d_wide
    # Each multi-token-prediction module keeps its block's activations (model/recompute.py wraps the
    # model's blocks only: none of them is recomputed) and six d-wide tensors: the two norms' inputs
    # (the hidden states and the embeddings ahead), the projection's input (both, concatenated), its
    # final norm's input and the head's input (its sequence is k tokens shorter: not counted).
    mtp = cfg.mtp_depth * (none + 6 * d_wide)
    if job.recompute == "offload":
        return _LayerActivations(none, none, embeddings, mtp)
    kept = layer_bytes(job, job.recompute)
    if job.recompute == "every_k":
        full = layer_bytes(job, "full")
        rebuilt = none - full if checkpointed_layers(cfg.n_layer, cfg.recompute_every_k) else 0.0
    else:
        rebuilt = max(none - kept, 0.0)
    return _LayerActivations(kept, rebuilt, embeddings, mtp)


def activation_bytes_total(job: JobSpec, stage: int = 0, layer: _LayerActivations | None = None) -> tuple[float, float]:
    """(device bytes, host bytes) of saved activations on one GPU of ``stage``, with the recompute working set.

    Each in-flight micro-batch keeps the stage's L/p layers; recomputing (or reloading) a layer
    during backward rebuilds what that layer dropped, on the device, so every recompute policy but ``none``
    adds that much for one layer at the peak. The first stage also keeps the embedding output, the last
    the multi-token-prediction modules'.
    """
    layer = layer or _layer_activations(job)
    layers = job.model.n_layer // job.layout.pp
    in_flight = _in_flight(job, stage)
    ends = (layer.embeddings if stage == 0 else 0.0) + (layer.mtp if stage == job.layout.pp - 1 else 0.0)
    if job.recompute == "offload":
        return layer.rebuilt + in_flight * ends, in_flight * layers * layer.kept
    return in_flight * layers * layer.kept + layer.rebuilt + in_flight * ends, 0.0


def loss_backward_bytes(tp: int) -> int:
    """Bytes per logit the loss's backward allocates beside the fp32 log-probabilities it saved, at
    its peak (the 16-bit logits are gone: their fp32 copy was freed in forward). Without tensor
    parallelism ``F.cross_entropy(logits.float())`` (kernels/reference.py, torchtitan's loss) runs
    nll_loss's backward, an fp32 gradient of the log-probabilities, then log_softmax's, an fp32
    gradient of the logits' copy, while both are held: 4 + 4. Vocab-parallel (tp > 1, torch's
    loss_parallel, which the trainer and torchtitan use) its nll_loss backward handler builds the
    one-hot gradient, adds exp(log-probs) and multiplies by the loss gradient, three fp32 tensors
    held at once: 4 + 4 + 4. Both are the CPU allocator's running total measured around one
    backward (tests/unit/analysis/test_memory_held.py)."""
    return 12 if tp > 1 else 8


def _logits_bytes(job: JobSpec, stage: int | None = None) -> float:
    """fp32 log-probabilities the loss saves (per in-flight micro-batch; one set more per multi-token-
    prediction depth, each run through the head again) and what its backward allocates beside them
    (``loss_backward_bytes``, one micro-batch at a time); vocab-parallel over tp; on the last stage
    only. With ``loss_chunk_tokens`` each chunk's logits are recomputed in its backward and nothing of
    them is kept between chunks (nor between the heads, which run one after another): the same for
    one chunk of tokens, whatever is in flight."""
    last = job.layout.pp - 1
    if stage is not None and stage != last:
        return 0.0
    tokens = job.local_seq_len * job.micro_batch
    per_token = job.model.vocab_size / job.layout.tp
    backward = loss_backward_bytes(job.layout.tp)
    if job.loss_chunk_tokens:
        return min(job.loss_chunk_tokens, tokens) * per_token * (4 + backward)
    heads = 1 + job.model.mtp_depth
    # Only GPipe runs the last stage's forwards ahead of their backwards; the 1F1B schedules run each
    # micro-batch's backward through the model's last chunk right after its forward (an interleaved
    # last GPU's warm-up forwards are those of its earlier chunks), so one set of log-probabilities.
    in_flight = _in_flight(job, last) if job.layout.pp_schedule == "gpipe" else 1
    return tokens * per_token * (4 * heads * in_flight + backward)


# FSDP2 reduces gradients in fp32 (the trainer's parallel/precision.py and torchtitan's default
# mixed_precision_reduce), and while gradient sync is off it accumulates the unsharded gradients in
# that dtype, not the 16-bit weights' (pytorch/pytorch#125191, April 2024).
REDUCE_BYTES = 4


def gathered_bytes(precision: str) -> int:
    """Bytes per weight FSDP2 gathers: its MixedPrecisionPolicy's param_dtype, 16-bit in every mode but
    fp32 (parallel/precision.py; torchtitan's mixed_precision_param), whatever the shards are kept in
    (the fp32 weights of the bf16 and fp16 autocast modes are gathered as 16-bit copies)."""
    check_choice("precision", precision, PRECISION_MODES)
    return 4 if precision == "fp32" else 2


def root_parameters_per_gpu(job: JobSpec) -> float:
    """What the FSDP root module owns on one GPU without a pipeline: every parameter outside the
    blocks and the multi-token-prediction modules (the token table, learned positions, the final
    norm and the head; vocab-parallel over tp)."""
    cfg, tp, etp = job.model, job.layout.tp, job.layout.etp
    return (stage_parameters(cfg, tp, 1, 0, etp) - cfg.n_layer * block_parameters_per_gpu(cfg, tp, etp)
            - mtp_parameters_per_gpu(cfg, tp, etp))


def _unsharded_bytes(job: JobSpec, stage: int = 0) -> float:
    """ZeRO-3/FSDP: the gathered weights and unreduced gradients one GPU holds at the peak beyond its
    shards: ``unsharded_layers`` blocks (the one in use and the prefetched one); every block's weights
    without reshard-after-forward; FSDP's root module's weights; under pp the whole stage, weights
    and gradients (accumulated in fp32)."""
    if job.layout.strategy not in ("zero3", "fsdp") or job.layout.dp_shard_cp == 1:
        return 0.0
    per, gathered = STATE_BYTES[job.precision], gathered_bytes(job.precision)
    if job.layout.pp > 1:  # pipelining keeps the stage gathered, and its gradients unreduced, until the last backward
        held = job_stage_parameters(job, stage) - stage_routed_parameters(job, stage) * (1 - 1 / job.layout.ep)
        return held * (gathered + REDUCE_BYTES)
    # FSDP2 keeps the root's weights gathered from its forward to the end of backward: the trainer asks
    # for it (parallel/fsdp.py), and before pytorch/pytorch#154704 (May 2025) FSDP2 did so whatever
    # the root's reshard_after_forward said (pytorch/pytorch#131965), as in torchtitan's 2024 runs.
    root = root_parameters_per_gpu(job) * gathered if job.layout.strategy == "fsdp" else 0.0
    block = (block_parameters_per_gpu(job.model, job.layout.tp, job.layout.etp)
             - routed_parameters_per_block(job.model) / job.layout.etp * (1 - 1 / job.layout.ep))
    if not job.fsdp_reshard_after_forward:
        # Every block keeps its gathered weights from its forward to its backward: all of them at the
        # peak (the start of backward); gradients are reduced layer by layer as before.
        return root + block * (job.model.n_layer * gathered + job.assumptions.unsharded_layers * per.grad)
    return root + job.assumptions.unsharded_layers * block * (gathered + per.grad)


def stage_memory(job: JobSpec, stage: int, layer: _LayerActivations | None = None) -> MemoryEstimate:
    """Bytes per GPU of pipeline stage ``stage`` at its peak."""
    n_params = job_stage_parameters(job, stage)
    states = stage_state_bytes(job, n_params, stage)
    device_acts, host_acts = activation_bytes_total(job, stage, layer)
    a = job.assumptions
    logits, unsharded = _logits_bytes(job, stage), _unsharded_bytes(job, stage)
    return MemoryEstimate(
        params=states.param,
        grads=states.grad,
        optimizer=states.optimizer,
        activations=device_acts,
        logits=logits,
        unsharded_params=unsharded,
        overhead=(a.cuda_context_gib + a.comm_buffers_gib) * GIB,
        host=host_acts,
        stage=stage,
        # Model states are allocated once, in a few large blocks; what is freed and allocated again
        # every micro-batch (activations, logits, gathered layers) is what fragments the cache.
        fragmentation=a.fragmentation * (device_acts + logits + unsharded),
    )


def edge_stages(job: JobSpec) -> tuple[int, ...]:
    # A middle stage holds no more than the first (the same blocks, no embedding, no more micro-batches
    # in flight) and computes no more than the first or the last, so these two decide (tested).
    return (0,) if job.layout.pp == 1 else (0, job.layout.pp - 1)


def estimate_memory(job: JobSpec) -> MemoryEstimate:
    """The fullest stage's memory (every GPU must fit, so the largest decides)."""
    layer = _layer_activations(job)
    return max((stage_memory(job, i, layer) for i in edge_stages(job)), key=lambda m: (m.total, m.host))


def routed_parameters_per_block(cfg: ModelConfig) -> float:
    """The routed experts' weights of one block, as ``block_parameters_per_gpu`` averages blocks
    (shared experts and the router are dense: every GPU holds them)."""
    if cfg.moe.experts is None:
        return 0.0
    matrices = 3 if cfg.mlp == "swiglu" else 2
    return cfg.n_moe_layers * cfg.moe.experts * matrices * cfg.d_model * cfg.expert_d_ff / cfg.n_layer


def stage_routed_parameters(job: JobSpec, stage: int = 0) -> float:
    """Routed expert weights among a pipeline stage's parameters on one GPU before ep splits them
    (after expert tensor parallelism has: 1/etp of each expert); the last stage's include the
    multi-token-prediction modules'."""
    mtp = mtp_routed_parameters(job.model) if stage == job.layout.pp - 1 else 0.0
    return (job.model.n_layer // job.layout.pp * routed_parameters_per_block(job.model) + mtp) / job.layout.etp


def job_stage_parameters(job: JobSpec, stage: int) -> float:
    """``stage_parameters`` of the job's model on one GPU of pipeline stage ``stage`` (before ep)."""
    return stage_parameters(job.model, job.layout.tp, job.layout.pp, stage, job.layout.etp)


def stage_state_bytes(job: JobSpec, n_params: float, stage: int = 0) -> StateBytes:
    """Model-state bytes per GPU of a stage holding ``n_params``: with ep > 1 the routed experts
    are split over ep GPUs and each split sharded over the dp_shard / ep GPUs holding it; the rest
    is sharded over the shard group as without ep (with cp, ep is carved out of the shard group, cp included)."""
    saving = muon_buffer_saving(job)
    if job.layout.ep == 1:
        states = model_state_bytes(n_params, job.layout.strategy, job.layout.dp_shard_cp, job.precision)
        return dataclasses.replace(states, optimizer=states.optimizer - saving)
    routed = stage_routed_parameters(job, stage)
    dense = model_state_bytes(n_params - routed, job.layout.strategy, job.layout.dp_shard_cp, job.precision)
    experts = model_state_bytes(routed / job.layout.ep, job.layout.strategy, job.layout.dp_shard_cp // job.layout.ep, job.precision)
    return StateBytes(dense.param + experts.param, dense.grad + experts.grad,
                      dense.optimizer + experts.optimizer - saving)


# --------------------------------------------------------------------------- Muon


@dataclass(frozen=True)
class MuonMatrices:
    """The matrices Muon orthogonalises in the whole model, each kind as (count, rows, columns):
    those tensor parallelism splits (attention's QKV and output projections, the dense MLPs), those
    a MoE layer keeps whole on every tp GPU (shared experts), and the routed experts, one matrix per
    expert. Routers, embeddings, the head, norms and biases stay on AdamW (parallel/optim.py)."""

    split: tuple[tuple[int, int, int], ...]
    whole: tuple[tuple[int, int, int], ...]
    routed: tuple[tuple[int, int, int], ...]


def muon_matrices(cfg: ModelConfig) -> MuonMatrices:
    d, per_mlp, moe = cfg.d_model, (3 if cfg.mlp == "swiglu" else 2), cfg.n_moe_layers
    split = [(cfg.n_layer, cfg.q_dim + 2 * cfg.kv_dim, d), (cfg.n_layer, d, cfg.q_dim)]
    if cfg.n_layer > moe:  # the down projection is the up one transposed: the same size and cost
        split.append(((cfg.n_layer - moe) * per_mlp, cfg.d_ff, d))
    whole, routed = [], []
    if moe and cfg.moe.shared_experts:
        whole.append((moe * per_mlp, cfg.moe.shared_experts * cfg.expert_d_ff, d))
    if moe:
        routed.append((moe * cfg.moe.experts * per_mlp, cfg.expert_d_ff, d))
    return MuonMatrices(tuple(split), tuple(whole), tuple(routed))


def muon_numel(kind: tuple[tuple[int, int, int], ...]) -> float:
    return sum(count * rows * cols for count, rows, cols in kind)


def muon_groups(job: JobSpec) -> tuple[int, int]:
    """GPUs each split matrix and each whole (shared-expert) matrix is sharded over: tensor
    parallelism times FSDP's shard group (ddp and none keep the data-parallel copies whole)."""
    shard = job.layout.dp_shard_cp if job.layout.strategy in ("fsdp", "zero3") else 1
    return job.layout.tp * shard, shard


def muon_buffer_saving(job: JobSpec) -> float:
    """Optimizer-state bytes per GPU Muon saves against AdamW: one fp32 momentum per hidden matrix
    element instead of two moments (4 bytes less; fp32 masters, where kept, stay)."""
    if job.optimizer != "muon":
        return 0.0
    m, layout = muon_matrices(job.model), job.layout
    shard = layout.dp_shard_cp if layout.strategy in ("zero1", "zero2", "zero3", "fsdp") else 1
    dense = muon_numel(m.split) / layout.tp + muon_numel(m.whole)
    routed = muon_numel(m.routed) / layout.ep / (shard // layout.ep if shard > 1 else 1)
    return 4 * (dense / shard + routed) / layout.pp
