"""Propagation across the kinds of rewrite real training-script histories make.

Each case is a pair: an old version as history has it (from before retrolog was adopted,
so without ``rl.loop`` and without the import) and today's version with the user's log
statements. The cases are modelled on what public example scripts did over the years:
the epoch loop moved from module level into ``def main()``, ``train()`` taking its state
as arguments instead of globals, loops wrapped in ``enumerate``/``zip``/``tqdm``, loop
variables renamed, a function extracted or inlined, methods of a class, code moved under
``if __name__ == "__main__":``. Each asserts the whole propagated file.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass, replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from retrolog._replay.propagate import Propagation, propagate


def expected(old: str, *insertions: tuple[str, str], imported_after: str = "") -> str:
    """``old`` with each ``(anchor line, new line)`` inserted after the anchor line.

    The anchor is a whole line of ``old`` (indentation included) that occurs once. With
    ``imported_after``, ``import retrolog as rl`` goes after that line too.
    """
    lines = old.splitlines(keepends=True)
    after: dict[int, list[str]] = {}
    pairs = [(imported_after, "import retrolog as rl")] if imported_after else []
    for anchor, text in [*pairs, *insertions]:
        found = [i for i, line in enumerate(lines) if line.rstrip("\n") == anchor]
        assert len(found) == 1, (anchor, found)
        after.setdefault(found[0], []).append(text + "\n")
    out = []
    for index, line in enumerate(lines):
        out.append(line)
        out.extend(after.get(index, []))
    return "".join(out)


def placed_line(result: Propagation, name: str) -> int:
    return next(p.line for p in result.placements if p.name == name)


def check(result: Propagation, want: str, lines: dict[str, str]) -> None:
    """The propagated file is ``want``, and each name sits on the line holding its text."""
    assert result.problems == (), result.problems
    assert result.source == want
    ast.parse(result.source)
    got = result.source.splitlines()
    for name, text in lines.items():
        assert got[placed_line(result, name) - 1] == text, (name, got)


# --- The epoch loop moved into main(); train() takes its state as arguments -----------------

MODULE_LEVEL = """\
from __future__ import print_function
import argparse
import torch
import torch.nn.functional as F

parser = argparse.ArgumentParser()
parser.add_argument('--epochs', type=int, default=10)
parser.add_argument('--lr', type=float, default=0.01)
args = parser.parse_args()

model = Net()
optimizer = torch.optim.SGD(model.parameters(), lr=args.lr)


def train(epoch):
    model.train()
    for batch_idx, (data, target) in enumerate(train_loader):
        optimizer.zero_grad()
        output = model(data)
        loss = F.nll_loss(output, target)
        loss.backward()
        optimizer.step()
        if batch_idx % 10 == 0:
            print(epoch, batch_idx, loss.item())


def test(epoch):
    model.eval()
    for data, target in test_loader:
        output = model(data)


for epoch in range(1, args.epochs + 1):
    train(epoch)
    test(epoch)
"""

IN_MAIN = """\
import argparse
import torch
import torch.nn.functional as F
from torch.optim.lr_scheduler import StepLR

import retrolog as rl


def train(args, model, device, train_loader, optimizer, epoch):
    model.train()
    for batch_idx, (data, target) in enumerate(rl.loop("step", train_loader)):
        data, target = data.to(device), target.to(device)
        optimizer.zero_grad()
        output = model(data)
        loss = F.nll_loss(output, target)
        loss.backward()
        optimizer.step()
        rl.log("loss", loss.item())
        if batch_idx % args.log_interval == 0:
            print(epoch, batch_idx, loss.item())
        if args.dry_run:
            break


def test(model, device, test_loader):
    model.eval()
    with torch.no_grad():
        for data, target in test_loader:
            data, target = data.to(device), target.to(device)
            output = model(data)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument('--lr', type=float, default=1.0)
    parser.add_argument('--epochs', type=int, default=14)
    parser.add_argument('--dry-run', action='store_true')
    args = parser.parse_args()
    device = torch.device("cpu")
    model = Net().to(device)
    optimizer = torch.optim.Adadelta(model.parameters(), lr=args.lr)
    scheduler = StepLR(optimizer, step_size=1)
    for epoch in rl.loop("epoch", range(1, args.epochs + 1)):
        train(args, model, device, train_loader, optimizer, epoch)
        test(model, device, test_loader)
        rl.log("w_norm", sum(p.norm().item() for p in model.parameters()))
        scheduler.step()


