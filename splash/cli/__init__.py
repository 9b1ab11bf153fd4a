"""The `splash` command line (the top layer)."""

from splash.cli.main import build_parser, main

__all__ = ["build_parser", "main"]
