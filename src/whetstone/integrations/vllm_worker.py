"""The vLLM worker extension that makes a vLLM server follow whetstone's weight store.

vLLM loads it into its worker process (`--worker-extension-cls
whetstone.integrations.vllm_worker.WeightStoreFollower`, which `vllm_serve` passes) and its
methods are called through vLLM's `collective_rpc` (the `/collective_rpc` route of
`VLLM_SERVER_DEV_MODE`):

  whetstone_follow(sync_json)  start following the store: whetstone's `Subscriber` fetches,
                               verifies and decodes every version in a background thread (a
                               corrupt or truncated one is rejected and the server stays where it
                               is, as `whetstone serve` does), and the update is checked against
                               the served model's names and shapes and staged
  whetstone_status()           where it stands: the served version, the staged one, the store's
                               newest, rejected versions and why it cannot take the newest
  whetstone_apply()            write the staged update into vLLM's model in place (vLLM's
                               `reload_weights`, HF names); `vllm_serve` calls it while vLLM's
                               scheduler is paused, so no step sees half of it. A write that
                               fails part-way leaves the update staged, to be written again, and
                               is reported (`weights_problem`) until one succeeds

vLLM's loaders take whole checkpoint tensors and then process them into its kernels' layout (its
CPU build repacks the linear layers), and its in-place reload processes a layer once all of the
layer's tensors are loaded. So the follower keeps the weights it served last (whetstone names, on
the CPU), applies each delta to them, and reloads every tensor: the delta saves the transfer and
the decoding, not vLLM's load. Runs inside
the vLLM virtual environment with whetstone importable (`vllm_serve` puts it on PYTHONPATH); vLLM
itself is imported only inside the methods that need it.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

import torch

from whetstone.inference.swap import WeightFollower, WeightUpdateError
from whetstone.sync.update import WeightUpdate, apply_update, merge_updates

log = logging.getLogger("whetstone.vllm")


class ServedWeights:
    """The engine side of a `WeightFollower` for a vLLM model: updates are checked and staged by
    the follower's thread, and written by `load` (the `whetstone_apply` call)."""

    def __init__(self, worker, shapes: dict[str, tuple[int, ...]], version: int):
        """`worker`: the vLLM worker (its `reload_weights`, model and config)."""
        from whetstone.model.hf import read_hf_config

        self.worker, self.shapes = worker, shapes
        self.cfg = read_hf_config(worker.vllm_config.model_config.model)
        self.version = version
        """The version served: the one loaded at start, then the last one written."""
        self.weights: dict[str, torch.Tensor] = {}
        """The newest weights applied, by whetstone name: the served version's, or the staged
        one's while it is being written (deltas are applied to them)."""
        self.problem: str | None = None
        """Why the model holds no whole version (a write that failed part-way), until a write succeeds."""
        self._staged: WeightUpdate | None = None
        self._lock = threading.Lock()

    @property
    def staged_version(self) -> int | None:
        with self._lock:
            return None if self._staged is None else self._staged.version

    def update_weights(self, update: WeightUpdate) -> None:
        """Check `update` against the served model and stage it (merged with one staged before)."""
        where = f"weight version {update.version}"
        for name, change in update.tensors.items():
            shape = self.shapes.get(name)
            if shape is None:
                raise WeightUpdateError(f"{where}: the served model has no tensor {name!r}")
            if tuple(change.shape) != shape:
                raise WeightUpdateError(
                    f"{where}: {name} has shape {tuple(change.shape)}, the served model has {shape}"
                )
            if change.indices is not None and name not in self.weights and not self._staged_whole(name):
                raise WeightUpdateError(f"{where}: {name} is a delta, but no full value of it was served before")
        needed = [name for name in update.removed if name in self.shapes]
        if needed:
            raise WeightUpdateError(f"{where} removes tensors the served model needs: {needed[:5]}")
        with self._lock:
            self._staged = update if self._staged is None else merge_updates([self._staged, update])

    def _staged_whole(self, name: str) -> bool:
        staged = self._staged
        return staged is not None and name in staged.tensors and staged.tensors[name].indices is None

    @torch.no_grad()
    def load(self) -> int:
        """Write the staged update into the model; returns the version now served.

        The update is taken off the stage, and its version becomes the served one, only once
        vLLM's reload has taken every tensor: a reload that raises part-way (out of memory, say)
        leaves the model holding parts of two versions, so the update stays staged (merged with
        any staged since) for the next call to write whole, and `problem` says so. The update is
        applied to `weights` in place first: an update overwrites values (it adds nothing), so
        applying it again on a retry gives the same values, and the host holds one copy of the
        model beside the one tensor being handed to vLLM, not two."""
        from whetstone.model.hf import hf_pieces

        with self._lock:
            update = self._staged
        if update is None:
            return self.version
        missing = sorted(set(self.shapes) - (set(self.weights) - set(update.removed)) - set(update.tensors))
        if missing:  # a first version that is not whole (staging checks deltas, so never expected)
            self._unstage(update)  # nothing was written: the model still holds its version whole
            raise WeightUpdateError(f"weight version {update.version} leaves {missing[:5]} unknown")
        apply_update(self.weights, update)
        # copies, one at a time as vLLM takes them: its reload may keep the tensors it is given as
        # parameters, or process them in place, and `weights` must keep the values deltas apply to
        pieces = (
            (hf_name, piece.clone())
            for name, tensor in self.weights.items()
            for hf_name, piece in hf_pieces(name, tensor, self.cfg)
        )
        try:
            self.worker.reload_weights(weights_iterator=pieces, is_checkpoint_format=True)
            self._process_raw_experts()
        except Exception as err:
            self.problem = (
                f"writing weight version {update.version} failed part-way ({type(err).__name__}: {err}): the "
                f"model holds parts of versions {self.version} and {update.version} until it is written again"
            )
            log.error("%s", self.problem)
            raise
        self._unstage(update)
        self.version, self.problem = update.version, None
        log.info("serving weight version %d (%d tensors changed)", update.version, len(update.tensors))
        return self.version

    def _unstage(self, update: WeightUpdate) -> None:
        """Take `update` off the stage, unless a newer one was merged into it meanwhile: writing
        that merge again rewrites `update`'s values with themselves, then the newer ones."""
        with self._lock:
            if self._staged is update:
                self._staged = None

    def _process_raw_experts(self) -> None:
        """Put expert weights that vLLM's reload left in checkpoint layout into its kernel's.

        vLLM 0.32's CPU build reloads a fused-MoE layer's weights but does not prepack them for
        its CPU kernel again (at start it does), so the kernel would read raw weights as packed
        ones (measured: max |Δ logprob| 0.17 against the trainer; 5e-7 once processed). A layer
        whose weights are still exactly the checkpoint's is processed here; one vLLM processed
        itself (other builds, other backends) differs from them and is left alone."""
        from vllm.config import set_current_vllm_config

        from whetstone.model.hf_convert import GATE_UP

        for name, module in self.worker.get_model().named_modules():
            experts = getattr(getattr(getattr(module, "quant_method", None), "moe_kernel", None), "impl", None)
            experts = getattr(experts, "fused_experts", None)
            if experts is None or not hasattr(module, "w13_weight") or ".layers." not in name:
                continue
            if module.w13_weight.device.type != "cpu":  # a GPU build: its reload processes its weights itself
                continue
            raw = self.weights.get(f"layers.{name.split('.layers.')[1].split('.')[0]}.{GATE_UP}")
            if raw is not None and raw.shape == module.w13_weight.shape and torch.equal(module.w13_weight, raw):
                with set_current_vllm_config(self.worker.vllm_config):
                    experts.process_weights_after_loading(module)


