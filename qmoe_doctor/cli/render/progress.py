"""Progress on stderr while children run: a bar and one line per probe for scans, one line per
probe for check, one line per launch and rank for parallel runs. Results go to stdout
elsewhere; nothing here is part of the report."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.text import Text

from qmoe_doctor.cli.output import stderr_console
from qmoe_doctor.core.events import Event, EventKind
from qmoe_doctor.core.records import Outcome

OnEvent = Callable[[Event], None]


def _outcome_line(err: Console, o: Outcome, prefix: str = "") -> None:
    err.print(
        Text(
            f"  {prefix}{o.probe_id}: {o.status}" + (f" ({o.error_kind})" if o.error_kind else ""),
            style="dim",
        ),
        soft_wrap=True,
    )


def probe_lines() -> OnEvent:
    """One line per probe outcome and per replaced worker."""
    err = stderr_console()

    def on_event(event: Event) -> None:
        if event.kind is EventKind.OUTCOME and event.outcome is not None:
            _outcome_line(err, event.outcome)
        elif event.kind is EventKind.WORKER_RESTARTED:
            err.print(Text(f"  worker replaced: {event.detail}", style="yellow"), soft_wrap=True)

    return on_event


@contextmanager
def probe_bar(total: int) -> Iterator[OnEvent]:
    """A progress bar over ``total`` probes (the probe and phase in flight), and a line per
    outcome above it."""
    err = stderr_console()
    with Progress(
        TextColumn("{task.description}", markup=False, style="progress.description"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=err,
        transient=True,
    ) as progress:
        task = progress.add_task("starting probe workers", total=total)
        lines = probe_lines()

        def on_event(event: Event) -> None:
            if event.kind is EventKind.OUTCOME and event.outcome is not None:
                progress.advance(task)
            elif event.kind in (EventKind.PROBE_STARTED, EventKind.CRUMB) and event.probe_id:
                phase = f" [{event.phase}]" if event.phase else ""
                progress.update(task, description=f"{event.probe_id}{phase}")
            lines(event)

        yield on_event


def parallel_lines() -> OnEvent:
    """One line per launch started and per rank that reported."""
    err = stderr_console()

    def on_event(event: Event) -> None:
        if event.kind is EventKind.RUN_STARTED:
            err.print(Text(f"  {event.mode}: {event.detail}", style="dim"), soft_wrap=True)
        elif event.kind is EventKind.RANK_DONE and event.outcome is not None:
            _outcome_line(err, event.outcome, prefix=f"{event.mode} ")

    return on_event


__all__ = ["OnEvent", "parallel_lines", "probe_bar", "probe_lines"]