if __name__ == '__main__':
    main()
"""

W_NORM = 'rl.log("w_norm", sum(p.norm().item() for p in model.parameters()))'


def test_epoch_loop_moved_into_main_and_train_signature_changed() -> None:
    result = propagate(IN_MAIN, MODULE_LEVEL, ["loss", "w_norm"])
    want = expected(
        MODULE_LEVEL,
        ("        optimizer.step()", '        rl.log("loss", loss.item())'),
        ("    test(epoch)", f"    {W_NORM}"),
        imported_after="import torch.nn.functional as F",
    )
    check(result, want, {"loss": '        rl.log("loss", loss.item())', "w_norm": f"    {W_NORM}"})
    assert result.added_import is not None and result.added_import.line == 5


def test_epoch_loop_moved_out_of_main_the_other_way() -> None:
    # Today's file is the old layout (module level, globals), the run's is the newer one.
    new = expected(
        MODULE_LEVEL,
        ("        optimizer.step()", '        rl.log("loss", loss.item())'),
        ("    test(epoch)", f"    {W_NORM}"),
        imported_after="import torch.nn.functional as F",
    )
    new = new.replace("in enumerate(train_loader)", 'in enumerate(rl.loop("step", train_loader))')
    new = new.replace(
        "in range(1, args.epochs + 1)", 'in rl.loop("epoch", range(1, args.epochs + 1))'
    )
    old = IN_MAIN.replace('rl.loop("step", train_loader)', "train_loader")
    old = old.replace('rl.loop("epoch", range(1, args.epochs + 1))', "range(1, args.epochs + 1)")
    old = old.replace('        rl.log("loss", loss.item())\n', "").replace(
        f"        {W_NORM}\n", ""
    )
    old = old.replace("\nimport retrolog as rl\n", "\n")
    result = propagate(new, old, ["loss", "w_norm"])
    want = expected(
        old,
        ("        optimizer.step()", '        rl.log("loss", loss.item())'),
        ("        test(model, device, test_loader)", f"        {W_NORM}"),
        imported_after="from torch.optim.lr_scheduler import StepLR",
    )
    check(result, want, {"w_norm": f"        {W_NORM}"})


def test_epoch_loop_moved_under_a_main_guard() -> None:
    new = MODULE_LEVEL.replace(
        "for epoch in range(1, args.epochs + 1):\n    train(epoch)\n    test(epoch)\n",
        'if __name__ == "__main__":\n'
        '    for epoch in rl.loop("epoch", range(1, args.epochs + 1)):\n'
        "        train(epoch)\n"
        "        test(epoch)\n"
        f"        {W_NORM}\n",
    ).replace("import torch\n", "import torch\nimport retrolog as rl\n")
    result = propagate(new, MODULE_LEVEL, ["w_norm"])
    want = expected(
        MODULE_LEVEL,
        ("    test(epoch)", f"    {W_NORM}"),
        imported_after="import torch.nn.functional as F",
    )
    check(result, want, {"w_norm": f"    {W_NORM}"})


# --- Loop headers: wrappers added or removed, loop variables renamed ------------------------

LOADER_LOOP = """\
import torch
import torch.nn.functional as F

import retrolog as rl


def train(args, model, device, loader, optimizer):
    model.train()
    for {target} in {iterable}:
        data, target = data.to(device), target.to(device)
        optimizer.zero_grad()
        output = model(data)
        loss = F.cross_entropy(output, target, label_smoothing=0.1)
        loss.backward()
        optimizer.step()
        rl.log("loss", loss.item())
        if args.dry_run:
            break


model = Net().to(device)
optimizer = torch.optim.Adam(model.parameters())
for epoch in rl.loop("epoch", range(args.epochs)):
    train(args, model, device, loader, optimizer)
    scheduler.step()
