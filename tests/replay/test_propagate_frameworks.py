"""Statements where framework users write them: Lightning and transformers shapes.

A LightningModule's ``training_step``, a ``Trainer`` subclass's ``compute_loss``, a
``TrainerCallback``'s ``on_step_end``; a hook only today's version has, carried into
the old class; a callback class only today's version has, carried with the line that
creates it. Pure propagation on source text: nothing here imports a framework.
"""

from __future__ import annotations

import ast
import textwrap

from retrolog._replay.propagate import propagate

LIGHTNING_OLD = textwrap.dedent(
    """\
    import torch
    import lightning as L

    import retrolog as rl


    class Model(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = torch.nn.Linear(4, 2)

        def training_step(self, batch, batch_idx):
            x, y = batch
            loss = torch.nn.functional.cross_entropy(self.net(x), y)
            self.log("loss", loss)
            return loss

        # the optimizer Lightning steps
        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)


    def main():
        trainer = L.Trainer(max_epochs=2)
        trainer.fit(Model())


    main()
    """
)

# Today: training_step gained lines and a statement; a new epoch hook logs the weights'
# norm, with a decorator; a new helper method nobody calls... is not one of them.
LIGHTNING_NEW = textwrap.dedent(
    """\
    import torch
    import lightning as L

    import retrolog as rl


    class Model(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = torch.nn.Linear(4, 2)

        def training_step(self, batch, batch_idx):
            x, y = batch
            logits = self.net(x)
            loss = torch.nn.functional.cross_entropy(logits, y)
            rl.log("step_loss", loss.item())
            self.log("loss", loss, prog_bar=True)
            return loss

        @torch.no_grad()
        def on_train_epoch_end(self):
            # the norm of the only layer's weights
            w = self.net.weight
            rl.log("w_norm", w.norm().item())

        # the optimizer Lightning steps
        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)


    def main():
        trainer = L.Trainer(max_epochs=2)
        trainer.fit(Model())


    main()
    """
)


def test_a_new_lightning_hook_is_carried_whole_after_its_neighbour_method() -> None:
    result = propagate(LIGHTNING_NEW, LIGHTNING_OLD, ["w_norm", "step_loss"])
    assert not result.problems, result.problems
    assert result.methods == (("Model", "on_train_epoch_end"),)
    hook = (
        "\n"
        "    @torch.no_grad()\n"
        "    def on_train_epoch_end(self):\n"
        "        # the norm of the only layer's weights\n"
        "        w = self.net.weight\n"
        '        rl.log("w_norm", w.norm().item())\n'
    )
    expected = LIGHTNING_OLD.replace(
        "        return loss\n",
        "        return loss\n" + hook,
    ).replace(
        '        self.log("loss", loss)\n',
        '        rl.log("step_loss", loss.item())\n        self.log("loss", loss)\n',
    )
    assert result.source == expected
    placed = {p.name: p for p in result.placements}
    lines = result.source.splitlines()
    assert lines[placed["w_norm"].line - 1].strip() == 'rl.log("w_norm", w.norm().item())'
    assert placed["w_norm"].statement == 'rl.log("w_norm", w.norm().item())'
    assert "carried into class `Model` after line 12 `def training_step" in placed["w_norm"].anchor
    assert lines[placed["step_loss"].line - 1].strip() == 'rl.log("step_loss", loss.item())'


def test_a_new_hook_before_any_known_method_goes_before_the_first_one() -> None:
    new = LIGHTNING_NEW.replace(
        "    def __init__(self):\n",
        '    def on_fit_start(self):\n        rl.log("width", self.net.out_features)\n\n'
        "    def __init__(self):\n",
    )
    result = propagate(new, LIGHTNING_OLD, ["width"])
    assert not result.problems, result.problems
    assert result.source.index("def on_fit_start") < result.source.index("def __init__")
    assert "class Model(L.LightningModule):\n    def on_fit_start(self):\n" in result.source
    ast.parse(result.source)


