"""Hyper-parameters from the parsers scripts already use: argparse and click.

Most training scripts take their hyper-parameters as ``--lr 0.8`` through
argparse (or click, or typer, which is click), not through ``rl.arg``. Their
values are recorded as run-level values named by their destination (``lr``,
``batch_size``), with their parsed types, so ``where "lr > 0.5"`` and the
dataframe see them without the user calling anything:

- argparse: :func:`install` wraps ``ArgumentParser.parse_known_args`` (which
  ``parse_args`` and ``parse_intermixed_args`` go through) when retrolog is
  imported; a parse of the command line (no ``args``, or ``sys.argv[1:]``)
  hands its namespace to :data:`listener`. Parses of explicit lists (a
  library's own parser, a subparser, a notebook's ``parse_args([])``) are left
  alone.
- click: :func:`click_params` reads the parameters of the click context the
  run starts in (the command's and its parent groups'), without patching.

``rl.arg`` wins: a name it reads is never overwritten by a parsed value of the
same name (docs/recording.md, "Arguments"). Replay runs the script with its
recorded command line, so the parser yields the recorded values again; a
worker reports what it parsed and the deferred check compares them.

retrolog's own ``--kwargs`` flag for ``rl.arg`` is kwargs.py's.
"""

from __future__ import annotations

import enum
import functools
import os
import sys
from collections.abc import Callable, Mapping
from typing import Any

# Called with the values of each command-line parse, as plain data (set by _api).
listener: Callable[[dict[str, Any]], None] | None = None
# Everything parsed so far in this process, for a run that starts after the parse.
parsed: dict[str, Any] = {}

_MARK = "__retrolog_wrapped__"


def install() -> None:
    """Wrap argparse so that parses of the command line reach :data:`listener` (once)."""
    import argparse

    original = argparse.ArgumentParser.parse_known_args
    if getattr(original, _MARK, False):
        return

    @functools.wraps(original)
    def parse_known_args(self: Any, args: Any = None, namespace: Any = None) -> Any:
        result = original(self, args, namespace)
        if _reads_command_line(args):
            try:
                values = plain_values(vars(result[0]))
            except TypeError:  # a namespace without __dict__: nothing we can read
                return result
            _hand_over(values)
        return result

    setattr(parse_known_args, _MARK, True)
    argparse.ArgumentParser.parse_known_args = parse_known_args  # type: ignore[method-assign]


def _reads_command_line(args: Any) -> bool:
    if args is None:
        return True
    try:
        return list(args) == sys.argv[1:]
    except TypeError:
        return False


def _hand_over(values: dict[str, Any]) -> None:
    parsed.update(values)
    if listener is not None and values:
        listener(values)


def click_params() -> dict[str, Any]:
    """The parameters of the click command running now (and its groups'), if any.

    Only a script's own command counts: not retrolog's command line.
    """
    click = sys.modules.get("click")
    get_context = getattr(click, "get_current_context", None)
    if not callable(get_context):
        return {}
    ctx = get_context(silent=True)
    if ctx is None:
        return {}
    chain = []
    while ctx is not None:
        chain.append(ctx)
        ctx = ctx.parent
    root_callback = getattr(chain[-1].command, "callback", None)
    if getattr(root_callback, "__module__", "").startswith("retrolog."):
        return {}
    values: dict[str, Any] = {}
    for context in reversed(chain):  # a subcommand's value wins over its group's
        values.update(getattr(context, "params", None) or {})
    return plain_values(values)


def plain_values(values: Mapping[str, Any]) -> dict[str, Any]:
    """Parsed values as JSON-able data: numbers, strings, bools, None and lists of them."""
    return {str(name): _plain(value) for name, value in values.items()}


def _plain(value: Any) -> Any:
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, enum.Enum):
        return _plain(value.value)
    if isinstance(value, (list, tuple, set, frozenset)):
        items = sorted(value, key=repr) if isinstance(value, (set, frozenset)) else value
        return [_plain(item) for item in items]
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, os.PathLike):
        path = os.fspath(value)
        return path if isinstance(path, str) else os.fsdecode(path)
    name = getattr(value, "name", None)  # argparse.FileType, click.File: the file's name
    if isinstance(name, str) and (hasattr(value, "read") or hasattr(value, "write")):
        return name
    return str(value)