"""

# The same loop years earlier, inline in the epoch loop: Variables, another loss function,
# a progress print. Too little of the body is kept for GumTree's bottom-up phase alone.
OLD_LOADER_LOOP = """\
import torch
import torch.nn.functional as F

model = Net()
optimizer = torch.optim.Adam(model.parameters())
for epoch in range(args.epochs):
    for {target} in {iterable}:
        data, target = Variable(data), Variable(target)
        optimizer.zero_grad()
        output = model(data)
        loss = F.nll_loss(output, target)
        loss.backward()
        optimizer.step()
        if batch_idx % args.log_interval == 0:
            print("Train Epoch: {{}} Loss: {{:.6f}}".format(epoch, loss.data[0]))
"""
STEP_LOG = '        rl.log("loss", loss.item())'


def loader_pair(new_header: tuple[str, str], old_header: tuple[str, str]) -> tuple[str, str]:
    new = LOADER_LOOP.format(target=new_header[0], iterable=new_header[1])
    return new, OLD_LOADER_LOOP.format(target=old_header[0], iterable=old_header[1])


@pytest.mark.parametrize(
    ("new_header", "old_header"),
    [
        # enumerate added around rl.loop, and the loop variables renamed
        (("i, (data, target)", 'enumerate(rl.loop("step", loader))'), ("batch", "loader")),
        # rl.loop around enumerate; the old enumerate had other names
        (
            ("step, (data, target)", 'rl.loop("step", enumerate(loader, 1))'),
            ("batch_idx, (data, target)", "enumerate(loader)"),
        ),
        # zip added
        (
            ("(data, target), w", 'rl.loop("step", zip(loader, weights))'),
            ("data, target", "loader"),
        ),
        # tqdm removed: the old version had a progress bar
        (("data, target", 'rl.loop("step", loader)'), ("data, target", "tqdm.tqdm(loader)")),
        # tqdm imported by name, and iter() around the loader
        (("data, target", 'rl.loop("step", tqdm(loader))'), ("data, target", "iter(loader)")),
    ],
)
def test_loop_header_wrappers_and_renamed_variables(
    new_header: tuple[str, str], old_header: tuple[str, str]
) -> None:
    new, old = loader_pair(new_header, old_header)
    result = propagate(new, old, ["loss"])
    want = expected(
        old,
        ("        optimizer.step()", STEP_LOG),
        imported_after="import torch.nn.functional as F",
    )
    check(result, want, {"loss": STEP_LOG})


def test_wrapper_that_reorders_is_another_loop_paired_by_its_body() -> None:
    # ``reversed`` is not a wrapper: the header says nothing, but the kept statements of
    # the body all lie in the one old loop, and its kept statements in the new one.
    new, old = loader_pair(("data, target", 'rl.loop("step", loader)'), ("x", "reversed(loader)"))
    result = propagate(new, old, ["loss"])
    want = expected(
        old,
        ("        optimizer.step()", STEP_LOG),
        imported_after="import torch.nn.functional as F",
    )
    check(result, want, {"loss": STEP_LOG})


# --- Code wrapped in a new block; a call whose result is now kept ---------------------------

MANUAL_UPDATE = """\
import torch


def train():
    model.train()
    for batch, i in enumerate(range(0, n - 1, bptt)):
        data, targets = get_batch(train_data, i)
        model.zero_grad()
        output = model(data)
        loss = criterion(output, targets)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        for p in model.parameters():
            p.data.add_(p.grad, alpha=-lr)
        total_loss += loss.item()


for epoch in range(1, epochs + 1):
    train()
    val_loss = evaluate(val_data)