def test_a_hook_reading_todays_helper_and_import_carries_them() -> None:
    new = (
        LIGHTNING_NEW.replace("import torch\n", "import math\n\nimport torch\n")
        .replace(
            "\n\nclass Model",
            "\n\ndef log_norm(t):\n    return math.log(float(t.norm()))\n\n\nclass Model",
        )
        .replace('rl.log("w_norm", w.norm().item())', 'rl.log("w_norm", log_norm(w))')
    )
    result = propagate(new, LIGHTNING_OLD, ["w_norm"])
    assert not result.problems, result.problems
    assert dict(result.carried) == {"log_norm": "log_norm", "math": "math"}
    # Today's helpers go before the class they serve.
    assert result.source.index("def log_norm") < result.source.index("class Model")
    assert result.methods == (("Model", "on_train_epoch_end"),)
    ast.parse(result.source)


def test_a_hook_reading_what_the_old_version_lacks_is_reported() -> None:
    new = LIGHTNING_NEW.replace(
        "        self.net = torch.nn.Linear(4, 2)\n",
        "        self.net = torch.nn.Linear(4, 2)\n        self.seen = 0\n",
    ).replace("w = self.net.weight", "w = self.net.weight / (self.seen + scale)")
    result = propagate(new, LIGHTNING_OLD, ["w_norm", "step_loss"])
    assert result.source.count("rl.log(") == 1  # step_loss alone
    (problem,) = result.problems
    assert problem.name == "w_norm"
    assert problem.reason == (
        '`rl.log("w_norm", w.norm().item())` (line 25 of the new version): the old version '
        "has no `scale` and sets no `self.seen` in class `Model`, which today's method "
        "`on_train_epoch_end` reads (the method would go into class `Model` after line 12 "
        "`def training_step(self, batch, batch_idx):`)"
    )
    # A refused method carries nothing: not today's helper it reads either.
    helped = new.replace("\n\nclass Model", "\n\ndef halve(t):\n    return t / 2\n\n\nclass Model")
    helped = helped.replace("w.norm().item()", "halve(w).norm().item()")
    refused = propagate(helped, LIGHTNING_OLD, ["w_norm"])
    assert refused.problems and refused.carried == () and refused.source == LIGHTNING_OLD
    # Attributes neither version's class sets come from the framework's base class.
    fine = LIGHTNING_NEW.replace("w = self.net.weight", "w = self.net.weight * self.current_epoch")
    assert not propagate(fine, LIGHTNING_OLD, ["w_norm"]).problems


def test_a_hook_calling_its_base_class_and_an_old_version_before_retrolog() -> None:
    # super().on_train_epoch_end() names the hook, but from inside it: still a hook.
    new = LIGHTNING_NEW.replace(
        "        w = self.net.weight\n",
        "        super().on_train_epoch_end()\n        w = self.net.weight\n",
    )
    # History from before retrolog was adopted: the import goes in with the method.
    old = LIGHTNING_OLD.replace("\nimport retrolog as rl\n", "")
    result = propagate(new, old, ["w_norm"])
    assert not result.problems, result.problems
    assert result.methods == (("Model", "on_train_epoch_end"),)
    assert result.added_import is not None
    assert result.added_import.statement == "import retrolog as rl"
    assert "        super().on_train_epoch_end()\n" in result.source
    ast.parse(result.source)


def test_a_new_method_todays_code_calls_goes_in_with_its_call() -> None:
    # Not a hook: only the call in training_step runs it, so the call goes in too.
    new = LIGHTNING_NEW.replace(
        '        self.log("loss", loss, prog_bar=True)\n',
        '        self.log("loss", loss, prog_bar=True)\n        self.on_train_epoch_end()\n',
    )
    assert "self.on_train_epoch_end()" in new
    result = propagate(new, LIGHTNING_OLD, ["w_norm"])
    assert not result.problems, result.problems
    assert result.methods == (("Model", "on_train_epoch_end"),)
    assert '        self.log("loss", loss)\n        self.on_train_epoch_end()\n' in result.source
    (placement,) = result.placements
    assert "used by the line inserted after line 15" in placement.anchor
    # Called in a line the old version has otherwise: that line would have to change.
    changed = LIGHTNING_NEW.replace(
        "        return loss\n", "        return self.on_train_epoch_end() or loss\n"
    )
    refused = propagate(changed, LIGHTNING_OLD, ["w_norm"])
    assert refused.source == LIGHTNING_OLD
    (problem,) = refused.problems
    assert (
        "today's version uses it in line 18 `return self.on_train_epoch_end() or loss`, whose "
        "counterpart in the old version, line 16 `return loss`, does not" in problem.reason
    ), problem.reason


