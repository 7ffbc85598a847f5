"""The compute-sanitizer binary on this host: find it, ask its version, build its command line.

The parent never runs a kernel; the workflows run the command this module builds, and
``qmoe_doctor.diagnose.sanitizer_log`` reads what the tool wrote.
"""

from __future__ import annotations

import glob
import os
import re
import shutil
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from qmoe_doctor.core import knobs
from qmoe_doctor.core.compat import StrEnum

BINARY = "compute-sanitizer"
_VERSION_RE = re.compile(r"Version\s+(\d+(?:\.\d+)+)")


class SanitizerTool(StrEnum):
    MEMCHECK = "memcheck"  # out-of-bounds / misaligned accesses, hardware exceptions
    RACECHECK = "racecheck"  # shared-memory hazards only (global-memory races are invisible)
    SYNCCHECK = "synccheck"  # invalid barrier / synchronization use
    INITCHECK = "initcheck"  # reads of uninitialized global memory


@dataclass(frozen=True, slots=True, kw_only=True)
class SanitizerInfo:
    path: str
    version: str | None  # "2025.3.1.0" from `compute-sanitizer --version`; None if it did not say
    found_via: str  # "QMOE_DOCTOR_COMPUTE_SANITIZER", "PATH", "CUDA_HOME", or the directory searched

    @property
    def version_tuple(self) -> tuple[int, ...]:
        if not self.version:
            return ()
        return tuple(int(p) for p in self.version.split("."))


def _default_search_dirs(env: Mapping[str, str]) -> list[tuple[str, str]]:
    """(directory, label) pairs to look in after PATH, most specific first."""
    dirs: list[tuple[str, str]] = []
    for var in ("CUDA_HOME", "CUDA_PATH"):
        root = env.get(var)
        if root:
            dirs.append((os.path.join(root, "bin"), var))
            dirs.append((os.path.join(root, "compute-sanitizer"), var))
    dirs.append(("/usr/local/cuda/bin", "/usr/local/cuda/bin"))
    dirs.append(("/usr/local/cuda/compute-sanitizer", "/usr/local/cuda/compute-sanitizer"))
    # versioned toolkits, newest first (cuda-12.10 after cuda-12.9: compare numerically)
    for pattern in ("/usr/local/cuda-*/bin", "/usr/local/cuda-*/compute-sanitizer"):
        for d in sorted(glob.glob(pattern), key=_version_key, reverse=True):
            dirs.append((d, d))
    # the HPC SDK lays toolkits out as /opt/nvidia/hpc_sdk/Linux_x86_64/<ver>/cuda/<ver>/bin
    for pattern in (
        "/opt/nvidia/hpc_sdk/*/*/cuda/*/bin",
        "/opt/nvidia/hpc_sdk/*/*/cuda/*/compute-sanitizer",
        "/opt/nvidia/hpc_sdk/*/*/cuda/bin",
        "/opt/nvidia/*/bin",
    ):
        for d in sorted(glob.glob(pattern), key=_version_key, reverse=True):
            dirs.append((d, d))
    return dirs


def _version_key(path: str) -> tuple[int, ...]:
    return tuple(int(n) for n in re.findall(r"\d+", path))


def _is_executable(path: str) -> bool:
    return os.path.isfile(path) and os.access(path, os.X_OK)


