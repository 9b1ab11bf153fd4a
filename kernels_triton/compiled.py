"""How many binaries Triton has compiled (or loaded from its cache) per kernel of this package:
what the start-up warm-up is checked against (no kernel may compile again mid-serving)."""

from __future__ import annotations

import sys

from triton.runtime.jit import JITFunction


def compiled_binaries() -> dict[str, int]:
    """Binaries held per kernel, by kernel name, over every device (empty under the Triton
    interpreter, which compiles nothing)."""
    counts: dict[str, int] = {}
    prefix = __name__.rsplit(".", 1)[0] + "."
    for name, mod in list(sys.modules.items()):
        if mod is None or not name.startswith(prefix):
            continue
        for attr, obj in vars(mod).items():
            if isinstance(obj, JITFunction) and obj.__module__ == name:
                # each device's cache is a tuple whose first item maps keys to binaries
                counts[attr] = sum(len(cache[0]) for cache in obj.device_caches.values())
    return counts
