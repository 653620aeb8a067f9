"""The numerical environment of a run: what changes floating-point results besides its code.

Two runs of the same code on the same data give bit-identical values only in
the same numerical environment. Much of it is set by the script's own code,
which replay executes again (``torch.manual_seed``, ``torch.set_num_threads``
called by the script); the rest comes from outside the code, and a replay
worker would otherwise get whatever the replaying machine and shell give it:

==================  ===========================================================
torch threads       intra-op threads decide how reductions are split, so their
                    count changes sums in the last bits (a CNN's loss differed
                    in 69 of 80 steps with 1 thread instead of 2); inter-op
                    threads are recorded too
torch flags         deterministic algorithms, cuDNN deterministic / benchmark /
                    TF32, CUDA matmul TF32 and reduced-precision reductions,
                    float32 matmul precision, oneDNN on or off
environment         thread counts of OpenMP, MKL, OpenBLAS and friends, MKL's
                    reproducibility mode, the ISA torch and oneDNN may use,
                    CUBLAS_WORKSPACE_CONFIG, PYTHONHASHSEED (set order)
machine             CPU model and cores, CUDA devices, torch/numpy/Python
                    versions: not reproducible here, so only compared
==================  ===========================================================

A run records all of it (:func:`capture`, :func:`torch_state`); a replay
worker gets the recorded environment variables at launch and applies the
recorded torch state as soon as torch is imported (:func:`apply_in_worker`),
before the script's own code runs; what the script sets itself it sets
again. The replay plan lists what cannot be reproduced
(:func:`differences`), and the worker reports what it actually ran with, so a
difference is never silent (docs/replay.md, "The numerical environment").
"""

from __future__ import annotations

import contextlib
import importlib.abc
import importlib.machinery
import importlib.util
import os
import platform
import sys
import warnings
from collections.abc import Callable, Mapping, Sequence
from types import ModuleType
from typing import Any

# Variables read by the libraries training scripts use, whose values change results:
# thread counts (a different split of a reduction rounds differently), reproducibility
# and instruction-set switches, and the hash seed (set iteration order).
ENV_VARIABLES: tuple[str, ...] = (
    "OMP_NUM_THREADS",
    "MKL_NUM_THREADS",
    "OPENBLAS_NUM_THREADS",
    "BLIS_NUM_THREADS",
    "VECLIB_MAXIMUM_THREADS",
    "NUMEXPR_NUM_THREADS",
    "MKL_CBWR",
    "MKL_ENABLE_INSTRUCTIONS",
    "MKL_DEBUG_CPU_TYPE",
    "KMP_DETERMINISTIC_REDUCTION",
    "ATEN_CPU_CAPABILITY",
    "DNNL_MAX_CPU_ISA",
    "ONEDNN_MAX_CPU_ISA",
    "DNNL_DEFAULT_FPMATH_MODE",
    "ONEDNN_DEFAULT_FPMATH_MODE",
    "CUBLAS_WORKSPACE_CONFIG",
    "NVIDIA_TF32_OVERRIDE",
    "TORCH_ALLOW_TF32_CUBLAS_OVERRIDE",
    "PYTHONHASHSEED",
)

# (key in the recorded state, how to read it from the torch module, how to set it).
# Read and set defensively: an attribute a torch version lacks is skipped, and the
# older TF32 switches may warn about their newer spelling.
_Getter = Callable[[Any], Any]
_Setter = Callable[[Any, Any], None]


def _set_attr(path: str) -> tuple[_Getter, _Setter]:
    *owner, name = path.split(".")

    def resolve(torch: Any) -> Any:
        obj = torch
        for part in owner:
            obj = getattr(obj, part)
        return obj

    return (lambda torch: getattr(resolve(torch), name)), (
        lambda torch, value: setattr(resolve(torch), name, value)
    )


def _deterministic(torch: Any, value: Any) -> None:
    enabled, warn_only = value
    torch.use_deterministic_algorithms(bool(enabled), warn_only=bool(warn_only))


