"""DevicePrefetcher: overlap the host-to-device copy of batch k+1 with the compute of batch k.

On CUDA the next batch is copied with ``non_blocking=True`` on a side stream right after the
current one is handed out, so the copy runs while the step computes. Before a batch is used the
compute stream waits on the side stream, and ``record_stream`` tells the caching allocator the
tensors are used on the compute stream (otherwise their memory could be reused while a kernel
still reads them). The copy is only asynchronous when the source is pinned (``data.pin_memory``).

On any other device it is a pass-through that moves each batch with ``.to(device)``.

Its ``state_dict`` is the position of the last batch handed out: the batch waiting on the side
stream was taken from the underlying stream but not yet by the caller, so it is not counted.
"""

from __future__ import annotations

import torch


class DevicePrefetcher:
    def __init__(self, stream, device: torch.device | str):
        self._stream = stream
        self.device = torch.device(device)
        self._cuda = self.device.type == "cuda"
        self._copy_stream = torch.cuda.Stream(device=self.device) if self._cuda else None
        self._pending = None  # (x, y) being copied on the side stream
        self._state_before_pending = None

    def __iter__(self) -> "DevicePrefetcher":
        return self

    def _start_copy(self) -> None:
        self._state_before_pending = self._stream.state_dict()
        x, y = next(self._stream)
        with torch.cuda.stream(self._copy_stream):
            self._pending = (x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True))

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        if not self._cuda:
            x, y = next(self._stream)
            return x.to(self.device), y.to(self.device)
        if self._pending is None:
            self._start_copy()
        compute = torch.cuda.current_stream(self.device)
        compute.wait_stream(self._copy_stream)
        x, y = self._pending
        x.record_stream(compute)
        y.record_stream(compute)
        self._pending = None
        self._start_copy()  # overlaps with whatever the caller runs next on the compute stream
        return x, y

    def state_dict(self) -> dict:
        if self._pending is not None:
            return self._state_before_pending
        return self._stream.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self._pending = None
        self._state_before_pending = None
        self._stream.load_state_dict(state)

    def __getattr__(self, name):  # batches_per_epoch, close, ... of the wrapped stream
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self._stream, name)
