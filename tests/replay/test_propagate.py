"""Statement propagation: requested log statements land at the aligned place of an old version."""

from __future__ import annotations

import difflib
import re
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from retrolog._replay.propagate import (
    Propagation,
    find_log_statements,
    propagate,
)

# The run recorded weeks ago.
OLD = '''\
"""Train a small MLP on digits."""
import torch
import torch.nn.functional as F

import retrolog as rl
from data import make_loaders
from model import MLP, weight_norm

lr = rl.arg("lr", 0.01)
epochs = rl.arg("epochs", 5)
train_loader, test_loader = make_loaders(batch_size=64)
net = MLP(64, 10)
optimizer = torch.optim.SGD(net.parameters(), lr=lr)


def evaluate(model, loader):
    correct = total = 0
    with torch.no_grad():
        for x, y in loader:
            correct += (model(x).argmax(1) == y).sum().item()
            total += len(y)
    return correct / total


with rl.checkpointing(model=net, optimizer=optimizer):
    for epoch in rl.loop("epoch", range(epochs)):
        net.train()
        for x, y in rl.loop("step", train_loader):
            optimizer.zero_grad()
            loss = F.cross_entropy(net(x), y)
            loss.backward()
            optimizer.step()
            rl.log("loss", loss.item())
        rl.log("acc", evaluate(net, test_loader))
rl.log("test_acc", evaluate(net, test_loader))
'''

# Today's train.py: a scheduler, a larger batch, a print, no net.train(); plus {stmt}s.
NEW_TEMPLATE = '''\
"""Train a small MLP on digits."""
import torch
import torch.nn.functional as F

import retrolog as rl
from data import make_loaders
from model import MLP, weight_norm

lr = rl.arg("lr", 0.05)
epochs = rl.arg("epochs", 5)
train_loader, test_loader = make_loaders(batch_size=128)
net = MLP(64, 10)
optimizer = torch.optim.SGD(net.parameters(), lr=lr)
{prefix}scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1)


def evaluate(model, loader):
    correct = total = 0
    with torch.no_grad():
        for x, y in loader:
            correct += (model(x).argmax(1) == y).sum().item()
            total += len(y)
    return correct / total


with rl.checkpointing(model=net, optimizer=optimizer):
    for epoch in rl.loop("epoch", range(epochs)):
        for x, y in rl.loop("step", train_loader):
            optimizer.zero_grad()
            loss = F.cross_entropy(net(x), y)
            loss.backward()
            optimizer.step()
{step}            rl.log("loss", loss.item())
{epoch}        scheduler.step()
        rl.log("acc", evaluate(net, test_loader))
        print("epoch", epoch, "done")
rl.log("test_acc", evaluate(net, test_loader))
{suffix}'''


def new_version(**statements: str) -> str:
    """NEW_TEMPLATE with each given statement at its slot, indented for it."""
    indents = {"prefix": "", "step": " " * 12, "epoch": " " * 8, "suffix": ""}
    filled = {slot: "" for slot in indents}
    for slot, statement in statements.items():
        filled[slot] = indents[slot] + statement + "\n"
    return NEW_TEMPLATE.format(**filled)


def inserted_lines(old: str, result: Propagation) -> list[str]:
    """The lines propagation added; fails if it changed or removed anything else."""
    compile(result.source, "train.py", "exec")
    changes = [
        line
        for line in difflib.ndiff(old.splitlines(), result.source.splitlines())
        if line[:2] in ("+ ", "- ", "? ")
    ]
    assert all(line.startswith("+ ") for line in changes), changes
    return [line[2:] for line in changes]


def line_of(source: str, text: str) -> int:
    """1-based number of the only line of ``source`` that is ``text`` once stripped."""
    numbers = [i for i, line in enumerate(source.splitlines(), 1) if line.strip() == text]
    assert len(numbers) == 1, (text, numbers)
    return numbers[0]


def test_identical_files_keep_the_existing_statement() -> None:
    result = propagate(OLD, OLD, ["acc"])
    assert result.source == OLD
    assert result.problems == ()
    (placement,) = result.placements
    assert placement.line == line_of(OLD, 'rl.log("acc", evaluate(net, test_loader))')
    assert placement.statement == 'rl.log("acc", evaluate(net, test_loader))'


def test_old_plus_statement_gives_back_the_new_file() -> None:
    old_lines = OLD.splitlines(keepends=True)
    at = line_of(OLD, 'rl.log("acc", evaluate(net, test_loader))')
    new = "".join(
        [*old_lines[:at], '        rl.log("w_norm", weight_norm(net))\n', *old_lines[at:]]
    )
    result = propagate(new, OLD, ["w_norm"])
    assert result.source == new
    assert result.placements[0].line == at + 1