# In the order they are applied: the float32 matmul precision first, since setting it
# also sets the older TF32 switches (and setting those after it to other values is what
# torch calls mixing the legacy and new APIs).
_FLAGS: tuple[tuple[str, _Getter, _Setter], ...] = (
    (
        "deterministic_algorithms",
        lambda t: [
            bool(t.are_deterministic_algorithms_enabled()),
            bool(t.is_deterministic_algorithms_warn_only_enabled()),
        ],
        _deterministic,
    ),
    (
        "float32_matmul_precision",
        lambda t: t.get_float32_matmul_precision(),
        lambda t, v: t.set_float32_matmul_precision(v),
    ),
    ("fp32_precision", *_set_attr("backends.fp32_precision")),
    ("cuda_matmul_fp32_precision", *_set_attr("backends.cuda.matmul.fp32_precision")),
    ("cudnn_conv_fp32_precision", *_set_attr("backends.cudnn.conv.fp32_precision")),
    ("cudnn_rnn_fp32_precision", *_set_attr("backends.cudnn.rnn.fp32_precision")),
    ("mkldnn_matmul_fp32_precision", *_set_attr("backends.mkldnn.matmul.fp32_precision")),
    ("mkldnn_conv_fp32_precision", *_set_attr("backends.mkldnn.conv.fp32_precision")),
    ("mkldnn_rnn_fp32_precision", *_set_attr("backends.mkldnn.rnn.fp32_precision")),
    ("cudnn_enabled", *_set_attr("backends.cudnn.enabled")),
    ("cudnn_deterministic", *_set_attr("backends.cudnn.deterministic")),
    ("cudnn_benchmark", *_set_attr("backends.cudnn.benchmark")),
    ("cudnn_allow_tf32", *_set_attr("backends.cudnn.allow_tf32")),
    ("cuda_matmul_allow_tf32", *_set_attr("backends.cuda.matmul.allow_tf32")),
    (
        "cuda_matmul_fp16_reduced_precision",
        *_set_attr("backends.cuda.matmul.allow_fp16_reduced_precision_reduction"),
    ),
    (
        "cuda_matmul_bf16_reduced_precision",
        *_set_attr("backends.cuda.matmul.allow_bf16_reduced_precision_reduction"),
    ),
    ("mkldnn_enabled", *_set_attr("backends.mkldnn.enabled")),
)


def capture() -> dict[str, Any]:
    """The environment of this process now: variables, machine, and torch's state if imported."""
    state: dict[str, Any] = {
        "env": {name: os.environ.get(name) for name in ENV_VARIABLES},
        "machine": machine(),
    }
    torch = sys.modules.get("torch")
    if torch is not None:
        state["torch_at_start"] = torch_state(torch)
    return state


def machine() -> dict[str, Any]:
    """What the replaying machine is compared on: CPU model and counts."""
    try:
        affinity: int | None = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        affinity = None
    return {"cpu": cpu_model(), "logical_cpus": os.cpu_count(), "affinity": affinity}


def cpu_model() -> str:
    """The CPU's model name (Linux's /proc/cpuinfo; elsewhere what platform knows)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as lines:
            for line in lines:
                key, sep, value = line.partition(":")
                if sep and key.strip() in ("model name", "Model", "cpu model"):
                    return value.strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def torch_state(torch: Any) -> dict[str, Any]:
    """Torch's threads, numerical flags, version, CPU kernel set and devices."""
    state: dict[str, Any] = {"version": str(getattr(torch, "__version__", ""))}
    with _quiet():
        for key, getter in (
            ("intra_op_threads", lambda t: int(t.get_num_threads())),
            ("inter_op_threads", lambda t: int(t.get_num_interop_threads())),
            ("cpu_capability", lambda t: str(t.backends.cpu.get_cpu_capability())),
            *((key, get) for key, get, _ in _FLAGS),
        ):
            with contextlib.suppress(Exception):
                state[key] = getter(torch)
        cuda = getattr(torch, "cuda", None)
        # Only a script that already uses CUDA is asked about its devices: querying
        # them initializes CUDA, which a DataLoader forking later would not survive.
        if cuda is not None and _call(cuda, "is_initialized"):
            with contextlib.suppress(Exception):
                count = int(cuda.device_count())
                state["cuda_devices"] = [str(cuda.get_device_name(i)) for i in range(count)]
    return state


