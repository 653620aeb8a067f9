"""Replaying runs recorded hands-free (``retrolog run``): which runs were, the loops the
statements are placed against, and what the plan says about the inference.

A hands-free run recorded, in its ``checkpointing`` record, what runtime/handsfree.py
inferred. Its replay workers run the propagated old version through the same rewrite
(execute.py starts them as ``retrolog run``), and today's statements are placed against
the rewritten loops, since the file itself has no ``rl.loop`` call.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from typing import Any

from retrolog.runtime.handsfree import instrumented_text


def inferred(row: Mapping[str, Any]) -> dict[str, Any] | None:
    """What ``retrolog run`` inferred for a run (its runs row), None for an instrumented run."""
    text = row.get("checkpointing")
    if not text:
        return None
    try:
        record = json.loads(text)
    except ValueError:
        return None
    found = record.get("handsfree") if isinstance(record, dict) else None
    return found if isinstance(found, dict) else None


def any_handsfree(conn: Any, run_ids: Iterable[str]) -> bool:
    """Whether any of the runs was recorded hands-free."""
    for run_id in run_ids:
        rows = conn.execute("SELECT checkpointing FROM runs WHERE run_id = ?", (run_id,))
        for (text,) in rows:
            if inferred({"checkpointing": text}) is not None:
                return True
    return False


def loops_source(source: str, filename: str) -> str:
    """Today's script with the loops a hands-free recording gives it, for placing statements.
    A script that cannot be parsed is returned as it is (placing reports it)."""
    try:
        return instrumented_text(source, filename)
    except SyntaxError:
        return source


def plan_lines(runs: Mapping[str, Mapping[str, Any]], planned: Iterable[str]) -> list[str]:
    """A line per hands-free run in the plan: its loops, objects and uncertainties."""
    lines: list[str] = []
    for run_id in planned:
        found = inferred(runs[run_id]) if run_id in runs else None
        if found is None:
            continue
        parts = []
        for loop in found.get("loops", []):
            inner = ", ".join(f"{i['name']} (line {i['line']})" for i in loop.get("inner", []))
            objects = ", ".join(loop.get("objects", [])) or "none"
            part = (
                f"loop {loop['name']} (line {loop['line']}; nested: {inner or 'none'}), "
                f"objects {objects}"
            )
            if loop.get("uncertain"):
                part += f"; executed, not restored: {'; '.join(loop['uncertain'])}"
            parts.append(part)
        for note in found.get("notes", []):
            parts.append(note)
        said = "; ".join(parts) or "no training loop found, executed"
        lines.append(f"run {run_id}: recorded hands-free (retrolog run): {said}")
    return lines