HF_OLD = textwrap.dedent(
    """\
    import torch
    from transformers import Trainer, TrainerCallback

    import retrolog as rl


    class LossTrainer(Trainer):
        def compute_loss(self, model, inputs, return_outputs=False, **kwargs):
            labels = inputs.pop("labels")
            outputs = model(**inputs)
            loss = torch.nn.functional.cross_entropy(outputs.logits, labels)
            return (loss, outputs) if return_outputs else loss


    class Printer(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step % 10 == 0:
                print(state.global_step)

        def on_log(self, args, state, control, logs=None, **kwargs):
            print(logs)


    def main(model, args, data):
        trainer = LossTrainer(model=model, args=args, train_dataset=data, callbacks=[Printer()])
        trainer.train()
    """
)

HF_NEW = textwrap.dedent(
    """\
    import torch
    from transformers import Trainer, TrainerCallback

    import retrolog as rl


    class LossTrainer(Trainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            labels = inputs.pop("labels")
            outputs = model(**inputs)
            logits = outputs.logits.float()
            loss = torch.nn.functional.cross_entropy(logits, labels, label_smoothing=0.1)
            rl.log("logit_max", logits.max().item())
            rl.log("train_loss", loss.item())
            return (loss, outputs) if return_outputs else loss


    class Printer(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            rl.log("step_lr", state.learning_rate)
            if state.global_step % 10 == 0:
                print(state.global_step, flush=True)

        def on_log(self, args, state, control, logs=None, **kwargs):
            print(logs)


    def main(model, args, data):
        trainer = LossTrainer(model=model, args=args, train_dataset=data, callbacks=[Printer()])
        trainer.train()
    """
)


def test_statements_in_changed_compute_loss_and_on_step_end_land_at_the_aligned_place() -> None:
    result = propagate(HF_NEW, HF_OLD, ["train_loss", "step_lr", "logit_max"])
    assert result.methods == () and result.classes == ()
    lines = result.source.splitlines()
    placed = {p.name: p.line for p in result.placements}
    # compute_loss gained lines and a parameter: after the old loss line, before the return.
    assert lines[placed["train_loss"] - 2].strip().startswith("loss = torch.nn.functional")
    assert lines[placed["train_loss"]].strip().startswith("return (loss, outputs)")
    # on_step_end's body changed: at its start, as today.
    assert lines[placed["step_lr"] - 2].strip().startswith("def on_step_end(")
    assert lines[placed["step_lr"] - 1] == '        rl.log("step_lr", state.learning_rate)'
    # Today's `logits` is a variable the old compute_loss never had.
    (problem,) = result.problems
    assert problem.name == "logit_max"
    assert "the old version has no `logits`" in problem.reason, problem.reason
    assert "in function `compute_loss`" in problem.reason
    ast.parse(result.source)


