"""Where statements sit in code a framework calls: its epoch hooks, and rl.begin loops."""

from __future__ import annotations

import textwrap

from retrolog._replay.statements import Position, StatementSite, locate_statements


def only(source: str, name: str) -> StatementSite:
    (site,) = locate_statements(textwrap.dedent(source), [name])[name]
    return site


def test_a_callbacks_epoch_hook_is_outer_and_its_step_hook_inner() -> None:
    source = """
        import retrolog as rl
        from transformers import Trainer, TrainerCallback

        class Norms(TrainerCallback):
            def on_epoch_end(self, args, state, control, model=None, **kwargs):
                rl.log("w_norm", self.norm(model))

            def norm(self, model):
                return sum(p.norm().item() for p in model.parameters())

            def on_step_end(self, args, state, control, model=None, **kwargs):
                rl.log("g_norm", 1.0)

        Trainer(callbacks=[Norms()]).train()
    """
    site = only(source, "w_norm")
    assert site.position is Position.OUTER
    assert "Norms.on_epoch_end" in site.note and "once per epoch" in site.note
    assert only(source, "g_norm").position is Position.INNER


def test_compute_metrics_passed_to_a_trainer_is_outer() -> None:
    source = """
        import retrolog as rl

        def compute_metrics(prediction):
            rl.log("f1", 0.5)
            return {}

        Trainer(compute_metrics=compute_metrics).train()
    """
    assert only(source, "f1").position is Position.OUTER


def test_a_file_that_opens_loops_with_begin_puts_its_other_statements_deep() -> None:
    source = """
        import retrolog as rl

        for epoch in range(3):
            rl.begin("epoch", epoch)
            rl.log("loss", 1.0)
        rl.end()
        rl.log("final", 2.0)
    """
    for name in ("loss", "final"):
        site = only(source, name)
        assert site.position is Position.INNER, name
        assert "rl.begin" in site.note
