"""Running git for retrolog: a fixed environment, no hooks, errors as VersionError.

Every git process retrolog starts goes through :func:`run_git`, so the rules
that keep the user's repository safe live in one place:

- hooks never run (``core.hooksPath`` points nowhere), and neither does a
  configured fsmonitor hook;
- commits carry retrolog's own identity, so a machine without ``user.name`` /
  ``user.email`` can still record runs;
- opportunistic index refreshes are off (``GIT_OPTIONAL_LOCKS=0``), so even a
  read-only git call never rewrites the user's index;
- a non-zero exit or a missing git binary becomes one :class:`VersionError`
  whose message names the project, the command and git's own words.
"""

from __future__ import annotations

import os
import shlex
import subprocess
from collections.abc import Mapping, Sequence
from pathlib import Path

from retrolog.errors import VersionError

# Commits on retrolog's refs are retrolog's, not the user's: a fixed identity
# also makes capture work where git has no identity configured at all.
IDENTITY: Mapping[str, str] = {
    "GIT_AUTHOR_NAME": "retrolog",
    "GIT_AUTHOR_EMAIL": "retrolog@localhost",
    "GIT_COMMITTER_NAME": "retrolog",
    "GIT_COMMITTER_EMAIL": "retrolog@localhost",
}

# Variables that redirect git to another repository, index or object store.
# Calls that name their git directory explicitly drop them, so a training
# script started from inside a git hook (where GIT_DIR is set) is not confused.
LOCATION_VARIABLES = (
    "GIT_DIR",
    "GIT_WORK_TREE",
    "GIT_INDEX_FILE",
    "GIT_COMMON_DIR",
    "GIT_OBJECT_DIRECTORY",
    "GIT_ALTERNATE_OBJECT_DIRECTORIES",
    "GIT_NAMESPACE",
    "GIT_PREFIX",
)

# Passed as `-c` to every call. Hooks (including reference-transaction, which
# update-ref would run) are user code with side effects; fsmonitor is a hook
# too; a split index would make git write shared-index files next to the
# user's index.
SAFE_CONFIG: tuple[str, ...] = (
    "-c",
    f"core.hooksPath={os.devnull}",
    "-c",
    "core.fsmonitor=false",
    "-c",
    "core.splitIndex=false",
    "-c",
    "advice.addEmbeddedRepo=false",
)

DEFAULT_HINT = (
    "Check that git works there (`git status`; `git fsck` finds a corrupt repository) "
    "and try again."
)


def git_env(
    *,
    git_dir: Path | None = None,
    work_tree: Path | None = None,
    index_file: Path | None = None,
    isolate: bool = False,
) -> dict[str, str]:
    """The environment for a git call.

    isolate: drop inherited variables that point git at some other repository;
        set it whenever ``git_dir`` is given.
    """
    env = dict(os.environ)
    if isolate:
        for name in LOCATION_VARIABLES:
            env.pop(name, None)
    env.update(IDENTITY)
    env["GIT_OPTIONAL_LOCKS"] = "0"
    env["GIT_TERMINAL_PROMPT"] = "0"
    if git_dir is not None:
        env["GIT_DIR"] = str(git_dir)
    if work_tree is not None:
        env["GIT_WORK_TREE"] = str(work_tree)
    if index_file is not None:
        env["GIT_INDEX_FILE"] = str(index_file)
    return env


def run_git(
    args: Sequence[str],
    *,
    cwd: Path,
    env: Mapping[str, str],
    subject: Path,
    doing: str,
    stdin: bytes | None = None,
    hint: str = DEFAULT_HINT,
) -> bytes:
    """Run ``git <args>`` and return its stdout; raise VersionError when it fails.

    subject: the project (or git directory) the message names.
    doing: what retrolog was trying to do, as a verb phrase ("capture the code
        version of run 'x'"), for the message.
    hint: what the user can do about a failure.
    """
    command = ["git", *SAFE_CONFIG, *args]
    shown = shlex.join(["git", *args])
    try:
        proc = subprocess.run(
            command, cwd=cwd, env=env, input=stdin, capture_output=True, check=False
        )
    except OSError as exc:
        if not cwd.is_dir():
            problem = f"the directory {cwd} does not exist"
            fix = "Check the path and try again."
        else:
            problem = f"the git executable could not be started ({exc.strerror or exc})"
            fix = (
                "Install git and make sure it is on PATH; retrolog needs it to keep code versions."
            )
        raise VersionError(
            f"Could not {doing} in {subject}: {problem}. {fix}", path=str(subject)
        ) from exc
    if proc.returncode != 0:
        # One paragraph: git's multi-line output (hints, "fatal:" lines) joined by spaces.
        said = " ".join(proc.stderr.decode("utf-8", errors="replace").split()) or "no message"
        if not said.endswith((".", "!", "?")):
            said += "."
        failure = subprocess.CalledProcessError(proc.returncode, command, proc.stdout, proc.stderr)
        raise VersionError(
            f"Could not {doing} in {subject}: `{shown}` exited with status "
            f"{proc.returncode}: {said} {hint}",
            path=str(subject),
        ) from failure
    return proc.stdout
