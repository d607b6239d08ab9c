"""The engine's decode forward: one token for each running sequence, two ways.

`DynamicDecode` runs the batch as it is: B rows, attending to the longest sequence's length
(rounded to whole blocks). It is the CPU's path, where a forward costs about what its shapes
cost.

`StaticDecode` gives every forward one of a few fixed shapes, so on CUDA each can be captured
once in a CUDA graph and replayed: a step then costs one launch instead of a few hundred
Python-issued kernels. The batch is padded up to a bucket (1, 2, 4, ... up to `max_batch`) with
dummy rows, and the attended length is rounded up to a power of two of cache blocks (capped at
the cache's length), with a mask hiding what a row must not see. Inputs go into fixed buffers,
which the captured forward reads. A dummy row feeds token 0 at position 0 of a free running slot
(B..bucket-1, all free, since running sequences fill slots 0..B-1): whatever it writes there is
overwritten by the next sequence given that slot before anything attends to it. Off CUDA (a
test forcing static shapes) the same forward runs eagerly.

A captured forward reads the model's parameters and the weights it derives and keeps from them
(attention's fused q/k/v matrix) at the addresses they had at capture. Weight swaps write
parameters in place; `weights_changed` drops the graphs if a derived weight was made anew
rather than refreshed in place, so the next step captures again.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable

import torch

from whetstone.inference.kv_cache import SlotKVCache
from whetstone.inference.metrics import EngineStats
from whetstone.utils.device import synchronize
from whetstone.utils.transfer import copy_into, to_device

log = logging.getLogger(__name__)

Forward = Callable[..., object]
"""The engine's forward: (ids, positions, cache, return_routes=...) -> ModelOutput."""


class DynamicDecode:
    graphs = False
    """Never replays CUDA graphs (as `StaticDecode.graphs` says whether it does)."""

    def __init__(self, forward: Forward, cache: SlotKVCache, with_routes: bool):
        self.forward, self.cache, self.with_routes = forward, cache, with_routes

    def __call__(self, rows: list[tuple[int, int]], span: int, tokens: torch.Tensor | None = None):
        """(logits [B, vocab], routes [B, moe_layers, top_k] or None) for `rows` of (token,
        position) in slots 0..B-1, every position below `span`. `tokens` [B] on the device, if
        given, replace the rows' tokens (the previous step's draws, not read back yet)."""
        inputs = to_device(rows, torch.int64, self.cache.keys.device)
        if tokens is not None:
            inputs[:, 0] = tokens
        out = self.forward(
            inputs[:, :1], inputs[:, 1:], self.cache.rows(0, len(rows), span), return_routes=self.with_routes
        )
        return out.logits[:, -1], out.routes[:, 0] if self.with_routes else None

    def weights_changed(self) -> None:
        """Nothing is kept across steps."""


def batch_buckets(max_batch: int) -> list[int]:
    """The batch sizes static decode runs: powers of two below `max_batch`, then `max_batch`."""
    sizes = [1 << i for i in range(max_batch.bit_length()) if 1 << i < max_batch]
    return sizes + [max_batch]


