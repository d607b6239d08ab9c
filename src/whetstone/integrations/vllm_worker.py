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
                               fails part-way is undone (the served version written back), the
                               update stays staged to be written again, and the failure is
                               reported (`weights_problem`) until a write succeeds: the server
                               keeps serving its last good version, as `whetstone serve` does

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

from whetstone.inference.swap import WeightFollower, WeightUpdateError, WeightWriteError
from whetstone.sync.update import WeightUpdate, merge_updates

log = logging.getLogger("whetstone.vllm")

Undo = list[tuple[str, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]]
"""How to take an update back off the served weights: (name, the tensor held before or None when
there was none, the flat positions overwritten in it or None for the whole tensor, their values)."""


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
        """Why the staged version is not served (its write failed), until a write succeeds."""
        self.whole = True
        """The model holds `version` whole: False after a write failed and writing `version`
        back failed too (it holds parts of two versions), until a write succeeds."""
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
            staged = update if self._staged is None else merge_updates([self._staged, update])
            # what a load would leave unknown (a first version that is not whole): refused here, as
            # no write of it could ever succeed
            unknown = sorted(set(self.shapes) - set(self.weights) - set(staged.tensors))
            if unknown:
                raise WeightUpdateError(f"{where} leaves tensors the served model needs unknown: {unknown[:5]}")
            self._staged = staged

    def _staged_whole(self, name: str) -> bool:
        staged = self._staged
        return staged is not None and name in staged.tensors and staged.tensors[name].indices is None

    @torch.no_grad()
    def load(self) -> bool:
        """Write the staged update into the model; whether its version is now served (True when
        nothing is staged).

        The update is taken off the stage, and its version becomes the served one, only once
        vLLM's reload has taken every tensor. A reload that raises part-way (out of memory, say)
        leaves the model holding parts of two versions: the update is taken back off `weights`
        and the served version written again, so the server goes on serving it whole (False);
        the update stays staged (merged with any staged since) for the next call to write, and
        `problem` says why it is not served. If writing the served version back fails too, the
        model holds no whole version: `whole` turns False and `WeightWriteError` is raised.

        The update is applied to `weights` in place (whole tensors replaced by the update's own
        values, sparse values overwritten with the old ones kept to take them back), so the host
        holds one copy of the model beside the update and the one tensor being handed to vLLM."""
        with self._lock:
            update = self._staged
        if update is None:
            return True
        served, reloaded = self.version, False
        try:
            undo = self._apply(update)
            try:
                reloaded = True
                self._reload()
            except Exception:
                self._revert(undo)
                raise
        except Exception as err:
            failed = f"writing weight version {update.version} failed ({type(err).__name__}: {err})"
            if reloaded or not self.whole:
                try:
                    unknown = sorted(set(self.shapes) - set(self.weights))
                    if unknown:  # the first version from the store: the folder's weights were never held here
                        raise WeightUpdateError(f"its tensors {unknown[:5]} are not held here")
                    self._reload()
                except Exception as again:
                    self.whole = False
                    self.problem = (
                        f"{failed}, and writing version {served} back failed too ({type(again).__name__}: {again}): "
                        f"the model holds parts of versions {served} and {update.version} until one is written whole"
                    )
                    log.error("%s", self.problem)
                    raise WeightWriteError(self.problem) from again
            self.whole = True
            self.problem = f"{failed}: serving version {served} until it is written"
            log.error("%s", self.problem)
            return False
        self._unstage(update)
        self.version, self.problem, self.whole = update.version, None, True
        log.info("serving weight version %d (%d tensors changed)", update.version, len(update.tensors))
        return True

    def _apply(self, update: WeightUpdate) -> Undo:
        """Apply `update` to `weights`; returns how to take it back (`_revert`). On an error what
        was applied is taken back before it is raised."""
        undo: Undo = []
        try:
            for name, change in update.tensors.items():
                held = self.weights.get(name)
                if change.indices is None:  # the update's own values (fresh from decoding or a merge)
                    values = change.values.reshape(change.shape).contiguous()
                    undo.append((name, held, None, None))
                    self.weights[name] = values if held is None else values.to(held.dtype)
                    continue
                if held is None:
                    raise WeightUpdateError(f"weight version {update.version}: {name} is a delta on no value held")
                flat = held.view(-1)  # every tensor held came in whole, contiguous
                positions = change.indices.reshape(-1).long()
                undo.append((name, held, positions, flat[positions].clone()))
                flat[positions] = change.values.reshape(-1).to(held.dtype)
            for name in update.removed:
                if name in self.weights:
                    undo.append((name, self.weights.pop(name), None, None))
        except Exception:
            self._revert(undo)
            raise
        return undo

    def _revert(self, undo: Undo) -> None:
        for name, held, positions, values in reversed(undo):
            if positions is not None:
                held.view(-1)[positions] = values
            elif held is None:
                self.weights.pop(name, None)
            else:
                self.weights[name] = held

    def _reload(self) -> None:
        """Hand every tensor of `weights` to vLLM's reload."""
        from whetstone.model.hf import hf_pieces

        # copies, one at a time as vLLM takes them: its reload may keep the tensors it is given as
        # parameters, or process them in place, and `weights` must keep the values deltas apply to
        pieces = (
            (hf_name, piece.clone())
            for name, tensor in self.weights.items()
            for hf_name, piece in hf_pieces(name, tensor, self.cfg)
        )
        try:
            self.worker.reload_weights(weights_iterator=pieces, is_checkpoint_format=True)
        except Exception:
            self._finish_failed_reload()
            raise
        self._process_raw_experts()

    def _finish_failed_reload(self) -> None:
        """Bring vLLM's model out of a reload that raised part-way, so that the next one can run.

        vLLM 0.32's in-place reload moves every layer to the meta device, its weight loaders
        wrapped, until all of the layer's tensors have come; one that raises leaves the layers not
        yet complete so, and every later reload fails on them ("'Parameter' object has no attribute
        'weight_loader'"). vLLM's own finalization puts back the kernel tensors of the layers that
        took nothing and processes those that took part of theirs (the next reload rewrites them)."""
        try:
            from vllm.config import set_current_vllm_config
            from vllm.model_executor.model_loader.reload.layerwise import finalize_layerwise_reload
        except ImportError:  # a vLLM without layerwise reloads: nothing to finish
            return
        try:
            with set_current_vllm_config(self.worker.vllm_config):
                finalize_layerwise_reload(self.worker.get_model(), self.worker.vllm_config.model_config)
        except Exception:  # the write back will fail and say so
            log.exception("could not finish vLLM's failed reload")

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
            "weights_problem": follower.engine.problem or report.problem,  # a failed write first
        }

    def whetstone_apply(self) -> dict[str, Any]:
        """Write the staged version into the model (call it with the scheduler paused). `written`:
        whether it is served now; if not, the model serves `weight_version` whole and
        `weights_problem` says why. Raises `WeightWriteError` when the model holds no whole
        version (vLLM must not resume)."""
        follower: WeightFollower | None = getattr(self, "_whetstone", None)
        if follower is None:
            raise RuntimeError("whetstone_apply before whetstone_follow")
        written = follower.engine.load()
        return {**self.whetstone_status(), "written": written}