def _call(obj: Any, name: str) -> Any:
    func = getattr(obj, name, None)
    try:
        return func() if callable(func) else None
    except Exception:  # a CPU-only or broken CUDA build: no devices
        return None


@contextlib.contextmanager
def _quiet() -> Any:
    # Newer torch versions warn when the older TF32 switches are read or set.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def training_threads(state: Mapping[str, Any] | None) -> int | None:
    """Torch's intra-op threads when training started (first top-level loop), if known."""
    if not state:
        return None
    for key in ("torch", "torch_at_start"):
        threads = (state.get(key) or {}).get("intra_op_threads")
        if isinstance(threads, int) and threads > 0:
            return threads
    return None


# -- in a replay worker ------------------------------------------------------------------


def worker_environment(
    base: Mapping[str, str], recorded: Mapping[str, Any] | None
) -> dict[str, str]:
    """``base`` with the recorded variables put back: set as they were, or removed."""
    env = dict(base)
    recorded_env = (recorded or {}).get("env")
    if not isinstance(recorded_env, Mapping):
        return env  # recorded before retrolog kept it: leave the environment as it is
    for name in ENV_VARIABLES:
        value = recorded_env.get(name)
        if isinstance(value, str):
            env[name] = value
        else:
            env.pop(name, None)
    return env


def apply_torch(torch: Any, wanted: Mapping[str, Any]) -> list[str]:
    """Set torch's threads and flags to ``wanted``; returns what could not be set, and why."""
    problems: list[str] = []
    with _quiet():
        threads = wanted.get("intra_op_threads")
        if isinstance(threads, int) and threads > 0 and torch.get_num_threads() != threads:
            torch.set_num_threads(threads)
        inter = wanted.get("inter_op_threads")
        if isinstance(inter, int) and inter > 0:
            try:
                if torch.get_num_interop_threads() != inter:
                    torch.set_num_interop_threads(inter)
            except RuntimeError as exc:  # only settable before inter-op work starts
                problems.append(f"inter-op threads stay {torch.get_num_interop_threads()} ({exc})")
        for key, getter, setter in _FLAGS:
            if key not in wanted:
                continue
            try:
                if getter(torch) != wanted[key]:
                    setter(torch, wanted[key])
            except Exception as exc:  # a flag this torch lacks, or cannot set here
                problems.append(f"{key} not set to {wanted[key]!r} ({exc})")
    return problems


class _AfterImport(importlib.abc.MetaPathFinder):
    """Calls ``then(module)`` right after ``name`` is imported, before anyone uses it."""

    def __init__(self, name: str, then: Callable[[ModuleType], None], key: str) -> None:
        self.name = name
        self.then = then
        self.key = key

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname != self.name:
            return None
        with contextlib.suppress(ValueError):
            sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)
        loader = spec.loader if spec is not None else None
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        execute = loader.exec_module
        then = self.then

        def exec_module(module: ModuleType) -> None:
            execute(module)
            then(module)

        loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


def apply_in_worker(wanted: Mapping[str, Any], problems: list[str]) -> None:
    """Apply the recorded torch state now if torch is imported, else right after its import.

    problems: filled with what could not be applied (the worker reports them).
    """

    def apply(torch: ModuleType) -> None:
        problems.extend(apply_torch(torch, wanted))

    after_import("torch", apply, key="numerics")


