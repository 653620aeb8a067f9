"""Lightning's ``Trainer``, recorded with one line and replayed with epochs restored
(docs/integrations.md, "Lightning").

``Trainer(..., callbacks=[RetrologCallback()])``, or ``rl.autolog()`` before the
Trainer is made. The callback records:

- the LightningModule's (and the DataModule's) ``hparams``, the Trainer's arguments
  (``max_epochs``, ``precision``, ...), the seed of ``seed_everything`` and a
  ``LightningCLI``'s configuration as typed run-level values, at the start of fit;
- the loops: ``epoch`` (one context per epoch, its value Lightning's
  ``current_epoch``) and ``step`` inside it (one per training batch, its value the
  ``global_step`` the batch starts from), opened and closed from the fit loop's events;
- every value ``self.log`` logs on step at every training batch, whatever
  ``log_every_n_steps`` is; epoch aggregates and validation metrics at their epoch;
  timing names declared volatile; a name that is also a loop name or a recorded
  argument is kept as ``train/<name>``.

At epoch ends the adaptive rule decides checkpoints of the module, optimizers, LR
schedulers, the precision plugin (its gradient scaler), the fit loop's state (its
progress counters, the epoch's logged results), the callbacks' states, the samplers'
generators and the RNG states. The step loop ends before the epoch's validation, so
in a replay an epoch the plan restores is not trained: the fit loop's ``advance``
restores it and runs the rest of the epoch (validation, the epoch-end hooks).
"""

from __future__ import annotations

import contextlib
import math
import os
import sys
import weakref
from collections.abc import Iterator, Mapping
from typing import Any

import lightning
import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.loops import _Loop
from lightning.pytorch.trainer import call
from lightning.pytorch.trainer.connectors.logger_connector.result import (
    _ResultCollection,
    _ResultMetric,
)

import retrolog as rl
from retrolog import _api
from retrolog.errors import StoreError, UsageError

# The Lightning versions whose fit loop this module knows (the loop methods wrapped,
# the state restored): others record without checkpoints.
TESTED = ("2.6.",)
LOOP_NAMES = ("epoch", "step")
# The Trainer's arguments recorded as run-level values (read back from the Trainer).
TRAINER_ARGUMENTS = (
    "max_epochs",
    "min_epochs",
    "max_steps",
    "min_steps",
    "precision",
    "accumulate_grad_batches",
    "gradient_clip_val",
    "gradient_clip_algorithm",
    "log_every_n_steps",
    "check_val_every_n_epoch",
    "val_check_interval",
    "limit_train_batches",
    "limit_val_batches",
    "num_sanity_val_steps",
    "num_devices",
)
_REDUCTIONS = ("mean", "max", "min", "sum")
# Callback hooks Lightning calls through ``call._call_callback_hooks``, which skips a
# callback whose attribute is not callable. Those this class does not define are set to
# None on the instance: a no-op hook still costs its dispatch (a profiler context, the
# callback's state key, about fifteen Python calls), six times a training step.
_SKIPPED_HOOKS = (
    "on_train_batch_start",
    "on_train_batch_end",
    "on_before_backward",
    "on_after_backward",
    "on_before_optimizer_step",
    "on_before_zero_grad",
    "on_validation_batch_start",
    "on_validation_batch_end",
    "on_test_batch_start",
    "on_test_batch_end",
    "on_predict_batch_start",
    "on_predict_batch_end",
)
# Trainers whose loop calls are wrapped (a Trainer fits again: wrapped once).
_WRAPPED: weakref.WeakSet[Trainer] = weakref.WeakSet()


def _tested(version: str) -> bool:
    return version.startswith(TESTED)


def _volatile_name(name: str) -> bool:
    return name.endswith(("_runtime", "_per_sec", "_per_second", "_time")) or name == "time"


def _plain(value: Any) -> bool:
    return value is None or type(value) in (bool, int, float, str)


def _flat(values: Mapping[str, Any], prefix: str = "") -> Iterator[tuple[str, Any]]:
    """Plain values of a nested configuration, nested keys joined with dots."""
    for key, value in values.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            yield from _flat(value, f"{name}.")
        elif _plain(value):
            yield name, value


