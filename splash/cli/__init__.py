"""The `splash` command line (the top layer)."""

from splash.cli.main import main

__all__ = ["main"]
