"""Shared test set-up.

CPU machines (CI) run Triton kernels through the interpreter: TRITON_INTERPRET must be set
before triton is imported, so it is set here when no CUDA device is present. GPU tests are
marked ``gpu`` / ``multigpu`` and skipped without the devices (run them on a GPU machine and
record the run in docs/validation/gpu-tests.md). ``--shard I/N`` keeps every N-th test of the
selection from the I-th (0-based): N processes with I = 0..N-1 share one run, as the GPU recipe
does on one card (tools/gpu/validate_one_gpu.sh, SHARDS=N), where compiling is the slow part.

No test leaves a process behind: every test runs with a token of its own in the environment
(``QMOE_TEST_REAP``), which every process it starts inherits; a process that still carries it
once the test is over (after a grace of a few seconds) is killed, and the test fails naming it.
Each test also gets a temp folder of its own (TMPDIR, ``tempfile.tempdir``) under pytest's
basetemp, so that what a run keeps in the temp folder is not left in the machine's.
Signal dispositions are the tests' own business: ``signal_dispositions.py`` sets what a signal
test needs, whatever the suite inherited (``nohup`` ignores SIGHUP, a background job SIGINT).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
import time
import uuid
from collections.abc import Iterator

import pytest


def _cuda_device_count() -> int:
    # Ask nvidia-smi rather than torch: importing torch here would put it in every test
    # process, and the "parent never imports torch" tests run in subprocesses anyway.
    if os.environ.get("QMOE_TEST_FORCE_CPU"):
        return 0
    if shutil.which("nvidia-smi") is None:
        return 0
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=index", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired):
        return 0
    return len([line for line in out.stdout.splitlines() if line.strip()]) if out.returncode == 0 else 0


CUDA_DEVICES = _cuda_device_count()

if CUDA_DEVICES == 0:
    os.environ.setdefault("TRITON_INTERPRET", "1")
    # ``-n auto`` runs a pytest worker per core already; numpy's BLAS and torch's intra-op pool
    # would add a thread per core in each worker and in each child it starts, and spin against
    # each other (measured on 2 cores: 8-10% more CPU for the same tests). Set before either is
    # imported here; the children inherit it.
    os.environ.setdefault("OMP_NUM_THREADS", "1")


def pytest_xdist_auto_num_workers(config: pytest.Config) -> int | None:
    """``-n auto``: a worker per core and one more. Many tests wait on a child (a timeout, a rank,
    a hung import) with their core idle; the extra worker fills those waits (measured on 2 cores:
    3 workers 283 s, 2 workers 305 s, 4 workers 304 s). ``PYTEST_XDIST_AUTO_NUM_WORKERS`` still
    decides when set."""
    if os.environ.get("PYTEST_XDIST_AUTO_NUM_WORKERS"):
        return None
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return cores + 1


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--shard",
        default=None,
        metavar="I/N",
        help="run only every N-th selected test from the I-th (0-based); N processes with I = 0..N-1 run "
        "each selected test once between them",
    )


def _shard(spec: str) -> tuple[int, int]:
    """(I, N) of ``--shard I/N``; a usage error names what is wrong."""
    index, _, count = spec.partition("/")
    try:
        i, n = int(index), int(count)
    except ValueError:
        raise pytest.UsageError(f"--shard {spec!r}: want I/N with whole numbers, e.g. 0/4") from None
    if n < 1 or not 0 <= i < n:
        raise pytest.UsageError(f"--shard {spec!r}: want 0 <= I < N, e.g. 0/4 .. 3/4")
    return i, n


@pytest.hookimpl(trylast=True)  # after -m and -k have deselected: each shard gets its share of what runs
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    spec = config.getoption("--shard")
    if spec:
        i, n = _shard(spec)
        dropped = [item for j, item in enumerate(items) if j % n != i]
        items[:] = items[i::n]
        if dropped:
            config.hook.pytest_deselected(items=dropped)
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU (run on a GPU machine)")
    skip_multi = pytest.mark.skip(reason="needs two or more CUDA GPUs")
    for item in items:
        if "multigpu" in item.keywords and CUDA_DEVICES < 2:
            item.add_marker(skip_multi)
        elif "gpu" in item.keywords and CUDA_DEVICES < 1:
            item.add_marker(skip_gpu)


#: The variable whose per-test token marks every process a test starts (see the module docstring).
REAP_VARIABLE = "QMOE_TEST_REAP"
#: How long a test's processes may take to finish on their own once the test is over.
REAP_GRACE_S = 5.0


def _pids() -> set[int]:
    try:
        return {int(e) for e in os.listdir("/proc") if e.isdigit()}
    except OSError:  # no /proc (not Linux): nothing to reap by
        return set()


def _marked(needle: bytes, pids: set[int]) -> dict[int, str]:
    """Live (not zombie) processes among ``pids`` whose environment holds ``needle``."""
    found: dict[int, str] = {}
    for pid in pids:
        try:
            with open(f"/proc/{pid}/environ", "rb") as fh:
                if needle not in fh.read().split(b"\0"):
                    continue
            with open(f"/proc/{pid}/stat") as fh:
                state = fh.read().rsplit(")", 1)[1].split()[0]
            with open(f"/proc/{pid}/cmdline", "rb") as fh:
                cmdline = fh.read().replace(b"\0", b" ").decode(errors="replace").strip()
        except (OSError, IndexError):
            continue  # gone meanwhile, or not ours to read
        if state not in ("Z", "X"):
            found[pid] = cmdline
    return found


@pytest.fixture(autouse=True)
def _reap_processes(monkeypatch: pytest.MonkeyPatch, tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    token = uuid.uuid4().hex
    monkeypatch.setenv(REAP_VARIABLE, token)
    # the temp folder of the test and of every process it starts: what a run keeps there (a
    # failing scan's logs, torchrun's files) stays under pytest's own basetemp, not in /tmp
    tmp = tmp_path_factory.mktemp("tmpdir")
    for name in ("TMPDIR", "TMP", "TEMP"):
        monkeypatch.setenv(name, str(tmp))
    monkeypatch.setattr(tempfile, "tempdir", str(tmp))
    before = _pids()
    yield
    needle = f"{REAP_VARIABLE}={token}".encode()
    new = _pids() - before
    left = _marked(needle, new)
    deadline = time.monotonic() + REAP_GRACE_S
    while left and time.monotonic() < deadline:
        time.sleep(0.1)
        left = _marked(needle, set(left))
    for pid in left:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    if left:
        pytest.fail(
            f"the test left {len(left)} process(es) running (killed now): "
            + "; ".join(f"{pid}: {cmd[:200]}" for pid, cmd in sorted(left.items())),
            pytrace=False,
        )