class _LoopState:
    """What the next epoch depends on beyond the module, optimizers and schedulers, as a
    checkpoint holds it: the fit loop's progress (epochs, batches, optimizer steps, its
    loops' own state), the epoch's logged results and metrics, the callbacks' states,
    ``should_stop``, the samplers' generators, and whether the epoch's validation and
    its step's end are still to run after the checkpoint point."""

    def __init__(self, owner: RetrologCallback, trainer: Trainer) -> None:
        self.owner = owner
        self.trainer = trainer

    def state_dict(self) -> dict[str, Any]:
        t = self.trainer
        connector = t._logger_connector
        return {
            "fit_loop": t.fit_loop.state_dict(),
            "callbacks": {
                key: state
                for key, state in call._call_callbacks_state_dict(t).items()
                if key != self.owner.state_key
            },
            "should_stop": bool(t.should_stop),
            "results": _results_state(t.fit_loop.epoch_loop._results),
            "callback_metrics": dict(connector._callback_metrics),
            "logged_metrics": dict(connector._logged_metrics),
            "progress_bar_metrics": dict(connector._progress_bar_metrics),
            "generators": [g.get_state() for g in _generators(t)],
            "tail": self.owner._tail,
        }

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        t = self.trainer
        if saved["results"] is None:
            # Raised before any live object changes: the replay trains this epoch instead.
            raise StoreError(
                "the epoch logged a torchmetrics object, whose accumulated state the "
                "checkpoint does not hold"
            )
        # Loaded without Loop.load_state_dict, which marks the loops as restarting (a
        # resumed fit): this fit goes on as it did while recording.
        _load_loop(t.fit_loop, saved["fit_loop"])
        call._call_callbacks_load_state_dict(t, {"callbacks": saved["callbacks"]})
        t.should_stop = bool(saved["should_stop"])
        _load_results(t, saved["results"])
        connector = t._logger_connector
        connector._callback_metrics = dict(saved["callback_metrics"])
        connector._logged_metrics = dict(saved["logged_metrics"])
        connector._progress_bar_metrics = dict(saved["progress_bar_metrics"])
        for generator, state in zip(_generators(t), saved["generators"], strict=True):
            generator.set_state(state)
        self.owner._tail = bool(saved["tail"])


def _load_loop(loop: _Loop, saved: dict[str, Any], prefix: str = "") -> None:
    loop._load_from_state_dict(saved.copy(), prefix)
    for key, child in vars(loop).items():
        if isinstance(child, _Loop):
            _load_loop(child, saved, f"{prefix}{key}.")


def _results_state(results: _ResultCollection) -> list[dict[str, Any]] | None:
    """The training epoch's logged results; None when one is a torchmetrics object (its
    state is the metric's own, not captured)."""
    if not all(metric.is_tensor for metric in results.values()):
        return None
    return [_metric_state(key, metric) for key, metric in results.items()]


def _metric_state(key: str, metric: _ResultMetric) -> dict[str, Any]:
    meta = metric.meta
    return {
        "key": key,
        "fx": meta.fx,
        "name": meta.name,
        "prog_bar": meta.prog_bar,
        "logger": meta.logger,
        "on_step": meta.on_step,
        "on_epoch": meta.on_epoch,
        "reduce_fx": meta.reduce_fx.__name__,
        "enable_graph": meta.enable_graph,
        "add_dataloader_idx": meta.add_dataloader_idx,
        "metric_attribute": meta.metric_attribute,
        "sync": meta.sync.should,
        "rank_zero_only": meta.sync.rank_zero_only,
        "value": metric.value,
        "cumulated_batch_size": getattr(metric, "cumulated_batch_size", None),
        "forward_cache": metric._forward_cache,
        "computed": metric._computed,
        "has_reset": metric.has_reset,
        "update_count": metric._update_count,
    }


