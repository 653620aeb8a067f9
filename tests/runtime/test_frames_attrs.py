"""The named objects' plain attributes a checkpoint carries (runtime/frames.py, capture_attrs).

A module keeps what the step loop collects (``model.rewards``) beside its
state_dict; a checkpoint carries that as data, restores it in place, and lists
an attribute it cannot carry only when the block changed it.
"""

from __future__ import annotations

import torch
from torch import nn

from retrolog.runtime import frames


class Agent(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(3, 2)
        self.rewards: list[float] = []
        self.saved: list[object] = []
        self.config = object()  # not data, and never changed
        self.tied = [self.fc.weight]  # the module's own parameter: its state_dict's
        self._cache = [torch.ones(1, requires_grad=True)]  # torch-style private: not carried


def _round_trip(model: Agent, before: dict[tuple[str, str], object]) -> tuple:
    blob = frames.capture(None, {}, frozenset(), {"model": model}, before)
    return frames.load_attrs(blob)


def test_plain_attributes_changed_in_a_block_are_carried_and_restored_in_place() -> None:
    model = Agent()
    before = frames.attr_ids({"model": model})
    model.rewards += [1.0, 0.5]
    model.saved.append((torch.arange(3.0), 1))
    model.steps = 7  # added in the block
    attrs, blocked = _round_trip(model, before)
    assert blocked == []
    carried = attrs["model"]
    assert carried["rewards"] == [1.0, 0.5] and carried["steps"] == 7
    assert "config" not in carried and "tied" not in carried and "_cache" not in carried
    assert "training" not in carried

    rewards = model.rewards
    model.rewards.clear()
    model.saved.clear()
    model.steps = 0
    frames.restore_attrs({"model": model}, attrs)
    assert model.rewards is rewards and model.rewards == [1.0, 0.5]
    state, action = model.saved[0]
    assert torch.equal(state, torch.arange(3.0)) and action == 1
    assert model.steps == 7
    assert model.tied[0] is model.fc.weight


def test_an_attribute_holding_autograd_history_is_listed_with_why() -> None:
    model = Agent()
    before = frames.attr_ids({"model": model})
    model.saved.append(model.fc(torch.ones(3)).sum())
    _, blocked = _round_trip(model, before)
    assert [b[:2] for b in blocked] == [["model", "saved"]]
    assert "autograd history" in blocked[0][2]
    assert "model.saved (it holds tensors that carry autograd history" in (
        frames.describe_blocked(blocked)
    )


def test_an_uncarried_attribute_the_block_left_alone_is_not_listed() -> None:
    model = Agent()
    model.saved.append(model.fc(torch.ones(3)).sum())  # before the block: not its doing
    before = frames.attr_ids({"model": model})
    model.rewards.append(1.0)
    attrs, blocked = _round_trip(model, before)
    assert blocked == [] and attrs["model"]["rewards"] == [1.0]
    # An item replaced (same length, another object) is a change.
    model.saved[0] = model.fc(torch.zeros(3)).sum()
    _, blocked = _round_trip(model, before)
    assert [b[:2] for b in blocked] == [["model", "saved"]]


def test_an_object_of_another_class_changed_in_the_block_is_listed() -> None:
    model = Agent()
    before = frames.attr_ids({"model": model})
    model.config = object()
    _, blocked = _round_trip(model, before)
    assert [b[:2] for b in blocked] == [["model", "config"]]
    assert "builtins.object" in blocked[0][2]


def test_an_optimizers_state_is_left_to_its_state_dict() -> None:
    model = Agent()
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    before = frames.attr_ids({"opt": opt})
    model.fc(torch.ones(3)).sum().backward()
    opt.step()
    blob = frames.capture(None, {}, frozenset(), {"opt": opt}, before)
    attrs, blocked = frames.load_attrs(blob)
    assert blocked == [] and attrs.get("opt", {}) == {}