@pytest.mark.parametrize(
    ("slot", "statement", "after", "where"),
    [
        (
            "prefix",
            'rl.log("n_params", sum(p.numel() for p in net.parameters()))',
            "optimizer = torch.optim.SGD(net.parameters(), lr=lr)",
            "at module level",
        ),
        ("step", 'rl.log("grad_norm", weight_norm(net))', "optimizer.step()", 'in loop "step"'),
        (
            "epoch",
            'rl.log("w_norm", weight_norm(net))',
            'rl.log("loss", loss.item())',
            None,  # right after the step loop, so in the epoch loop's body
        ),
        (
            "suffix",
            'rl.log("final_w", weight_norm(net))',
            'rl.log("test_acc", evaluate(net, test_loader))',
            "at module level",
        ),
    ],
)
def test_statement_goes_after_its_aligned_neighbour(
    slot: str, statement: str, after: str, where: str | None
) -> None:
    result = propagate(new_version(**{slot: statement}), OLD, [statement.split('"')[1]])
    (added,) = inserted_lines(OLD, result)
    assert added.strip() == statement
    (placement,) = result.placements
    lines = result.source.splitlines()
    indent = {"prefix": 0, "step": 12, "epoch": 8, "suffix": 0}[slot]
    assert lines[placement.line - 1] == " " * indent + statement
    if slot == "epoch":  # the epoch body continues after the nested loop
        assert lines[placement.line] == '        rl.log("acc", evaluate(net, test_loader))'
        assert 'in loop "epoch"' in placement.anchor
    else:
        assert lines[placement.line - 2].strip() == after
        assert where is not None and placement.anchor.endswith(where)


def test_all_four_levels_at_once_keep_their_order() -> None:
    statements = {
        "prefix": 'rl.log("a", 1)',
        "step": 'rl.log("b", loss.item())',
        "epoch": 'rl.log("c", epoch)',
        "suffix": 'rl.log("d", 2)',
    }
    result = propagate(new_version(**statements), OLD, ["d", "c", "b", "a"])
    assert [line.strip() for line in inserted_lines(OLD, result)] == list(statements.values())
    assert [p.name for p in result.placements] == ["a", "b", "c", "d"]
    for placement in result.placements:
        assert result.source.splitlines()[placement.line - 1].strip() == placement.statement


def test_lines_added_and_removed_around_the_anchor_in_the_old_version() -> None:
    old = OLD.replace(
        "            optimizer.step()\n",
        "            torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)\n"
        "            optimizer.step()\n"
        "            if epoch == 0:\n"
        "                print('warm-up step')\n",
    ).replace("            optimizer.zero_grad()\n", "")
    new = new_version(step='rl.log("grad_norm", weight_norm(net))')
    result = propagate(new, old, ["grad_norm"])
    inserted_lines(old, result)
    lines = result.source.splitlines()
    at = result.placements[0].line
    assert lines[at - 2] == "            optimizer.step()"
    assert lines[at - 1] == '            rl.log("grad_norm", weight_norm(net))'
    assert lines[at] == "            if epoch == 0:"


def test_lines_added_and_removed_around_the_anchor_in_the_new_version() -> None:
    old_step = """\
            optimizer.zero_grad()
            loss = F.cross_entropy(net(x), y)
            loss.backward()
            optimizer.step()
"""
    new_step = """\
            x = x.float()
            loss = F.cross_entropy(net(x), y)
            loss.backward()
            optimizer.step()
            rl.log("grad_norm", weight_norm(net))
            optimizer.zero_grad(set_to_none=True)
            if epoch == 0:
                print("warm-up step")
"""
    new = OLD.replace(old_step, new_step)
    result = propagate(new, OLD, ["grad_norm"])
    inserted_lines(OLD, result)
    lines = result.source.splitlines()
    at = result.placements[0].line
    assert lines[at - 2] == "            optimizer.step()"
    assert lines[at] == '            rl.log("loss", loss.item())'