def _load_results(trainer: Trainer, saved: list[dict[str, Any]]) -> None:
    """The training epoch's logged results as they were at the checkpoint: each made as
    ``LightningModule.log`` makes it (so the epoch's later logs find the same metadata),
    then given its saved state."""
    results: _ResultCollection = trainer.fit_loop.epoch_loop._results
    results.clear()
    for item in saved:
        reduce_fx = item["reduce_fx"]
        results.log(
            item["fx"],
            item["name"],
            torch.zeros((), dtype=item["value"].dtype),
            prog_bar=item["prog_bar"],
            logger=item["logger"],
            on_step=item["on_step"],
            on_epoch=item["on_epoch"],
            reduce_fx=getattr(torch, reduce_fx) if reduce_fx in _REDUCTIONS else reduce_fx,
            enable_graph=item["enable_graph"],
            add_dataloader_idx=item["add_dataloader_idx"],
            batch_size=1,
            sync_dist=item["sync"],
            sync_dist_fn=trainer.strategy.reduce,
            metric_attribute=item["metric_attribute"],
            rank_zero_only=item["rank_zero_only"],
        )
        metric = results[item["key"]]
        metric.value = item["value"]
        if item["cumulated_batch_size"] is not None:
            metric.cumulated_batch_size = item["cumulated_batch_size"]
        metric._forward_cache = item["forward_cache"]
        metric._computed = item["computed"]
        metric.has_reset = bool(item["has_reset"])
        metric._update_count = int(item["update_count"])


def _generators(trainer: Trainer) -> list[torch.Generator]:
    """The generators that draw the training data's order besides torch's global one."""
    loader = trainer.fit_loop._combined_loader
    found: list[torch.Generator] = []
    for dl in loader.flattened if loader is not None else []:
        for owner in (dl, getattr(dl, "sampler", None), getattr(dl, "batch_sampler", None)):
            generator = getattr(owner, "generator", None)
            if isinstance(generator, torch.Generator) and all(g is not generator for g in found):
                found.append(generator)
    return found


def _uncapturable_order(trainer: Trainer) -> str | None:
    """Why the training data's order cannot be put back from a checkpoint, or None."""
    from torch.utils.data import (
        BatchSampler,
        DataLoader,
        IterableDataset,
        RandomSampler,
        SequentialSampler,
    )
    from torch.utils.data.distributed import DistributedSampler

    loader = trainer.fit_loop._combined_loader
    for dl in loader.flattened if loader is not None else []:
        if not isinstance(dl, DataLoader):
            return f"the training data is a {type(dl).__name__}, not a DataLoader"
        if isinstance(dl.dataset, IterableDataset):
            return "the training data is an IterableDataset, whose position is not captured"
        if type(dl.batch_sampler) is not BatchSampler:
            return f"the DataLoader's batch sampler is a {type(dl.batch_sampler).__name__}"
        sampler = dl.batch_sampler.sampler
        if type(sampler) not in (RandomSampler, SequentialSampler, DistributedSampler):
            return f"the DataLoader's sampler is a {type(sampler).__name__}"
    return None


