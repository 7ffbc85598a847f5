"""The Triton interpreter (``TRITON_INTERPRET=1``) without a check whose result it throws away.

The CPU tier, the CPU tests and the CPU ranks run every Triton kernel through Triton's
interpreter, in numpy, one program at a time. ``InterpreterOptions.sanitize_overflow`` defaults
to True there, so every int32 add, sub and mul is done a second time in int64, compared against
the int32 range, and the comparison handed to ``device_assert``, which returns at once unless
``options.debug`` is set (triton/language/semantic.py), and the interpreter never sets it
(triton/runtime/interpreter.py, 3.4 to 3.9). A compiled kernel does the same: no assertion
without debug. ``speed_up()`` turns the check off while debug is off: the same values, the same
(absent) assertion, about 30% less time for our kernels under the interpreter (their CPU tests:
81 s down to 59 s on one core).

It is installed once per process, when the interpreter is on, by importing our kernels; on a
Triton whose interpreter lacks the option it changes nothing and ``state()`` says why.
"""

from __future__ import annotations

import dataclasses

from qmoe_doctor.kernels.grouped_gemm import interpreting

_state = "not installed"


def state() -> str:
    """What ``speed_up`` did in this process, for logs and tests."""
    return _state


def speed_up() -> str:
    """Turn the interpreter's discarded overflow check off when ``TRITON_INTERPRET`` is on and
    its options have debug off (idempotent); returns ``state()``."""
    global _state
    if _state.startswith("installed") or not interpreting():
        return _state
    try:
        from triton.runtime import interpreter as interp
    except Exception as exc:  # no triton, or one whose interpreter moved: nothing to change
        _state = f"not installed: {type(exc).__name__}: {exc}"
        return _state
    builder = getattr(interp, "interpreter_builder", None)
    options = getattr(builder, "options", None)
    if options is None or not dataclasses.is_dataclass(options) or isinstance(options, type):
        _state = "not installed: this Triton's interpreter has no options to change"
    elif getattr(options, "debug", True):
        _state = "not installed: the interpreter's debug option is on (its overflow assertions count)"
    elif not getattr(options, "sanitize_overflow", False):
        _state = "installed: the overflow check was already off"
    else:
        builder.options = dataclasses.replace(options, sanitize_overflow=False)  # type: ignore[union-attr]
        _state = "installed: the int32 overflow check off (debug off: its assertion is discarded)"
    return _state


__all__ = ["speed_up", "state"]