def test_train_step_extracted_into_a_function() -> None:
    new = OLD.replace(
        """with rl.checkpointing""",
        """def train_epoch(model, optimizer, loader):
    model.train()
    for x, y in rl.loop("step", loader):
        optimizer.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        rl.log("grad_norm", weight_norm(model))
        optimizer.step()
        rl.log("loss", loss.item())


with rl.checkpointing""",
    )
    start = new.index("        net.train()\n        for x, y")
    end = new.index('        rl.log("acc"')
    new = (
        new[:start]
        + "        train_epoch(net, optimizer, train_loader)\n"
        + '        rl.log("w_norm", weight_norm(net))\n'
        + new[end:]
    )
    result = propagate(new, OLD, ["grad_norm", "w_norm"])
    assert result.problems == ()
    added = inserted_lines(OLD, result)
    # Inside the function, ``model`` is the old file's ``net`` at the same places.
    assert added == [
        '            rl.log("grad_norm", weight_norm(net))',
        '        rl.log("w_norm", weight_norm(net))',
    ]
    lines = result.source.splitlines()
    grad, w_norm = result.placements
    assert lines[grad.line - 2] == "            loss.backward()"
    assert 'in loop "step"' in grad.anchor
    # After the call that stands for the old inline step loop: after that loop.
    assert lines[w_norm.line - 2] == '            rl.log("loss", loss.item())'
    assert lines[w_norm.line] == '        rl.log("acc", evaluate(net, test_loader))'


def test_reordered_loop_body() -> None:
    flatten, cast = "            x = x.view(len(x), -1)\n", "            y = y.long()\n"
    probe = '            rl.log("x_mean", x.mean().item())\n'
    zero_grad = "            optimizer.zero_grad()\n"
    old = OLD.replace(zero_grad, flatten + cast + zero_grad)
    new = old.replace(flatten + cast, cast + flatten + probe)
    result = propagate(new, old, ["x_mean"])
    inserted_lines(old, result)
    lines = result.source.splitlines()
    at = result.placements[0].line
    assert lines[at - 2] == "            x = x.view(len(x), -1)"
    assert lines[at] == "            y = y.long()"


def test_renamed_variable_is_mapped_back_to_the_old_name() -> None:
    new = OLD.replace("net", "model").replace(
        '        rl.log("acc"', '        rl.log("w_norm", weight_norm(model))\n        rl.log("acc"'
    )
    assert "net" not in new
    result = propagate(new, OLD, ["w_norm"])
    assert inserted_lines(OLD, result) == ['        rl.log("w_norm", weight_norm(net))']
    assert result.placements[0].statement == 'rl.log("w_norm", weight_norm(net))'


def test_aligned_but_distinct_variables_are_not_renamed() -> None:
    # ``ema = copy(net)`` aligns with the old ``best = copy(net)``, but the new file
    # still has ``best`` too: two variables, so ``ema`` is missing, not renamed.
    old = OLD.replace("optimizer = torch", "best = copy.deepcopy(net)\noptimizer = torch")
    new = old.replace("best = copy", "best = None\nema = copy").replace(
        '        rl.log("acc"', '        rl.log("ema_norm", weight_norm(ema))\n        rl.log("acc"'
    )
    result = propagate(new, old, ["ema_norm"])
    assert result.source == old
    assert "the old version has no `ema`" in result.problems[0].reason


def test_name_the_old_version_lacks_is_reported_not_guessed() -> None:
    new = new_version(step='rl.log("scale", scaler.get_scale())').replace(
        "scheduler = ", "scaler = torch.cuda.amp.GradScaler()\nscheduler = "
    )
    result = propagate(new, OLD, ["scale"])
    assert result.source == OLD
    assert result.placements == ()
    (problem,) = result.problems
    assert problem.name == "scale"
    assert "the old version has no `scaler`" in problem.reason
    assert "optimizer.step()" in problem.reason


def test_name_bound_only_later_in_the_old_version_is_reported() -> None:
    # The new version builds the loaders before the model and logs right after the model.
    new = OLD.replace("train_loader, test_loader = make_loaders(batch_size=64)\n", "").replace(
        "net = MLP(64, 10)\n",
        "train_loader, test_loader = make_loaders(batch_size=64)\n"
        "net = MLP(64, 10)\n"
        'rl.log("n_test", len(test_loader.dataset))\n',
    )
    old = OLD.replace("train_loader, test_loader = make_loaders(batch_size=64)\n", "").replace(
        "optimizer = torch.optim.SGD(net.parameters(), lr=lr)\n",
        "optimizer = torch.optim.SGD(net.parameters(), lr=lr)\n"
        "train_loader, test_loader = make_loaders(batch_size=64)\n",
    )
    result = propagate(new, old, ["n_test"])
    (problem,) = result.problems
    assert "binds `test_loader` only after that point" in problem.reason


def test_unknown_name_lists_the_logged_names() -> None:
    with pytest.raises(ValueError, match=r"logs no 'acc_val'.*acc, loss, test_acc.*'acc'"):
        propagate(OLD, OLD, ["acc_val"])