class RetrologCallback(Callback):
    """Records a Lightning ``Trainer``'s fit with retrolog: pass it in
    ``callbacks=[RetrologCallback()]``.

    checkpoints: False records without checkpoints (every replay then trains).
    """

    def __init__(self, checkpoints: bool = True) -> None:
        self.checkpoints = checkpoints
        self.trainer: Trainer | None = None
        self._scope: contextlib.ExitStack | None = None
        self._wrapped = False
        self._steps_open = False
        self._epochs_open = False
        self._tail = False  # the epoch's validation and its last step's end follow the block
        self._arguments: frozenset[str] = frozenset()
        self._names: dict[str, str] = {}  # a logged name -> the name it is stored under
        for hook in _SKIPPED_HOOKS:
            # A subclass that defines one keeps it.
            if getattr(type(self), hook) is getattr(Callback, hook):
                setattr(self, hook, None)

    # -- the Trainer ------------------------------------------------------------------

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        self.trainer = trainer
        callbacks: list[Callback] = trainer.callbacks  # type: ignore[attr-defined]
        if self in callbacks and callbacks[0] is not self:
            # First, so the epoch and step contexts are open before any other callback's
            # hook runs. Moved while the hook iterates the list: the element after this
            # one stays at the index it visits next, so none is skipped or repeated.
            callbacks.remove(self)
            callbacks.insert(0, self)
        self._record_arguments(trainer, pl_module)
        self._names = {}
        version = lightning.__version__
        self._wrapped = False
        if not _tested(version):
            # Its loops' internals (what is wrapped, what a checkpoint restores) may differ.
            _say(
                f"Lightning {version} is not a version this integration was tested with "
                f"({', '.join(v + 'x' for v in TESTED)}); training is recorded without "
                "checkpoints (a replay trains every epoch), and logged values only at "
                "epoch ends."
            )
            if vars(self).get("on_train_batch_start", False) is None:
                # No wrapped connector to open the steps: the hook does, as the public API.
                self.on_train_batch_start = self._begin_step  # type: ignore[method-assign]
            return
        self._wrap(trainer)
        self._wrapped = True

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if not (self._wrapped and self.checkpoints):
            return
        why = _uncapturable_order(trainer)
        if why is not None:
            _say(f"{why}; training is recorded without checkpoints (a replay trains every epoch).")
            return
        # The loop state first: a checkpoint it refuses is refused before the module changes.
        objects: dict[str, Any] = {"fit_loop": _LoopState(self, trainer), "model": pl_module}
        for i, optimizer in enumerate(trainer.optimizers):
            objects[f"optimizer{i or ''}"] = optimizer
        for i, config in enumerate(trainer.lr_scheduler_configs):
            objects[f"lr_scheduler{i or ''}"] = config.scheduler
        objects["precision"] = trainer.precision_plugin
        self._scope = contextlib.ExitStack()
        self._scope.enter_context(rl.checkpointing(**objects))

    def _record_arguments(self, trainer: Trainer, pl_module: LightningModule) -> None:
        hparams: dict[str, Any] = dict(_flat(dict(pl_module.hparams_initial)))
        datamodule = getattr(trainer, "datamodule", None)
        if datamodule is not None:
            hparams.update(_flat(dict(datamodule.hparams_initial)))
        values = dict(hparams)
        for name in TRAINER_ARGUMENTS:
            value = getattr(trainer, name, None)
            if _plain(value):
                # An hparam of the same name keeps the plain name.
                values[f"trainer.{name}" if name in hparams else name] = value
        seed = os.environ.get("PL_GLOBAL_SEED")
        if seed is not None and seed.lstrip("-").isdigit() and "seed" not in values:
            values["seed"] = int(seed)
        for callback in trainer.callbacks:  # type: ignore[attr-defined]
            # LightningCLI's parsed configuration, which its SaveConfigCallback holds.
            if type(callback).__name__ == "SaveConfigCallback":
                config = getattr(callback, "config", None)
                as_dict = getattr(config, "as_dict", None)
                if callable(as_dict):
                    values.update(_flat(as_dict()))
        values = {k: v for k, v in values.items() if not k.startswith("_")}
        # As argparse's values are: typed run-level values, which a replay compares.
        _api.parsed_values(values)
        self._arguments = frozenset(values)

    def _wrap(self, trainer: Trainer) -> None:
        """Wrap, on this Trainer only, the loop calls that carry what the callback hooks
        do not see: each step's logged values, the end of the epoch's steps before its
        validation, and the epoch's training (skipped when the replay restores it)."""
        if trainer in _WRAPPED:
            return
        _WRAPPED.add(trainer)
        fit_loop = trainer.fit_loop
        epoch_loop = fit_loop.epoch_loop
        connector = trainer._logger_connector
        advance = fit_loop.advance
        step_end = epoch_loop.on_advance_end
        batch_start = connector.on_batch_start
        step_metrics = connector.update_train_step_metrics
        epoch_metrics = connector.update_train_epoch_metrics
        eval_metrics = connector.log_eval_end_metrics

        def fit_advance() -> None:
            if self._scope is None or not rl.restore_block():
                return advance()
            # Restored: the state at the end of the epoch's steps. The rest of the epoch
            # loop runs as it did: the last step's end (validation) when it was to come.
            if self._tail and fit_loop._data_fetcher is not None:
                epoch_loop.on_advance_end(fit_loop._data_fetcher)
            epoch_loop.on_iteration_done()
            return None

        def epoch_step_end(data_fetcher: Any) -> None:
            if self._steps_open and epoch_loop._is_training_done:
                # The epoch's last step: its block ends before validation runs.
                self._tail = True
                self._end_steps()
            try:
                step_end(data_fetcher)
            finally:
                self._tail = False

        def on_batch_start(batch: Any, *dataloader_idx: Any) -> None:
            batch_start(batch, *dataloader_idx)
            if not dataloader_idx:
                # A training batch (the evaluation loop passes its dataloader's index), just
                # before the batch's hooks: its step opens here rather than in
                # on_train_batch_start, which costs Lightning a hook dispatch per step.
                rl.begin("step", epoch_loop.global_step)
                self._steps_open = True

        def train_step_metrics() -> None:
            # trainer._results once: each read resolves the active loop (a dozen calls).
            results = trainer._results if self._steps_open else None
            if results is not None:
                for name, value in _step_values(results):
                    self._log(name, value)
            step_metrics()

        def train_epoch_metrics() -> None:
            for name, value in connector.metrics["log"].items():
                self._log(name, value)
            epoch_metrics()

        def eval_end_metrics(metrics: dict[str, Any]) -> None:
            if not trainer.sanity_checking and trainer.training is False and self._epochs_open:
                for name, value in metrics.items():
                    self._log(name, value)
            eval_metrics(metrics)

        # Instance attributes: other Trainers, and the classes, are left as they are.
        vars(fit_loop)["advance"] = fit_advance
        vars(epoch_loop)["on_advance_end"] = epoch_step_end
        vars(connector).update(
            on_batch_start=on_batch_start,
            update_train_step_metrics=train_step_metrics,
            update_train_epoch_metrics=train_epoch_metrics,
            log_eval_end_metrics=eval_end_metrics,
        )

    # -- the loop's events ------------------------------------------------------------

    def on_train_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        rl.begin("epoch", trainer.current_epoch)
        self._epochs_open = True

    def _begin_step(
        self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int
    ) -> None:
        rl.begin("step", trainer.global_step)
        self._steps_open = True

    def on_train_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._end_steps()  # an epoch that ended before its last step (should_stop)
        if not self._wrapped:
            for name, value in trainer.callback_metrics.items():
                self._log(name, value)

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._end_epochs()

    def on_exception(
        self, trainer: Trainer, pl_module: LightningModule, exception: BaseException
    ) -> None:
        # The run records the crash; its scope closes without a last checkpoint.
        if self._scope is not None:
            scope, self._scope = self._scope, None
            with contextlib.suppress(Exception):
                scope.__exit__(type(exception), exception, exception.__traceback__)

    def _end_steps(self) -> None:
        if self._steps_open:
            self._steps_open = False
            rl.end("step")  # the epoch's block ends: the adaptive rule's checkpoint point

    def _end_epochs(self) -> None:
        self._end_steps()
        if self._epochs_open:
            self._epochs_open = False
            with contextlib.suppress(UsageError):
                rl.end("epoch")
        if self._scope is not None:
            scope, self._scope = self._scope, None
            scope.close()

    def _log(self, name: str, value: Any) -> None:
        stored = self._names.get(name)
        if stored is None:
            # Once per name and run: this runs at every step.
            stored = name
            if name in LOOP_NAMES or name in self._arguments:
                # Kept, beside the loop column or the argument of the same name.
                stored = f"train/{name}"
            if _volatile_name(stored):
                rl.volatile(stored)
            self._names[name] = stored
        rl.log(stored, value.item() if type(value) is torch.Tensor else _number(value))


