"""``rl.restore``: put any recorded checkpoint of any run back into live objects.

The model-registry use, which FlorDB's users lean on: pick a run (and an
iteration) by what it logged, then load that state::

    df = rl.dataframe("val_acc")
    rl.restore(df.loc[df.val_acc.idxmax()], model=net, optimizer=opt)

A checkpoint is chosen by run and outer-loop position; its objects are decoded
from the store and loaded in place, exactly as replay restores a skipped block.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from retrolog.errors import (
    CheckpointTargetError,
    CorruptObjectError,
    RunNotFoundError,
    StoreError,
    UsageError,
)


@dataclass(frozen=True)
class RestoredCheckpoint:
    """What :func:`restore` put back."""

    run_id: str
    at: int | str  # the outer-loop iteration whose block ended at the checkpoint, or "end"
    loop_name: str  # the outer loop, e.g. "epoch"
    manifest: str  # the checkpoint's manifest key in the object store
    names: tuple[str, ...]  # the objects restored
    available: tuple[str, ...]  # every object the checkpoint holds
    rng: bool  # whether the process's RNG states were set to the checkpoint's


@dataclass(frozen=True)
class _Row:
    ctx_id: int | None
    kind: str
    iteration: int | None
    loop_name: str
    manifest: str


def restore(
    run: Any, /, *, at: int | str | None = None, rng: bool = False, **objects: Any
) -> RestoredCheckpoint:
    """Restore a recorded checkpoint of ``run`` into the live ``objects``, in place.

    run: a run id (a unique prefix is enough), or one row of ``rl.dataframe(...)``
        (a Series, or a one-row DataFrame): its ``run_id``, and its outer-loop
        column (e.g. ``epoch``) as ``at`` unless ``at`` is given.
    at: an outer-loop iteration (0-based) or ``"end"``. The checkpoint of an
        iteration is its state at the END of that iteration's block: after the
        nested loop (e.g. the epoch's training steps) when there is one, else
        after the whole iteration. Default: the end checkpoint, else the latest.
    rng: also set Python's, numpy's and torch's global random states to the
        checkpoint's. Off by default: loading a model must not reseed the process.
    objects: the live objects, named as in the run's ``checkpointing(...)``; any
        subset of those names.

    Returns a :class:`RestoredCheckpoint` saying which checkpoint was restored.
    """
    from retrolog._api import current_project
    from retrolog.checkpoint.capture import load_checkpoint
    from retrolog.checkpoint.state import Snapshot
    from retrolog.checkpoint.state import restore as restore_state
    from retrolog.store.backends import object_store_for

    if type(rng) is not bool:
        raise UsageError(
            f"restore()'s rng= is a flag (True: also restore the global random states), "
            f"not {type(rng).__name__}; a checkpointed object named 'rng' cannot be passed "
            "by that name."
        )
    ref, row = _run_reference(run)
    if at is not None:
        at = _position(at)
    project = current_project()
    run_id, positions = project.checkpoint_positions(ref)
    rows = [_Row(*position) for position in positions]
    loop_name = rows[-1].loop_name if rows else ""
    if at is None and row is not None:
        at = _position_from_row(row, loop_name)
    chosen = _choose(run_id, rows, at)
    position: int | str = "end" if chosen.kind == "end" else _iteration(chosen)
    where = f"checkpoint at {_label(loop_name, position)} of run {run_id}"
    if not objects:
        raise UsageError(
            f"restore() needs the live objects to load the {where} into, passed by the names the "
            "run's checkpointing(...) used, e.g. rl.restore(run, model=net, optimizer=opt)."
        )
    store = object_store_for(project.paths.store)
    try:
        snap = load_checkpoint(store, chosen.manifest)
    except CorruptObjectError as exc:
        raise CorruptObjectError(
            f"Cannot restore the {where}: {exc}", path=exc.path, key=exc.key
        ) from exc
    except StoreError as exc:
        raise StoreError(f"Cannot restore the {where}: {exc}", path=exc.path) from exc
    available = tuple(snap.objects)
    unknown = [name for name in objects if name not in snap.objects]
    if unknown:
        raise CheckpointTargetError(
            f"The {where} has no object named {_names(unknown)}; it holds "
            f"{_names(list(available)) or 'no objects'}. Pass the live objects by the names "
            "the run's checkpointing(...) gave them (any subset of those).",
            name=unknown[0],
        )
    subset = Snapshot(
        objects={name: snap.objects[name] for name in objects}, rng=snap.rng if rng else {}
    )
    restore_state(objects, subset)
    return RestoredCheckpoint(
        run_id=run_id,
        at=position,
        loop_name=loop_name,
        manifest=chosen.manifest,
        names=tuple(objects),
        available=available,
        rng=rng,
    )


def _run_reference(run: Any) -> tuple[str, Any]:
    """The run id ``run`` names, and the row (a Series) when it is a dataframe row."""
    if isinstance(run, str):
        return run, None
    module = type(run).__module__ or ""
    if module.startswith("pandas"):
        import pandas as pd

        if isinstance(run, pd.DataFrame):
            if len(run) != 1:
                raise UsageError(
                    f"restore() takes one row of a dataframe, not {len(run)} rows; choose one, "
                    'e.g. df.loc[df["val_acc"].idxmax()] or df.iloc[[0]].'
                )
            run = run.iloc[0]
        if isinstance(run, pd.Series):
            if "run_id" not in run.index:
                raise UsageError(
                    "restore() was given a row without a run_id column; pass a row of "
                    "rl.dataframe(...), or a run id."
                )
            return str(run["run_id"]), run
    raise UsageError(
        f"restore() takes a run id (str) or one row of rl.dataframe(...), not a "
        f"{type(run).__name__}."
    )


def _position(at: Any) -> int | str:
    if isinstance(at, str) and at == "end":
        return "end"
    if not isinstance(at, bool):
        try:
            return operator.index(at)  # int, and numpy's integers
        except TypeError:
            pass
    raise UsageError(f"at= takes an outer-loop iteration (an int, 0-based) or 'end', not {at!r}.")


def _position_from_row(row: Any, loop_name: str) -> int | str | None:
    """The row's value in the outer loop's column; None for a row outside that loop."""
    if not loop_name or loop_name not in row.index:
        return None
    import pandas as pd

    value = row[loop_name]
    if pd.isna(value):
        return None
    return _position(value)


def _choose(run_id: str, rows: Sequence[_Row], at: int | str | None) -> _Row:
    """The checkpoint at ``at``; the last of several (an outer loop that ran twice)."""
    if not rows:
        raise RunNotFoundError(
            f"Run {run_id} has no checkpoint to restore: it ran no loop inside "
            "rl.checkpointing(...), or garbage collection (retrolog gc) removed them all.",
            run_id=run_id,
        )
    if at is None:
        ends = [r for r in rows if r.kind == "end"]
        return ends[-1] if ends else rows[-1]
    if at == "end":
        matches = [r for r in rows if r.kind == "end"]
    else:
        matches = [r for r in rows if r.kind == "block" and r.iteration == at]
    if matches:
        return matches[-1]
    loop_name = rows[-1].loop_name
    raise RunNotFoundError(
        f"Run {run_id} has no checkpoint at {_label(loop_name, at)}; it has checkpoints at "
        f"{_listing(rows)}. Blocks are not all checkpointed (adaptive checkpointing skips "
        "some, a crashed run has no end checkpoint), and garbage collection (retrolog gc) "
        "may have removed others.",
        run_id=run_id,
    )


def _iteration(row: _Row) -> int:
    return row.iteration if row.iteration is not None else -1


def _listing(rows: Sequence[_Row]) -> str:
    from retrolog._gc import CheckpointRef, format_positions

    refs = [
        CheckpointRef(i, "", r.ctx_id, r.kind, r.iteration, r.manifest, 0)
        for i, r in enumerate(rows)
    ]
    loop_name = rows[-1].loop_name
    return f"{loop_name} {format_positions(refs)}"


def _label(loop_name: str, at: int | str) -> str:
    return "the end" if at == "end" else f"{loop_name} {at}"


def _names(names: Sequence[str]) -> str:
    return ", ".join(repr(n) for n in names)