def test_find_log_statements_reports_names_lines_and_loops() -> None:
    found = find_log_statements(OLD)
    assert list(found) == ["loss", "acc", "test_acc"]
    assert found["loss"][0].loops == ("epoch", "step")
    assert found["acc"][0].loops == ("epoch",)
    assert found["test_acc"][0].loops == ()
    assert found["acc"][0].line == line_of(OLD, 'rl.log("acc", evaluate(net, test_loader))')
    assert list(find_log_statements(OLD, ["acc"])) == ["acc"]


def test_assignment_form_and_other_import_styles() -> None:
    old = OLD.replace(
        "import retrolog as rl\n", "from retrolog import log, loop\nimport retrolog\n"
    )
    old = old.replace("rl.loop", "loop").replace("rl.log", "log").replace("rl.", "retrolog.")
    new = new_version(epoch='w = rl.log("w_norm", weight_norm(net))')
    result = propagate(new, old, ["w_norm"])
    assert result.problems == ()
    # The old file reaches retrolog as ``retrolog``, not ``rl``.
    assert inserted_lines(old, result) == ['        w = retrolog.log("w_norm", weight_norm(net))']


def test_new_if_block_holding_only_requested_statements_is_copied_whole() -> None:
    new = new_version(
        step='if loss.item() > 5:\n                rl.log("spike", loss.item())\n'
        '                rl.log("spike_epoch", epoch)'
    )
    result = propagate(new, OLD, ["spike", "spike_epoch"])
    assert inserted_lines(OLD, result) == [
        "            if loss.item() > 5:",
        '                rl.log("spike", loss.item())',
        '                rl.log("spike_epoch", epoch)',
    ]
    lines = result.source.splitlines()
    assert [lines[p.line - 1].strip() for p in result.placements] == [
        'rl.log("spike", loss.item())',
        'rl.log("spike_epoch", epoch)',
    ]


def test_statement_in_a_block_the_old_version_lacks_is_reported() -> None:
    new = new_version(
        step="if loss.item() > 5:\n                print('spike')\n"
        '                rl.log("spike", loss.item())'
    )
    result = propagate(new, OLD, ["spike"])
    assert result.source == OLD
    assert "`if` block" in result.problems[0].reason
    assert "no counterpart in the old version" in result.problems[0].reason


def test_old_indentation_style_and_line_endings_are_kept() -> None:
    old = OLD.replace("    ", "\t").replace("\n", "\r\n")
    result = propagate(new_version(step='rl.log("g", weight_norm(net))'), old, ["g"])
    added = inserted_lines(old.replace("\r\n", "\n"), _normalised(result))
    assert added == ['\t\t\trl.log("g", weight_norm(net))']
    assert "\r\n\t\t\trl.log" in result.source and "\n\n" not in result.source.replace("\r", "")[:3]


def _normalised(result: Propagation) -> Propagation:
    return Propagation(result.source.replace("\r\n", "\n"), result.placements, result.problems)