"""


def test_statement_after_a_new_block_wrapping_the_old_code() -> None:
    new = (
        MANUAL_UPDATE.replace(
            "        for p in model.parameters():\n            p.data.add_(p.grad, alpha=-lr)\n",
            "        if use_optimizer:\n"
            "            optimizer.step()\n"
            "        else:\n"
            "            for p in model.parameters():\n"
            "                p.data.add_(p.grad, alpha=-lr)\n"
            '        rl.log("loss", loss.item())\n',
        )
        .replace("import torch\n", "import torch\nimport retrolog as rl\n")
        .replace("in enumerate(range(", 'in rl.loop("step", enumerate(range(')
        .replace("bptt)):", "bptt))):")
    )
    result = propagate(new, MANUAL_UPDATE, ["loss"])
    want = expected(
        MANUAL_UPDATE,
        ("            p.data.add_(p.grad, alpha=-lr)", '        rl.log("loss", loss.item())'),
        imported_after="import torch",
    )
    check(result, want, {"loss": '        rl.log("loss", loss.item())'})


def test_a_call_whose_result_is_kept_in_the_old_version() -> None:
    # The first versions stepped the optimizer with a closure computing the loss.
    new = LOADER_LOOP.format(target="data, target", iterable='rl.loop("step", loader)')
    old = """\
import torch


def train(epoch):
    for i in range(0, training_data.size(0), BATCH_SIZE):
        batch_data.data[:] = training_data[i : i + BATCH_SIZE]
        loss = optimizer.step(lambda: criterion(model(batch_data), batch_targets))
        loss = loss.data[0]
        print("Epoch: {} Loss: {:.4f}".format(epoch, loss))


for epoch in range(1, NUM_EPOCHS + 1):
    train(epoch)
"""
    result = propagate(new, old, ["loss"])
    want = expected(
        old,
        (
            "        loss = optimizer.step(lambda: criterion(model(batch_data), batch_targets))",
            STEP_LOG,
        ),
        imported_after="import torch",
    )
    check(result, want, {"loss": STEP_LOG})


# --- Functions extracted, inlined, and turned into methods ----------------------------------

INLINE = """\
import torch

model = Net()
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for epoch in range(5):
    for x, y in loader:
        opt.zero_grad()
        loss = criterion(model(x), y)
        loss.backward()
        opt.step()
    acc = evaluate(model)
    print(epoch, acc)
"""


def test_step_loop_inlined_today_was_a_function_in_the_old_version() -> None:
    old = """\
import torch


def train_epoch(model, opt, loader):
    for x, y in loader:
        opt.zero_grad()
        loss = criterion(model(x), y)
        loss.backward()
        opt.step()


model = Net()
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for epoch in range(5):
    train_epoch(model, opt, loader)
    acc = evaluate(model)
    print(epoch, acc)
"""
    new = (
        INLINE.replace("for x, y in loader:", 'for x, y in rl.loop("step", loader):')
        .replace("for epoch in range(5):", 'for epoch in rl.loop("epoch", range(5)):')
        .replace(
            "        opt.step()\n", '        opt.step()\n        rl.log("loss", loss.item())\n'
        )
        .replace(
            "    acc = evaluate(model)\n", '    acc = evaluate(model)\n    rl.log("acc", acc)\n'
        )
        .replace("import torch\n", "import torch\nimport retrolog as rl\n")
    )
    result = propagate(new, old, ["loss", "acc"])
    want = expected(
        old,
        ("        opt.step()", '        rl.log("loss", loss.item())'),
        ("    acc = evaluate(model)", '    rl.log("acc", acc)'),
        imported_after="import torch",
    )
    check(result, want, {"loss": '        rl.log("loss", loss.item())'})


def test_functions_became_methods_of_a_trainer_class() -> None:
    new = """\
import torch
import retrolog as rl


class Trainer:
    def __init__(self, model, loader):
        self.model = model
        self.loader = loader
        self.opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def train_epoch(self):
        for x, y in rl.loop("step", self.loader):
            self.opt.zero_grad()
            loss = criterion(self.model(x), y)
            loss.backward()
            self.opt.step()
            rl.log("loss", loss.item())

    def fit(self, epochs):
        for epoch in rl.loop("epoch", range(epochs)):
            self.train_epoch()
            acc = evaluate(self.model)
            rl.log("acc", acc)
            print(epoch, acc)


