"""`/metrics`: engine + server stats rendered in the Prometheus text exposition format (0.0.4).

Pure function of the dict ``ZmqServer.stats()`` returns; keys an engine does not report are
left out rather than invented.
"""

from __future__ import annotations

import math
from collections import Counter, defaultdict
from typing import Any

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


def _label_value(value: object) -> str:
    return str(value).replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _number(value: Any) -> str | None:
    if isinstance(value, bool):
        return "1" if value else "0"
    if isinstance(value, (int, float)):
        return repr(float(value)) if math.isfinite(value) else ("+Inf" if value > 0 else "NaN")
    return None


class _Writer:
    def __init__(self) -> None:
        self.lines: list[str] = []

    def family(self, name: str, kind: str, help_text: str,
               samples: list[tuple[dict[str, object], Any]]) -> None:
        rendered = []
        for labels, value in samples:
            num = _number(value)
            if num is None:
                continue
            label_text = ",".join(f'{k}="{_label_value(v)}"' for k, v in labels.items())
            rendered.append(f"splash_{name}{{{label_text}}} {num}" if label_text
                            else f"splash_{name} {num}")
        if rendered:
            self.lines += [f"# HELP splash_{name} {help_text}", f"# TYPE splash_{name} {kind}"]
            self.lines += rendered


def render_metrics(stats: dict[str, Any]) -> str:
    w = _Writer()
    w.family("healthy", "gauge", "1 while the engine and its workers are healthy",
             [({}, stats.get("healthy", True))])
    if "layout" in stats:
        w.family("layout_info", "gauge", "current attention layout (value is always 1)",
                 [({"layout": stats["layout"]}, 1)])
    switches = stats.get("switches") or []
    by_dir = Counter((str(s.get("from")), str(s.get("to"))) for s in switches if isinstance(s, dict))
    w.family("layout_switches_total", "counter", "live layout switches by direction",
             [({"from": a, "to": b}, n) for (a, b), n in sorted(by_dir.items())])
    overhead: defaultdict[tuple[str, str], float] = defaultdict(float)
    for s in switches:
        if isinstance(s, dict) and _number(s.get("overhead_ms")) is not None:
            overhead[(str(s.get("from")), str(s.get("to")))] += float(s["overhead_ms"])
    w.family("layout_switch_overhead_ms_total", "counter", "summed switch overhead (ms)",
             [({"from": a, "to": b}, v) for (a, b), v in sorted(overhead.items())])
    used = stats.get("kv_pages_used")
    if isinstance(used, list):
        w.family("kv_pages_used", "gauge", "KV pages in use per rank",
                 [({"rank": r}, n) for r, n in enumerate(used)])
    w.family("kv_pages_total", "gauge", "KV pages per rank", [({}, stats.get("kv_pages_total"))])
    cap = stats.get("kv_capacity_tokens")
    if isinstance(cap, dict):
        w.family("kv_capacity_tokens", "gauge", "distinct KV tokens the group can hold per layout",
                 [({"layout": k}, v) for k, v in sorted(cap.items())])
    w.family("requests_waiting", "gauge", "requests queued in the scheduler",
             [({}, stats.get("num_waiting"))])
    w.family("requests_running", "gauge", "requests being decoded or prefilled",
             [({}, stats.get("num_running"))])
    w.family("tokens_per_second", "gauge", "generated tokens per second (recent)",
             [({}, stats.get("tokens_per_s"))])
    w.family("step_time_ms", "gauge", "engine step time, exponential moving average",
             [({}, stats.get("step_time_ms_ema"))])
    for key, help_text in [
        ("prefix_cache_hit_tokens", "prompt tokens served from the prefix cache"),
        ("prefix_cache_queried_tokens", "prompt tokens looked up in the prefix cache"),
        ("prompt_tokens_computed", "prompt tokens whose KV was computed (prefill work)"),
    ]:
        w.family(f"{key}_total", "counter", help_text, [({}, stats.get(key))])
    server = stats.get("server") or {}
    for key, help_text in [
        ("requests_total", "generate requests accepted"),
        ("requests_finished", "requests answered with a final output"),
        ("protocol_errors", "malformed or unauthorised messages answered with an error"),
        ("request_errors", "requests refused (bad input, unknown id, ...)"),
        ("aborts", "requests aborted by a client"),
        ("lease_expired", "requests aborted because their client went silent"),
        ("dropped_connections", "client connections closed (incl. frames over the hard limit)"),
    ]:
        w.family(f"server_{key}_total" if not key.endswith("total") else f"server_{key}",
                 "counter", help_text, [({}, server.get(key))])
    w.family("server_requests_in_flight", "gauge", "requests with a live client lease",
             [({}, server.get("requests_in_flight"))])
    return "\n".join(w.lines) + "\n"
