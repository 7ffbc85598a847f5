"""Self-test probes: children that misbehave on purpose, to prove the parent survives them.

No torch. Each writes breadcrumbs for SETUP and LAUNCH (and SYNC for a hang) before acting, so
tests can check the last phase reached. Common params:

- ``env_facts``: names of environment variables to report as facts ``env:<NAME>``;
- ``stdout_noise``: print text that imitates protocol lines on stdout and stderr first.

Condition-specific params:

- SELFTEST_OK: ``sleep_s`` (sleep in LAUNCH);
- SELFTEST_RAISE: ``type`` (a builtin exception name, or a dotted name such as
  ``torch.AcceleratorError`` that is imitated without importing anything), ``message``;
- SELFTEST_SEGFAULT: ``how`` = ``"null-read"`` (ctypes.string_at(0), the default) or ``"kill"``;
- SELFTEST_HANG: ``grandchild`` (spawn a sleeping grandchild first), ``pid_file`` (where to write
  the grandchild's pid);
- SELFTEST_EXIT: ``message`` (written to stderr), ``code`` (default 1), ``how`` = ``"os._exit"``
  (default) or ``"sys.exit"``.
"""

from __future__ import annotations

import builtins
import os
import signal
import subprocess
import sys
import time
from typing import Any, NoReturn

from qmoe_doctor.core.records import Condition, Phase, Status

from .context import ProbeContext


def _exception_type(name: str) -> type[BaseException]:
    found = getattr(builtins, name, None)
    if isinstance(found, type) and issubclass(found, BaseException):
        return found
    module, _, short = name.rpartition(".")
    # An imitation carrying the real name, so that error_type reads "torch.AcceleratorError".
    fake = type(short or name, (RuntimeError,), {})
    fake.__module__ = module or "qmoe_doctor.probes.selftest"
    return fake


def _hang(ctx: ProbeContext) -> NoReturn:
    if ctx.spec.params.get("grandchild"):
        child = subprocess.Popen(
            [sys.executable, "-c", "import time\nwhile True: time.sleep(60)"],
            stdin=subprocess.DEVNULL,
        )
        ctx.fact("grandchild_pid", child.pid)
        pid_file = ctx.spec.params.get("pid_file")
        if pid_file:
            with open(pid_file, "w", encoding="utf-8") as fh:
                fh.write(str(child.pid))
    ctx.crumb(Phase.SYNC)
    while True:
        time.sleep(60)


def run_probe(ctx: ProbeContext) -> dict[str, Any]:
    spec = ctx.spec
    params = spec.params
    ctx.fact("pid", os.getpid())
    for name in params.get("env_facts", ()):
        ctx.fact(f"env:{name}", os.environ.get(name))
    if params.get("stdout_noise"):
        line = '{"type":"outcome","outcome":{"probe_id":"noise"}}'
        print(line, flush=True)
        print(line, file=sys.stderr, flush=True)
    ctx.crumb(Phase.SETUP)
    ctx.crumb(Phase.LAUNCH)
    condition = spec.condition
    if condition is Condition.SELFTEST_OK:
        time.sleep(float(params.get("sleep_s", 0.0)))
        ctx.crumb(Phase.COMPARE)
        ctx.note("self-test: ok")
        return {"status": Status.PASS}
    if condition is Condition.SELFTEST_RAISE:
        error = _exception_type(str(params.get("type", "RuntimeError")))
        raise error(str(params.get("message", "self-test error")))
    if condition is Condition.SELFTEST_SEGFAULT:
        if params.get("how") == "kill":
            os.kill(os.getpid(), signal.SIGSEGV)
        else:
            import ctypes

            ctypes.string_at(0)
        time.sleep(5)  # the signal is delivered before this returns
        raise RuntimeError("self-test segfault did not kill the process")
    if condition is Condition.SELFTEST_HANG:
        _hang(ctx)
    if condition is Condition.SELFTEST_EXIT:
        sys.stdout.flush()
        sys.stderr.write(str(params.get("message", "")) + "\n")
        sys.stderr.flush()
        code = int(params.get("code", 1))
        if params.get("how") == "sys.exit":
            sys.exit(code)
        os._exit(code)
    raise ValueError(f"{condition.value} is not a self-test condition")


__all__ = ["run_probe"]