Trainer(Net(), loader).fit(5)
"""
    result = propagate(new, INLINE, ["loss", "acc"])
    want = expected(
        INLINE,
        ("        opt.step()", '        rl.log("loss", loss.item())'),
        ("    acc = evaluate(model)", '    rl.log("acc", acc)'),
        imported_after="import torch",
    )
    check(
        result,
        want,
        {"loss": '        rl.log("loss", loss.item())', "acc": '    rl.log("acc", acc)'},
    )


# --- The prefix: argparse blocks reshuffled --------------------------------------------------


def test_argparse_block_reshuffled() -> None:
    old = """\
import argparse
parser = argparse.ArgumentParser(description='PyTorch MNIST Example')
parser.add_argument('--batch-size', type=int, default=64)
parser.add_argument('--epochs', type=int, default=10)
parser.add_argument('--lr', type=float, default=0.01)
parser.add_argument('--no-cuda', action='store_true', default=False)
parser.add_argument('--seed', type=int, default=1)
args = parser.parse_args()
torch.manual_seed(args.seed)
"""
    new = """\
import argparse
import retrolog as rl
parser = argparse.ArgumentParser(description='PyTorch MNIST Example')
parser.add_argument('--seed', type=int, default=1)
parser.add_argument('--batch-size', type=int, default=64)
parser.add_argument('--lr', type=float, default=1.0)
parser.add_argument('--epochs', type=int, default=14)
parser.add_argument('--dry-run', action='store_true')
args = parser.parse_args()
rl.log("batch_size", args.batch_size)
torch.manual_seed(args.seed)
"""
    result = propagate(new, old, ["batch_size"])
    want = expected(
        old,
        ("args = parser.parse_args()", 'rl.log("batch_size", args.batch_size)'),
        imported_after="import argparse",
    )
    check(result, want, {"batch_size": 'rl.log("batch_size", args.batch_size)'})


# --- What must be refused ---------------------------------------------------------------------


def test_statement_in_a_loop_the_old_version_does_not_have() -> None:
    # Gradient accumulation is new: the micro-batch loop has no counterpart.
    new, old = loader_pair(("data, target", 'rl.loop("step", loader)'), ("data, target", "loader"))
    new = new.replace(
        "        loss = F.cross_entropy(output, target, label_smoothing=0.1)\n"
        "        loss.backward()\n",
        "        for part in output.chunk(4):\n"
        "            loss = F.cross_entropy(part, target)\n"
        "            loss.backward()\n"
        '            rl.log("micro_loss", loss.item())\n',
    )
    result = propagate(new, old, ["micro_loss"])
    assert result.source == old
    assert result.added_import is None
    (problem,) = result.problems
    assert problem.reason == (
        '`rl.log("micro_loss", loss.item())` (line 16 of the new version): it sits in the '
        "`for` loop at line 13 of the new version, which has no counterpart in the old version"
    )


def test_token_level_while_loop_is_not_the_batch_loop() -> None:
    # The oldest language models stepped every bptt tokens inside a ``while`` over tokens:
    # after the update there means once per token, not once per step. Refused.
    new = MANUAL_UPDATE.replace(
        "            p.data.add_(p.grad, alpha=-lr)\n",
        '            p.data.add_(p.grad, alpha=-lr)\n        rl.log("loss", loss.item())\n',
    ).replace(
        "in enumerate(range(0, n - 1, bptt))",
        'in rl.loop("step", enumerate(range(0, n - 1, bptt)))',
    )
    new = "import retrolog as rl\n" + new
    old = """\
import torch

for epoch in range(1, epochs + 1):
    i = 0
    while i < n - 1:
        output = model(data[i])
        loss += criterion(output, data[i + 1])
        i += 1
        if i % bptt == 0:
            loss.backward()
            for p in model.parameters():
                p.data.add_(p.grad, alpha=-lr)
            loss = 0
    val_loss = evaluate(val_data)