def test_multi_line_statement_is_reindented_for_the_old_block() -> None:
    old = re.sub(r"(?m)^( +)", lambda m: " " * (len(m[1]) // 2), OLD)  # two-space indents
    statement = (
        'rl.log(\n                "grad_norm",\n                weight_norm(net),\n            )'
    )
    result = propagate(new_version(step=statement), old, ["grad_norm"])
    assert inserted_lines(old, result) == [
        "      rl.log(",
        '          "grad_norm",',
        "          weight_norm(net),",
        "      )",
    ]


def test_statement_shares_a_line_with_another_in_the_old_version() -> None:
    old = OLD.replace(
        "            optimizer.step()\n            rl.log",
        "            optimizer.step(); rl.log",
    )
    result = propagate(new_version(step='rl.log("g", 1.0)'), old, ["g"])
    compile(result.source, "train.py", "exec")
    assert '            optimizer.step(); rl.log("g", 1.0); rl.log("loss", loss.item())' in (
        result.source
    )
    assert result.source.splitlines()[result.placements[0].line - 1].lstrip().startswith("opt")


def test_diff_shows_only_the_inserted_line() -> None:
    result = propagate(new_version(suffix='rl.log("final", 1)'), OLD, ["final"])
    diff = result.diff(OLD, "train.py")
    assert diff.startswith("--- a/train.py\n+++ b/train.py\n")
    changed = [line for line in diff.splitlines()[2:] if line[:1] in "+-"]
    assert changed == ['+rl.log("final", 1)']


def test_old_version_that_does_not_parse_is_reported() -> None:
    result = propagate(new_version(suffix='rl.log("final", 1)'), "print 'python 2'\n", ["final"])
    assert result.source == "print 'python 2'\n"
    assert "does not parse" in result.problems[0].reason


def test_three_hundred_line_script_propagates_fast() -> None:
    new, old = _large_pair()
    assert 280 <= len(new.splitlines()) <= 340
    # CPU time, not wall time: on a busy machine this process waits for a core meanwhile.
    start = time.process_time()
    result = propagate(new, old, ["w_norm", "grad_norm"])
    elapsed = time.process_time() - start
    assert result.problems == ()
    assert len(inserted_lines(old, result)) == 2
    assert elapsed < 1.0, f"propagation took {elapsed:.3f} s"


def _large_pair() -> tuple[str, str]:
    """A ~300-line script (helpers, a long step body) and its older version."""
    helpers = "".join(
        f'''
def metric_{i}(model, batch):
    """Metric {i}."""
    total = 0.0
    for part in batch:
        total += float(part.sum()) * {i}
    return total / max(len(batch), 1)
'''
        for i in range(30)
    )
    body = "".join(f"            m{i} = metric_{i % 30}(net, (x, y))\n" for i in range(60))
    old = OLD.replace("\n\ndef evaluate", helpers + "\n\ndef evaluate").replace(
        "            optimizer.step()\n", "            optimizer.step()\n" + body
    )
    new = old.replace('lr = rl.arg("lr", 0.01)', 'lr = rl.arg("lr", 0.02)')
    new = (
        new.replace("m20 = metric_20", "m20 = 2 * metric_20")
        .replace("m41 = ", "m41b = ")
        .replace(
            "            m7 = metric_7(net, (x, y))\n",
            '            m7 = metric_7(net, (x, y))\n            rl.log("grad_norm", m7)\n',
        )
    )
    new = new.replace(
        '        rl.log("acc"', '        rl.log("w_norm", weight_norm(net))\n        rl.log("acc"'
    )
    return new, old


# --- Property: an inserted statement comes back right after the same statement ------------

HEADER = 'import retrolog as rl\n\nx = 0\nfor epoch in rl.loop("epoch", range(3)):\n'
PROBE = '    rl.log("probe", epoch)'
_targets = st.sampled_from(["a", "b", "x", "total"])
_values = st.sampled_from(["0", "1", "x + 1", "x * 2", "epoch", "len([x])", "x - epoch"])
_bodies = st.lists(
    st.tuples(_targets, _values).map(lambda tv: f"    {tv[0]} = {tv[1]}"), min_size=1, max_size=8
)


@settings(max_examples=150, deadline=None)
@given(_bodies, st.data())
def test_property_statement_returns_after_the_same_statement(
    body: list[str], data: st.DataObject
) -> None:
    position = data.draw(st.integers(0, len(body)), label="position")
    old = HEADER + "\n".join(body) + "\n"
    new = HEADER + "\n".join([*body[:position], PROBE, *body[position:]]) + "\n"
    result = propagate(new, old, ["probe"])
    compile(result.source, "train.py", "exec")
    assert result.source == new
    assert result.placements[0].line == len(HEADER.splitlines()) + position + 1


@settings(max_examples=150, deadline=None)
@given(_bodies.filter(lambda b: len(b) >= 2), st.data())
def test_property_unrelated_deletion_does_not_move_the_statement(
    body: list[str], data: st.DataObject
) -> None:
    position = data.draw(st.integers(1, len(body)), label="position")
    deleted = data.draw(
        st.integers(0, len(body) - 1).filter(lambda i: i != position - 1), label="deleted"
    )
    old = HEADER + "\n".join(body[:deleted] + body[deleted + 1 :]) + "\n"
    new = HEADER + "\n".join([*body[:position], PROBE, *body[position:]]) + "\n"
    result = propagate(new, old, ["probe"])
    compile(result.source, "train.py", "exec")
    lines = result.source.splitlines()
    at = result.placements[0].line
    assert lines[at - 1] == PROBE
    assert lines[at - 2] == body[position - 1]


def test_consecutive_statements_in_one_block_keep_their_order() -> None:
    new = new_version(step='rl.log("g1", 1.0)\n            rl.log("g2", 2.0)')
    result = propagate(new, OLD, ["g1", "g2"])
    assert inserted_lines(OLD, result) == [
        '            rl.log("g1", 1.0)',
        '            rl.log("g2", 2.0)',
    ]
    lines = result.source.splitlines()
    assert lines[result.placements[0].line - 2].strip() == "optimizer.step()"
    assert result.placements[1].line == result.placements[0].line + 1
