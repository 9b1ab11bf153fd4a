"""Print the installed splash-serve's requirements, less torch and Triton, one per line.

Used by the ROCm and DCU images, whose torch and Triton (pytorch-triton-rocm, or the DTK's own
build) must stay as shipped: installing SPLASH's wheel with its dependencies would pull the
CUDA `triton` wheel over them. Usage: python requirements.py [EXTRA[,EXTRA] ...] > requirements.txt
"""

from __future__ import annotations

import re
import sys
from importlib.metadata import requires

KEEP_VENDOR = {"torch", "triton", "pytorch-triton-rocm"}


def main(extras: list[str]) -> None:
    for line in requires("splash-serve") or []:
        req, _, marker = line.partition(";")
        name = re.match(r"[A-Za-z0-9._-]+", req.strip())
        if name is None or name.group(0).lower().replace("_", "-") in KEEP_VENDOR:
            continue
        extra = re.search(r"extra\s*==\s*[\"']([^\"']+)[\"']", marker)
        if extra is None:
            print(line.strip())
        elif extra.group(1) in extras:
            print(req.strip())


if __name__ == "__main__":
    main([e for arg in sys.argv[1:] for e in arg.split(",") if e])
