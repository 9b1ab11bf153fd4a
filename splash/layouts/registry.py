"""The four attention layouts behind one interface (docs/design.md §2)."""

from __future__ import annotations

from splash.dist.comm import Comm
from splash.layouts.base import AttentionLayout, KVStore
from splash.layouts.cp import CPAttention
from splash.layouts.dop import DOPAttention
from splash.layouts.dp import DPAttention
from splash.layouts.tp import TPAttention

LAYOUT_CLASSES: dict[str, type[AttentionLayout]] = {
    "tp": TPAttention,
    "dp": DPAttention,
    "cp": CPAttention,
    "dop": DOPAttention,
}


def make_layouts(comm: Comm, store: KVStore, kv_lora_rank: int) -> dict[str, AttentionLayout]:
    return {name: cls(comm, store, kv_lora_rank) for name, cls in LAYOUT_CLASSES.items()}