class StaticDecode:
    def __init__(
        self,
        forward: Forward,
        cache: SlotKVCache,
        max_batch: int,
        with_routes: bool,
        graphs: bool,
        stats: EngineStats,
        derived_weights: Callable[[], list[torch.Tensor]] = list,
    ):
        self.forward, self.cache, self.with_routes, self.stats = forward, cache, with_routes, stats
        self.buckets = batch_buckets(max_batch)
        self.graphs = graphs
        """Capture and replay CUDA graphs (CUDA only); off: the same static shapes, run eagerly."""
        self.derived_weights = derived_weights
        self.inputs = torch.zeros(max_batch, 2, dtype=torch.int64, device=cache.keys.device)
        """Row i: (token, position) of the sequence in slot i, (0, 0) for a dummy row."""
        self._captured: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, tuple]] = {}
        self._derived: list[tuple[int, int]] | None = None
        self._pool = None
        self._capture_stream: torch.cuda.Stream | None = None
        """Where the graphs are captured (made at the first capture)."""

    def shape(self, count: int, span: int) -> tuple[int, int]:
        """(batch bucket, attended length) of a step over `count` rows with positions below `span`."""
        batch = next(size for size in self.buckets if size >= count)
        blocks = -(-span // self.cache.block)
        return batch, min((1 << (blocks - 1).bit_length()) * self.cache.block, self.cache.max_len)

    def __call__(self, rows: list[tuple[int, int]], span: int, tokens: torch.Tensor | None = None):
        """As `DynamicDecode.__call__`."""
        count = len(rows)
        batch, length = self.shape(count, span)
        copy_into(self.inputs[:batch], list(rows) + [(0, 0)] * (batch - count))
        if tokens is not None:
            self.inputs[:count, 0] = tokens
        logits, routes = self._replay(batch, length) if self.graphs else self._run(batch, length)
        return logits[:count], None if routes is None else routes[:count]

    def _run(self, batch: int, length: int):
        inputs = self.inputs[:batch]
        out = self.forward(
            inputs[:, :1], inputs[:, 1:], self.cache.rows(0, batch, length), return_routes=self.with_routes
        )
        return out.logits[:, -1], out.routes[:, 0] if self.with_routes else None

    def _replay(self, batch: int, length: int):
        captured = self._captured.get((batch, length))
        if captured is None:
            try:
                captured = self._capture(batch, length)
            except RuntimeError as err:  # e.g. a forward that reads a value back: serve without graphs
                log.warning("decoding without CUDA graphs: capturing the decode forward failed: %s", err)
                self.graphs = False
                return self._run(batch, length)
        graph, outputs = captured
        graph.replay()
        return outputs

    def _capture(self, batch: int, length: int):
        """Capture the forward of one shape. It first runs once eagerly on a side stream (lazy
        initialisations, library workspaces, the model's kept weights happen outside the graph),
        on this step's inputs: it writes the same keys and values the replay then writes again."""
        start = time.perf_counter()
        device = self.cache.keys.device
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            self._run(batch, length)
        torch.cuda.current_stream(device).wait_stream(side)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        if self._capture_stream is None:
            # its own stream on this device: torch's default capture stream is one per process,
            # made on the device current at the first capture (an engine on cuda:1 would capture
            # on cuda:0's). High priority: those streams come from their own pool, so no stream a
            # weight upload takes from the normal pool (swap.py) is this one while it captures.
            self._capture_stream = torch.cuda.Stream(device, priority=-1)
        graph = torch.cuda.CUDAGraph()
        # thread_local: other threads (a weight upload) may use CUDA while this one captures. The
        # outer stream context gives the thread its stream back however the capture ends (a
        # capture that fails raises in torch.cuda.graph's exit before it restores the stream).
        try:
            with (
                torch.cuda.stream(self._capture_stream),
                torch.cuda.graph(
                    graph, pool=self._pool, stream=self._capture_stream, capture_error_mode="thread_local"
                ),
            ):
                outputs = self._run(batch, length)
        except RuntimeError:
            # torch's capture_end raises before it stops sending the stream's allocations to the
            # graphs' pool, and a later empty_cache would then find a capture still under way
            with contextlib.suppress(RuntimeError):
                index = device.index if device.index is not None else torch.cuda.current_device()
                torch._C._cuda_endAllocateToPool(index, self._pool)
            raise
        synchronize(device)
        if self._derived is None:
            self._derived = _addresses(self.derived_weights())
        self._captured[(batch, length)] = (graph, outputs)
        self.stats.record_capture(time.perf_counter() - start)
        return graph, outputs

    def weights_changed(self) -> None:
        """After a weight swap: keep the graphs if every derived weight they read was refreshed in
        place, else drop them (captured again on first use)."""
        if self._captured and _addresses(self.derived_weights()) != self._derived:
            log.info("weights the model derives moved: capturing the decode graphs again")
            self._captured.clear()
            self._derived, self._pool = None, None


def _addresses(tensors: list[torch.Tensor]) -> list[tuple[int, int]]:
    return [(t.data_ptr(), t.numel()) for t in tensors]
