"""ReplayRequest (_replay/request.py): the replay options defined once.

Its ``argv()`` is what the dashboard runs as ``retrolog replay``: parsed by the
command's own option parser it must give back the same options, so the two never
drift apart. Options given both as keywords and as a request are refused.
"""

from __future__ import annotations

from pathlib import Path

import pytest

import retrolog
from retrolog._replay.request import ReplayRequest
from retrolog.cli import replay_command
from retrolog.errors import UsageError

REQUESTS = [
    ReplayRequest("w_norm"),
    ReplayRequest(" w_norm, grad_norm ", "lr > 0.01 AND run_id IN ('a')", workers=3, force=True),
    ReplayRequest(["acc"], script="sub/train.py", threads=2, reuse=False, allow_inexact=True),
    ReplayRequest(verify=True, where="lr > 0.5", dry_run=True),
    ReplayRequest("w", executor="ray", ray_address="10.0.0.5:6379", yes=True),
]


@pytest.mark.parametrize("request_", REQUESTS)
def test_argv_parses_back_into_the_same_request(request_: ReplayRequest) -> None:
    argv = request_.argv()
    assert argv[0] == "replay"
    params = replay_command.make_context("replay", argv[1:]).params
    names, where = params["names"], params["where"]
    if params["verify"]:  # the command takes --verify's WHERE as its first argument
        names, where = None, names
    parsed = ReplayRequest(
        names or (), where, script=params["script"], workers=params["workers"],
        threads=params["threads"], dry_run=params["dry_run"], force=params["force"],
        verify=params["verify"], reuse=not params["no_reuse"],
        allow_inexact=params["allow_inexact"], executor=params["executor"],
        ray_address=params["ray_address"], yes=params["yes"],
    )  # fmt: skip
    assert parsed == request_


def test_names_are_one_list_however_given() -> None:
    assert ReplayRequest("a, b,,c").names == ("a", "b", "c")
    assert ReplayRequest([" a ", ""]).names == ("a",)


@pytest.mark.parametrize(
    ("request_", "says"),
    [
        (ReplayRequest(), "Name at least one log statement"),
        (ReplayRequest("w", verify=True), "--verify replays the statements each run recorded"),
        (ReplayRequest("w", threads=0), "--threads needs a positive number"),
    ],
)
def test_a_request_that_cannot_run_says_what_to_change(request_: ReplayRequest, says: str) -> None:
    with pytest.raises(UsageError, match=says):
        request_.checked()


def test_project_replay_takes_keywords_or_a_request_not_both(tmp_path: Path) -> None:
    project = retrolog.Project(tmp_path)
    with pytest.raises(UsageError, match="either as keywords or as request="):
        project.replay(request=ReplayRequest("w"), force=True)