def _step_values(results: _ResultCollection) -> Iterator[tuple[str, torch.Tensor]]:
    """The values logged at this step for the loggers: what ``results.metrics(True)["log"]``
    holds, without the callback and progress-bar dictionaries it builds besides, which
    cost more than the step's own logging does on a small model."""
    for result_metric in results.values():
        meta = result_metric.meta
        if (
            not meta.on_step
            or not meta.logger
            or result_metric.has_reset
            or meta.dataloader_idx != results.dataloader_idx
        ):
            continue
        value = result_metric._forward_cache
        if isinstance(value, torch.Tensor):
            yield results._forked_name(result_metric, True)[1], value


def _number(value: Any) -> Any:
    item = getattr(value, "item", None)
    value = item() if callable(item) else value
    return float(value) if isinstance(value, float) and not math.isnan(value) else value


def _say(message: str) -> None:
    print(f"retrolog: {message}", file=sys.stderr)


def patch_trainer() -> None:
    """Give every Lightning Trainer made from now on a RetrologCallback (``rl.autolog()``)."""
    original = Trainer.__init__
    if getattr(original, "_retrolog", False):
        return

    def __init__(self: Trainer, *args: Any, **kwargs: Any) -> None:
        callbacks = kwargs.get("callbacks")
        if isinstance(callbacks, Callback):
            callbacks = [callbacks]
        callbacks = list(callbacks or [])
        if not any(isinstance(c, RetrologCallback) for c in callbacks):
            kwargs["callbacks"] = [RetrologCallback(), *callbacks]
        original(self, *args, **kwargs)

    __init__._retrolog = True  # type: ignore[attr-defined]
    Trainer.__init__ = __init__  # type: ignore[method-assign]
