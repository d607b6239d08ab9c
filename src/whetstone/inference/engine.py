"""The inference engine: continuous batching over the whetstone model with a slot KV cache.

Each `step()`:
  1. takes in what other threads sent (new sequences, aborts, weight updates);
  2. applies pending weight versions in place (the only pause a swap causes);
  3. asks the scheduler whom to preempt and admit, and prefills the admitted sequences into
     their slots in one batched forward (all tokens but the last; resumed sequences replay
     their recorded routes);
  4. runs ONE forward over the last token of every running sequence, samples, and retires the
     sequences that stopped.

So every sampled token comes out of a batched decode step, with its logprob, the weight version
of that step, and the routes of the token fed to produce it. Forwards run with the configured
`numerics` and `dtype`; with `invariant` numerics those logprobs and routes are what the trainer
computes for the same tokens, bit for bit (docs/consistency.md). The engine runs in its own thread
(`start()`); other threads only call `add`, `abort` and `update_weights`, which never block it.

The engine moves the model it is given to its device (`EngineConfig.device`), where the KV cache,
the decode inputs and sampling live too. On the CPU it stores the model in the serving layout, in
place (`whetstone.model.layout`: column-major matmul weights, same values, faster decoding),
except under invariant numerics: there its matmuls must see the operands the trainer's see, layout
included, for one library path. On CUDA the decode forward runs in CUDA graphs
(`inference/decode.py`, `EngineConfig.cuda_graphs`).

A decode step reads back from the device once: the sampled tokens with their logprobs (and top
logprobs) in one tensor. The routes of the tokens fed travel to a host buffer by asynchronous
copies queued before that read-back, so they are there once it returns; the engine applies them
to the buffer then (`_apply_routes`).

On CUDA the engine runs one decode step ahead (`EngineConfig.overlap_steps`): step n + 1 is
launched, fed step n's draws on the device, before step n is read back, so the GPU computes while
the host hands out tokens and schedules. A sequence leaving its slot drops the step pending for
it (`_drop_pending`); docs/inference.md has the rules.

A failure ends as little as it can. One in a sequence's own host code (its stop checks and text,
its callback, its sampling parameters) fails that sequence alone. One in the batch's work (a
forward out of memory) costs the sequences it hit nothing but time: they go back to their queues
as preempted ones do, as suspects, and are recomputed, the suspects admitted one per step with no
other (`Scheduler.probe`). A step that fails again while admitting a suspect fails that sequence
alone (a prompt too long for memory costs no one else), and the others it ran are requeued once
more; one that fails again admitting no suspect fails the sequences it ran (`_recover`). So a
fault tied to no sequence (a broken device) still ends them, one or a few per step. A sequence
whose end was under way (it had stopped, failed alone or was aborted) fails rather than resume.
If putting the engine back in order raises too, every sequence it holds fails and it serves on
(`_fail_all`). A weight write that fails leaves the weights as they were (`swap.write`) and is
the sender's to retry; one that cannot put them back stops the engine (`_break`): it would serve
weights of no version.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass

import torch

from whetstone.errors import WhetstoneError
from whetstone.inference.config import EngineConfig
from whetstone.inference.decode import DynamicDecode, StaticDecode
from whetstone.inference.detokenize import IncrementalText
from whetstone.inference.kv_cache import ATTENTION_BLOCK, SlotKVCache
from whetstone.inference.metrics import EngineStats
from whetstone.inference.sampling import Drawn, InvalidRequest, Readback, SamplingParams, sample
from whetstone.inference.scheduler import Plan, Scheduler
from whetstone.inference.sequence import Priority, Sequence
from whetstone.inference.swap import (
    PreparedUpdate,
    WeightUpdateError,
    WeightWriteError,
    prepare,
    serving_tensors,
    write,
)
from whetstone.model import invariant, numerics
from whetstone.model.layout import serving_copy, to_column_major
from whetstone.sync.update import WeightUpdate
from whetstone.utils.device import autocast, on_device, resolve_device
from whetstone.utils.transfer import tensor_to_device, to_device

log = logging.getLogger(__name__)

WAITING_POLL_S = 0.005
"""How long the engine's thread sleeps after a step that could start nothing while sequences
wait (a user's grace keeping batch work out, a drain): it would otherwise spin a core."""
FAIL_AFTER_STEPS = 2
"""Consecutive failed steps after which the sequences a step ran fail instead of being requeued
(steps admitting a suspect aside: their failure is the suspect's, `Engine._recover`)."""


def kv_cache_dtype(config: EngineConfig, weights: torch.dtype, device: torch.device) -> torch.dtype:
    """What the KV cache holds keys and values in: what attention computes with. Under bf16
    autocast that is bf16 (SDPA and the GPU's invariant kernel cast q, k and v to it; the q/k
    norms' fp32 weights make k fp32 before that), so a bf16 cache holds the same values in half
    the memory. Invariant numerics on the CPU attend in fp32 (`invariant.attention`): there the
    cache keeps the weights' dtype."""
    if config.dtype == "bfloat16" and not (config.numerics == "invariant" and device.type == "cpu"):
        return torch.bfloat16
    return weights


class Engine:
    def __init__(
        self,
        model,
        config: EngineConfig = EngineConfig(),
        *,
        eos_token_ids: tuple[int, ...] = (),
        decode: Callable[[list[int]], str] | None = None,
        version: int = 0,
        static_shapes: bool | None = None,
        overlap: bool | None = None,
    ):
        """`static_shapes`: decode with `StaticDecode` (True: also on the CPU, without graphs;
        False: never); None: on CUDA when `config.cuda_graphs`. `overlap`: run one decode step
        ahead (True: also on the CPU, where it only reorders the work; tests); None: on CUDA when
        `config.overlap_steps`."""
        cfg = model.cfg
        self.device = resolve_device(config.device)
        # in bf16, the values autocast would compute with, kept: the bits of the trainer's
        # forward, which casts its fp32 weights the same way in every matmul, so invariant
        # numerics keep them too. The caller's model stays on its device and in its dtype; what is
        # already right is shared with it (and takes the engine's weight swaps).
        model = serving_copy(model.eval(), self.device, torch.bfloat16 if config.dtype == "bfloat16" else None)
        # the serving layout (faster CPU decode, same values); invariant numerics keep the trainer's
        serving_layout = config.numerics == "fast" and self.device.type == "cpu"
        self.model = to_column_major(model) if serving_layout else model
        self.config = config
        self.context_limit = config.context_limit or cfg.max_position_embeddings
        self.vocab_size = cfg.vocab_size
        self.eos_token_ids = frozenset(eos_token_ids)
        self.decode = decode
        self.version = version
        dtype = kv_cache_dtype(config, next(model.parameters()).dtype, self.device)
        block = invariant.KEY_CHUNK if config.numerics == "invariant" else ATTENTION_BLOCK
        # slots 0..max_batch-1 for running sequences, the rest keep finished ones (`keep_finished`)
        slots = config.max_batch + (config.keep_finished if config.share_prefixes else 0)
        self.cache = self._kv_cache(cfg, slots, dtype, block)
        self._kept: OrderedDict[int, Kept] = OrderedDict()
        """Finished sequences' caches by slot, least recently used first."""
        # routes by slot and position (int16 holds any expert id we serve), on the host, where
        # finished sequences take them; pinned on CUDA, so copies into it do not wait
        self.routes = None
        if cfg.num_moe_layers:
            shape = (slots, self.cache.max_len, cfg.num_moe_layers, cfg.num_experts_per_tok)
            self.routes = torch.zeros(shape, dtype=torch.int16, device="cpu", pin_memory=self.device.type == "cuda")
        self._routes_pending: list[tuple[int, int, torch.Tensor]] = []
        """Writes into `routes` (slot, first position, values) waiting for the copies queued for
        them: values copied from the device without waiting, or rows of another slot that such a
        copy is filling."""
        self._routes_copied: torch.cuda.Event | None = None
        """Recorded on CUDA after the admissions' route copies were queued (`_apply_routes`)."""
        self.overlap = config.overlap_steps and self.device.type == "cuda" if overlap is None else overlap
        """Launch decode step n + 1 before reading step n back (`EngineConfig.overlap_steps`)."""
        self._launched: Launched | None = None
        """The step launched ahead, not read back yet (with `overlap`)."""
        self.scheduler = Scheduler(
            config.max_batch,
            config.prefill_tokens_per_step,
            config.batch_beside_interactive,
            config.interactive_grace_s,
            prefill_cost=self._prefill_cost,
        )
        self._weights_epoch = 0
        """Bumped by every weight write: caches filled before it hold other weights' keys."""
        self.stats = EngineStats(weight_version=version)
        if static_shapes is None:
            static_shapes = config.cuda_graphs and self.device.type == "cuda"
        if static_shapes:
            graphs = config.cuda_graphs and self.device.type == "cuda"
            self.decoder = StaticDecode(
                self._forward, self.cache, config.max_batch, bool(cfg.num_moe_layers), graphs, self.stats, self._derived
            )
        else:
            self.decoder = DynamicDecode(self._forward, self.cache, bool(cfg.num_moe_layers))
        self._admitting: list[Sequence] = []
        """The sequences being admitted, from the scheduler taking them off their queues (`plan`)
        until their prefill is done: taken back if anything in between raises (`_recover`)."""
        self._unfinished: dict[Sequence, None] = {}
        """Every sequence taken in and not finished, wherever it is (running, being admitted,
        waiting, or between them when a step raised): what `_fail_all` ends."""
        self._ending: set[Sequence] = set()
        """Sequences whose end is under way (stopped, failing alone, aborted): if a step raises
        before they end, they fail rather than resume (`_recover`)."""
        self._failed_steps = 0
        """Consecutive steps whose batched work raised (`_recover`)."""
        self._probe_ahead = False
        """The scheduler's probe was admitted by the step before, whose decode step, launched
        ahead, is read back in this one (`_settle_probe`)."""
        self._decoding: list[Sequence] = []
        """The sequences of the decode step being launched or read back, while it is: if that
        raises, the failure is theirs (`_recover` blames a probe only for work it was in)."""
        self._tensors = serving_tensors(model)
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._updates: deque[PreparedUpdate] = deque()
        self._unwritten: PreparedUpdate | None = None
        """The last update whose write failed (the weights were put back), until one that
        contains it is written: later versions build on it, so no update is written without it
        (one applying on its base, i.e. it sent again, merged with those after; or a full one)."""
        self._broken: str | None = None
        """Why the engine stopped for good (its weights hold no whole version); None while it serves."""
        self._send_lock = threading.Lock()
        """Orders `_send` against `_break`: nothing sent is left in the inbox of a stopped engine."""
        self._wake = threading.Event()
        self._stalled = False
        """The last step ran, admitted and preempted nothing, with work waiting (`step`)."""
        self._stopping = False
        self._thread: threading.Thread | None = None

    # ---- called from any thread -------------------------------------------------------------

    def add(self, seq: Sequence, checked: bool = False) -> None:
        """Queue a sequence; raises `InvalidRequest` (nothing queued) if it cannot be served.
        `checked`: the caller has run `check_request` on its prompt with parameters at least as
        demanding (the choices of one prompt share that check, which reads the whole prompt)."""
        if not checked:
            self.check_request(seq.prompt_ids, seq.params)
        if self.decode is not None:
            seq.text = IncrementalText(self.decode, seq.params.stop)
        self._send("add", seq)

    def check_request(self, prompt_ids: list[int], params: SamplingParams) -> None:
        n, limit = len(prompt_ids), self.context_limit
        if n == 0:
            raise InvalidRequest("the prompt is empty")
        if n >= limit:
            raise InvalidRequest(
                f"the prompt has {n} tokens; the context limit is {limit} "
                f"(prompt + completion), so it must be at most {limit - 1}"
            )
        if n + params.max_tokens > limit:
            raise InvalidRequest(
                f"prompt ({n} tokens) + max_tokens ({params.max_tokens}) = "
                f"{n + params.max_tokens} exceeds the context limit of {limit} tokens"
            )
        if min(prompt_ids) < 0 or max(prompt_ids) >= self.vocab_size:
            raise InvalidRequest(f"prompt token ids must be in 0..{self.vocab_size - 1}")

    def abort(self, seq: Sequence) -> None:
        """Stop a sequence (e.g. its client went away); it finishes with reason `abort`."""
        self._send("abort", seq)

    def update_weights(self, update: WeightUpdate) -> PreparedUpdate:
        """Queue a new weight version (checked and copied to the device here, in the caller's
        thread; raises `WeightUpdateError` if it does not fit). The engine writes it between two
        steps; the update returned says when it did, or why it did not (`done`, `error`): its
        write failed, or it builds on a version whose write failed (the weights stay as they
        were; send that version again, merged with those after it)."""
        prepared = prepare(update, self._tensors)
        self._send("weights", prepared)
        return prepared

    def _send(self, kind: str, item) -> None:
        with self._send_lock:
            broken = self._broken
            if broken is None:
                self._inbox.put((kind, item))
                self._wake.set()
                return
        if kind == "add":  # the engine stopped: the sequence ends at once, as it would have there
            self._fail(item, broken)
        elif kind == "weights":
            raise WeightUpdateError(f"the engine has stopped: {broken}")

    def start(self) -> None:
        """Run the engine in a background thread until `stop()`."""
        self._stopping = False
        self._thread = threading.Thread(target=self._loop, name="whetstone-engine", daemon=True)
        self._thread.start()

    @property
    def running(self) -> bool:
        """Whether the background thread is serving."""
        return self._thread is not None and self._thread.is_alive()

    def stop(self) -> None:
        self._stopping = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def _loop(self) -> None:
        with torch.inference_mode(), on_device(self.device):
            while not self._stopping and self._broken is None:
                try:
                    busy = self.step()
                except Exception as err:  # past the step's own recovery: the last resort
                    log.exception("the engine's step raised: failing every sequence it holds")
                    try:
                        self._fail_all(f"the engine failed: {failure(err)}")
                    except Exception:
                        self._break(f"the engine failed, and so did failing its sequences: {failure(err)}")
                    busy = True
                if not busy or self._stalled:  # a new request or update sets `_wake`
                    self._wake.wait(None if not busy else WAITING_POLL_S)
                    self._wake.clear()

    # ---- offline use (tests, benchmarks): same path, driven from the caller's thread ---------

    def generate(
        self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams], priority: Priority = "batch"
    ) -> list[Sequence]:
        """Generate from `prompts` in this thread; raises `WhetstoneError` if any sequence failed,
        `InvalidRequest` (nothing queued) if any prompt cannot be served."""
        if self._thread is not None:
            raise RuntimeError("generate() drives the engine itself; do not call it while start()ed")
        params = params if isinstance(params, list) else [params] * len(prompts)
        seqs = [Sequence(f"offline-{i}", list(p), sp, priority) for i, (p, sp) in enumerate(zip(prompts, params))]
        for i, seq in enumerate(seqs):  # all of them first: one refused leaves none queued behind
            try:
                self.check_request(seq.prompt_ids, seq.params)
            except InvalidRequest as err:
                raise InvalidRequest(f"prompt {i}: {err}") from None
        for seq in seqs:
            self.add(seq, checked=True)
        with torch.inference_mode(), on_device(self.device):
            while not all(seq.finished for seq in seqs):
                self.step()
        failed = [seq for seq in seqs if seq.error]
        if failed:
            raise WhetstoneError(
                f"{len(failed)} of {len(seqs)} sequences failed; {failed[0].request_id}: {failed[0].error}"
            )
        return seqs

    # ---- the engine thread --------------------------------------------------------------------

    def step(self) -> bool:
        """One scheduling round and one decode step; returns whether there is work left. Does not
        raise: a failure fails or requeues the sequences it hit (`_recover`), or, if that raises
        too, fails every sequence the engine holds (`_fail_all`)."""
        if self._broken is not None:
            return False
        self._stalled = False
        try:
            self._take_inbox()
            self._apply_updates()
            plan = Plan()
            self._admitting = plan.admit  # what the scheduler takes off its queues, as it takes it
            self.scheduler.plan(plan)
            for seq in plan.preempt:
                self._drop_pending(seq)
                self._release(seq)
                seq.preempt()
                self.scheduler.requeue(seq)
                self.stats.preemptions_total += 1
            if plan.admit:
                self._admit(plan.admit)
            ran = bool(self.scheduler.running) or self._launched is not None
            # nothing ran, came or went: only a message (which sets `_wake`) or the clock (a grace
            # ending) changes what the next step can do; an update waiting for a drain included
            self._stalled = not (ran or plan.admit or plan.preempt)
            if ran:
                self._decode()
            self._apply_routes()  # nothing decoded after an admission: wait for the copies here
            if ran:  # the step's batched work went through (whether or not its sequences ended)
                self._failed_steps = 0
            if self.scheduler.probe is not None:
                self._settle_probe()
        except WeightWriteError as err:
            self._break(str(err))
            return False
        except Exception as err:  # neither a bug nor the device may take the server down
            try:
                self._recover(err)
            except Exception as again:
                log.exception("engine step failed, and so did putting it back in order: failing every sequence")
                self._fail_all(f"{failure(err)} (and putting the engine back in order failed: {failure(again)})")
        if not self.scheduler.has_work:
            self._failed_steps = 0  # idle: no sequence is left that a failure could repeat on
        stats, waiting = self.stats, self.scheduler.waiting
        stats.running = len(self.scheduler.running)
        stats.waiting_interactive, stats.waiting_batch = len(waiting["interactive"]), len(waiting["batch"])
        return self.scheduler.has_work or bool(self._updates) or self._launched is not None

    def _take_inbox(self) -> None:
        while True:
            try:
                kind, item = self._inbox.get_nowait()
            except queue.Empty:
                return
            if kind == "add":
                self._unfinished[item] = None
                self.scheduler.add(item)
            elif kind == "weights":
                self._updates.append(item)
            elif kind == "abort" and not item.finished:
                if item.slot is not None:
                    self._finish(item, "abort")
                elif self.scheduler.remove_waiting(item):
                    self._finish(item, "abort")

    def _apply_updates(self) -> None:
        if not self._updates:
            return
        if self.config.swap_policy == "finish" and self.scheduler.in_flight():
            self.scheduler.admit_fresh = False  # drain: in-flight sequences end on these weights
            return
        if self._launched is not None:  # read the step in flight back first: the pause (which waits
            launched, self._launched = self._launched, None  # for the device) is the write's alone,
            self._take(launched)  # and no graph a swap may drop is still running
        pause, written, touched = 0.0, False, False
        while self._updates:
            update = self._updates.popleft()
            unwritten = self._unwritten
            if unwritten is not None and update.base is not None and update.base != unwritten.base:
                update.settle(f"not written: it builds on weight version {unwritten.version}, whose write failed")
                continue
            touched = True
            try:
                pause += write(update)
            except WeightWriteError as err:
                update.settle(str(err))
                raise
            except Exception as err:  # the weights were put back: its sender sends it again
                log.error(
                    "could not write weight version %d: serving version %d", update.version, self.version, exc_info=err
                )
                update.settle(f"writing it failed ({failure(err)}); serving version {self.version} until it is written")
                self._unwritten = update
                continue
            self._unwritten = None
            self.version = update.version
            self._weights_epoch += 1
            self._kept.clear()  # their keys and values are the old weights'
            update.settle()
            written = True
        if touched:  # also after a write put back: derived weights are refreshed from what is there
            self.decoder.weights_changed()
        if written:
            self.stats.record_swap(self.version, pause)
        self.scheduler.admit_fresh = True

    def _admit(self, seqs: list[Sequence]) -> None:
        """Start the sequences the scheduler admitted (`_start_all`) and count their prompts.

        The scheduler has taken `seqs` off its queues: if starting them raises (a prefill out of
        memory, say), `_recover` takes them all back (`_admitting`, set since `plan`); else they
        would be in no queue and never finish."""
        self._admitting = seqs
        self._start_all(seqs)
        self._admitting = []
        self.stats.prompt_tokens_total += sum(s.num_tokens for s in seqs if not s.preemptions)
        if self._routes_pending and self.device.type == "cuda":  # the prefills' route copies end here
            self._routes_copied = torch.cuda.Event()
            self._routes_copied.record(torch.cuda.current_stream(self.device))

    def _start_all(self, seqs: list[Sequence]) -> None:
        """Give each sequence the next free slot and feed all its tokens but the last.

        Resumed sequences go one by one, replaying exactly the experts they used before (replay
        covers a whole forward). Fresh ones that can copy a prefix from a running sequence, or
        from one prefilled just before them (`share_prefixes`), copy it and prefill the rest;
        the others are prefilled together. Followers are prefilled together too, each from its
        own first uncached position, in waves: one whose longest prefix is another follower's
        waits for the wave after that one's, so it shares as much as one at a time would."""
        running = self.scheduler.running
        resumed = [s for s in seqs if s.routes is not None]
        fresh = sorted((s for s in seqs if s.routes is None), key=lambda s: -s.num_tokens)
        leaders: list[Sequence] = []
        followers: list[Sequence] = []
        for seq in fresh:
            (followers if self._copyable(seq, running, leaders)[0] is not None else leaders).append(seq)
        for seq in resumed:
            self._start([(seq, None, 0)])
        if leaders:
            self._start([(seq, None, 0) for seq in leaders])
        while followers:  # their donors run by now (leaders, earlier waves) or are kept
            wave: list[tuple[Sequence, Sequence | Kept | None, int]] = []
            later: list[Sequence] = []
            for seq in followers:
                donor, shared = self._copyable(seq, running)
                waiting_pays = any(
                    common_prefix_length(other.prompt_ids, seq.prompt_ids, len(seq.prompt_ids) - 1) > shared
                    for other, _, _ in wave
                )
                (later.append(seq) if waiting_pays else wave.append((seq, donor, shared)))
            self._start(wave)
            followers = later

    def _start(self, plans: list[tuple[Sequence, Sequence | Kept | None, int]]) -> None:
        """Slots for the sequences of `plans` (sequence, donor, shared), each first copying its
        `shared` positions from its donor (if any), then their prefill: together, the most to
        prefill first (so the rows still feeding at any chunk are a prefix of the group:
        contiguous slots), except a row whose padding would run past the cache, alone."""
        running = self.scheduler.running
        plans = sorted(plans, key=lambda plan: -(plan[0].num_tokens - 1 - plan[2]))
        most = plans[0][0].num_tokens - 1 - plans[0][2]
        fits = [plan for plan in plans if plan[2] + most <= self.cache.max_len]
        plans = fits + [plan for plan in plans if plan[2] + most > self.cache.max_len]
        for seq, donor, shared in plans:  # slots in that order: the rows prefilled together first
            seq.slot = len(running)
            running.append(seq)
            if donor is not None:
                self._copy_prefix(donor, seq, shared)
        if fits:
            self._prefill([seq for seq, _, _ in fits])
        for seq, _, _ in plans[len(fits) :]:
            self._prefill([seq])
        for seq, _, _ in plans:  # a resumed sequence replayed old routes: nobody copies from it
            seq.weights_epoch = self._weights_epoch if seq.routes is None else None

    def _copyable(
        self, seq: Sequence, running: list[Sequence], planned: list[Sequence] | None = None
    ) -> tuple[Sequence | Kept | None, int]:
        """The cache holding the longest prefix of fresh `seq`'s prompt (all but its last token at
        most), and that prefix's length: among `running` sequences whose caches were filled under
        the current weights, kept ones, and fresh ones `planned` to be prefilled first."""
        if not self.config.share_prefixes or seq.routes is not None:
            return None, 0
        # (source, its tokens, how many of them are (or will be) cached): not the positions of a
        # step still in flight, whose routes are not written yet
        candidates = [
            (
                other,
                other.prompt_ids if cached <= len(other.prompt_ids) else other.tokens(0, cached),
                cached,
            )
            for other, cached in ((other, other.num_cached - other.pending) for other in running)
            if other.weights_epoch == self._weights_epoch
        ]
        candidates += [(kept, kept.tokens, len(kept.tokens)) for kept in self._kept.values()]
        candidates += [(other, other.prompt_ids, len(other.prompt_ids) - 1) for other in planned or ()]
        best, best_length, want = None, 0, len(seq.prompt_ids) - 1
        for source, tokens, cached in candidates:
            length = common_prefix_length(tokens, seq.prompt_ids, min(want, cached))
            if length > best_length:
                best, best_length = source, length
        return best, best_length

    def _kv_cache(self, cfg, slots: int, dtype: torch.dtype, block: int) -> SlotKVCache:
        """The engine's KV cache, or an error naming its size and the settings that make it."""
        try:
            return SlotKVCache.for_model(cfg, slots, self.context_limit, dtype, block, self.device)
        except RuntimeError as err:  # torch.OutOfMemoryError on CUDA; the CPU allocator's own
            if not isinstance(err, torch.OutOfMemoryError) and "can't allocate memory" not in str(err):
                raise
        # raised here, not in the handler: the error's traceback would hold the half-made cache
        positions = -(-self.context_limit // block) * block
        size = 2 * cfg.num_hidden_layers * slots * cfg.num_key_value_heads * positions * cfg.head_dim * dtype.itemsize
        more = ""
        if self.device.type == "cuda":
            more = (
                ", or give the server more of its GPU (a lower placement.trainer_memory_fraction where it shares "
                "the trainer's; on Ray, more placement.ray.server.num_gpus)"
            )
        raise WhetstoneError(
            f"the engine's KV cache does not fit on {self.device}: {size / 2**30:.1f} GiB of keys and values "
            f"({slots} slots of {positions} positions, {cfg.num_hidden_layers} layers x "
            f"{cfg.num_key_value_heads} KV heads x {cfg.head_dim}, {dtype}); give it fewer slots "
            f"(engine.max_batch, keep_finished) or positions (engine.context_limit){more}"
        )

    def _prefill_cost(self, seq: Sequence, admitted: list[Sequence]) -> int:
        """Tokens `seq` would prefill if admitted after `admitted` (the scheduler's budget)."""
        return seq.num_tokens - 1 - self._copyable(seq, self.scheduler.running, admitted)[1]

    def _copy_prefix(self, donor: Sequence | Kept, seq: Sequence, length: int) -> None:
        """Start `seq`'s cache and routes with the first `length` positions of `donor`'s."""
        if isinstance(donor, Kept):
            self._kept.move_to_end(donor.slot)
        self.cache.move(donor.slot, seq.slot, length)
        if self.routes is not None:  # the donor's routes may still be on their way from the device
            self._routes_pending.append((seq.slot, 0, self.routes[donor.slot, :length]))
        seq.num_cached = length
        self.stats.prompt_tokens_shared_total += length

    def _prefill(self, group: list[Sequence]) -> None:
        """Feed each sequence's uncached tokens but the last, all rows in one forward per chunk of
        `prefill_chunk` tokens, each row from its own first uncached position (0, or after a
        copied prefix). `group` holds contiguous slots, the most to feed first; a shorter row is
        padded with 0s at positions past its own, which nothing attends before its later tokens
        overwrite them (the caller keeps that padding inside the cache)."""
        starts = [seq.num_cached for seq in group]
        ends = [seq.num_tokens - 1 for seq in group]
        todo = [end - start for start, end in zip(starts, ends)]
        tokens = [seq.tokens(start, end) for seq, start, end in zip(group, starts, ends)]
        replay = group[0].routes if len(group) == 1 else None
        ragged = len(set(starts)) > 1
        for offset in range(0, todo[0], self.config.prefill_chunk):
            rows = sum(1 for n in todo if n > offset)
            width = min(self.config.prefill_chunk, todo[0] - offset)
            ids = to_device(
                [pad(tokens[row][offset : offset + width], width) for row in range(rows)], torch.int64, self.device
            )
            if ragged:
                first = [starts[row] + offset for row in range(rows)]
                positions = to_device([list(range(f, f + width)) for f in first], torch.int64, self.device)
            else:
                positions = torch.arange(starts[0] + offset, starts[0] + offset + width, device=self.device)
                positions = positions.expand(rows, -1)
            span = max(starts[row] for row in range(rows)) + offset + width
            lo, hi = starts[0] + offset, starts[0] + offset + width  # the replayed sequence's positions
            # a resumed sequence's recorded routes (pageable host memory): through a pinned copy
            chunk_routes = None if replay is None else tensor_to_device(replay[lo:hi].unsqueeze(0), self.device)
            out = self._forward(
                ids,
                positions,
                self.cache.rows(group[0].slot, rows, span),
                routes=chunk_routes,
                return_routes=self.routes is not None and replay is None,
                logits_to_keep=0,
            )  # prefill only fills the cache; decode samples
            if self.routes is None:
                continue
            if replay is not None:
                self.routes[group[0].slot, lo:hi] = replay[lo:hi]
                continue
            used = out.routes.to(torch.int16).to("cpu", non_blocking=True)
            for row, seq in enumerate(group[:rows]):
                fed = min(width, todo[row] - offset)
                self._routes_pending.append((seq.slot, starts[row] + offset, used[row, :fed]))
        for seq, end in zip(group, ends):
            seq.num_cached = end

    def _forward(self, ids: torch.Tensor, positions: torch.Tensor, cache, **kwargs):
        """The model's forward with the configured numerics and compute dtype (the trainer's own)."""
        with numerics(self.config.numerics), autocast(self.config.dtype, self.device):
            return self.model(ids, positions=positions, cache=cache, **kwargs)

    def _derived(self) -> list[torch.Tensor]:
        """The weights the model derives from its parameters and keeps between forwards (attention's
        fused q/k/v matrix), made or refreshed for the current parameters."""
        with torch.inference_mode():  # where the model keeps them
            return [module.qkv_weight() for module in self.model.modules() if hasattr(module, "qkv_weight")]

    def _decode(self) -> None:
        """Launch a decode step over the running sequences, then take the results of the one
        launched before it, if any (overlapping: the device computes this step meanwhile), and
        of this one unless the engine runs one step ahead (`overlap`)."""
        running, ahead = self.scheduler.running, self._launched
        self._launched = None
        if ahead is not None and not all(self._may_run_ahead(seq) for seq in running):
            self._decoding = ahead.seqs
            self._take(ahead)  # a sequence may end with it: know first
            ahead = None
        if running:
            self._decoding = list(running)
            launched = self._launch(self._decoding, ahead)
        else:
            launched = None
        if ahead is not None:
            self._decoding = ahead.seqs
            self._take(ahead)
        if launched is not None and self.overlap:
            self._launched = launched
        elif launched is not None:
            self._decoding = launched.seqs
            self._take(launched)
        self._decoding = []

    def _may_run_ahead(self, seq: Sequence) -> bool:
        """Whether another step may be launched for `seq` before its pending token is read back:
        not if that token would end it by length (the step would be wasted, and could run past
        the cache)."""
        return not seq.pending or (
            len(seq.output_ids) + seq.pending < seq.params.max_tokens
            and seq.num_tokens + seq.pending < self.context_limit
        )

    def _launch(self, seqs: list[Sequence], ahead: Launched | None) -> Launched:
        """Queue one decode step over `seqs` (slots 0..B-1) and its sampling, and start reading
        its draws back. A sequence with a token pending in `ahead` is fed that token straight
        from the device."""
        span = max(seq.num_cached for seq in seqs) + 1
        rows = [(seq.last_token, seq.num_cached) for seq in seqs]
        tokens = None
        if ahead is not None and ahead.feeds(seqs):  # the usual step: the same rows as the one ahead
            tokens = ahead.drawn.tokens
        elif ahead is not None and any(seq.pending for seq in seqs):
            row_of = {id(seq): row for row, seq in enumerate(ahead.seqs) if ahead.launches[row] == seq.launches}
            index = to_device([row_of[id(seq)] if seq.pending else -1 for seq in seqs], torch.int64, self.device)
            host = to_device([seq.last_token for seq in seqs], torch.int64, self.device)
            tokens = torch.where(index >= 0, ahead.drawn.tokens.index_select(0, index.clamp(min=0)), host)
        logits, routes = self.decoder(rows, span, tokens)
        fed = None if routes is None else routes.to(torch.int16).to("cpu", non_blocking=True)
        params = [seq.params for seq in seqs]
        counters = [len(seq.output_ids) + seq.pending for seq in seqs]
        drawn = self._sample(logits, seqs, counters)
        launched = Launched(
            seqs, [seq.launches for seq in seqs], [pos for _, pos in rows], self.version, drawn, fed,
            drawn.read_later(params),
        )  # fmt: skip
        for seq in seqs:
            seq.num_cached += 1
            seq.pending += 1
        self.stats.decode_steps_total += 1
        return launched

    def _sample(self, logits: torch.Tensor, seqs: list[Sequence], counters: list[int]) -> Drawn:
        """`sample` the step's rows. If it raises, each row is sampled alone to find the sequences
        whose parameters raise (`SequencesFailed`); none: the batch's failure, raised as it is."""
        params, seeds = [seq.params for seq in seqs], [seq.seed for seq in seqs]
        with numerics(self.config.numerics):  # the trainer's log-softmax, under invariant numerics
            try:
                return sample(logits, params, seeds, counters)
            except Exception as err:
                culprits = []
                for row, seq in enumerate(seqs):
                    try:
                        sample(
                            logits[row : row + 1], params[row : row + 1], seeds[row : row + 1], counters[row : row + 1]
                        )
                    except Exception:
                        culprits.append(seq)
                if not culprits:
                    raise
                raise SequencesFailed(culprits) from err

    def _take(self, launched: Launched) -> None:
        """Read `launched`'s draws back (waiting for that step only) and hand each token to its
        sequence, unless the sequence dropped that step since (finished, preempted, aborted)."""
        result = launched.readback.result()  # the step's one read-back; its routes are there too
        self._apply_routes()
        live = [row for row, seq in enumerate(launched.seqs) if launched.launches[row] == seq.launches]
        if launched.routes is not None and live:  # into each sequence's slot now (`routes` is on the host)
            slots = torch.tensor([launched.seqs[row].slot for row in live], device="cpu")
            positions = torch.tensor([launched.positions[row] for row in live], device="cpu")
            every = len(live) == len(launched.seqs)
            self.routes[slots, positions] = launched.routes if every else launched.routes[live]
        self.stats.record_tokens(len(live))
        finished, failed = [], []
        for row in live:
            seq, token = launched.seqs[row], result.tokens[row]
            seq.pending -= 1
            seq.output_ids.append(token)
            seq.logprobs.append(result.logprobs[row])
            seq.versions.append(launched.version)
            if seq.params.top_logprobs:
                seq.top_logprobs.append(result.top[row])
            try:  # the sequence's own host code: what raises there is its failure alone
                reason = self._stop_reason(seq, token)
                if reason is None and seq.stream:
                    seq.notify()
            except Exception as err:
                failed.append((seq, err))
                self._ending.add(seq)
                continue
            if reason is not None:  # its last token is in: it must not resume if the step raises
                finished.append((seq, reason))
                self._ending.add(seq)
        for seq, reason in finished:
            self._finish(seq, reason)
        for seq, err in failed:
            self._fail_alone(seq, err)

    def _drop_pending(self, seq: Sequence) -> None:
        """Forget the steps launched for `seq` whose tokens are not read back (it is leaving its
        slot): their cache positions are not its, and their tokens will not be handed over."""
        seq.num_cached -= seq.pending
        seq.pending = 0
        seq.launches += 1

    def _apply_routes(self) -> None:
        """Write the routes that were on their way into `routes`, in the order they were issued,
        once the copies queued for them (`_routes_copied`) are done."""
        if not self._routes_pending:
            return
        if self._routes_copied is not None:
            self._routes_copied.synchronize()
            self._routes_copied = None
        for slot, start, values in self._routes_pending:
            self.routes[slot, start : start + values.shape[0]] = values
        self._routes_pending.clear()

    def _stop_reason(self, seq: Sequence, token: int) -> str | None:
        params = seq.params
        if token in params.stop_token_ids or (token in self.eos_token_ids and not params.ignore_eos):
            return "stop"
        if seq.text is not None and (seq.stream or params.stop):
            seq.text.push([token])
            if seq.text.stopped:
                return "stop"
        if len(seq.output_ids) >= params.max_tokens or seq.num_tokens >= self.context_limit:
            return "length"
        return None

    def _finish(self, seq: Sequence, reason: str) -> None:
        self._ending.add(seq)
        self._drop_pending(seq)
        if seq.slot is not None:
            self._keep(seq)
            self._release(seq)
        if seq.text is not None:
            try:
                if not (seq.stream or seq.params.stop):
                    ended_on_stop_token = reason == "stop" and seq.output_ids
                    seq.text.push(seq.output_ids[:-1] if ended_on_stop_token else seq.output_ids)
                seq.text.finish()
            except Exception as err:
                self._fail_alone(seq, err)
                return
        seq.finish_reason = reason
        self.stats.requests_total[reason] += 1
        self._notify_last(seq)

    def _keep(self, seq: Sequence) -> None:
        """Copy a finishing sequence's cache into a spare slot (the least recently used one if
        all are taken), for a request that continues it."""
        spare = range(self.config.max_batch, self.cache.slots)
        if not spare or seq.weights_epoch != self._weights_epoch or seq.num_cached == 0:
            return
        slot = next((s for s in spare if s not in self._kept), None)
        if slot is None:
            slot, _ = self._kept.popitem(last=False)
        self.cache.move(seq.slot, slot, seq.num_cached)
        if self.routes is not None:
            self.routes[slot, : seq.num_cached] = self.routes[seq.slot, : seq.num_cached]
        self._kept[slot] = Kept(slot, seq.tokens(0, seq.num_cached))

    def _release(self, seq: Sequence) -> None:
        """Free `seq`'s slot, keeping its routes; the last running sequence moves into the gap.
        If the move raises, both keep their slots (`running` is left as it was)."""
        slot, running = seq.slot, self.scheduler.running
        if self.routes is not None:
            seq.routes = self.routes[slot, : seq.num_cached].clone()
        last = running[-1]
        if last is not seq:
            self.cache.move(last.slot, slot, last.num_cached)
            if self.routes is not None:
                self.routes[slot, : last.num_cached] = self.routes[last.slot, : last.num_cached]
            last.slot = slot
            running[slot] = last
        running.pop()
        seq.slot = seq.weights_epoch = None

    def _recover(self, err: Exception) -> None:
        """Put the engine back in order after a step raised `err`, ending as little as it can.

        The step in flight is dropped (its tokens are drawn again) and the sequences being
        admitted (taken off their queues by the step's plan, prefilled or not) are taken back.
        `SequencesFailed` (a sequence's own parameters): those fail alone, the others keep their
        slots. Else the batch's work failed (a forward out of memory, say): the sequences it ran
        (running and admitted) keep their tokens and go back to the front of their queues, as
        preempted ones do, to be recomputed, as suspects: the scheduler admits those one per step
        with no other (its `probe`). If the failure was in work of the probe's (its prefill, or a
        decode step it is in, launched or read back), it is that sequence's (a prompt whose
        prefill never fits, say): it fails alone, and the others go back, not suspects, with no
        failed step counted. Else, if the step before failed too, they fail instead (a failure
        that repeats would requeue them for ever). So a failure tied
        to one sequence costs that sequence, and one tied to none ends one sequence per step that
        admits a suspect, never failing steps for ever. A sequence whose end was under way
        (`_ending`) fails either way: it had stopped (resumed, it would generate past its stop),
        failed alone or been aborted. What raises here is the caller's (`step` then fails every
        sequence, `_fail_all`). Each sequence requeued is counted in `failure_requeues_total`,
        apart from preemptions (which make room for users; this is a failure's cost), and each
        suspect failed alone in `isolated_failures_total`."""
        admitted, self._admitting = self._admitting, []
        ending, self._ending = self._ending, set()
        running = self.scheduler.running
        probe, self.scheduler.probe, self._probe_ahead = self.scheduler.probe, None, False
        self._launched = None
        if admitted:  # their slots are the last ones; their prefill's routes are left unused
            del running[min((seq.slot for seq in admitted if seq.slot is not None), default=len(running)) :]
            self._routes_pending.clear()
            self._routes_copied = None
            for seq in admitted:
                seq.slot = seq.weights_epoch = None
                seq.num_cached = 0
        for seq in running:
            self._drop_pending(seq)
        self._apply_routes()  # the routes of an admission that completed: released sequences keep them
        ended = f"{failure(err)} (the engine failed while ending the sequence)"
        if isinstance(err, SequencesFailed):
            for seq in reversed(admitted):  # a probe's admission was cut short: it waits its turn again
                self._requeue_after_failure(seq, suspect=seq is probe)
            for seq in err.seqs:
                self._fail_alone(seq, err.__cause__)
            for seq in ending:
                if not seq.finished:
                    self._fail_alone(seq, err, ended)
            return
        decoding, self._decoding = self._decoding, []
        at_fault = probe is not None and any(seq is probe for seq in admitted + decoding)
        isolated = probe if at_fault else None  # else the failure was in work the probe was not in
        if isolated is not None:
            log.error(
                "engine step failed again, admitting sequence %s alone: failing it", isolated.request_id, exc_info=err
            )
            self._failed_steps = 0  # the failure is the probe's: the others get their retry
        else:
            self._failed_steps += 1
            if self._failed_steps >= FAIL_AFTER_STEPS:
                log.error(
                    "engine step failed (%d in a row): failing the sequences it ran", self._failed_steps, exc_info=err
                )
                if not admitted and not running:  # it failed before taking any (the plan itself): the next in line
                    admitted = self._take_next_waiting()
                self._fail_running(
                    f"{failure(err)} (the engine's step failed {self._failed_steps} times in a row)", admitted
                )
                self._failed_steps = 0  # the sequences it counted for have failed; others get their retry
                return
            log.error("engine step failed: requeueing the sequences it ran", exc_info=err)
        suspect = isolated is None
        for seq in reversed(admitted):
            if seq is not isolated:
                self._requeue_after_failure(seq, suspect)
        for seq in reversed(list(running)):  # the last one first: no slot to move
            self._release(seq)
            if seq in ending:
                self._fail(seq, ended)
            elif seq is not isolated:
                seq.preempt()
                self._requeue_after_failure(seq, suspect)
        if isolated is not None and not isolated.finished:
            self.stats.isolated_failures_total += 1
            self._fail(
                isolated, f"{failure(err)} (the engine's step failed again when it admitted this sequence alone)"
            )

    def _requeue_after_failure(self, seq: Sequence, suspect: bool) -> None:
        """Put `seq`, out of its slot, back at the front of its queue after a failed step;
        `suspect`: to be admitted with no other (`Scheduler.suspects`)."""
        self.scheduler.requeue(seq)
        if suspect:
            self.scheduler.suspects.add(seq)
        self.stats.failure_requeues_total += 1

    def _settle_probe(self) -> None:
        """After a step that went through, end the scheduler's probe's admission once the first
        decode step that ran it is read back: in the step that admitted it, or, running ahead
        (`overlap`), in the next. Its prefill is done within the step that admitted it (all of
        its `prefill_chunk` forwards). A probe that left its slot (finished, aborted, preempted)
        ends it at once."""
        if self._launched is not None and not self._probe_ahead and self.scheduler.probe.slot is not None:
            self._probe_ahead = True
            return
        self.scheduler.probe, self._probe_ahead = None, False

    def _take_next_waiting(self) -> list[Sequence]:
        """The sequence the scheduler would take next (users first), off its queue; none if all
        are empty. Failed when steps keep failing before taking any sequence: a failure tied to
        that sequence then costs it, and one that is not still ends the waiting sequences, one
        per `FAIL_AFTER_STEPS` steps, instead of failing steps for ever."""
        for priority in ("interactive", "batch"):
            if self.scheduler.waiting[priority].head is not None:
                return [self.scheduler.pop_waiting(priority)]
        return []

    def _fail_running(self, message: str, admitted: list[Sequence]) -> None:
        """Fail the running sequences and `admitted` (out of slots and queues) with `message`.
        Nothing is moved in the cache: every slot is freed."""
        self._routes_pending.clear()  # the failed step's: the sequences they were for end here
        self._routes_copied = self._launched = None
        running = self.scheduler.running
        failed = list(reversed(running))
        running.clear()
        for seq in failed:
            self._drop_pending(seq)
            seq.slot = seq.weights_epoch = None
        for seq in failed + admitted:
            self._fail(seq, message)

    def _fail_all(self, message: str) -> None:
        """Fail every unfinished sequence the engine holds (running, being admitted, waiting, or
        lost between them) with `message`, and start afresh: no slot taken, no queue, no step in
        flight, no kept cache. For when putting the engine back in order failed: nothing it
        holds can be trusted. Moves nothing on the device, and ends each sequence once."""
        self._launched = None
        self._routes_pending.clear()
        self._routes_copied = None
        self._admitting = []
        self._ending = set()
        self._kept.clear()
        self._failed_steps = 0
        self._probe_ahead = False
        self._decoding = []
        self.scheduler.running.clear()
        for waiting in self.scheduler.waiting.values():
            waiting.clear()
        self.scheduler.suspects.clear()
        self.scheduler.probe = None
        for seq in list(self._unfinished):
            seq.slot = seq.weights_epoch = None
            seq.pending = 0
            self._fail(seq, message)

    def _break(self, message: str) -> None:
        """Stop the engine for good (its weights hold no whole version): every sequence it holds
        or is sent fails with `message`, every queued update is refused, and the thread ends
        (/health: "engine stopped"); from now on `add` fails a sequence at once and
        `update_weights` raises."""
        log.critical("the engine stops: %s", message)
        with self._send_lock:
            self._broken = message
        try:
            self._take_inbox()  # what was sent before: it fails with the rest
            self._fail_all(message)
        except Exception:
            log.exception("failing the sequences of the stopped engine failed")
        while self._updates:
            self._updates.popleft().settle(message)

    def _fail_alone(self, seq: Sequence, err: Exception, message: str | None = None) -> None:
        """Fail `seq`, whose own host code raised `err` (or whose end `err` cut short: `message`);
        the other sequences carry on."""
        self._ending.add(seq)
        log.error("sequence %s failed", seq.request_id, exc_info=err)
        self._drop_pending(seq)
        if seq.slot is not None:
            self._release(seq)
        self._fail(seq, message or failure(err))

    def _fail(self, seq: Sequence, message: str) -> None:
        """End `seq` (out of its slot and queues) with the engine's error: its request answers 500."""
        if seq.finished:  # each sequence ends once
            return
        seq.error = message
        self.stats.requests_total["error"] += 1
        seq.finish_reason = "abort"
        self._notify_last(seq)

    def _notify_last(self, seq: Sequence) -> None:
        """Tell `seq`'s callback it ended; one that raises is logged (the sequence is over)."""
        self._unfinished.pop(seq, None)
        self._ending.discard(seq)
        try:
            seq.notify()
        except Exception:
            log.exception("sequence %s: its callback raised on its last event", seq.request_id)


class SequencesFailed(Exception):
    """The step failed in code of `seqs` alone (their sampling parameters); `__cause__` is why."""

    def __init__(self, seqs: list[Sequence]):
        super().__init__(", ".join(seq.request_id for seq in seqs))
        self.seqs = seqs


@dataclass
class Launched:
    """A decode step on its way: launched for `seqs` (row i for seqs[i]), not read back yet."""

    seqs: list[Sequence]
    launches: list[int]
    """Each sequence's `launches` then: a row whose sequence has moved on since is dropped."""
    positions: list[int]
    """The position each row fed."""
    version: int
    """The weight version the step ran with."""
    drawn: Drawn
    """The draws on the device (the next step, launched before these are read back, feeds them)."""
    routes: torch.Tensor | None
    """[B, moe_layers, top_k] int16 routes of the tokens fed, on their way to the host."""
    readback: Readback

    def feeds(self, seqs: list[Sequence]) -> bool:
        """Whether the next step's rows are this step's, row for row, none of them moved on: its
        tokens are then this step's draws as they are (no gather, nothing copied to the device)."""
        return len(seqs) == len(self.seqs) and all(
            seq is mine and seq.launches == launches for seq, mine, launches in zip(seqs, self.seqs, self.launches)
        )


@dataclass
class Kept:
    """A finished sequence's cache, kept in a spare slot: its first `len(tokens)` positions."""

    slot: int
    tokens: list[int]


def failure(err: Exception) -> str:
    """What a sequence failed by `err` reports."""
    return f"{type(err).__name__}: {err}"


def pad(tokens: list[int], length: int) -> list[int]:
    """`tokens` followed by 0s up to `length`."""
    return tokens + [0] * (length - len(tokens))


def common_prefix_length(a: list[int], b: list[int], limit: int) -> int:
    """Length of the longest common prefix of `a` and `b`, at most `limit` (a bisection over
    slice comparisons, which run in C)."""
    n = min(len(a), len(b), limit)
    if n <= 0 or a[0] != b[0]:
        return 0
    if a[:n] == b[:n]:
        return n
    equal, different = 1, n
    while different - equal > 1:
        middle = (equal + different) // 2
        if a[:middle] == b[:middle]:
            equal = middle
        else:
            different = middle
    return equal
