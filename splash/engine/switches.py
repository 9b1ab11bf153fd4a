"""When and how the engine switches layout: forced plans, explicit requests, the policy;
manifests, deferral under memory pressure, and the switch history in stats()."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from splash.core.ownership import get_layout
from splash.core.prefix_cache import cached_histories
from splash.errors import LayoutInfeasibleError
from splash.logging_utils import get_logger
from splash.switching.manifest import SwitchManifest, build_manifest

logger = get_logger("splash.switch")


class SwitchController:
    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.forced: dict[int, str] = {}  # engine step -> layout
        self.requested: str | None = None
        self.history: list[dict[str, Any]] = []
        self.deferred: list[dict[str, Any]] = []
        self.decisions: list[dict[str, Any]] = []
        self._last_switch: dict[str, Any] | None = None
        self.policy: Callable[[Any], str | None] | None = None  # set in layout="auto"

    def request(self, name: str) -> None:
        layout = get_layout(name)
        if layout.name not in self.engine.setup.fitting:
            raise LayoutInfeasibleError(
                f"layout {name!r} does not fit this model/group; layouts that fit: "
                f"{self.engine.setup.fitting}")
        self.requested = layout.name

    def force_at(self, step: int, name: str) -> None:
        self.request(name)  # validates
        self.requested = None
        self.forced[step] = get_layout(name).name

    def _target(self, step: int) -> str | None:
        if step in self.forced:
            self.requested = self.forced.pop(step)
        if self.requested is not None:
            return self.requested
        if self.policy is not None:
            return self.policy(self.engine)
        return None

    def prepare(self, step: int) -> SwitchManifest | None:
        """Plan the switch for this step, or None (no switch, or deferred)."""
        eng = self.engine
        target = self._target(step)
        if target is None or target == eng.layout:
            self.requested = None
            return None
        src, dst = eng.scheduler.layout, get_layout(target)
        setup, alloc = eng.setup, eng.allocators
        alloc.set_reserved(max(setup.reserved_pages(src), setup.reserved_pages(dst)))
        running = list(eng.scheduler.running)
        prefix = eng.scheduler.prefix
        cached = cached_histories(alloc, src, eng.world, setup.page_size) if prefix.enabled else []
        manifest = build_manifest(src, dst, running, alloc, eng.world, setup.page_size,
                                  eng.model_cfg.num_attention_heads, cached)
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
            eng.scheduler.hold_admission = True
            return None
        if self.deferred and not self.deferred[-1].get("resolved"):
            self.deferred[-1]["resolved"] = step
        eng.scheduler.hold_admission = False
        self.requested = None
        for req in running:
            req.tables = manifest.new_tables.get(req.request_id, [[] for _ in range(eng.world)])
            req.owner = manifest.new_owners.get(req.request_id, req.owner)
            for rank in range(eng.world):
                eng.scheduler.mark_dirty(req, rank, 0)
        # pages received in this step are hits from now on: a request admitted into this very
        # step reads them in each layer only after that layer's transfer has landed
        for hist in [*running, *manifest.cached]:
            hist.tables = manifest.new_tables.get(hist.request_id, hist.tables)
            hist.owner = manifest.new_owners.get(hist.request_id, hist.owner)
            prefix.register_moved(hist, dst)
        eng.scheduler.layout = dst
        logger.info("switching %s -> %s at step %d (KV %s, weights %s; %d of %d cached chains "
                    "move along)", src.name, dst.name, step, manifest.kv_op, manifest.weight_op,
                    len(manifest.cached), len(cached))
        return manifest

    def finish(self, manifest: SwitchManifest | None, results: list, step_ms: float,
               step: int) -> None:
        eng = self.engine
        if self._last_switch is not None and manifest is None:
            entry = self._last_switch  # the destination's ready step: overhead = difference
            entry["ready_step_ms"] = round(step_ms, 3)
            entry["overhead_ms"] = round(max(entry["step_ms"] - step_ms, 0.0), 3)
            self._last_switch = None
        if manifest is None:
            return
        for rank, pages in enumerate(manifest.discard):
            eng.allocators[rank].free(pages)
        for rank, pages in enumerate(manifest.release):
            eng.allocators[rank].free(pages)
        eng.allocators.set_reserved(eng.setup.reserved_pages(manifest.dst))
        mcfg = eng.model_cfg
        mem = eng.setup.memory
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
            "transfer_wait_ms": round(max(r.switch_ms for r in results), 3),
            "step_ms": round(step_ms, 3),
            "overhead_ms": round(max(r.switch_ms for r in results), 3),
            "mode": eng.cfg.switch_mode,
        }
        self.history.append(entry)
        self._last_switch = entry
