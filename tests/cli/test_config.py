"""Settings in one place: the environment over the store's config.toml over pyproject.toml.

Through a user's project and the retrolog command; the recording process reads
the same files, so a setting in pyproject.toml changes how a run records.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from retrolog import _config

from conftest import Project

SCRIPT = """
    import retrolog as rl
    w = [0.0]
    with rl.checkpointing(w=w):
        for epoch in rl.loop("epoch", range(3)):
            w[0] += 1.0
            rl.log("w", w[0])
"""


def settings(project: Project, **env: str) -> dict[str, dict[str, str]]:
    out = project.cli("config", "--json", **env)
    assert out.returncode == 0, out.stderr
    return {s["key"]: s for s in json.loads(out.stdout)}


def test_config_shows_each_setting_with_its_source(project: Project) -> None:
    found = settings(project)
    assert set(found) == {s.key for s in _config.SETTINGS}
    assert found["query_timeout"]["source"] == "default"
    assert found["query_timeout"]["value"] == "120"

    project.write("pyproject.toml", "[tool.retrolog]\nquery_timeout = 30\nprogress = false\n")
    found = settings(project, RETROLOG_PROGRESS="")
    assert found["query_timeout"]["value"] == "30"
    assert found["query_timeout"]["source"] == str(project.root / "pyproject.toml")
    assert found["progress"]["value"] == "0"

    # The store's own file wins over pyproject.toml, and the environment over both.
    project.write(".retrolog/config.toml", "query_timeout = 5\n")
    assert settings(project)["query_timeout"]["value"] == "5"
    env = settings(project, RETROLOG_QUERY_TIMEOUT="7")["query_timeout"]
    assert env == {**env, "value": "7", "source": "environment (RETROLOG_QUERY_TIMEOUT)"}

    text = project.cli("config").stdout
    assert f"query_timeout       5  ({project.root / '.retrolog' / 'config.toml'})" in text


def test_pyproject_settings_change_how_a_run_records(project: Project) -> None:
    project.write(
        "pyproject.toml",
        '[tool.retrolog]\nstore = "../shared-store"\ncheckpoints = "every"\n'
        "overhead_tolerance = 0.01\n",
    )
    project.write("train.py", SCRIPT)
    project.git("add", "-A")
    project.git("commit", "-qm", "settings")
    # The suite's own RETROLOG_CHECKPOINTS is unset here, so the file decides.
    project.run("train.py", RETROLOG_CHECKPOINTS="")
    store = project.root.parent / "shared-store"
    assert (store / "retrolog.db").exists()
    assert not (project.root / ".retrolog").exists()
    ((policy,),) = read_db_at(store, "SELECT checkpointing FROM runs")
    policy = json.loads(str(policy))
    assert policy["mode"] == "every" and policy["overhead_tolerance"] == 0.01
    assert settings(project)["store"]["value"] == str(store.resolve())
    # Readers find the same store: the run is listed.
    out = project.cli("runs", "--json")
    assert out.returncode == 0, out.stderr
    assert len(json.loads(out.stdout)) == 1


def read_db_at(store: Path, sql: str) -> list[tuple[object, ...]]:
    import sqlite3

    conn = sqlite3.connect(store / "retrolog.db")
    try:
        return conn.execute(sql).fetchall()
    finally:
        conn.close()


@pytest.mark.parametrize(
    ("where", "text", "says"),
    [
        ("pyproject.toml", "[tool.retrolog]\nquery_timout = 3\n", "'query_timout', which is not"),
        ("pyproject.toml", "[tool.retrolog\nquery_timeout = 3\n", "is not valid TOML"),
        (".retrolog/config.toml", "trust_pickles = true\n", "only the environment variable"),
        (".retrolog/config.toml", 'store = "x"\n', "lives in the store itself"),
        ("pyproject.toml", "[tool.retrolog]\nquery_timeout = [1]\n", "must be a string"),
    ],
)
def test_a_bad_settings_file_is_one_clear_paragraph(
    project: Project, where: str, text: str, says: str
) -> None:
    project.write(where, text)
    out = project.cli("config")
    assert out.returncode != 0
    assert says in " ".join(out.stderr.split())
    assert "Traceback" not in out.stderr
    # A recording refuses it the same way before it writes anything.
    project.write("train.py", SCRIPT)
    run = project.run("train.py", check=False)
    assert run.returncode != 0 and says in " ".join(run.stderr.split())
    assert not (project.root / ".retrolog" / "retrolog.db").exists()


def test_trusting_pickles_comes_from_the_environment_alone(project: Project) -> None:
    assert settings(project)["trust_pickles"]["value"] == "0"
    found = settings(project, RETROLOG_TRUST_PICKLES="1")["trust_pickles"]
    assert found["value"] == "1" and found["source"].startswith("environment")


def test_lookup_prefers_the_environment_and_ignores_files_for_env_only_settings(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "pyproject.toml").write_text("[tool.retrolog]\nmax_in_flight = 4\n")
    _config.use(tmp_path, tmp_path / ".retrolog")
    try:
        monkeypatch.delenv("RETROLOG_MAX_IN_FLIGHT", raising=False)
        assert _config.lookup("RETROLOG_MAX_IN_FLIGHT") == "4"
        monkeypatch.setenv("RETROLOG_MAX_IN_FLIGHT", "3")
        assert _config.lookup("RETROLOG_MAX_IN_FLIGHT") == "3"
        monkeypatch.delenv("RETROLOG_TRUST_PICKLES", raising=False)
        assert _config.lookup("RETROLOG_TRUST_PICKLES") is None
        # An explicit mapping stands for the environment and the files (tests of readers).
        assert _config.lookup("RETROLOG_MAX_IN_FLIGHT", {}) is None
    finally:
        _config.use(tmp_path / "none", tmp_path / "none")


def test_passwords_in_urls_are_masked() -> None:
    assert (
        _config.mask("postgresql://ann:s3cr%40t@db:5432/runs")
        == "postgresql://ann:***@db:5432/runs"
    )
    assert _config.mask("s3://bucket/prefix") == "s3://bucket/prefix"
    assert _config.mask("postgresql://ann@db/runs") == "postgresql://ann@db/runs"


def test_config_never_prints_a_password(project: Project) -> None:
    url = "simplecache::s3://ann:hunter2@bucket/runs"
    out = project.cli("config", RETROLOG_OBJECTS_URL=url)
    assert out.returncode == 0, out.stderr
    assert "hunter2" not in out.stdout and "s3://ann:***@bucket/runs" in out.stdout
    assert "hunter2" not in project.cli("config", "--json", RETROLOG_OBJECTS_URL=url).stdout