"""
    result = propagate(new, old, ["loss"])
    assert result.source == old
    assert "has no counterpart in the old version" in result.problems[0].reason


def test_evaluation_result_the_old_version_never_computes() -> None:
    new = INLINE.replace(
        "    print(epoch, acc)\n",
        '    f1 = f1_score(model)\n    rl.log("f1", f1)\n    print(epoch, acc)\n',
    )
    new = "import retrolog as rl\n" + new
    result = propagate(new, INLINE, ["f1"])
    assert result.source == INLINE
    (problem,) = result.problems
    assert problem.reason.startswith('`rl.log("f1", f1)` (line 14 of the new version): ')
    assert "the old version has no `f1`" in problem.reason


def test_loop_header_repeated_in_a_new_function_is_not_guessed() -> None:
    # Today's file also loops over ``loader`` in a new calibrate(); the old version has only
    # the training loop. The statement in calibrate's loop has nowhere to go.
    new = """\
import retrolog as rl


def train():
    for x in loader:
        step(x)


def calibrate():
    for x in loader:
        stats = measure(x)
        rl.log("calib", stats)


train()
calibrate()
"""
    old = "def train():\n    for x in loader:\n        step(x)\n\n\ntrain()\n"
    result = propagate(new, old, ["calib"])
    assert result.source == old
    assert "no counterpart in the old version" in result.problems[0].reason


def test_rewritten_neighbours_are_not_guessed_at() -> None:
    # The loop pairs by its header, but everything before the statement was rewritten:
    # the start of the old loop would be a guess.
    new = 'import retrolog as rl\nfor x in rl.loop("step", loader):\n    y = f(x)\n    z = g(y)\n'
    new += '    rl.log("z", z)\n'
    old = "for x in loader:\n    a = h(x)\n    b = k(a)\n"
    result = propagate(new, old, ["z"])
    assert result.source == old
    assert "none of the statements around it" in result.problems[0].reason


# --- Properties: a statement comes back to its place through moves and adoption --------------

STEP_STATEMENTS = [
    "x = x.to(device)",
    "optimizer.zero_grad()",
    "out = model(x)",
    "loss = criterion(out, y)",
    "loss.backward()",
    "optimizer.step()",
    "total += loss.item()",
    "seen += 1",
    "print(seen, total)",
]
EPOCH_STATEMENTS = [
    "model.train()",
    "total = 0.0",
    "seen = 0",
    "acc = evaluate(model)",
    "scheduler.step()",
    "print(epoch, acc)",
    "torch.save(model.state_dict(), path)",
]
# (loop variables, the iterable with LOADER where the loader goes)
WRAPPERS = [
    ("x, y", "LOADER"),
    ("i, (x, y)", "enumerate(LOADER)"),
    ("x, y", "tqdm(LOADER)"),
    ("(x, y), w", "zip(LOADER, weights)"),
]
PROBE = 'rl.log("probe", 0.5)'


@dataclass(frozen=True)
class Script:
    """A training script's shape, rendered before and after retrolog was adopted."""

    layout: str  # "module", "main" (loops in def main()) or "guard" (under __name__)
    extracted: bool  # the step loop in def train(...), called from the epoch loop
    wrapper: int  # index into WRAPPERS
    loop_inside: bool  # rl.loop inside the wrapper (enumerate(rl.loop(...))) or around it
    step: tuple[str, ...]
    before: tuple[str, ...]  # epoch body before the training
    after: tuple[str, ...]  # epoch body after it
    probe_in_step: bool
    probe_at: int

    def render(self, wrapped: bool, imported: bool, probe: bool) -> str:
        target, iterable = WRAPPERS[self.wrapper]
        if not wrapped:
            step_iter = iterable.replace("LOADER", "loader")
        elif self.loop_inside:
            step_iter = iterable.replace("LOADER", 'rl.loop("step", loader)')
        else:
            step_iter = 'rl.loop("step", {})'.format(iterable.replace("LOADER", "loader"))
        epoch_iter = 'rl.loop("epoch", range(epochs))' if wrapped else "range(epochs)"
        step = list(self.step)
        epoch = [*self.before, "TRAIN", *self.after]
        if probe:
            (step if self.probe_in_step else epoch).insert(self.probe_at, PROBE)
        step_loop = [f"for {target} in {step_iter}:", *("    " + s for s in step)]
        lines = ["import torch", *(["import retrolog as rl"] if imported else []), ""]
        if self.extracted:
            lines += ["def train(model, loader, optimizer):", *("    " + s for s in step_loop)]
            lines += [""]
        body = ["model = Net()", f"for epoch in {epoch_iter}:"]
        for statement in epoch:
            if statement != "TRAIN":
                body.append("    " + statement)
            elif self.extracted:
                body.append("    train(model, loader, optimizer)")
            else:
                body += ["    " + s for s in step_loop]
        if self.layout == "module":
            lines += body
        elif self.layout == "main":
            lines += ["def main():", *("    " + s for s in body), "", "main()"]
        else:
            lines += ['if __name__ == "__main__":', *("    " + s for s in body)]
        return "\n".join(lines) + "\n"


