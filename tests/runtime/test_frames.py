"""The locals a checkpoint carries: which ones a block rebound.

At module level a frame's locals are the module's globals: rebinding a name
frees the old object at once, and a new object may get its address. These run
the code as a module does, through exec.
"""

from __future__ import annotations

import pickle
from typing import Any

from retrolog.runtime import frames


def _module(code: str) -> dict[str, Any]:
    namespace: dict[str, Any] = {"frames": frames, "pickle": pickle}
    exec(compile(code, "<script>", "exec"), namespace)
    return namespace


def test_a_local_rebound_onto_a_reused_address_still_counts_as_rebound() -> None:
    found = _module(
        "import sys\n"
        "frame = sys._getframe()\n"
        "value = float('1.5')\n"
        "first = id(value)\n"
        "before = frames.local_ids(frame)\n"
        "value = float('2.5')\n"
        "value = float('3.5')\n"
        "blob = frames.capture(frame, before, frozenset())\n"
        "captured = frames.load(blob)[0]\n"
        # The same steps holding bare ids: 1.5 is freed at the first rebinding and
        # CPython's float free list hands its address to 3.5.
        "value = float('1.5')\n"
        "plain = id(value)\n"
        "value = float('2.5')\n"
        "value = float('3.5')\n"
        "reused = id(value) == plain\n"
    )
    assert found["captured"]["value"] == 3.5
    assert found["reused"]  # what made bare ids miss the rebinding


def test_nothing_is_kept_alive_and_an_untouched_local_is_left_out() -> None:
    found = _module(
        "import sys, weakref\n"
        "class Big:\n"
        "    pass\n"
        "frame = sys._getframe()\n"
        "big = Big()\n"
        "kept = 7\n"
        "before = frames.local_ids(frame)\n"
        "watch = weakref.ref(big)\n"
        "big = Big()\n"
        "alive = watch() is not None\n"
        "loaded = frames.load(frames.capture(frame, before, frozenset()))\n"
    )
    assert not found["alive"]
    assert "kept" not in found["loaded"][0]
    assert "big" in found["loaded"][1]


def test_a_hidden_state_is_captured_and_what_does_not_fit_is_listed() -> None:
    """Smallest first within the frame's budget: the state, the counters; not the big output."""
    found = _module(
        "import sys, torch\n"
        "frame = sys._getframe()\n"
        "before = frames.local_ids(frame)\n"
        "hidden = (torch.randn(2, 20, 128), torch.randn(2, 20, 128))\n"
        "total = 3.25\n"
        "output = torch.randn(400, 1000)\n"  # 1.6 MB: more than the whole budget
        "half = torch.randn(frames.MAX_FRAME_BYTES // 8)\n"  # half the budget each
        "other = torch.randn(frames.MAX_FRAME_BYTES // 8)\n"
        "loaded = frames.load(frames.capture(frame, before, frozenset()))\n"
    )
    values, missing = found["loaded"]
    assert [t.shape for t in values["hidden"]] == [(2, 20, 128), (2, 20, 128)]
    assert all(
        (kept == live).all() for kept, live in zip(values["hidden"], found["hidden"], strict=True)
    )
    assert values["total"] == 3.25
    # Of two half-budget tensors, one fits beside the small values; the other is listed.
    assert len({"half", "other"} & set(values)) == 1
    assert len({"half", "other"} & set(missing)) == 1
    assert "output" in missing and "output" not in values