def read_version(path: str, *, timeout_s: float = 20.0) -> str | None:
    """Ask the binary for its version; None if it does not answer in time or says no version."""
    try:
        out = subprocess.run(
            [path, "--version"], capture_output=True, text=True, timeout=timeout_s, check=False
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    match = _VERSION_RE.search(out.stdout + "\n" + out.stderr)
    return match.group(1) if match else None


def find_compute_sanitizer(
    *,
    env: Mapping[str, str] | None = None,
    search_dirs: Sequence[tuple[str, str]] | None = None,
    query_version: bool = True,
) -> SanitizerInfo | None:
    """Locate compute-sanitizer: $QMOE_DOCTOR_COMPUTE_SANITIZER, then PATH, then $CUDA_HOME /
    $CUDA_PATH, then the usual toolkit directories (newest first).

    When QMOE_DOCTOR_COMPUTE_SANITIZER is set it is the only candidate: a wrong explicit path
    must not be papered over by another binary found elsewhere. ``env`` and ``search_dirs``
    exist for tests.
    """
    env = os.environ if env is None else env
    explicit = env.get(knobs.QMOE_SANITIZER)
    if explicit:
        if not _is_executable(explicit):
            return None
        return SanitizerInfo(
            path=explicit,
            version=read_version(explicit) if query_version else None,
            found_via=knobs.QMOE_SANITIZER,
        )
    candidates: list[tuple[str, str]] = []
    on_path = shutil.which(BINARY, path=env.get("PATH", ""))
    if on_path:
        candidates.append((on_path, "PATH"))
    dirs = _default_search_dirs(env) if search_dirs is None else list(search_dirs)
    candidates.extend((os.path.join(d, BINARY), label) for d, label in dirs)
    for path, label in candidates:
        if _is_executable(path):
            return SanitizerInfo(
                path=path, version=read_version(path) if query_version else None, found_via=label
            )
    return None


def sanitizer_command(
    info: SanitizerInfo,
    tool: SanitizerTool | str,
    argv: Sequence[str],
    *,
    kernel_regex: str | None = None,
    launch_count: int | None = None,
    launch_skip: int | None = None,
    xml_path: str | os.PathLike[str] | None = None,
    log_path: str | os.PathLike[str] | None = None,
    print_limit: int | None = None,
    error_exitcode: int | None = None,
    target_processes_all: bool = False,
) -> list[str]:
    """The argv that runs ``argv`` under one compute-sanitizer tool.

    Flags as documented for compute-sanitizer 2023+ (and measured with 2025.3.1):
    ``--kernel-name regex=...`` filters kernels (the older ``--kernel-regex`` was renamed);
    ``--launch-count N`` / ``--launch-skip N`` bound which launches are checked (memcheck costs
    ~47x, racecheck ~35,000x: check one launch of a minimal probe); ``--xml --save FILE``
    is the only machine-readable output (there is no JSON); ``--log-file`` takes the text report
    off the child's stderr.
    """
    tool = SanitizerTool(tool)
    if not argv:
        raise ValueError("sanitizer_command: empty argv (nothing to run)")
    cmd = [info.path, "--tool", tool.value]
    if kernel_regex is not None:
        if not kernel_regex or "," in kernel_regex:
            # the value is a key=value list separated by commas: a comma would split the regex
            raise ValueError(f"kernel_regex must be non-empty and contain no comma: {kernel_regex!r}")
        cmd += ["--kernel-name", f"regex={kernel_regex}"]
    for flag, value in (("--launch-count", launch_count), ("--launch-skip", launch_skip)):
        if value is not None:
            if value < (1 if flag == "--launch-count" else 0):
                raise ValueError(f"{flag} must be {'>= 1' if flag == '--launch-count' else '>= 0'}: {value}")
            cmd += [flag, str(value)]
    if print_limit is not None:
        if print_limit < 0:
            raise ValueError(f"print_limit must be >= 0 (0 = no limit): {print_limit}")
        cmd += ["--print-limit", str(print_limit)]
    if error_exitcode is not None:
        cmd += ["--error-exitcode", str(error_exitcode)]
    if target_processes_all:
        cmd += ["--target-processes", "all"]
    if xml_path is not None:
        # `--xml` is a flag in 2025.3: "--xml yes" fails with "extra yes detected on the input
        # command line" (2x H200 validation, 2026-11-22)
        cmd += ["--xml", "--save", os.fspath(xml_path)]
    if log_path is not None:
        cmd += ["--log-file", os.fspath(log_path)]
    return cmd + list(argv)


__all__ = [
    "BINARY",
    "SanitizerInfo",
    "SanitizerTool",
    "find_compute_sanitizer",
    "read_version",
    "sanitizer_command",
]
