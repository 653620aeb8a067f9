"""retrolog: multiversion hindsight logging for model training.

Log a little while training; ask for anything later. See README.md.
"""

from retrolog._api import (
    arg,
    checkpointing,
    commit,
    configure,
    dataframe,
    lineage,
    log,
    loop,
    query,
    replay,
)
from retrolog._project import Project
from retrolog._restore import restore

__all__ = [
    "Project",
    "arg",
    "checkpointing",
    "commit",
    "configure",
    "dataframe",
    "lineage",
    "log",
    "loop",
    "query",
    "replay",
    "restore",
]
__version__ = "0.1.0"
