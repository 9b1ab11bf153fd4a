"""Where every benchmark script writes its JSON: machine, versions and date added alike."""

from __future__ import annotations

import datetime
import json
import os
import platform
import sys

import torch


def save_json(path: str, result: dict) -> None:
    """Write ``result`` (plus date, machine, versions) to ``path``, creating its folder."""
    meta = {"date": datetime.date.today().isoformat(), "machine": platform.node(),
            "cpu_count": os.cpu_count(), "python": sys.version.split()[0],
            "torch": torch.__version__,
            "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None}
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        json.dump({**meta, **result}, f, indent=1)