@st.composite
def scripts(draw: st.DrawFn) -> Script:
    step = draw(st.lists(st.sampled_from(STEP_STATEMENTS), min_size=1, max_size=6))
    before = draw(st.lists(st.sampled_from(EPOCH_STATEMENTS), max_size=3))
    after = draw(st.lists(st.sampled_from(EPOCH_STATEMENTS), max_size=3))
    in_step = draw(st.booleans())
    top = len(step) if in_step else len(before) + 1 + len(after)
    return Script(
        layout=draw(st.sampled_from(["module", "main", "guard"])),
        extracted=draw(st.booleans()),
        wrapper=draw(st.integers(0, len(WRAPPERS) - 1)),
        loop_inside=draw(st.booleans()),
        step=tuple(step),
        before=tuple(before),
        after=tuple(after),
        probe_in_step=in_step,
        probe_at=draw(st.integers(0, top)),
    )


@settings(max_examples=200, deadline=None)
@given(scripts())
def test_property_new_file_minus_the_statement_gives_back_the_new_file(script: Script) -> None:
    new = script.render(wrapped=True, imported=True, probe=True)
    old = script.render(wrapped=True, imported=True, probe=False)
    result = propagate(new, old, ["probe"])
    assert result.problems == ()
    assert result.source == new


@settings(max_examples=200, deadline=None)
@given(scripts(), st.data())
def test_property_statement_reaches_a_moved_version_from_before_adoption(
    script: Script, data: st.DataObject
) -> None:
    # The old version has neither the import nor rl.loop, and its loops sit elsewhere (module
    # level, main(), a __main__ guard; inline or in train()) behind other wrappers: the
    # statement lands where it is today, the import is added, nothing else changes.
    old_shape = replace(
        script,
        layout=data.draw(st.sampled_from(["module", "main", "guard"]), label="old layout"),
        extracted=data.draw(st.booleans(), label="old extracted"),
        wrapper=data.draw(st.integers(0, len(WRAPPERS) - 1), label="old wrapper"),
    )
    new = script.render(wrapped=True, imported=True, probe=True)
    old = old_shape.render(wrapped=False, imported=False, probe=False)
    result = propagate(new, old, ["probe"])
    assert result.problems == ()
    assert result.source == old_shape.render(wrapped=False, imported=True, probe=True)


# Statements as an older version may have written them.
EDITS = {
    "x = x.to(device)": "x = Variable(x)",
    "out = model(x)": "out = model(x, hidden)",
    "loss = criterion(out, y)": "loss = F.nll_loss(out, y)",
    "total += loss.item()": "total += loss.data[0]",
    "print(seen, total)": "print('seen', seen, 'loss', total / seen)",
    "x = x.to(device)\n": "x = x.cuda()",
}


