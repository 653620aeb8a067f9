"""Where requested log statements sit relative to the rl.loop calls (replay/statements.py)."""

from __future__ import annotations

import textwrap

import pytest

from retrolog._replay import statements
from retrolog._replay.statements import Position, StatementSite, locate_statements
from retrolog.errors import UnknownNameError, UsageError

TRAIN = """
    import random
    import retrolog as rl

    lr = rl.arg("lr", 0.01)
    data = list(range(8))
    rl.log("n_data", len(data))                      # prefix
    state = {"w": 0.0}
    with rl.checkpointing(state=state):
        for epoch in rl.loop("epoch", range(3)):
            rl.log("lr_now", lr)                     # outer, before the block
            for x in rl.loop("step", data):
                state["w"] += lr * x
                rl.log("loss", state["w"])           # inner
            rl.log("w_norm", abs(state["w"]))        # outer, after the block
    rl.log("final_w", state["w"])                    # suffix
"""


def locate(source: str, *names: str) -> dict[str, list[StatementSite]]:
    return locate_statements(textwrap.dedent(source), list(names), "train.py")


def only(source: str, name: str) -> StatementSite:
    sites = locate(source, name)[name]
    assert len(sites) == 1, sites
    return sites[0]


def test_positions_in_a_plain_training_script() -> None:
    found = locate(TRAIN, "n_data", "lr_now", "loss", "w_norm", "final_w")
    assert {name: [s.position for s in sites] for name, sites in found.items()} == {
        "n_data": [Position.PREFIX],
        "lr_now": [Position.OUTER],
        "loss": [Position.INNER],
        "w_norm": [Position.OUTER],
        "final_w": [Position.SUFFIX],
    }
    assert found["loss"][0].loops == ("epoch", "step")
    assert found["w_norm"][0].loops == ("epoch",)
    assert found["final_w"][0].loops == ()
    assert found["w_norm"][0] == StatementSite("w_norm", 15, Position.OUTER, ("epoch",), "")


def test_a_name_logged_twice_gives_both_sites_in_line_order() -> None:
    source = """
        import retrolog as rl
        rl.log("x", 0)
        for e in rl.loop("epoch", range(2)):
            for s in rl.loop("step", range(2)):
                rl.log("x", 1)
    """
    sites = locate(source, "x")["x"]
    assert [(s.line, s.position) for s in sites] == [(3, Position.PREFIX), (6, Position.INNER)]


def test_statement_in_a_function_called_from_the_step_loop() -> None:
    source = """
        import retrolog as rl

        def train_step(batch):
            loss = sum(batch)
            rl.log("loss", loss)
            return loss

        for epoch in rl.loop("epoch", range(2)):
            for batch in rl.loop("step", [[1], [2]]):
                train_step(batch)
    """
    site = only(source, "loss")
    assert site.position is Position.INNER
    assert site.loops == ("epoch", "step")
    assert site.note == "inside function train_step, called in loop 'step'"


def test_function_holding_the_nested_loop_and_a_main_wrapper() -> None:
    source = """
        import retrolog as rl

        def train_epoch(data):
            for x in rl.loop("step", data):
                rl.log("loss", x)
            rl.log("epoch_loss", 0.0)

        def main():
            rl.log("start", 1)
            for epoch in rl.loop("epoch", range(3)):
                train_epoch([1, 2])
            rl.log("done", 1)

        if __name__ == "__main__":
            main()
    """
    found = locate(source, "start", "loss", "epoch_loss", "done")
    assert found["start"][0].position is Position.PREFIX
    assert found["loss"][0].position is Position.INNER
    assert found["loss"][0].loops == ("epoch", "step")
    # After the nested loop, still inside the epoch iteration: not part of the block.
    assert found["epoch_loss"][0].position is Position.OUTER
    assert (
        found["epoch_loss"][0].note
        == "inside function train_epoch, called in loop 'epoch' (via main)"
    )
    assert found["done"][0].position is Position.SUFFIX


def test_method_called_through_self_and_through_an_instance() -> None:
    source = """
        import retrolog as rl

        class Trainer:
            def step(self, x):
                rl.log("loss", x)

            def epoch(self, data):
                for x in rl.loop("step", data):
                    self.step(x)

        trainer = Trainer()
        for e in rl.loop("epoch", range(2)):
            trainer.epoch([1, 2])
    """
    site = only(source, "loss")
    assert site.position is Position.INNER
    assert site.loops == ("epoch", "step")


def test_function_never_called_is_inner_with_a_note() -> None:
    source = """
        import retrolog as rl

        def report(net):
            rl.log("w_norm", 1.0)

        for epoch in rl.loop("epoch", range(2)):
            for s in rl.loop("step", range(2)):
                pass
    """
    site = only(source, "w_norm")
    assert site.position is Position.INNER
    assert site.loops == ()
    assert site.note.startswith("could not resolve")
    assert "report" in site.note


