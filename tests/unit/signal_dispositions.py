"""Signal dispositions a signal test sets for itself, whatever the suite inherited.

``nohup`` starts the suite with SIGHUP ignored, a shell's background job with SIGINT (and SIGQUIT)
ignored, and a process inherits an ignored signal across ``exec``: a doctor started by such a
test keeps it ignored (as it should: what the user ignores stays ignored), so a test that sends it
SIGINT or SIGHUP would wait in vain and leave the doctor running. The tests that send or raise a
signal set the dispositions they test: ``DEFAULTS`` in their children (``preexec_fn``), or the
``default_dispositions`` context in the test process; the tests of an ignored signal set SIG_IGN
themselves.
"""

from __future__ import annotations

import signal
from collections.abc import Iterator
from contextlib import contextmanager

#: the signals a terminal, a job's time limit or a user sends to a doctor
SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT)


def restore_defaults() -> None:
    """``preexec_fn`` for a child the test will signal: every one of ``SIGNALS`` at SIG_DFL before
    ``exec`` (Python then installs its own SIGINT handler, KeyboardInterrupt, as in a terminal)."""
    for signum in SIGNALS:
        signal.signal(signum, signal.SIG_DFL)


@contextmanager
def default_dispositions() -> Iterator[None]:
    """In the test process: SIGINT raises KeyboardInterrupt, the others their default action,
    as in a terminal; the suite's own dispositions come back afterwards."""
    previous = {signum: signal.getsignal(signum) for signum in SIGNALS}
    signal.signal(signal.SIGINT, signal.default_int_handler)
    for signum in SIGNALS[1:]:
        signal.signal(signum, signal.SIG_DFL)
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
