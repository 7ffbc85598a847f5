"""Isolation: every child the parent starts, and how each one ends.

- ``process``: the one primitive: spawn a fresh program in its own session with the forced
  environment and the parent-death signal, ask a hung one for its stacks, kill its whole group.
- ``crash``: any way a child ends (exit status, signal, timeout, never ready, never started,
  unreadable output) as an ``Outcome``.
- ``worker_pool``: warm probe workers (``probes/worker.py``), one probe after another.
- ``torchrun``: parallel launches: start, kill, and read every rank back from its files.
- ``one_shot``: one child for one job (a probe, a command under compute-sanitizer, the benchmark).
- ``signals``: SIGINT, SIGTERM and SIGHUP end a run as Ctrl-C does (``core.events.Interrupted``).
- ``logs``: where the children's logs go, and whether they stay.

May import ``core`` and ``machine`` only; never torch.
"""