@settings(max_examples=300, deadline=None)
@given(scripts(), st.data())
def test_property_edited_bodies_place_after_the_anchor_or_refuse(
    script: Script, data: st.DataObject
) -> None:
    # Today's step body steps the optimizer once and logs right after; the old version moved
    # the loops and edited, dropped or added other statements. Whatever the aligner makes
    # of that, the statement never lands anywhere but right after ``optimizer.step()``.
    step = [s for s in script.step if s != "optimizer.step()"]
    at = data.draw(st.integers(0, len(step)), label="step at")
    step.insert(at, "optimizer.step()")
    new_shape = replace(script, step=tuple(step), probe_in_step=True, probe_at=at + 1)
    old_step = []
    for statement in step:
        choice = data.draw(st.sampled_from(["keep", "edit", "drop", "add"]), label=statement)
        if statement == "optimizer.step()" or choice == "keep":
            old_step.append(statement)
        elif choice == "edit":
            old_step.append(EDITS.get(statement, statement))
        elif choice == "add":
            old_step += [statement, "hidden = repackage(hidden)"]
    # Some old versions also stepped once more per epoch (a warm-up), a decoy.
    decoy = ("optimizer.step()",) if data.draw(st.booleans(), label="decoy") else ()
    old_shape = replace(
        new_shape,
        step=tuple(old_step),
        after=new_shape.after + decoy,
        layout=data.draw(st.sampled_from(["module", "main", "guard"]), label="old layout"),
        extracted=data.draw(st.booleans(), label="old extracted"),
        wrapper=data.draw(st.integers(0, len(WRAPPERS) - 1), label="old wrapper"),
    )
    new = new_shape.render(wrapped=True, imported=True, probe=True)
    old = old_shape.render(wrapped=False, imported=False, probe=False)
    result = propagate(new, old, ["probe"])
    if result.problems:
        assert result.source == old
        return
    tree = ast.parse(result.source)
    wanted = ast.unparse(ast.parse(PROBE))
    (probe,) = [n for n in ast.walk(tree) if isinstance(n, ast.Expr) and ast.unparse(n) == wanted]
    (loop,) = [
        n
        for n in ast.walk(tree)
        if isinstance(n, ast.For) and "loader" in ast.unparse(n.iter) and probe in n.body
    ]
    assert ast.unparse(loop.body[loop.body.index(probe) - 1]) == "optimizer.step()"


def test_statement_after_todays_inline_loop_goes_after_the_old_call() -> None:
    old = """\
import torch


def train_epoch(model, opt, loader):
    for x, y in loader:
        opt.zero_grad()
        criterion(model(x), y).backward()
        opt.step()


model = Net()
for epoch in range(5):
    train_epoch(model, opt, loader)
    print(epoch)
"""
    new = """\
import torch
import retrolog as rl

model = Net()
for epoch in rl.loop("epoch", range(5)):
    model.train()
    for x, y in rl.loop("step", loader):
        opt.zero_grad()
        criterion(model(x), y).backward()
        opt.step()
    rl.log("w", model.weight.norm().item())
    print(epoch)
"""
    result = propagate(new, old, ["w"])
    want = expected(
        old,
        ("    train_epoch(model, opt, loader)", '    rl.log("w", model.weight.norm().item())'),
        imported_after="import torch",
    )
    check(result, want, {"w": '    rl.log("w", model.weight.norm().item())'})


def test_new_code_before_the_statement_and_unmatched_old_code_after_the_anchor() -> None:
    # ``scheduler.step()`` is new; the old ``lr *= 0.9`` after ``optimizer.step()`` is gone
    # from today's file. The statement follows the new line: before or after the old one?
    old = "for x in loader:\n    optimizer.step()\n    lr *= 0.9\n    print(x)\n"
    new = "import retrolog as rl\nfor x in rl.loop('step', loader):\n    optimizer.step()\n"
    new += "    scheduler.step()\n    rl.log('x', x)\n    print(x)\n"
    result = propagate(new, old, ["x"])
    assert result.source == old
    (problem,) = result.problems
    assert problem.reason == (
        "`rl.log('x', x)` (line 5 of the new version): it follows line 4 `scheduler.step()` "
        "of the new version, which has no counterpart; in the old version line 2 "
        "`optimizer.step()` is followed by code that has none either, and as the one may be "
        "the other rewritten, its place among them is not known"
    )
    # Without old code after the anchor there is nothing to confuse it with: placed.
    old = "for x in loader:\n    optimizer.step()\n    print(x)\n"
    result = propagate(new, old, ["x"])
    assert result.source.splitlines()[2:4] == ["    optimizer.step()", "    rl.log('x', x)"]
