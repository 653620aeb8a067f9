"""``--kwargs name=value`` overrides for ``arg()``.

The flag is FlorDB's: ``python train.py --kwargs lr=0.01 batch_size=64``. It is
taken out of ``sys.argv`` when retrolog is imported, so a script's own argparse
(which usually runs before the first ``arg()`` call) never sees it.

The script's own parsers (argparse, click) are read by cli_args.py: this module
is retrolog's flag, that one the values of flags the script defines.
"""

from __future__ import annotations

import ast
from typing import Any

from retrolog.errors import ArgumentError

FLAG = "--kwargs"

_TRUE = {"1", "true", "yes", "on", "y", "t"}
_FALSE = {"0", "false", "no", "off", "n", "f"}


def split_argv(argv: list[str]) -> tuple[list[str], dict[str, str]]:
    """Remove every ``--kwargs k=v ...`` group from ``argv``; returns (rest, overrides).

    A group runs from the flag to the first token that is not ``name=value``.
    ``--kwargs=k=v`` is accepted too. A later value for the same name wins.
    """
    rest: list[str] = []
    overrides: dict[str, str] = {}
    i = 0
    while i < len(argv):
        token = argv[i]
        if token == FLAG or token.startswith(FLAG + "="):
            pairs = [token[len(FLAG) + 1 :]] if token.startswith(FLAG + "=") else []
            i += 1
            while i < len(argv) and _is_pair(argv[i]):
                pairs.append(argv[i])
                i += 1
            if not pairs:
                raise ArgumentError(
                    f"{FLAG} needs at least one name=value pair after it, e.g. "
                    f"`{FLAG} lr=0.01 epochs=5`."
                )
            for pair in pairs:
                if not _is_pair(pair):
                    raise ArgumentError(
                        f"{FLAG} got {pair!r}; each override must look like name=value, "
                        f"e.g. `{FLAG} lr=0.01`."
                    )
                name, _, value = pair.partition("=")
                overrides[name] = value
            continue
        rest.append(token)
        i += 1
    return rest, overrides


def _is_pair(token: str) -> bool:
    name, sep, _ = token.partition("=")
    return bool(sep) and name.isidentifier()


def cast(name: str, text: str, default: Any) -> Any:
    """Convert the override ``text`` to the type of ``default`` (None keeps the string)."""
    if default is None or isinstance(default, str):
        return text
    if isinstance(default, bool):  # before int: bool is an int subclass
        lowered = text.strip().lower()
        if lowered in _TRUE:
            return True
        if lowered in _FALSE:
            return False
        raise _bad(name, text, default, "true or false (also 1/0, yes/no)")
    if isinstance(default, int):
        try:
            return int(text.strip().replace("_", ""))
        except ValueError:
            try:  # 1e3 is a common way to write an integer count
                as_float = float(text)
            except ValueError:
                raise _bad(name, text, default, "an integer") from None
            if as_float.is_integer():
                return int(as_float)
            raise _bad(name, text, default, "an integer") from None
    if isinstance(default, float):
        try:
            return float(text)
        except ValueError:
            raise _bad(name, text, default, "a number") from None
    try:
        value = ast.literal_eval(text)
    except (ValueError, SyntaxError):
        raise _bad(
            name, text, default, f"a Python literal of type {type(default).__name__}"
        ) from None
    if not isinstance(value, type(default)):
        raise _bad(name, text, default, f"a {type(default).__name__} literal")
    return value


def _bad(name: str, text: str, default: Any, wanted: str) -> ArgumentError:
    return ArgumentError(
        f"{FLAG} {name}={text}: {text!r} is not {wanted}, which the script's default "
        f"for {name!r} ({default!r}) requires. Pass e.g. `{FLAG} {name}={default!r}`.",
        name=name,
    )