def test_function_passed_as_a_callback_is_inner_even_if_also_called_in_the_prefix() -> None:
    source = """
        import retrolog as rl

        def on_epoch_end():
            rl.log("w_norm", 1.0)

        on_epoch_end()
        fit(callbacks=[on_epoch_end])
    """
    site = only(source, "w_norm")
    assert site.position is Position.INNER
    assert "callback" in site.note


def test_statement_in_a_lambda_is_inner() -> None:
    source = """
        import retrolog as rl
        hook = lambda v: rl.log("grad", v)
        for e in rl.loop("epoch", range(2)):
            hook(1.0)
    """
    site = only(source, "grad")
    assert site.position is Position.INNER
    assert "lambda" in site.note


def test_outer_loop_without_nested_loop_makes_the_iteration_the_block() -> None:
    source = """
        import retrolog as rl
        for epoch in rl.loop("epoch", range(3)):
            for x in range(10):          # a plain loop is not a block boundary
                pass
            rl.log("acc", 0.5)
    """
    site = only(source, "acc")
    assert site.position is Position.INNER
    assert "no nested rl.loop" in site.note


def test_aliases_import_retrolog_and_from_import_with_as() -> None:
    plain = """
        import retrolog
        for e in retrolog.loop("epoch", range(2)):
            for s in retrolog.loop("step", range(2)):
                retrolog.log("loss", 1.0)
            retrolog.log("acc", 1.0)
    """
    found = locate(plain, "loss", "acc")
    assert found["loss"][0].position is Position.INNER
    assert found["acc"][0].position is Position.OUTER

    renamed = """
        from retrolog import log as L, loop
        L("before", 0)
        for e in loop("epoch", range(2)):
            for s in enumerate(loop("step", range(2))):
                L("loss", 1.0)
        L("after", 2)
    """
    found = locate(renamed, "before", "loss", "after")
    assert found["before"][0].position is Position.PREFIX
    assert found["loss"][0].position is Position.INNER
    assert found["loss"][0].loops == ("epoch", "step")
    assert found["after"][0].position is Position.SUFFIX


def test_log_of_another_library_is_not_ours() -> None:
    source = """
        import retrolog as rl
        import wandb
        wandb.log("acc", 1)
        rl.log("acc2", 1)
    """
    with pytest.raises(UnknownNameError):
        locate(source, "acc")


def test_statement_in_a_plain_loop_around_a_top_level_loop_is_suffix() -> None:
    # The second pass over the phase loop runs after the first epoch loop ended.
    source = """
        import retrolog as rl
        for phase in ["warmup", "main"]:
            rl.log("phase_start", phase)
            for epoch in rl.loop("epoch", range(2)):
                pass
    """
    assert only(source, "phase_start").position is Position.SUFFIX


def test_loop_in_a_comprehension_counts_as_a_loop() -> None:
    source = """
        import retrolog as rl
        for e in rl.loop("epoch", range(2)):
            losses = [rl.log("loss", x) for x in rl.loop("step", range(3))]
    """
    site = only(source, "loss")
    assert site.position is Position.INNER
    assert site.loops == ("epoch", "step")


def test_unknown_name_lists_the_logged_names_and_suggests_the_closest() -> None:
    with pytest.raises(UnknownNameError) as info:
        locate(TRAIN, "w_nrom")
    message = str(info.value)
    assert "train.py" in message
    assert "final_w, loss, lr_now, n_data, w_norm" in message
    assert "Did you mean 'w_norm'?" in message
    assert info.value.name == "w_nrom"


def test_unknown_name_in_a_file_that_logs_nothing() -> None:
    with pytest.raises(UnknownNameError, match=r"no rl\.log statement"):
        locate("import retrolog as rl\nx = 1\n", "acc")


def test_syntax_error_names_file_and_line() -> None:
    with pytest.raises(UsageError, match=r"train\.py.*line 3"):
        locate_statements("import retrolog as rl\nx = 1\nfor x in\n", ["x"], "train.py")


def test_a_file_too_complex_to_follow_puts_everything_inner(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(statements, "_NODE_BUDGET", 5)
    site = only(TRAIN, "n_data")
    assert site.position is Position.INNER
    assert site.note.startswith("could not resolve")


def test_nul_byte_is_a_usage_error() -> None:
    with pytest.raises(UsageError, match=r"train\.py"):
        locate_statements("x = 1\0\n", ["x"], "train.py")


def test_names_read_leaves_out_what_is_assigned_after_the_block() -> None:
    """A checkpoint lacking ``fake`` does not matter when ``fake`` is set anew after the
    step loop and before the statement; ``total += ...`` reads the restored value first."""
    from retrolog._replay.statements import names_read

    source = (
        "import retrolog as rl\n"
        "for epoch in rl.loop('epoch', range(3)):\n"
        "    for step in rl.loop('step', range(2)):\n"
        "        fake = g(step)\n"
        "        big = h(step)\n"
        "        total = total + 1\n"
        "    total += 2\n"
        "    with no_grad():\n"
        "        fake = g(None)\n"
        "    if epoch:\n"
        "        rl.log('m', fake.mean() + total + big.sum())\n"
    )
    assert names_read(source, ["m"]) == {"total", "big"}