def test_a_new_callback_class_goes_in_with_the_new_line_creating_it() -> None:
    new = HF_NEW.replace(
        "\n\ndef main(",
        '\n\nclass LrLogger(TrainerCallback):\n    """Logs the learning rate."""\n\n'
        "    def on_step_end(self, args, state, control, **kwargs):\n"
        '        rl.log("lr", state.learning_rate)\n\n\ndef main(',
    ).replace(
        "    trainer.train()\n", "    trainer.add_callback(LrLogger())\n    trainer.train()\n"
    )
    result = propagate(new, HF_OLD, ["lr"])
    assert not result.problems, result.problems
    assert result.classes == (("LrLogger", "trainer.add_callback(LrLogger())"),)
    lines = result.source.splitlines()
    (placement,) = result.placements
    assert lines[placement.line - 1] == '        rl.log("lr", state.learning_rate)'
    assert result.source.index("class LrLogger") < result.source.index("def main(")
    assert "    trainer.add_callback(LrLogger())\n    trainer.train()\n" in result.source
    carried = result.source[
        result.source.index("class LrLogger") : result.source.index("def main(")
    ]
    assert '"""Logs the learning rate."""' in carried  # as written today, docstring and all
    unchanged = result.source.replace("    trainer.add_callback(LrLogger())\n", "")
    assert unchanged.replace(carried, "") == HF_OLD
    # Created inside a line the old version has otherwise: that line would have to change.
    changed = new.replace("    trainer.add_callback(LrLogger())\n", "").replace(
        "callbacks=[Printer()]", "callbacks=[Printer(), LrLogger()]"
    )
    refused = propagate(changed, HF_OLD, ["lr"])
    (problem,) = refused.problems
    assert refused.source == HF_OLD
    assert (
        "today's version creates it in line 36 `trainer = LossTrainer(model=model, args=args, "
        "train_dataset=data, callbacks=[Printer(), LrLogger()])`, whose counterpart in the old "
        "version, line 25 `trainer = LossTrainer(model=model, args=args, train_dataset=data, "
        "callbacks=[Printer()])`, does not" in problem.reason
    ), problem.reason


def test_a_new_callback_class_reading_what_the_old_version_lacks_is_reported() -> None:
    new = HF_NEW.replace(
        "\n\ndef main(",
        "\n\nclass LrLogger(TrainerCallback):\n    scale = SCALE\n\n"
        "    def on_step_end(self, args, state, control, **kwargs):\n"
        '        rl.log("lr", state.learning_rate * self.scale + offset)\n\n\ndef main(',
    ).replace(
        "    trainer.train()\n", "    trainer.add_callback(LrLogger())\n    trainer.train()\n"
    )
    refused = propagate(new, HF_OLD, ["lr"])
    assert refused.source == HF_OLD and refused.classes == ()
    (problem,) = refused.problems
    assert problem.reason.endswith(
        "the old version has no `SCALE` or `offset`, which today's class `LrLogger` reads "
        "(it would go before line 24 `def main(model, args, data):`)"
    ), problem.reason
    # Today's module constants the old version lacks go in first, then the class.
    defined = new.replace("import torch\n", "import torch\n\nSCALE = 2.0\noffset = 1\n")
    result = propagate(defined, HF_OLD, ["lr"])
    assert not result.problems, result.problems
    assert dict(result.carried) == {"SCALE": "SCALE", "offset": "offset"}
    assert result.source.index("SCALE = 2.0") < result.source.index("class LrLogger")
    ast.parse(result.source)


def test_a_new_callback_class_is_carried_even_where_its_code_looks_like_old_code() -> None:
    # Its hook repeats a line of the old Printer's on_step_end; the framework calls it,
    # so it runs as its own callback, not inside Printer's.
    new = HF_NEW.replace(
        "\n\ndef main(",
        "\n\nclass LrLogger(TrainerCallback):\n"
        "    def on_step_end(self, args, state, control, **kwargs):\n"
        "        if state.global_step % 10 == 0:\n"
        "            print(state.global_step)\n"
        '        rl.log("lr", state.learning_rate)\n\n\ndef main(',
    ).replace(
        "    trainer.train()\n", "    trainer.add_callback(LrLogger())\n    trainer.train()\n"
    )
    result = propagate(new, HF_OLD, ["lr", "step_lr"])
    assert not result.problems, result.problems
    assert result.classes == (("LrLogger", "trainer.add_callback(LrLogger())"),)
    # Printer is still Printer, and its changed hook still its hook.
    placed = {p.name: p for p in result.placements}
    assert "in function `on_step_end`" in placed["step_lr"].anchor
    lines = result.source.splitlines()
    assert lines[placed["step_lr"].line - 2].strip().startswith("def on_step_end(")
    printer = result.source[
        result.source.index("class Printer") : result.source.index("class LrLogger")
    ]
    assert printer.count("rl.log") == 1  # step_lr alone
