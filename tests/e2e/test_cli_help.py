"""`splash --help` is for users: every option's default shown, no developer notes; `--version`;
`plan` and `simulate` share one set of deployment defaults."""

from __future__ import annotations

from importlib.metadata import version

import pytest

import splash
from splash.cli import build_parser, main

COMMANDS = ["generate", "serve", "demo", "plan", "simulate", "calibrate", "make-model"]


def _help(argv: list[str], capsys) -> str:
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 0
    return capsys.readouterr().out


def test_version(capsys) -> None:
    out = _help(["--version"], capsys)
    assert out.strip() == f"splash {splash.__version__}" == f"splash {version('splash-serve')}"


@pytest.mark.parametrize("cmd", [[], *([c] for c in COMMANDS)])
def test_help_is_for_users(cmd, capsys) -> None:
    text = _help([*cmd, "--help"], capsys)
    # no developer notes, and no citations of documents (the help stands on its own)
    for note in (".md", "§", "delegates", "parses arguments"):
        assert note not in text
    parser = build_parser()
    if cmd:
        sub = parser._subparsers._group_actions[0].choices[cmd[0]]  # type: ignore[union-attr]
        for action in sub._actions:
            shown = action.default is not None and action.default is not False \
                and action.option_strings and action.help != "==SUPPRESS==" \
                and action.dest != "help"
            if shown:
                assert f"(default: {action.default})" in " ".join(text.split()), action.dest


def test_plan_and_simulate_share_defaults() -> None:
    parser = build_parser()
    plan = vars(parser.parse_args(["plan", "--model", "deepseek-v3"]))
    sim = vars(parser.parse_args(["simulate"]))
    keys = ("hardware", "tp_size", "weight_dtype", "kv_dtype")
    assert {k: plan[k] for k in keys} == {k: sim[k] for k in keys}
