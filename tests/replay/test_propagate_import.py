"""Propagating into history from before retrolog was adopted: the import goes in too."""

from __future__ import annotations

import ast
from pathlib import Path

from click.testing import CliRunner

from retrolog._replay.propagate import AddedImport, propagate
from retrolog.cli import cli

NEW = '''\
"""Train."""
from __future__ import annotations

import torch

import retrolog as rl

net = torch.nn.Linear(2, 1)
for epoch in rl.loop("epoch", range(3)):
    net.zero_grad()
    rl.log("w", net.weight.norm().item())
'''

OLD = '''\
"""Train."""
from __future__ import annotations

import os
import torch

net = torch.nn.Linear(2, 1)
for epoch in range(3):
    net.zero_grad()
'''


def test_old_version_without_retrolog_gets_the_import_after_its_imports() -> None:
    result = propagate(NEW, OLD, ["w"])
    assert result.problems == ()
    assert result.added_import == AddedImport("import retrolog as rl", 6)
    lines = result.source.splitlines()
    assert lines[4:6] == ["import torch", "import retrolog as rl"]
    (placement,) = result.placements
    assert lines[placement.line - 1] == '    rl.log("w", net.weight.norm().item())'
    assert lines[placement.line - 2] == "    net.zero_grad()"
    # Nothing else changed.
    assert (
        result.source.replace("import retrolog as rl\n", "").replace(
            '    rl.log("w", net.weight.norm().item())\n', ""
        )
        == OLD
    )


def test_nothing_placed_means_nothing_imported() -> None:
    new = NEW.replace("net.weight", "scaler.weight")
    result = propagate(new, OLD, ["w"])
    assert result.source == OLD
    assert result.added_import is None
    assert "has no `scaler`" in result.problems[0].reason


def test_old_version_that_imports_retrolog_gets_no_second_import() -> None:
    old = OLD.replace("import torch\n", "import torch\nimport retrolog as rl\n")
    result = propagate(NEW, old, ["w"])
    assert result.added_import is None
    assert result.source.count("import retrolog") == 1


def test_old_version_without_imports_gets_it_after_the_docstring() -> None:
    old = '"""Train."""\nfor epoch in range(3):\n    x = epoch\n'
    new = 'import retrolog as rl\nfor epoch in rl.loop("epoch", range(3)):\n'
    new += '    x = epoch\n    rl.log("x", x)\n'
    result = propagate(new, old, ["x"])
    assert result.source == (
        '"""Train."""\nimport retrolog as rl\nfor epoch in range(3):\n'
        '    x = epoch\n    rl.log("x", x)\n'
    )
    assert result.added_import == AddedImport("import retrolog as rl", 2)


def test_shebang_and_encoding_lines_stay_first() -> None:
    old = "#!/usr/bin/env python\n# -*- coding: latin-1 -*-\nx = 1\nprint(x)\n"
    new = "import retrolog as rl\nx = 1\nrl.log('x', x)\nprint(x)\n"
    result = propagate(new, old, ["x"])
    assert result.source.splitlines() == [
        "#!/usr/bin/env python",
        "# -*- coding: latin-1 -*-",
        "import retrolog as rl",
        "x = 1",
        "rl.log('x', x)",
        "print(x)",
    ]


def test_old_version_binding_rl_itself_gets_another_name() -> None:
    # ``rl`` is the old script's learning rate: shadowing it would change the training.
    old = OLD.replace("net = ", "rl = 0.1\nnet = ")
    result = propagate(NEW, old, ["w"])
    assert result.added_import == AddedImport("import retrolog", 6)
    assert '    retrolog.log("w", net.weight.norm().item())' in result.source.splitlines()
    assert "rl = 0.1" in result.source


def test_an_rl_read_from_a_star_import_counts_as_taken() -> None:
    old = OLD.replace("import torch\n", "import torch\nfrom config import *\n")
    old = old.replace("net.zero_grad()", "net.zero_grad(rl)")  # ``rl`` from config
    result = propagate(NEW, old, ["w"])
    assert result.added_import is not None
    assert result.added_import.statement == "import retrolog"
    assert '    retrolog.log("w", net.weight.norm().item())' in result.source.splitlines()


def test_a_local_rl_anywhere_counts_as_taken() -> None:
    old = OLD + "\n\ndef schedule(rl):\n    return rl / 2\n"
    old = old.replace("import os\n", "import os\nimport retrolog_utils as retrolog\n")
    result = propagate(NEW, old, ["w"])
    assert result.added_import is not None
    assert result.added_import.statement == "import retrolog as _retrolog"
    assert '    _retrolog.log("w", net.weight.norm().item())' in result.source.splitlines()
    compile(result.source, "train.py", "exec")


def test_the_new_files_from_import_is_copied() -> None:
    new = NEW.replace("import retrolog as rl", "from retrolog import log, loop")
    new = new.replace("rl.loop", "loop").replace("rl.log", "log")
    result = propagate(new, OLD, ["w"])
    assert result.added_import is not None
    assert result.added_import.statement == "from retrolog import log"
    assert '    log("w", net.weight.norm().item())' in result.source.splitlines()


def test_statement_placed_among_the_imports_comes_after_the_import() -> None:
    new = "import torch\nimport retrolog as rl\nrl.log('torch', torch.__version__)\nimport os\n"
    old = "import torch\nimport os\n"
    result = propagate(new, old, ["torch"])
    assert result.source == (
        "import torch\nimport retrolog as rl\nrl.log('torch', torch.__version__)\nimport os\n"
    )
    assert result.placements[0].line == 3
    assert result.added_import == AddedImport("import retrolog as rl", 2)


def test_import_takes_the_old_files_line_endings() -> None:
    old = OLD.replace("\n", "\r\n")
    result = propagate(NEW, old, ["w"])
    assert "import torch\r\nimport retrolog as rl\r\n" in result.source
    assert "\n" not in result.source.replace("\r\n", "")
    ast.parse(result.source)


def test_refusal_names_the_statement_and_its_line() -> None:
    new = NEW.replace("net.weight", "scaler.weight")
    (problem,) = propagate(new, OLD, ["w"]).problems
    assert problem.reason.startswith(
        '`rl.log("w", scaler.weight.norm().item())` (line 11 of the new version): '
    )
    assert "the old version has no `scaler`" in problem.reason


def test_cli_reports_the_added_import(tmp_path: Path) -> None:
    (tmp_path / "new.py").write_text(NEW)
    (tmp_path / "old.py").write_text(OLD)
    result = CliRunner().invoke(
        cli, ["propagate", str(tmp_path / "new.py"), str(tmp_path / "old.py"), "--names", "w"]
    )
    assert result.exit_code == 0, result.output
    assert result.stdout == propagate(NEW, OLD, ["w"]).source
    assert f"import: `import retrolog as rl` added at line 6, since {tmp_path / 'old.py'}" in (
        result.stderr
    )
