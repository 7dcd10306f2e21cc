"""The environment variables the docs name for each server's settings (the tables of docs/broker.md,
docs/delay.md and docs/meta.md) are the ones the commands read: a setting documented as
QMQ_BROKER_SERVE_AHEAD once only worked as QMQ_BROKER_AHEAD_WINDOW_S, its parameter's name."""

from __future__ import annotations

import re
from pathlib import Path

import click
import pytest

from qmq.cli import main

DOCS = Path(__file__).resolve().parents[1] / "docs"
# doc -> the command its settings table is for, and what `..._X` in the table stands for
TABLES = {
    "broker.md": ("broker", "QMQ_BROKER_"),
    "delay.md": ("delay-server", "QMQ_DELAY_SERVER_"),
    "meta.md": ("meta", "QMQ_META_"),
}
ROW = re.compile(r"^\|[^|]*\| ((?:`--[a-z-]+`(?:, )?)+) \| ((?:`(?:QMQ_|\.\.\._)[A-Z_]+`(?:, )?)+) \|", re.M)


def documented(doc: str) -> list[tuple[str, str]]:
    """(flag, environment variable) of every row of the doc's settings table."""
    prefix = TABLES[doc][1]
    pairs: list[tuple[str, str]] = []
    for flags, envs in ROW.findall((DOCS / doc).read_text()):
        names = [prefix + e[4:] if e.startswith("...") else e for e in re.findall(r"`([A-Z_.]+)`", envs)]
        pairs.extend(zip(re.findall(r"`(--[a-z-]+)`", flags), names, strict=True))
    return pairs


def command_context(name: str) -> tuple[click.Command, click.Context]:
    root = click.Context(main, info_name="qmq", auto_envvar_prefix="QMQ")
    command = main.get_command(root, name)
    assert command is not None
    return command, click.Context(command, info_name=name, parent=root)


@pytest.mark.parametrize("doc", sorted(TABLES))
def test_every_documented_environment_variable_sets_its_flag(doc, monkeypatch) -> None:
    command, ctx = command_context(TABLES[doc][0])
    pairs = documented(doc)
    assert len(pairs) >= 6, f"{doc}: the settings table was not found"
    options = {opt: p for p in command.params if isinstance(p, click.Option) for opt in p.opts}
    wrong = []
    for flag, env in pairs:
        option = options[flag]
        monkeypatch.setenv(env, "7")
        if option.resolve_envvar_value(ctx) != "7":
            wrong.append(f"{flag}: {env}")
        monkeypatch.delenv(env)
    assert not wrong, f"{doc} names environment variables its command does not read: {wrong}"


def test_a_parameter_named_otherwise_still_reads_its_old_name(monkeypatch) -> None:
    command, ctx = command_context("broker")
    [option] = [p for p in command.params if "--serve-ahead" in getattr(p, "opts", ())]
    monkeypatch.setenv("QMQ_BROKER_AHEAD_WINDOW_S", "0.5")
    assert option.resolve_envvar_value(ctx) == "0.5"
    monkeypatch.setenv("QMQ_BROKER_SERVE_AHEAD", "0")
    assert option.resolve_envvar_value(ctx) == "0"  # the documented name comes first


def every_option() -> list[tuple[str, click.Option, click.Context]]:
    """(command path, option, its context) of every option of every `qmq` command that reads an
    automatic environment variable."""
    found = []

    def walk(group: click.Group, ctx: click.Context, path: list[str]) -> None:
        for name in group.list_commands(ctx):
            command = group.get_command(ctx, name)
            sub = click.Context(command, info_name=name, parent=ctx)
            if isinstance(command, click.Group):
                walk(command, sub, [*path, name])
                continue
            for p in command.params:
                if isinstance(p, click.Option) and p.envvar is None and p.allow_from_autoenv:
                    found.append((" ".join([*path, name]), p, sub))

    walk(main, click.Context(main, info_name="qmq", auto_envvar_prefix="QMQ"), [])
    return found


def test_every_option_reads_the_variable_named_after_its_command_and_flag(monkeypatch) -> None:
    # docs/worker.md: "Every option also reads QMQ_WORKER_<OPTION>"; docs/reconcile.md the same
    options = every_option()
    assert len(options) > 100
    wrong = []
    for path, option, ctx in options:
        env = "QMQ_" + "_".join([*path.split(), max(option.opts, key=len).lstrip("-")]).upper().replace("-", "_")
        monkeypatch.setenv(env, "7")
        if option.resolve_envvar_value(ctx) != "7":
            wrong.append(f"qmq {path} {max(option.opts, key=len)}: {env}")
        monkeypatch.delenv(env)
    assert not wrong, wrong
