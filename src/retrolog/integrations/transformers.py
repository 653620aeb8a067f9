"""Hugging Face transformers' ``Trainer``, recorded with one line and replayed with
epochs restored (docs/integrations.md, "Hugging Face transformers").

``Trainer(..., callbacks=[RetrologCallback()])``, or ``rl.autolog()`` before the
Trainer is made. The callback records:

- ``TrainingArguments`` and the model's config as run-level values (the config's
  under ``config.<name>``), at the start of training;
- the loops: ``epoch`` (one context per epoch) and ``step`` inside it (one per
  optimizer step, its loop value the global step), opened and closed from the
  Trainer's events with ``rl.begin``/``rl.end``;
- at every step, whatever ``logging_steps`` is: ``loss`` (the step's training loss,
  summed over its gradient-accumulation micro-batches as the Trainer sums it),
  ``grad_norm`` and ``train/learning_rate``;
- every other value the Trainer logs (evaluation metrics at their epoch, the
  end-of-training figures), with the timing names (``*_runtime``,
  ``*_per_second``) declared volatile; a name that is also a loop name
  (``epoch``) or a recorded argument (``learning_rate``) is kept as ``train/<name>``.

At epoch ends the adaptive rule decides checkpoints of the model, optimizer,
LR scheduler, gradient scaler, the Trainer's loop state (``TrainerState`` and its
loss accumulators) and the RNG states. In a replay, an epoch the plan restores is
not trained: the Trainer's ``_run_epoch`` for that epoch restores the checkpoint
and runs only the epoch's end (its hooks, logging, evaluation, saving).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import sys
import weakref
from typing import Any

import transformers
from transformers import Trainer, TrainerCallback, TrainerControl, TrainerState

import retrolog as rl
from retrolog import _api
from retrolog.errors import UsageError

# The transformers versions whose Trainer loop this module knows (its _run_epoch and
# the attributes restored): others record without checkpoints.
TESTED = ("5.",)
LOOP_NAMES = ("epoch", "step")
# Values taken at every step from the training loop: the Trainer's own logs of these
# names (means over logging_steps) would overwrite the step's value in its context.
PER_STEP = ("loss", "grad_norm", "learning_rate")
# Trainers whose loop calls are wrapped (a Trainer trains again: wrapped once).
_WRAPPED: weakref.WeakSet[Trainer] = weakref.WeakSet()
# Training arguments that differ between runs of the same configuration.
NOT_ARGUMENTS = frozenset({"logging_dir"})


def _tested(version: str) -> bool:
    return version.startswith(TESTED)


def _volatile_name(name: str) -> bool:
    return name.endswith(("_runtime", "_per_second"))


def _plain(value: Any) -> bool:
    return value is None or type(value) in (bool, int, float, str)


class _LoopState:
    """The Trainer's own loop state, as a checkpoint holds it: ``TrainerState`` and the
    loss accumulators ``_run_epoch`` carries from one epoch to the next."""

    def __init__(self, trainer: Trainer) -> None:
        self.trainer = trainer

    def state_dict(self) -> dict[str, Any]:
        t = self.trainer
        return {
            "state": json.dumps(dataclasses.asdict(t.state), sort_keys=True),
            "tr_loss": t._tr_loss.detach().clone(),
            "total_loss_scalar": float(t._total_loss_scalar),
            "globalstep_last_logged": int(t._globalstep_last_logged),
            "current_flos": float(t.current_flos),
        }

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        t = self.trainer
        for key, value in json.loads(saved["state"]).items():
            setattr(t.state, key, value)
        with _no_grad():
            t._tr_loss.copy_(saved["tr_loss"])  # in place: _run_epoch's callers hold it
        t._total_loss_scalar = float(saved["total_loss_scalar"])
        t._globalstep_last_logged = int(saved["globalstep_last_logged"])
        t.current_flos = float(saved["current_flos"])  # type: ignore[assignment]


def _no_grad() -> Any:
    torch = sys.modules.get("torch")
    return torch.no_grad() if torch is not None else contextlib.nullcontext()


class RetrologCallback(TrainerCallback):
    """Records a transformers ``Trainer``'s training with retrolog: pass it in
    ``callbacks=[RetrologCallback()]``.

    checkpoints: False records without checkpoints (every replay then trains).
    """

    def __init__(self, checkpoints: bool = True) -> None:
        self.checkpoints = checkpoints
        self.trainer: Trainer | None = None
        self._scope: contextlib.ExitStack | None = None
        self._epoch = 0
        self._steps_open = False
        self._step_loss: Any = None
        self._grad_norm: Any = None
        self._arguments: frozenset[str] = frozenset()  # names recorded as run-level values

    # -- the Trainer ------------------------------------------------------------------

    def _attach(self, trainer: Trainer | None) -> None:
        """Know the Trainer, and be its first callback: the step loop ends (and the epoch
        is checkpointed) before any other callback's on_epoch_end runs."""
        if trainer is None or self.trainer is trainer:
            return
        self.trainer = trainer
        callbacks = trainer.callback_handler.callbacks
        if self in callbacks and callbacks[0] is not self:
            # Moved while the handler iterates the list: the element after this one
            # stays at the index it visits next, so no callback is skipped or repeated.
            callbacks.remove(self)
            callbacks.insert(0, self)

    def on_init_end(
        self, args: Any, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        self._attach(_calling_trainer())

    def on_train_begin(
        self, args: Any, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        self._attach(_calling_trainer())
        trainer = self.trainer
        self._record_arguments(args, kwargs.get("model"))
        rl.volatile("train_runtime", "train_samples_per_second", "train_steps_per_second")
        self._epoch = 0
        if trainer is None:
            _say("cannot find the Trainer that runs this callback; training is recorded "
                 "without checkpoints.")  # fmt: skip
            return
        version = transformers.__version__
        if not _tested(version):
            # Its loop's internals (what is wrapped, what a checkpoint restores) may differ.
            _say(
                f"transformers {version} is not a version this integration was tested with "
                f"({', '.join(v + 'x' for v in TESTED)}); training is recorded without "
                "checkpoints (a replay trains every epoch), and the loss per step only as "
                "the Trainer logs it."
            )
            return
        self._wrap(trainer)
        if not self.checkpoints:
            return
        if not _has_length(trainer.train_dataset):
            _say(
                "the training data is an iterable dataset: a checkpoint cannot hold where "
                "it is, so training is recorded without checkpoints (a replay trains "
                "every epoch)."
            )
            return
        objects: dict[str, Any] = {
            "model": trainer.model,
            "optimizer": trainer.optimizer,
            "trainer_state": _LoopState(trainer),
        }
        if trainer.lr_scheduler is not None:
            objects["lr_scheduler"] = trainer.lr_scheduler
        scaler = getattr(trainer.accelerator, "scaler", None)
        if scaler is not None:
            objects["scaler"] = scaler
        self._scope = contextlib.ExitStack()
        self._scope.enter_context(rl.checkpointing(**objects))

    def _record_arguments(self, args: Any, model: Any) -> None:
        values = {k: v for k, v in args.to_dict().items() if _plain(v) and k not in NOT_ARGUMENTS}
        config = getattr(model, "config", None)
        if config is not None:
            values.update({f"config.{k}": v for k, v in config.to_diff_dict().items() if _plain(v)})
        # As argparse's values are: typed run-level values, which a replay compares.
        _api.parsed_values(values)
        self._arguments = frozenset(values)

    def _wrap(self, trainer: Trainer) -> None:
        """Wrap, on this Trainer only, the calls the loop makes that carry what the
        callbacks do not see: each step's loss and gradient norm, and the epoch."""
        if trainer in _WRAPPED:
            return
        _WRAPPED.add(trainer)
        training_step = trainer.training_step
        get_grad_norm = trainer._get_grad_norm
        run_epoch = trainer._run_epoch
        finalize = trainer._finalize_training

        def step_loss(*args: Any, **kwargs: Any) -> Any:
            loss = training_step(*args, **kwargs)
            self._step_loss = loss if self._step_loss is None else self._step_loss + loss
            return loss

        def grad_norm(*args: Any, **kwargs: Any) -> Any:
            self._grad_norm = get_grad_norm(*args, **kwargs)
            return self._grad_norm

        def epoch(*args: Any, **kwargs: Any) -> Any:
            if self._scope is None or not rl.restore_block():
                return run_epoch(*args, **kwargs)
            # Restored: the epoch's steps are not trained; its end runs as it did.
            bound = _bind(run_epoch, args, kwargs)
            trainer.control = trainer.callback_handler.on_epoch_end(
                trainer.args, trainer.state, trainer.control
            )
            trainer._maybe_log_save_evaluate(
                trainer._tr_loss,
                None,
                bound["model"],
                bound["trial"],
                bound["epoch"],
                bound["ignore_keys_for_eval"],
                bound["start_time"],
            )
            return None

        def finalize_training(*args: Any, **kwargs: Any) -> Any:
            # The epochs are over: their loop ends (the end checkpoint) before the
            # end-of-training figures are logged, at run level.
            self._end_epochs()
            return finalize(*args, **kwargs)

        # Instance attributes: other Trainers, and the class, are left as they are.
        vars(trainer).update(
            training_step=step_loss,
            _get_grad_norm=grad_norm,
            _run_epoch=epoch,
            _finalize_training=finalize_training,
        )

    # -- the loop's events ------------------------------------------------------------

    def on_epoch_begin(
        self, args: Any, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        rl.begin("epoch", self._epoch)
        self._epoch += 1

    def on_step_begin(
        self, args: Any, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        rl.begin("step", state.global_step + 1)
        self._steps_open = True
        self._step_loss = None
        self._grad_norm = None

    def on_step_end(
        self, args: Any, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        if self._step_loss is not None:
            rl.log("loss", _number(self._step_loss))
        if self._grad_norm is not None:
            rl.log("grad_norm", _number(self._grad_norm))
        trainer = self.trainer
        if trainer is not None and trainer in _WRAPPED:
            rl.log("train/learning_rate", _number(trainer._get_learning_rate()))

    def on_epoch_end(
        self, args: Any, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        if self._steps_open:
            self._steps_open = False
            rl.end("step")  # the epoch's block ends: the adaptive rule's checkpoint point

    def on_log(
        self,
        args: Any,
        state: TrainerState,
        control: TrainerControl,
        logs: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        if not logs:
            return
        # A training log at a step, whose loss, gradient norm and learning rate this
        # callback logged for the step itself.
        per_step = self._steps_open and "loss" in logs and self.trainer in _WRAPPED
        for name, value in logs.items():
            if per_step and name in PER_STEP:
                continue
            if name in LOOP_NAMES or name in self._arguments:
                # Kept, beside the loop column or the argument of the same name.
                name = f"train/{name}"
            if _volatile_name(name):
                rl.volatile(name)
            rl.log(name, value)

    def on_train_end(
        self, args: Any, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        self._end_epochs()

    def _end_epochs(self) -> None:
        if self._steps_open:
            self._steps_open = False
            rl.end("step")
        with contextlib.suppress(UsageError):  # no epoch began (zero epochs to train)
            rl.end("epoch")
        if self._scope is not None:
            scope, self._scope = self._scope, None
            scope.close()


def _number(value: Any) -> Any:
    item = getattr(value, "item", None)
    value = item() if callable(item) else value
    return float(value) if isinstance(value, float) and not math.isnan(value) else value


def _bind(function: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
    import inspect

    return dict(inspect.signature(function).bind(*args, **kwargs).arguments)


def _calling_trainer() -> Trainer | None:
    """The Trainer whose method is running this callback (its callback handler calls it)."""
    frame = sys._getframe(1)
    while frame is not None:
        candidate = frame.f_locals.get("self")
        if isinstance(candidate, Trainer):
            return candidate
        frame = frame.f_back  # type: ignore[assignment]
    return None


def _has_length(dataset: Any) -> bool:
    try:
        len(dataset)
    except TypeError:
        return False
    return True


def _say(message: str) -> None:
    print(f"retrolog: {message}", file=sys.stderr)


def patch_trainer() -> None:
    """Give every Trainer made from now on a RetrologCallback (``rl.autolog()``)."""
    original = Trainer.__init__
    if getattr(original, "_retrolog", False):
        return

    def __init__(self: Trainer, *args: Any, **kwargs: Any) -> None:
        callbacks = list(kwargs.get("callbacks") or [])
        if not any(isinstance(c, RetrologCallback) for c in callbacks):
            kwargs["callbacks"] = [RetrologCallback(), *callbacks]
        original(self, *args, **kwargs)

    __init__._retrolog = True  # type: ignore[attr-defined]
    Trainer.__init__ = __init__  # type: ignore[method-assign]
