"""A checkpoint's tokenizer is loaded with transformers; without transformers the engine says
what to install instead of claiming the model has no tokenizer."""

from __future__ import annotations

import logging
import sys

import pytest
from tiny_models import checkpoint
from tiny_tokenizer import add_tokenizer

from splash.engine.setup import load_tokenizer
from splash.errors import NO_TOKENIZER


@pytest.fixture
def splash_log():
    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda r: records.append(r.getMessage())  # type: ignore[method-assign]
    logger = logging.getLogger("splash")
    logger.addHandler(handler)
    yield records
    logger.removeHandler(handler)


def test_tokenizer_loads_with_transformers() -> None:
    tok = load_tokenizer(add_tokenizer(checkpoint("v3")))
    assert tok is not None and tok.decode(tok.encode("中文 ok")) == "中文 ok"


def test_without_transformers_says_what_to_install(monkeypatch, splash_log) -> None:
    path = add_tokenizer(checkpoint("v3"))
    monkeypatch.setitem(sys.modules, "transformers", None)  # import fails as if not installed
    assert load_tokenizer(path) is None
    assert any("pip install 'splash-serve[tokenizer]'" in r for r in splash_log), splash_log
    assert "pip install 'splash-serve[tokenizer]'" in NO_TOKENIZER
