"""Today's helpers go with the statement: an old version computes today's definition."""

from __future__ import annotations

import textwrap

from retrolog._replay.propagate import propagate

OLD = textwrap.dedent(
    """\
    import numpy as np

    import retrolog as rl


    def weight_norm(w):
        return float(np.sqrt((w ** 2).sum()))


    w = np.ones(4)
    for epoch in rl.loop("epoch", range(2)):
        w *= 2
        rl.log("acc", weight_norm(w))
    """
)


def _new(extra_defs: str, statement: str) -> str:
    return OLD.replace("\n\nw = np.ones(4)", f"\n\n{extra_defs}\n\nw = np.ones(4)").replace(
        '    rl.log("acc", weight_norm(w))\n',
        f'    rl.log("acc", weight_norm(w))\n    {statement}\n',
    )


def _run(source: str) -> dict[str, object]:
    """The values a propagated file logs, with rl.log stubbed."""
    logged: dict[str, object] = {}

    class Stub:
        @staticmethod
        def log(name: str, value: object) -> object:
            logged[f"{name}@{len(logged)}"] = value
            return value

        @staticmethod
        def loop(name: str, iterable: object) -> object:
            return iterable

    code = source.replace("import retrolog as rl\n", "")
    exec(compile(code, "<propagated>", "exec"), {"rl": Stub})
    return logged


def test_a_helper_the_old_version_lacks_goes_in_under_its_name() -> None:
    new = _new(
        "def grad_stat(w):\n    return float(np.abs(w).max()) * SCALE\n\n\nSCALE = 3.0",
        'rl.log("g", grad_stat(w))',
    )
    result = propagate(new, OLD, ["g"])
    assert not result.problems
    assert result.carried == (("SCALE", "SCALE"), ("grad_stat", "grad_stat"))
    assert "def grad_stat(w):" in result.source and "SCALE = 3.0" in result.source
    # Before the module-level statement holding the placement, after what they read.
    assert result.source.index("def grad_stat") < result.source.index("for epoch in")
    assert result.source.index("import numpy") < result.source.index("def grad_stat")
    values = _run(result.source)
    assert [v for k, v in values.items() if k.startswith("g@")] == [6.0, 12.0]


def test_a_helper_defined_otherwise_goes_in_under_a_private_name() -> None:
    changed = OLD.replace("np.sqrt((w ** 2).sum())", "np.abs(w).sum()")
    new = changed.replace(
        '    rl.log("acc", weight_norm(w))\n',
        '    rl.log("acc", weight_norm(w))\n    rl.log("l1", weight_norm(w))\n',
    )
    result = propagate(new, OLD, ["l1"])
    assert not result.problems
    assert result.carried == (("weight_norm", "_retrolog_weight_norm"),)
    assert 'rl.log("l1", _retrolog_weight_norm(w))' in result.source
    values = _run(result.source)
    # The old code keeps its own helper; the new statement computes with today's.
    assert [v for k, v in values.items() if k.startswith("acc@")] == [4.0, 8.0]
    assert [v for k, v in values.items() if k.startswith("l1@")] == [8.0, 16.0]


def test_a_helper_that_is_the_same_is_used_as_it_is() -> None:
    new = _new("", 'rl.log("again", weight_norm(w))')
    result = propagate(new, OLD, ["again"])
    assert not result.problems and result.carried == ()
    assert result.source.count("def ") == 1


def test_a_helper_that_calls_a_changed_one_goes_in_too() -> None:
    changed = OLD.replace("np.sqrt((w ** 2).sum())", "np.abs(w).sum()")
    new = changed.replace(
        "\n\nw = np.ones(4)", "\n\ndef twice(w):\n    return 2 * weight_norm(w)\n\n\nw = np.ones(4)"
    ).replace(
        '    rl.log("acc", weight_norm(w))\n',
        '    rl.log("acc", weight_norm(w))\n    rl.log("t", twice(w))\n',
    )
    result = propagate(new, OLD, ["t"])
    assert dict(result.carried) == {"twice": "twice", "weight_norm": "_retrolog_weight_norm"}
    assert "return 2 * _retrolog_weight_norm(w)" in result.source
    assert [v for k, v in _run(result.source).items() if k.startswith("t@")] == [16.0, 32.0]


def test_an_import_today_adds_goes_in_and_a_missing_name_is_reported() -> None:
    new = _new("import math\n\n\ndef root(w):\n    return math.sqrt(float(w.sum()))", "")
    new = new.replace("    \n", '    rl.log("r", root(w))\n')
    result = propagate(new, OLD, ["r"])
    assert not result.problems, result.problems
    assert dict(result.carried) == {"math": "math", "root": "root"}
    assert "import math" in result.source
    needs_state = _new(
        "def scaled(w):\n    return float(w.sum()) * scaler", 'rl.log("s", scaled(w))'
    )
    refused = propagate(needs_state, OLD, ["s"])
    (problem,) = refused.problems
    assert "`scaler` (today's `scaled` reads it)" in problem.reason
    assert refused.source == OLD


def test_a_refused_statement_carries_none_of_todays_helpers() -> None:
    new = _new(
        "def grad_stat(w):\n    return float(np.abs(w).max())", 'rl.log("g", grad_stat(w) * scaler)'
    )
    refused = propagate(new, OLD, ["g"])
    (problem,) = refused.problems
    assert "the old version has no `scaler`" in problem.reason
    assert refused.carried == () and refused.source == OLD
