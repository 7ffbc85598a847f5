"""The launch monitor: runs INSIDE the user's processes under ``qmoe-doctor run -- COMMAND``.

::

    bootstrap/sitecustomize.py  on PYTHONPATH: waits for Triton's launch modules, chains the
                                user's own sitecustomize (never imports torch or this package
                                in a process that does not import Triton)
    attach.py                   the entry point the bootstrap calls: settings, the one Monitor,
                                the patches, the exit hooks
    hook.py                     the patched launch paths (JITFunction.run, the interpreter's
                                GridExecutor.__call__): the hot path
    session.py                  the Monitor: per launch, what to record, the device checks, the
                                live warnings, --strict
    kernels.py                  what is known of a kernel at its first launch: name, source
                                lines, parameter names, the lint of its source
    callsite.py                 the user's call site (first frame outside torch/triton/doctor)
    ring.py                     the last launches, kept as plain tuples; turned into records at
                                a flush
    writer.py                   the process record, written whole (at exit, uncaught exception,
                                CUDA error, SIGTERM/SIGINT, and every few seconds)

May import ``qmoe_doctor.core``, ``qmoe_doctor.diagnose`` and ``qmoe_doctor.lint`` only, and never
torch or triton (import-linter contract): torch and triton are read from ``sys.modules``, where
the user's program put them. Nothing here may break the user's program: the monitor's own
failures become ``problems`` in its record and a one-line warning.
"""
