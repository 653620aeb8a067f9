"""How a recording process checkpoints: the settings ``rl.configure`` and the environment set.

Each setting has an environment variable, read when a run first checkpoints,
and a keyword of :func:`retrolog.configure`, which wins over the variable:

=========================  ==============================  ==========================
setting                    environment variable            default
=========================  ==============================  ==========================
``overhead_tolerance``     ``RETROLOG_OVERHEAD_TOLERANCE`` 1/15 (eps in policy.py)
``checkpoints``            ``RETROLOG_CHECKPOINTS``        ``"adaptive"``
``max_in_flight``          ``RETROLOG_MAX_IN_FLIGHT``      2
``when_full``              ``RETROLOG_WHEN_FULL``          ``"skip"``; with ``"every"``:
                                                           ``"wait"``
``restore_ratio``          ``RETROLOG_RESTORE_RATIO``      learned (Flor's c; 1.0 before
                                                           any replay)
=========================  ==============================  ==========================

``checkpoints="every"`` checkpoints every block, knowingly paying whatever it
costs (tests, and users who want dense checkpoints); ``"adaptive"`` applies
Flor's joint invariant (:mod:`retrolog.checkpoint.policy`). A checkpoint
chosen is always written; ``when_full`` says what a block end does when the
background writer already holds ``max_in_flight`` snapshots: ``"skip"``
waits for a slot only as long as the adaptive rule can afford under eps,
then decides against checkpointing that block end (before any copy is taken;
counted in ``runs.checkpointing`` as ``refused_writer_full``, and the rule
asks again at the next block end), ``"wait"`` has training wait for a slot.
Unless set, it follows the mode: the adaptive rule skips (training waits
only within its bound), ``"every"`` waits, since dense checkpoints are what
was asked for.
The end state is always taken, waiting if it must.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any, Literal

from retrolog._config import lookup
from retrolog.errors import UsageError

Mode = Literal["adaptive", "every"]
MODES: tuple[Mode, ...] = ("adaptive", "every")
WHEN_FULL = ("wait", "skip")


@dataclass(frozen=True)
class CheckpointSettings:
    """The checkpointing settings in effect."""

    overhead_tolerance: float = 1 / 15  # eps: the share of training time checkpoints may cost
    checkpoints: Mode = "adaptive"  # "adaptive" (Flor's invariant) or "every" block
    max_in_flight: int = 2  # snapshots held by the background writer at once
    when_full: str = "skip"  # a block end with the writer full: "skip" it, or "wait" for a slot
    # c: restore time / materialize time; None: learned from the script's past replays.
    restore_ratio: float | None = None


def _tolerance(value: Any, source: str) -> float:
    try:
        eps = float(value)
    except (TypeError, ValueError):
        eps = math.nan
    if not 0 < eps <= 1:
        raise UsageError(
            f"{source} must be a number in (0, 1], the share of training time checkpointing "
            f"may cost (e.g. 0.0667 for 1/15), not {value!r}."
        )
    return eps


def _mode(value: Any, source: str) -> Mode:
    for mode in MODES:
        if value == mode:
            return mode
    raise UsageError(
        f"{source} must be 'adaptive' (checkpoint as often as the overhead tolerance allows) "
        f"or 'every' (checkpoint every block, whatever it costs), not {value!r}."
    )


def _in_flight(value: Any, source: str) -> int:
    try:
        n = int(value)
    except (TypeError, ValueError):
        n = 0
    if n < 1 or (isinstance(value, float) and not value.is_integer()) or isinstance(value, bool):
        raise UsageError(
            f"{source} must be a whole number of at least 1 (snapshots of the state held in "
            f"memory while the background writer stores them), not {value!r}."
        )
    return n


def _when_full(value: Any, source: str) -> str:
    if value not in WHEN_FULL:
        raise UsageError(
            f"{source} must be 'skip' (a block end that finds the checkpoint writer full "
            f"is not checkpointed, and replay executes that block) or 'wait' (training waits "
            f"for the writer), not {value!r}."
        )
    return str(value)


def _restore_ratio(value: Any, source: str) -> float:
    try:
        c = float(value)
    except (TypeError, ValueError):
        c = math.nan
    if not (c > 0 and math.isfinite(c)):
        raise UsageError(
            f"{source} must be a positive number (restore time divided by materialize time), "
            f"not {value!r}."
        )
    return c


_PARSERS: dict[str, Callable[[Any, str], Any]] = {
    "overhead_tolerance": _tolerance,
    "checkpoints": _mode,
    "max_in_flight": _in_flight,
    "when_full": _when_full,
    "restore_ratio": _restore_ratio,
}
ENV = {
    "overhead_tolerance": "RETROLOG_OVERHEAD_TOLERANCE",
    "checkpoints": "RETROLOG_CHECKPOINTS",
    "max_in_flight": "RETROLOG_MAX_IN_FLIGHT",
    "when_full": "RETROLOG_WHEN_FULL",
    "restore_ratio": "RETROLOG_RESTORE_RATIO",
}

_configured: dict[str, Any] = {}


def configure(**settings: Any) -> CheckpointSettings:
    """Set checkpoint settings for this process (None leaves a setting as it is)."""
    unknown = sorted(set(settings) - set(_PARSERS))
    if unknown:
        raise UsageError(
            f"configure() has no setting {', '.join(map(repr, unknown))}; the settings are: "
            f"{', '.join(_PARSERS)}."
        )
    parsed = {
        name: _PARSERS[name](value, f"configure({name}=...)")
        for name, value in settings.items()
        if value is not None
    }
    _configured.update(parsed)
    return current()


def current(environ: Mapping[str, str] | None = None) -> CheckpointSettings:
    """The settings in effect: configure() over the environment over the project's files
    over the defaults (``environ``: instead of the environment and the files, for tests)."""
    values: dict[str, Any] = {}
    for name, var in ENV.items():
        raw = (lookup(var, environ) or "").strip()
        if raw:
            values[name] = _PARSERS[name](raw, f"The environment variable {var}")
    values.update(_configured)
    if "when_full" not in values and values.get("checkpoints") == "every":
        values["when_full"] = "wait"
    return replace(CheckpointSettings(), **values)
