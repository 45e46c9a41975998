"""Random numbers for dropout when ranks share or split activations.

Two rules, as in Megatron-LM's model-parallel RNG tracker:

- Where the ranks of one tensor-parallel group hold the same activations (the residual stream
  without sequence parallelism), they must drop the same elements, or the copies diverge. Those
  dropouts draw from the default generator, which every rank of a tp group keeps in step: the
  build seeds it alike on all of them (``seed_activation_rng``).
- Where each holds its own part (the attention probabilities of its heads; with sequence
  parallelism the residual stream's positions), they must not draw the same mask for different
  elements. Those dropouts run inside ``split_rng(rank)``: a generator state of their own.

Data-parallel, context-parallel and pipeline ranks hold different activations altogether, so
``seed_activation_rng`` gives each tensor-parallel group its own default generator.

Megatron keeps the split regions' generator as a second live state, which its activation
recompute must save and restore next to the default one. Here that state is derived on entry
from one draw of the default generator and the rank: torch's recompute already replays the
default generator, so a recomputed region draws the same masks with nothing more to save, and a
checkpoint that holds each rank's default generator state resumes the masks exactly.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

_SEED_RANGE = 2**62  # derived seeds stay below torch's 64-bit limit after adding a rank
_GROUP_STRIDE = 0x9E3779B97F4A7C15  # odd, so groups map to distinct seeds modulo 2**63


def seed_activation_rng(seed: int, group: int) -> None:
    """Seed the default generators for the activations of tensor-parallel group ``group`` (the
    index of this rank's tp group among all of them). Group 0 keeps the state the build left, so
    it draws as one process with the same seed does; the others start from their own seed."""
    if group:
        torch.manual_seed((seed + group * _GROUP_STRIDE) % 2**63)


@contextlib.contextmanager
def split_rng(rank: int) -> Iterator[None]:
    """Run the block with a generator state of its own for tensor-parallel rank ``rank``: the same
    draw of the default generator on every rank of the group (which stays in step), mixed with the
    rank. The default generators (CPU, and this device's CUDA one) are left as after that draw."""
    seed = int(torch.randint(_SEED_RANGE, (1,)).item()) + rank
    cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
    cpu_state = torch.get_rng_state()
    cuda_state = torch.cuda.get_rng_state() if cuda else None
    torch.default_generator.manual_seed(seed)
    if cuda:
        torch.cuda.manual_seed(seed)
    try:
        yield
    finally:
        torch.set_rng_state(cpu_state)
        if cuda:
            torch.cuda.set_rng_state(cuda_state)
