"""When and how the engine switches layout: forced plans, explicit requests, the policy;
manifests, deferral under memory pressure, and the switch history in stats().

Under layout="auto" a manual choice (switch_layout, or a layout_plan entry when its step comes)
pins that layout: the policy is not consulted until switch_layout("auto") releases the pin.

Cost of a switch (``overhead_ms`` in the history): the time the workers spent on its work in
the switching step — issuing, waiting for and installing transfers — on the slowest rank. When
the next step decodes the same requests (a matched interval), ``step_minus_ready_ms`` also
gives the switching step's time minus that destination-ready step's time."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from splash.core.ownership import get_layout
from splash.core.protocol import StepResult
from splash.engine.scheduler import ScheduledBatch, Scheduler
from splash.engine.setup import EngineSetup
from splash.errors import ConfigError, LayoutInfeasibleError
from splash.logging_utils import get_logger
from splash.switching.manifest import SwitchManifest, build_manifest

logger = get_logger("splash.switch")


class SwitchController:
    """Decides and plans the switches of one engine: ``scheduler`` holds the layout, the
    requests and the page allocators; ``setup`` the pool's reserved pages and model sizes.
    ``policy`` (layout="auto") answers, for an engine step, the layout to switch to or None."""

    def __init__(self, scheduler: Scheduler, setup: EngineSetup) -> None:
        self.scheduler, self.setup = scheduler, setup
        self.forced: dict[int, str] = {}  # engine step -> layout
        self.requested: str | None = None
        self.pinned: str | None = None  # under auto: the layout a manual choice holds
        self.history: list[dict[str, Any]] = []
        self.deferred: list[dict[str, Any]] = []
        self._last_switch: dict[str, Any] | None = None
        self._last_rows: tuple | None = None  # the switching step's decode rows, if only decode
        self.policy: Callable[[int], str | None] | None = None  # set in layout="auto"

    def request(self, name: str) -> None:
        """Switch at the next step; under auto this pins ``name``; "auto" releases the pin. An
        unknown layout is an InvalidRequestError."""
        if name == "auto":
            if self.policy is None:
                raise ConfigError("switch_layout('auto') releases a layout pinned under "
                                  "layout='auto'; this engine runs a fixed layout")
            if self.pinned is not None:
                logger.info("layout %s released: the policy chooses again", self.pinned)
            self.pinned = self.requested = None
            return
        self.requested = self._checked(name)
        self._pin(self.requested)

    def _checked(self, name: str) -> str:
        layout = get_layout(name)
        if layout.name not in self.setup.fitting:
            raise LayoutInfeasibleError(
                f"layout {name!r} does not fit this model/group; layouts that fit: "
                f"{list(self.setup.fitting)}")
        return layout.name

    def _pin(self, name: str) -> None:
        if self.policy is not None and self.pinned != name:
            self.pinned = name
            logger.info("layout %s pinned by a manual switch; the policy waits until "
                        "switch_layout('auto') releases it", name)

    def force_at(self, step: int, name: str) -> None:
        self.forced[step] = self._checked(name)

    def _target(self, step: int) -> str | None:
        if step in self.forced:
            self.requested = self.forced.pop(step)
            self._pin(self.requested)
        if self.requested is not None:
            return self.requested
        if self.pinned is not None:
            return self.pinned
        if self.policy is not None:
            return self.policy(step)
        return None

    def prepare(self, step: int) -> SwitchManifest | None:
        """Plan the switch for this step and hand it to the scheduler, or None (no switch, or
        deferred: then admission is held until the destination's pages fit)."""
        sched, setup = self.scheduler, self.setup
        target = self._target(step)
        if target is None or target == sched.layout.name:
            self.requested = None
            return None
        src, dst, alloc = sched.layout, get_layout(target), sched.alloc
        alloc.set_reserved(max(setup.reserved_pages(src), setup.reserved_pages(dst)))
        manifest = build_manifest(src, dst, list(sched.running), alloc, setup.world,
                                  setup.page_size, setup.model_cfg.num_attention_heads)
        if manifest is None:
            alloc.set_reserved(setup.reserved_pages(src))
            reason = (f"switch {src.name}->{dst.name} deferred at step {step}: the destination "
                      f"needs more free KV pages than the ranks have (free {[a.num_available for a in alloc.ranks]}); "
                      "admission held until requests finish")
            if not self.deferred or self.deferred[-1]["to"] != dst.name or \
                    self.deferred[-1].get("resolved"):
                logger.warning(reason)
                self.deferred.append({"step": step, "from": src.name, "to": dst.name,
                                      "reason": reason})
            sched.hold_admission = True
            return None
        if self.deferred and not self.deferred[-1].get("resolved"):
            self.deferred[-1]["resolved"] = step
        self.requested = None
        sched.apply_switch(manifest)
        logger.info("switching %s -> %s at step %d (KV %s, weights %s)", src.name, dst.name,
                    step, manifest.kv_op, manifest.weight_op)
        return manifest

    def finish(self, manifest: SwitchManifest | None, results: list[StepResult], step_ms: float,
               step: int, batch: ScheduledBatch | None = None) -> None:
        """After the step: free the pages the switch discarded and record what it moved."""
        setup, alloc = self.setup, self.scheduler.alloc
        rows = _decode_rows(batch)
        if self._last_switch is not None and manifest is None:
            entry = self._last_switch  # the destination's ready step
            entry["ready_step_ms"] = round(step_ms, 3)
            if rows is not None and rows == self._last_rows:  # a matched interval
                entry["step_minus_ready_ms"] = round(entry["step_ms"] - step_ms, 3)
            self._last_switch = None
        if manifest is None:
            return
        self._last_rows = rows
        for rank, pages in enumerate(manifest.discard):
            alloc[rank].free(pages)
        alloc.set_reserved(setup.reserved_pages(manifest.dst))
        mcfg = setup.model_cfg
        mem = setup.memory
        head_bytes = mem.projection_bytes_per_layer // mcfg.num_attention_heads
        predicted = manifest.predicted_bytes(mem.kv_bytes_per_token_per_layer, head_bytes,
                                             mcfg.num_hidden_layers)
        entry = {
            "step": step, "from": manifest.src.name, "to": manifest.dst.name,
            "kv_op": manifest.kv_op, "weight_op": manifest.weight_op,
            "kv_bytes_received": sum(r.kv_bytes_received for r in results),
            "weight_bytes_received": sum(r.weight_bytes_received for r in results),
            "kv_bytes_received_per_rank": [r.kv_bytes_received for r in results],
            "weight_bytes_received_per_rank": [r.weight_bytes_received for r in results],
            "predicted_kv_bytes_per_rank": predicted["kv_bytes_received"],
            "predicted_weight_bytes_per_rank": predicted["weight_bytes_received"],
            "step_ms": round(step_ms, 3),
            "overhead_ms": round(max(r.switch_ms for r in results), 3),  # the switch work
            "mode": setup.cfg.switch_mode,
        }
        self.history.append(entry)
        self._last_switch = entry


def _decode_rows(batch: ScheduledBatch | None) -> tuple | None:
    """The request ids of a decode-only batch (one row each), else None."""
    entries = batch.entries if batch is not None else None
    if not entries or any(n != 1 for _, n in entries):
        return None
    return tuple(req.request_id for req, _ in entries)