class WeightStoreFollower:
    """Mixed into vLLM's worker class by `--worker-extension-cls` (methods only: vLLM refuses
    an extension whose names clash with the worker's, hence the `whetstone_` prefix)."""

    def whetstone_follow(self, sync_json: str, version: str) -> dict[str, Any]:
        """Follow the weight store of `sync_json` (a `SyncConfig`); `version`: the weight version
        of the model vLLM loaded. Calling it again changes nothing."""
        from whetstone.model.hf import read_hf_config
        from whetstone.model.transformer import Transformer
        from whetstone.sync import Subscriber, SyncConfig, WeightStore

        if getattr(self, "_whetstone", None) is None:
            config = SyncConfig.model_validate_json(sync_json)
            with torch.device("meta"):
                model = Transformer(read_hf_config(self.vllm_config.model_config.model))
            shapes = {name: tuple(t.shape) for name, t in model.state_dict().items()}
            served = ServedWeights(self, shapes, int(version))
            subscriber = Subscriber(WeightStore.open(config, create=False), config, name="vllm")
            self._whetstone = WeightFollower(subscriber, served, poll_seconds=config.poll_interval).start()
        return self.whetstone_status()

    def whetstone_status(self) -> dict[str, Any]:
        """Where the server stands, in the fields of `whetstone serve`'s /health."""
        follower: WeightFollower | None = getattr(self, "_whetstone", None)
        if follower is None:
            return {"following": False}
        report = follower.report()
        return {
            "following": True,
            "weight_version": follower.engine.version,
            "staged_version": follower.engine.staged_version,
            "latest_weight_version": report.latest_version,
            "rejected_versions": {str(v): why for v, why in sorted(report.rejected.items())},
            "rejections_total": report.rejections_total,
            "weights_problem": follower.engine.problem or report.problem,  # a half-written model first
        }

    def whetstone_apply(self) -> dict[str, Any]:
        """Write the staged version into the model (call it with the scheduler paused)."""
        follower: WeightFollower | None = getattr(self, "_whetstone", None)
        if follower is None:
            raise RuntimeError("whetstone_apply before whetstone_follow")
        follower.engine.load()
        return self.whetstone_status()
