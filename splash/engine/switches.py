"""When and how the engine switches layout: forced plans, explicit requests, the policy;
manifests, deferral under memory pressure, and the switch history in stats(). The controller
works on the scheduler (requests, pages, layout) and the engine's resolved setup.

Under layout="auto" a manual choice (switch_layout, or a layout_plan entry when its step comes)
pins that layout: the policy is not consulted until switch_layout("auto") releases the pin.

How a switch runs (``switch_mode``):

- ``background``: the step that decides it starts a pre-copy — the destination's missing
  weights and every KV row written so far move on the transfer group while the source layout
  keeps serving prefills and decodes, for as many steps as the transfer takes. Once every rank
  reports its transfer done, the next step hands off: the rows written since the pre-copy
  began (and whole requests admitted meanwhile) move as a small delta, the tables and owners
  change, and that step computes in the destination. A changed target cancels the pre-copy
  (its pages are freed; nothing changes for requests). Preemption waits while a pre-copy is in
  flight (a preempted request would free pages the pre-copy is filling).
- ``live``: one step computes in the destination while each layer's state moves behind the
  layer before it (hides a transfer only behind a step at least as long).
- ``blocking``: everything moves, then the step computes (the baseline).
- ``auto`` (default): ``live`` when the running step time covers the predicted transfer at
  the profile's link bandwidth twice over, else ``background``.

Prefix caching: a switch that completes in one step (live, blocking, the handoff) also moves
the cached pages no request holds any more (``cached_histories``), when they fit, and every
page received is registered in the prefix cache of its new holder (``Scheduler.apply_switch``),
so cached prefixes stay hits in the destination. A pre-copy moves only the requests' pages.

Cost of a switch (``overhead_ms`` in the history): the time the workers spent on its work in
the step that completes it — issuing, waiting for and installing transfers — on the slowest
rank. When the next step decodes the same requests (a matched interval), ``step_minus_ready_ms``
also gives the switching step's time minus that destination-ready step's time."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from splash.core.ownership import get_layout
from splash.core.prefix_cache import CachedHistory, cached_histories
from splash.core.protocol import StepResult
from splash.engine.scheduler import ScheduledBatch, Scheduler
from splash.engine.setup import EngineSetup
from splash.errors import ConfigError, LayoutInfeasibleError
from splash.logging_utils import get_logger
from splash.switching.manifest import SwitchManifest, build_manifest
from splash.switching.pages import free_placed

logger = get_logger("splash.switch")

MAX_PRECOPY_STEPS = 256  # hand off after this many steps even if a rank still reports work
# auto: a switch moving less than this completes within one step. On 2 x H200 (batch 16 x 4K,
# 0.6-1.8 GB per rank) a pre-copy cost 5-40 ms more than a blocking switch in every direction:
# its extra manifest and step boundary outweigh transfers of a few milliseconds
SHORT_TRANSFER_MS = 5.0


@dataclass
class SwitchStep:
    """This step's part of a switch: the manifest the plans carry and the workers' mode."""

    manifest: SwitchManifest
    mode: str  # live | blocking | precopy | handoff | cancel
    precopy: SwitchManifest | None = None  # handoff: the pre-copy it completes
    info: dict[str, Any] = field(default_factory=dict)


@dataclass
class _InFlight:
    manifest: SwitchManifest  # the pre-copy's
    copied: dict[str, int]  # rows moved per request
    step: int  # decided at
    t0: float  # monotonic time of the decision
    steps: int = 0  # steps served in the source since
    ready: bool = False  # every rank reported its transfer done
    step_ms: list[float] = field(default_factory=list)  # the source's steps meanwhile


class SwitchController:
    """Decides and plans the switches of one engine: ``scheduler`` holds the layout, the
    requests and the page allocators; ``setup`` the layouts that fit and the model sizes.
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
        self.inflight: _InFlight | None = None  # a background pre-copy
        self._controller_ms = 0.0  # planning time of the switch under way (decision, handoff)
        self.cancelled: list[dict[str, Any]] = []

    def forget_history(self) -> None:
        """Drop the records of past switches (the engine's warm-up is not part of a run)."""
        self.history.clear()
        self.deferred.clear()
        self.cancelled.clear()
        self._last_switch = self._last_rows = None

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

    def _drop_deferred(self, step: int, target: str | None) -> None:
        """A deferred switch no longer wanted (a later request, or the policy, keeps the
        current layout): admission, held for it, resumes; without this a group whose running
        requests all finished would wait for it forever."""
        if not self.scheduler.hold_admission:
            return
        self.scheduler.hold_admission = False
        if self.deferred and not self.deferred[-1].get("resolved"):
            last = self.deferred[-1]
            last["dropped"] = step
            logger.info("deferred switch %s->%s dropped at step %d: %s; admission resumes",
                        last["from"], last["to"], step,
                        f"layout {target} asked for" if target else "no switch wanted now")

    def _pin(self, name: str) -> None:
        if self.policy is not None and self.pinned != name:
            self.pinned = name
            logger.info("layout %s pinned by a manual switch; the policy waits until "
                        "switch_layout('auto') releases it", name)

    def force_at(self, step: int, name: str) -> None:
        self.forced[step] = self._checked(name)

    def asks_policy(self, step: int) -> bool:
        """Whether ``step``'s target will come from the policy (nothing forced, requested,
        pinned or in flight)."""
        return self.policy is not None and self.inflight is None and step not in self.forced \
            and self.requested is None and self.pinned is None

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

    def prepare(self, step: int, step_ms_ema: float | None = None) -> SwitchStep | None:
        """This step's part of a switch, or None (no switch, deferred, or a pre-copy that is
        still moving). ``step_ms_ema``: the engine's recent step time (picks the mode)."""
        t0 = time.perf_counter()
        action = self._prepare(step, step_ms_ema)
        if action is not None or self.inflight is not None:
            self._controller_ms += (time.perf_counter() - t0) * 1e3
        return action

    def _prepare(self, step: int, step_ms_ema: float | None) -> SwitchStep | None:
        sched, setup = self.scheduler, self.setup
        sched.register_switched()  # the manifest looks cached pages up
        target = self._target(step)
        if self.inflight is not None:
            if target is not None and target != self.inflight.manifest.dst.name:
                return self._cancel(step, f"the target changed to {target}")
            if self.inflight.ready or self.inflight.steps >= MAX_PRECOPY_STEPS:
                return self._handoff(step)
            return None
        if target is None or target == sched.layout.name:
            self.requested = None
            self._drop_deferred(step, target)
            return None
        src, dst, alloc = sched.layout, get_layout(target), sched.alloc
        running = list(sched.running)
        # cached chains move with a switch completed in one step; a pre-copy leaves them to
        # the handoff's delta. Under auto the manifest is built for the common case, a switch
        # in one step, and rebuilt without the chains only if the mode turns out background
        cached = self._cached() if setup.cfg.switch_mode != "background" else []
        manifest = build_manifest(src, dst, running, alloc, setup.world, setup.page_size,
                                  setup.model_cfg.num_attention_heads, cached=cached or None,
                                  resident_heads=setup.resident_heads)
        mode = self._mode(manifest, step_ms_ema) if manifest is not None else ""
        if manifest is not None and mode == "background" and cached:
            manifest.give_back(alloc)
            manifest = build_manifest(src, dst, running, alloc, setup.world, setup.page_size,
                                      setup.model_cfg.num_attention_heads,
                                      resident_heads=setup.resident_heads)
        if manifest is None:
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
        sched.hold_admission = False
        self.requested = None
        if mode == "background":
            self.inflight = _InFlight(manifest, {r.request_id: r.num_computed for r in running},
                                      step, time.monotonic())
            logger.info("switch %s -> %s: pre-copy started at step %d (KV %s, weights %s); "
                        "the source layout keeps serving", src.name, dst.name, step,
                        manifest.kv_op, manifest.weight_op)
            return SwitchStep(manifest, "precopy")
        sched.apply_switch(manifest)
        logger.info("switching %s -> %s at step %d (%s; KV %s, weights %s)", src.name, dst.name,
                    step, mode, manifest.kv_op, manifest.weight_op)
        return SwitchStep(manifest, mode)

    def _mode(self, manifest: SwitchManifest, step_ms_ema: float | None) -> str:
        mode = self.setup.cfg.switch_mode
        if mode != "auto":
            return mode
        mem, mcfg = self.setup.memory, self.setup.model_cfg
        head_bytes = mem.projection_bytes_per_layer // mcfg.num_attention_heads
        moved = manifest.predicted_bytes(mem.kv_bytes_per_token_per_layer, head_bytes,
                                         mcfg.num_hidden_layers,
                                         mem.index_bytes_per_token_per_layer *
                                         mcfg.num_indexer_layers)
        per_rank = max(k + w for k, w in zip(moved["kv_bytes_received"],
                                             moved["weight_bytes_received"]))
        transfer_ms = per_rank / (self.setup.profile.link_gbps * 1e9) * 1e3
        step_ms = step_ms_ema or 0.0
        if transfer_ms <= SHORT_TRANSFER_MS:  # less than a pre-copy's extra planning round
            return "blocking"
        if not self.scheduler.running:  # nothing to keep serving: a pre-copy would only run
            return "live"  # the requests being admitted in the source layout
        return "live" if step_ms >= 2 * transfer_ms else "background"

    def _cached(self) -> list[CachedHistory]:
        """The cached chains no request holds, complete under the current layout, less those
        a running request's history covers (copies a switch left behind, typically: the
        request's own pages move and are registered at the destination, so moving the copy
        too would only double the bytes)."""
        sched = self.scheduler
        if not sched.prefix.enabled or not any(a.num_evictable for a in sched.alloc.ranks):
            return []  # every cached page is a running request's: it moves with its request
        covered = {key for r in sched.running for key in r.block_hashes[:r.num_cached_pages]}
        if all(key in covered for a in sched.alloc.ranks for key in a.evictable_keys()):
            return []  # nothing but such copies (no chain to build)
        chains = cached_histories(sched.alloc, sched.layout, self.setup.world,
                                  self.setup.page_size)
        return [h for h in chains if h.block_hashes[-1] not in covered]

    def _handoff(self, step: int) -> SwitchStep | None:
        sched, setup, pc = self.scheduler, self.setup, self.inflight
        assert pc is not None
        self.inflight = None
        pre = pc.manifest
        running = list(sched.running)
        live = {r.request_id for r in running}
        free_placed(pre.placed, sched.alloc, keep=live)  # of requests finished meanwhile
        staged = {rid: pages for rid, pages in pre.placed.items() if rid in live}
        owners = {rid: o for rid, o in pre.new_owners.items() if rid in live}
        delta = build_manifest(pre.src, pre.dst, running, sched.alloc, setup.world,
                               setup.page_size, setup.model_cfg.num_attention_heads,
                               owners=owners, rows_from=pc.copied, staged=staged,
                               cached=self._cached(), resident_heads=setup.resident_heads)
        if delta is None:
            free_placed(staged, sched.alloc)
            self._cancelled(pc, step, "no free pages for the delta")
            return SwitchStep(pre, "cancel")
        sched.apply_switch(delta)
        info = {"decision_step": pc.step, "precopy_steps": pc.steps,
                "decision_to_handoff_ms": round((time.monotonic() - pc.t0) * 1e3, 3),
                "delta_kv_rows": sum(x.kv_rows_received for x in delta.summary),
                "precopy_step_ms": pc.step_ms}
        logger.info("switch %s -> %s: handoff at step %d after %d steps of pre-copy (delta "
                    "%d KV rows)", pre.src.name, pre.dst.name, step, pc.steps,
                    info["delta_kv_rows"])
        return SwitchStep(delta, "handoff", precopy=pre, info=info)

    def _cancel(self, step: int, why: str) -> SwitchStep:
        pc = self.inflight
        assert pc is not None
        self.inflight = None
        free_placed(pc.manifest.placed, self.scheduler.alloc)
        self._cancelled(pc, step, why)
        return SwitchStep(pc.manifest, "cancel")

    def _cancelled(self, pc: _InFlight, step: int, why: str) -> None:
        pre = pc.manifest
        logger.info("switch %s -> %s: pre-copy cancelled at step %d (%s); nothing changes "
                    "for requests", pre.src.name, pre.dst.name, step, why)
        self.cancelled.append({"step": step, "from": pre.src.name, "to": pre.dst.name,
                               "decision_step": pc.step, "reason": why})

    def finish(self, action: SwitchStep | None, results: list[StepResult], step_ms: float,
               step: int, batch: ScheduledBatch | None = None) -> None:
        """After the step: track a pre-copy; free the pages a completed switch discarded and
        record what it moved."""
        setup, alloc = self.setup, self.scheduler.alloc
        self.scheduler.register_switched()  # before any page of the switch is freed
        rows = _decode_rows(batch)
        if self.inflight is not None:
            self.inflight.ready = all(r.precopy_done for r in results)
            self.inflight.steps += 1
            self.inflight.step_ms.append(round(step_ms, 3))
        if self._last_switch is not None and (action is None or action.mode != "handoff"):
            entry = self._last_switch  # the destination's ready step
            entry["ready_step_ms"] = round(step_ms, 3)
            if rows is not None and rows == self._last_rows:  # a matched interval
                entry["step_minus_ready_ms"] = round(entry["step_ms"] - step_ms, 3)
            self._last_switch = None
        if action is not None and action.mode == "cancel":
            self._controller_ms = 0.0
        if action is None or action.mode in ("precopy", "cancel"):
            return
        manifest = action.manifest
        self._last_rows = rows
        for rank, pages in enumerate(manifest.discard):
            alloc[rank].free(pages)
        for rank, pages in enumerate(manifest.release):
            alloc[rank].free(pages)
        mcfg = setup.model_cfg
        mem = setup.memory
        head_bytes = mem.projection_bytes_per_layer // mcfg.num_attention_heads
        args = (mem.kv_bytes_per_token_per_layer, head_bytes, mcfg.num_hidden_layers,
                mem.index_bytes_per_token_per_layer * mcfg.num_indexer_layers)
        predicted = manifest.predicted_bytes(*args)
        if action.precopy is not None:  # handoff: the pre-copy moved the weights and most KV
            pre = action.precopy.predicted_bytes(*args)
            predicted = {"kv_bytes_received": [a + b for a, b in zip(
                pre["kv_bytes_received"], predicted["kv_bytes_received"])],
                "weight_bytes_received": pre["weight_bytes_received"]}
        manifests = [m for m in (action.precopy, manifest) if m is not None]
        timed = [r.switch_device_ms for r in results if r.switch_device_ms is not None]
        entry = {
            "step": step, "from": manifest.src.name, "to": manifest.dst.name,
            "kv_op": (action.precopy or manifest).kv_op,
            "weight_op": (action.precopy or manifest).weight_op,
            "kv_bytes_received": sum(r.kv_bytes_received for r in results),
            "weight_bytes_received": sum(r.weight_bytes_received for r in results),
            "kv_bytes_received_per_rank": [r.kv_bytes_received for r in results],
            "weight_bytes_received_per_rank": [r.weight_bytes_received for r in results],
            "predicted_kv_bytes_per_rank": predicted["kv_bytes_received"],
            "predicted_weight_bytes_per_rank": predicted["weight_bytes_received"],
            # pages a rank had cached under the same key (a copy an earlier switch left there)
            "kv_pages_reused_per_rank": [sum(m.summary[r].pages_reused for m in manifests)
                                         for r in range(setup.world)],
            "step_ms": round(step_ms, 3),
            "overhead_ms": round(max(r.switch_ms for r in results), 3),  # the switch work
            # its device time on the slowest rank (pack, collectives, unpack), where timed
            "transfer_device_ms": round(max(timed), 3) if len(timed) == len(results) else None,
            "mode": "background" if action.mode == "handoff" else action.mode,
            "controller_ms": round(self._controller_ms, 3),  # planning: manifests, tables
            **action.info,
        }
        self._controller_ms = 0.0
        self.history.append(entry)
        self._last_switch = entry


def _decode_rows(batch: ScheduledBatch | None) -> tuple | None:
    """The request ids of a decode-only batch (one row each), else None."""
    entries = batch.entries if batch is not None else None
    if not entries or any(n != 1 for _, n in entries):
        return None
    return tuple(req.request_id for req, _ in entries)
