"""The splash logger: one format, level from SPLASH_LOG_LEVEL."""

from __future__ import annotations

import logging

from splash import envs

_configured = False


def get_logger(name: str) -> logging.Logger:
    global _configured
    if not _configured:
        root = logging.getLogger("splash")
        if not root.handlers:
            handler = logging.StreamHandler()
            handler.setFormatter(
                logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s", "%H:%M:%S")
            )
            root.addHandler(handler)
        root.setLevel(envs.get("SPLASH_LOG_LEVEL").upper())
        root.propagate = False
        _configured = True
    return logging.getLogger(name if name.startswith("splash") else f"splash.{name}")
