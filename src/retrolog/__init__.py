"""retrolog: multiversion hindsight logging for model training.

Log a little while training; ask for anything later. See README.md.
"""

from retrolog._api import (
    arg,
    begin,
    checkpointing,
    commit,
    configure,
    dataframe,
    end,
    lineage,
    log,
    loop,
    query,
    replay,
    restore_block,
    volatile,
)
from retrolog._project import Project
from retrolog._restore import restore
from retrolog.integrations import autolog

__all__ = [
    "Project",
    "arg",
    "autolog",
    "begin",
    "checkpointing",
    "commit",
    "configure",
    "dataframe",
    "end",
    "lineage",
    "log",
    "loop",
    "query",
    "replay",
    "restore",
    "restore_block",
    "volatile",
]
__version__ = "0.1.0"
