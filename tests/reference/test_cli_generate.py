"""`splash generate --json`: one JSON object per request, then one stats line;
bad arguments give a clear error and exit code 2."""

from __future__ import annotations

import json

from tiny_models import checkpoint, hf_greedy

from splash.cli import main


def test_generate_json_matches_transformers(capsys):
    path = checkpoint("v3")
    rc = main(["generate", "--model", path, "--backend", "cpu", "--layout", "tp",
               "--prompt-ids", "5,6,7", "9,10", "--max-tokens", "3", "--page-size", "4",
               "--json"])
    assert rc == 0
    lines = [json.loads(x) for x in capsys.readouterr().out.strip().splitlines()]
    assert [set(x) for x in lines[:2]] == [{"request_id", "token_ids", "finish_reason"}] * 2
    assert "stats" in lines[2] and lines[2]["stats"]["layout"] == "tp"
    ref = hf_greedy(path, [[5, 6, 7], [9, 10]], 3)
    # eos may stop a request early: compare what was generated
    for got, want in zip(lines[:2], ref):
        assert got["token_ids"] == want[: len(got["token_ids"])]
        assert got["finish_reason"] in ("length", "stop")


def test_generate_bad_layout_plan_is_a_clear_error(capsys):
    rc = main(["generate", "--model", checkpoint("v3"), "--backend", "cpu",
               "--layout-plan", "three:dop"])
    assert rc == 2 and "STEP:LAYOUT" in capsys.readouterr().err