def after_import(name: str, then: Callable[[ModuleType], None], *, key: str) -> None:
    """Call ``then(module)`` now if ``name`` is imported, else right after its import.

    key: who asks; a second request with the same key while the first waits is dropped,
    requests with different keys are all made.
    """
    module = sys.modules.get(name)
    if module is not None:
        then(module)
    elif not any(isinstance(f, _AfterImport) and f.key == key for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterImport(name, then, key))


# -- comparing environments --------------------------------------------------------------

# Torch state that only the device it runs on decides; the rest the worker sets.
_DEVICE_KEYS = ("cpu_capability", "cuda_devices")


def differences(
    recorded: Mapping[str, Any] | None,
    packages: Mapping[str, str] | None,
    recorded_python: str | None,
    *,
    here: Mapping[str, Any] | None = None,
    here_packages: Mapping[str, str] | None = None,
) -> list[str]:
    """What of a run's recorded environment a replay on this machine cannot reproduce.

    recorded: the run's ``numerics``; packages: its package versions; here,
    here_packages: this machine's (measured when None). Returns one phrase each,
    e.g. "torch 2.12.0 then, 2.13.0 here".
    """
    found: list[str] = []
    here_packages = here_packages if here_packages is not None else installed_versions()
    for name in ("torch", "numpy", "jax", "tensorflow"):
        then = (packages or {}).get(name)
        now = here_packages.get(name)
        if then and then != now:
            found.append(f"{name} {then} then, {now or 'not installed'} here")
    if recorded_python and recorded_python != platform.python_version():
        found.append(f"Python {recorded_python} then, {platform.python_version()} here")
    if not recorded:
        return found
    here = here if here is not None else {"machine": machine()}
    cpu_then = (recorded.get("machine") or {}).get("cpu")
    cpu_now = (here.get("machine") or {}).get("cpu")
    if cpu_then and cpu_now and cpu_then != cpu_now:
        found.append(f"CPU {cpu_then!r} then, {cpu_now!r} here (kernels chosen per CPU)")
    devices = (recorded.get("torch") or recorded.get("torch_at_start") or {}).get("cuda_devices")
    if devices:
        now_devices = here.get("cuda_devices")
        if now_devices is None:
            now_devices = gpu_names()
        if list(devices) != list(now_devices[: len(devices)]):
            shown = ", ".join(now_devices) or "no GPU"
            found.append(f"GPUs {', '.join(devices)} then, {shown} here")
    return found


def worker_differences(recorded: Mapping[str, Any] | None, ran: Mapping[str, Any]) -> list[str]:
    """Where the torch state a worker trained with differs from the recorded one."""
    then = (recorded or {}).get("torch") or (recorded or {}).get("torch_at_start") or {}
    found = []
    for key, value in ran.items():
        if key in ("version", *_DEVICE_KEYS) or key not in then:
            continue
        if then[key] != value:
            found.append(f"{key.replace('_', ' ')} {then[key]!r} then, {value!r} in replay")
    for key in _DEVICE_KEYS:
        if key in then and key in ran and then[key] != ran[key]:
            found.append(f"{key.replace('_', ' ')} {then[key]!r} then, {ran[key]!r} in replay")
    return found


def installed_versions() -> dict[str, str]:
    """Versions of the packages that decide numerics, without importing them."""
    from importlib import metadata

    versions = {}
    for name in ("torch", "numpy", "jax", "tensorflow"):
        with contextlib.suppress(metadata.PackageNotFoundError):
            versions[name] = metadata.version(name)
    return versions


def gpu_names() -> list[str]:
    """This machine's NVIDIA GPUs, by ``nvidia-smi -L``, without importing torch."""
    import shutil
    import subprocess

    smi = shutil.which("nvidia-smi")
    if smi is None:
        return []
    try:
        out = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return []
    names = []
    for line in out.stdout.splitlines():
        if line.startswith("GPU "):
            name = line.split(":", 1)[1].split("(UUID")[0].strip()
            names.append(name)
    return names
