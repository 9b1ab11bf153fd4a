"""Profiles of a few steps (`LLMEngine.profile_steps`): the controller marks the plans
(`ProfileMarks`); on every worker torch's profiler runs from the plan marked "start" to the
plan marked "stop" (or shutdown), and the worker writes where its time went to
``<profile_dir>/profile_rank<r>.json``: device time and launches per kernel (kernels replayed
inside CUDA graphs included) or, on the CPU, host time and calls per operator, per step
(`StepProfiler`); with SPLASH_PROFILE_TRACE=1 also the timeline, ``trace_rank<r>.json``
(steps and switch phases are labelled: ``step N launch``, ``switch ...``)."""

from __future__ import annotations

import json
import os
from typing import Any

import msgspec
import torch
from torch.profiler import ProfilerActivity, profile

from splash import envs
from splash.core.protocol import StepPlan

TOP = 20  # kernels listed


class ProfileMarks:
    """The controller's side: the next ``steps`` plans submitted after `start` are profiled;
    the first carries "start", the one after the last "stop"."""

    def __init__(self) -> None:
        self.left = 0
        self.out_dir = ""
        self.started = self.active = False

    def start(self, steps: int, out_dir: str) -> None:
        self.left, self.out_dir, self.started, self.active = steps, out_dir, False, True

    def mark(self, plans: list[StepPlan]) -> list[StepPlan]:
        """``plans`` (one step's, every rank's), marked where the profile starts or stops."""
        if not self.active:
            return plans
        if self.left == 0:
            mark, self.active = "stop", False
        else:
            mark, self.started, self.left = "" if self.started else "start", True, self.left - 1
        if not mark:
            return plans
        return [msgspec.structs.replace(p, profile=mark, profile_dir=self.out_dir)
                for p in plans]


class StepProfiler:
    def __init__(self, rank: int, device: torch.device) -> None:
        self.rank, self.device = rank, device
        self.prof: Any = None
        self.first = self.steps = 0
        self.out_dir = ""

    def before(self, plan) -> None:
        """Start or stop as ``plan`` says, before it launches."""
        if plan.profile == "stop" or (plan.profile == "start" and self.prof is not None):
            self.stop()
        if plan.profile == "start":
            acts = [ProfilerActivity.CPU]
            if self.device.type == "cuda":
                acts.append(ProfilerActivity.CUDA)
            self.prof = profile(activities=acts)
            self.prof.__enter__()
            self.first, self.out_dir = plan.step, plan.profile_dir
        if self.prof is not None and plan.profile != "stop":
            self.steps += 1

    def stop(self) -> None:
        if self.prof is None:
            return
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.prof.__exit__(None, None, None)
        prof, self.prof = self.prof, None
        self._write(prof)
        self.steps = 0

    def _write(self, prof) -> None:
        cuda = self.device.type == "cuda"
        kind = torch.autograd.DeviceType.CUDA if cuda else torch.autograd.DeviceType.CPU
        totals: dict[str, float] = {}
        calls: dict[str, int] = {}
        for ev in prof.events():
            # labelled ranges (steps, switch phases) are not time of their own
            if ev.device_type == kind and not getattr(ev, "is_user_annotation", False) \
                    and not ev.name.startswith(("step ", "switch ")):
                us = ev.device_time if cuda else ev.self_cpu_time_total
                totals[ev.name] = totals.get(ev.name, 0.0) + us
                calls[ev.name] = calls.get(ev.name, 0) + 1
        steps = max(self.steps, 1)
        total = sum(totals.values()) or 1.0
        top = sorted(totals.items(), key=lambda kv: -kv[1])[:TOP]
        out = {"rank": self.rank, "first_step": self.first, "steps": self.steps,
               "time": "device" if cuda else "host (CPU operators, self time)",
               "ms_per_step": total / 1e3 / steps,
               # every launch counts: a step's glue (casts, copies) shows as calls, not time
               "calls_per_step": sum(calls.values()) / steps,
               "kernels": [{"kernel": name[:160], "ms_per_step": us / 1e3 / steps,
                            "calls_per_step": calls[name] / steps,
                            "pct": 100 * us / total} for name, us in top]}
        os.makedirs(self.out_dir or ".", exist_ok=True)
        if envs.get("SPLASH_PROFILE_TRACE") == "1":
            prof.export_chrome_trace(os.path.join(self.out_dir or ".",
                                                  f"trace_rank{self.rank}.json"))
        with open(os.path.join(self.out_dir or ".", f"profile_rank{self.rank}.json"), "w") as f:
            json.dump(out, f, indent=1)
