"""Lineage keys: what defines a logged value, and what does not change it."""

from __future__ import annotations

import textwrap

from hypothesis import given, settings
from hypothesis import strategies as st

from retrolog.versions.definitions import definitions

SCRIPT = textwrap.dedent(
    '''
    import torch

    import retrolog as rl
    from metrics import accuracy

    SCALE = 2.0


    def weight_norm(model):
        """The L2 norm of all parameters."""
        return sum(p.norm().item() ** 2 for p in model.parameters()) ** 0.5 * SCALE


    def main():
        net = torch.nn.Linear(4, 2)
        for epoch in rl.loop("epoch", range(3)):
            rl.log("w_norm", weight_norm(net))  # per epoch
            rl.log("acc", accuracy(net))
            rl.log("lr", 0.1)


    main()
    '''
)
METRICS = textwrap.dedent(
    """
    import torch


    def accuracy(model):
        return float((model.weight > 0).float().mean())
    """
)


def _keys(source: str, **files: str) -> dict[str, str]:
    found = definitions(source, read=lambda path: files.get(path.replace("/", "_")))
    return {name: d.key for name, d in found.items()}


def test_the_definition_holds_the_statement_and_what_it_calls() -> None:
    found = definitions(SCRIPT, read={"metrics.py": METRICS}.get)
    w_norm = found["w_norm"]
    assert w_norm.dependencies == ("weight_norm", "SCALE")
    assert w_norm.text.splitlines()[0] == "log('w_norm', weight_norm(net))"
    assert "The L2 norm" not in w_norm.text  # docstrings do not define anything
    line = SCRIPT.splitlines().index('        rl.log("w_norm", weight_norm(net))  # per epoch') + 1
    assert w_norm.coarse is None and w_norm.lines == (line,)
    acc = found["acc"]
    assert acc.dependencies == ("metrics.py:accuracy",)
    assert "(model.weight > 0)" in acc.text
    assert found["lr"].dependencies == ()


def test_formatting_comments_spelling_and_place_do_not_change_a_key() -> None:
    base = _keys(SCRIPT, **{"metrics.py": METRICS})
    reformatted = SCRIPT.replace(
        'rl.log("w_norm", weight_norm(net))  # per epoch',
        "rl.log(\n                'w_norm',\n                weight_norm( net ),\n            )",
    ).replace('"""The L2 norm of all parameters."""', '"""Another docstring."""\n    # a comment')
    assert _keys(reformatted, **{"metrics.py": METRICS}) == base
    spelled = SCRIPT.replace(
        "import retrolog as rl", "import retrolog as rl\nfrom retrolog import log"
    )
    spelled = spelled.replace('rl.log("w_norm"', 'log("w_norm"')
    assert _keys(spelled, **{"metrics.py": METRICS})["w_norm"] == base["w_norm"]
    # Moved out of main() to module level, the same expression: the same key.
    statement = '        rl.log("w_norm", weight_norm(net))  # per epoch\n'
    assert statement in SCRIPT
    moved = SCRIPT.replace(statement, "").replace(
        "\nmain()\n", '\nmain()\nnet = torch.nn.Linear(4, 2)\nrl.log("w_norm", weight_norm(net))\n'
    )
    assert moved.count('rl.log("w_norm"') == 1
    assert _keys(moved, **{"metrics.py": METRICS})["w_norm"] == base["w_norm"]


def test_changing_the_expression_a_helper_or_a_constant_changes_the_key() -> None:
    base = _keys(SCRIPT, **{"metrics.py": METRICS})
    l1 = SCRIPT.replace("p.norm().item() ** 2", "p.abs().sum().item() ** 2")
    assert _keys(l1, **{"metrics.py": METRICS})["w_norm"] != base["w_norm"]
    assert _keys(l1, **{"metrics.py": METRICS})["acc"] == base["acc"]
    scaled = SCRIPT.replace("SCALE = 2.0", "SCALE = 3.0")
    assert _keys(scaled, **{"metrics.py": METRICS})["w_norm"] != base["w_norm"]
    other = METRICS.replace("> 0", ">= 0")
    changed = _keys(SCRIPT, **{"metrics.py": other})
    assert changed["acc"] != base["acc"] and changed["w_norm"] == base["w_norm"]
    statement = SCRIPT.replace('rl.log("lr", 0.1)', 'rl.log("lr", 0.2)')
    assert _keys(statement, **{"metrics.py": METRICS})["lr"] != base["lr"]


def test_a_renamed_variable_keeps_its_key_when_the_rename_is_known() -> None:
    renamed = SCRIPT.replace("net", "model")
    base = definitions(SCRIPT, read={"metrics.py": METRICS}.get)["w_norm"].key
    assert definitions(renamed, read={"metrics.py": METRICS}.get)["w_norm"].key != base
    mapped = definitions(renamed, read={"metrics.py": METRICS}.get, rename={"model": "net"})
    assert mapped["w_norm"].key == base


def test_what_cannot_be_resolved_gets_a_coarse_key_that_says_why() -> None:
    computed = SCRIPT.replace('rl.log("lr", 0.1)', 'rl.log(f"lr_{epoch}", 0.1)')
    found = definitions(computed, ["lr"])
    assert found["lr"].coarse is not None and "computes" in found["lr"].coarse
    starred = SCRIPT.replace("from metrics import accuracy", "from metrics import *")
    unreadable = definitions(starred, ["acc"])["acc"]
    assert unreadable.coarse is not None and "import *" in unreadable.coarse
    readable = definitions(starred, ["acc"], read={"metrics.py": METRICS}.get)["acc"]
    assert readable.coarse is None and readable.dependencies == ("metrics.py:accuracy",)
    # A coarse key still changes with the file.
    assert definitions(starred + "\n# x\nX = 1\n", ["acc"])["acc"].key != unreadable.key


@settings(max_examples=30, deadline=None)
@given(st.sampled_from(["  ", "\t", "    "]), st.booleans())
def test_whitespace_and_comments_never_change_a_key(indent: str, comment: bool) -> None:
    source = (
        "import retrolog as rl\n"
        "def f(x):\n"
        f"{indent}return x * 2{'  # twice' if comment else ''}\n"
        "for i in rl.loop('i', range(2)):\n"
        f"{indent}rl.log('y', f(i)){'  # logged' if comment else ''}\n"
    )
    assert (
        definitions(source)["y"].key
        == definitions(
            "import retrolog as rl\ndef f(x):\n    return x * 2\n"
            "for i in rl.loop('i', range(2)):\n    rl.log('y', f(i))\n"
        )["y"].key
    )
