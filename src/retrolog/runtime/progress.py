"""The outermost loop's progress bar (tqdm on stderr, latest logged values as postfix)."""

from __future__ import annotations

import sys
import time
from collections.abc import Mapping
from typing import Any

from retrolog._config import lookup

PROGRESS_ENV = "RETROLOG_PROGRESS"
_POSTFIX_EVERY = 0.5  # seconds; set_postfix formats every value, so not on every iteration
_POSTFIX_NAMES = 6


def enabled() -> bool:
    """Shown only on a terminal, unless RETROLOG_PROGRESS=0 turns it off."""
    if (lookup(PROGRESS_ENV) or "").strip().lower() in {"0", "false", "off", "no"}:
        return False
    stream = sys.stderr
    return stream is not None and hasattr(stream, "isatty") and stream.isatty()


class LoopProgress:
    """A tqdm bar for one loop; ``tick()`` after each iteration."""

    def __init__(self, name: str, iterable: Any, latest: Mapping[str, Any]) -> None:
        from tqdm import tqdm  # imported here: importing retrolog must stay light

        try:
            total: int | None = len(iterable)
        except TypeError:
            total = None
        self._latest = latest
        self._bar = tqdm(total=total, desc=name, file=sys.stderr, dynamic_ncols=True, leave=True)
        self._last_postfix = 0.0

    def tick(self) -> None:
        now = time.monotonic()
        if now - self._last_postfix >= _POSTFIX_EVERY:
            self._last_postfix = now
            items = list(self._latest.items())[-_POSTFIX_NAMES:]
            self._bar.set_postfix({k: _short(v) for k, v in items}, refresh=False)
        self._bar.update(1)

    def close(self) -> None:
        items = list(self._latest.items())[-_POSTFIX_NAMES:]
        self._bar.set_postfix({k: _short(v) for k, v in items}, refresh=False)
        self._bar.close()


def _short(value: Any) -> Any:
    if isinstance(value, float):
        return float(f"{value:.4g}")
    if isinstance(value, str) and len(value) > 20:
        return value[:17] + "..."
    return value
