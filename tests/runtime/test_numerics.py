"""The numerical environment: what is recorded, how a worker gets it back, what is compared."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from retrolog.runtime import numerics

from conftest import Project, read_db


def test_a_run_records_its_variables_machine_and_torch_state(project: Project) -> None:
    pytest.importorskip("torch")
    project.write(
        "train.py",
        """
        import torch

        import retrolog as rl

        rl.arg("lr", 0.1)  # the run starts here, torch already imported
        torch.use_deterministic_algorithms(True)  # the script's own setting, before training
        for epoch in rl.loop("epoch", range(2)):
            rl.log("x", float(torch.ones(3).sum()))
        """,
    )
    project.run("train.py", MKL_CBWR="COMPATIBLE", OMP_NUM_THREADS="1")
    ((raw,),) = read_db(project.root, "SELECT numerics FROM runs")
    recorded = json.loads(str(raw))
    assert recorded["env"]["MKL_CBWR"] == "COMPATIBLE"
    assert recorded["env"]["OMP_NUM_THREADS"] == "1"
    assert recorded["env"]["CUBLAS_WORKSPACE_CONFIG"] is None
    assert recorded["machine"]["cpu"] == numerics.cpu_model()
    start, training = recorded["torch_at_start"], recorded["torch"]
    assert start["intra_op_threads"] == training["intra_op_threads"] == 1
    assert start["deterministic_algorithms"] == [False, False]
    assert training["deterministic_algorithms"] == [True, False]
    assert training["float32_matmul_precision"] == "highest"
    assert "cuda_devices" not in training  # CUDA was never initialized: not asked


def test_worker_environment_puts_back_exactly_the_recorded_variables() -> None:
    shell = {"OMP_NUM_THREADS": "1", "PATH": "/bin", "MKL_CBWR": "AUTO"}
    recorded = {"env": {name: None for name in numerics.ENV_VARIABLES}}
    recorded["env"]["MKL_CBWR"] = "COMPATIBLE"
    env = numerics.worker_environment(shell, recorded)
    assert env == {"PATH": "/bin", "MKL_CBWR": "COMPATIBLE"}
    # A run recorded before the environment was kept: the shell's, unchanged.
    assert numerics.worker_environment(shell, None) == shell


def test_torch_state_is_applied_and_what_cannot_be_is_reported() -> None:
    torch = pytest.importorskip("torch")
    before = numerics.torch_state(torch)
    try:
        problems = numerics.apply_torch(
            torch,
            {
                "intra_op_threads": 1,
                "deterministic_algorithms": [True, True],
                "float32_matmul_precision": "medium",
                "no_such_flag": True,
            },
        )
        assert problems == []  # unknown keys are ignored, not errors
        now = numerics.torch_state(torch)
        assert now["intra_op_threads"] == 1
        assert now["deterministic_algorithms"] == [True, True]
        assert now["float32_matmul_precision"] == "medium"
        differences = numerics.worker_differences({"torch": before}, now)
        assert any(d.startswith("intra op threads") for d in differences)
    finally:
        numerics.apply_torch(torch, before)
    assert numerics.torch_state(torch) == before


def test_the_state_is_applied_when_torch_is_imported_after_retrolog() -> None:
    pytest.importorskip("torch")
    code = (
        "import sys\n"
        "from retrolog.runtime import numerics\n"
        "problems = []\n"
        "numerics.apply_in_worker({'intra_op_threads': 1, 'float32_matmul_precision': 'high'},"
        " problems)\n"
        "assert 'torch' not in sys.modules\n"
        "import torch\n"
        "print(torch.get_num_threads(), torch.get_float32_matmul_precision(), problems)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    )
    assert out.stdout.split() == ["1", "high", "[]"]


def test_differences_name_what_cannot_be_reproduced() -> None:
    recorded = {
        "machine": {"cpu": "CPU A"},
        "torch": {"intra_op_threads": 2, "cuda_devices": ["NVIDIA A100"]},
    }
    here = {"machine": {"cpu": "CPU B"}, "cuda_devices": []}
    found = numerics.differences(
        recorded,
        {"torch": "2.1.0", "numpy": "1.26.0"},
        "3.10.0",
        here=here,
        here_packages={"torch": "2.13.0", "numpy": "1.26.0"},
    )
    assert "torch 2.1.0 then, 2.13.0 here" in found
    assert not any(d.startswith("numpy") for d in found)
    assert any(d.startswith("Python 3.10.0 then") for d in found) == (
        sys.version.split()[0] != "3.10.0"
    )
    assert any("'CPU A' then, 'CPU B' here" in d for d in found)
    assert "GPUs NVIDIA A100 then, no GPU here" in found
    same = numerics.differences(
        {"machine": {"cpu": "CPU A"}},
        {"torch": "2.13.0"},
        None,
        here={"machine": {"cpu": "CPU A"}},
        here_packages={"torch": "2.13.0"},
    )
    assert same == []
