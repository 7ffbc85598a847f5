"""A kernel on the default stream among a thread's side-stream launches (``wrong-device-stream``):
a pure check over a process's last launches, as the ring keeps them (``core.launches.Launch``).

The monitor records each compiled launch's stream as Triton takes it
(``driver.active.get_current_stream(device)``: torch's current stream of the launch device, the
raw ``cudaStream_t``). A wrapper that launches inside
``torch.cuda.stream(torch.cuda.default_stream(x.device))`` (or on stream 0) shows as a kernel
whose every launch carries the default stream while the same thread's other Triton launches on
that device, before and after it, carry a side stream: the caller's current stream, which the
kernel left. Nothing orders it after the work queued on that stream, so it can read stale inputs
and write outputs the caller never waits for.

The monitor runs :func:`wrong_stream` where the record is written (``Monitor.record``, at each
flush: every few seconds, at a new finding, at the end), never at a launch, so the hot path pays
nothing for it. It is a heuristic over the ring (the last ``--ring`` launches at a flush, 256 by
default), and these make it wrong:

* a named kernel that is right: a program whose current stream *is* the default stream and that
  sends another kernel to a side stream on purpose (a prefetch, an overlapped copy) makes every
  default-stream kernel launched between those side-stream launches look like this one;
* a missed kernel: its launches and the thread's side-stream launches are not in one ring window
  (thousands of launches apart); its thread launches no other Triton kernel on that device (aten
  ops and cuBLAS on the side stream are not seen); it is launched on the default stream only
  before or after the side-stream stretch (a phase of the program that ran on the default
  stream is not flagged: that is what the "between" condition is for);
* each thread is judged alone: torch's current stream is per thread (autograd's device threads
  take the forward's stream), and two threads' streams say nothing of each other;
* the interpreter records no stream: nothing is found under ``TRITON_INTERPRET=1``.
"""

from __future__ import annotations

from collections.abc import Sequence

from qmoe_doctor.core.launches import DEFAULT_STREAMS, FindingKind, Launch, LaunchFinding

#: Other kernels a finding names as the side stream's.
NAMED_NEIGHBOURS = 3


def on_default_stream(launch: Launch) -> bool:
    return launch.stream in DEFAULT_STREAMS


def _thread(name: str) -> str:
    return "the main thread" if not name else f"thread {name!r}"


def _streams(values: Sequence[int]) -> str:
    return ", ".join(f"0x{v:x}" for v in sorted(set(values)))


def wrong_stream(launches: Sequence[Launch]) -> list[LaunchFinding]:
    """One finding per kernel and device where, among the compiled launches of one thread on one
    device (``launches`` in launch order; the interpreter's, with no stream, are skipped):

    * every launch of the kernel ran on a default stream (:data:`DEFAULT_STREAMS`),
    * other launches of that thread and device ran on a non-default stream, and
    * at least one of the kernel's launches lies between two of those (by launch number).

    ``count`` is the kernel's launches there; ``launch`` the first of them that has a call site
    (a sampled launch), else the first."""
    groups: dict[tuple[str, str], list[Launch]] = {}
    for launch in launches:
        if launch.device is not None and launch.stream is not None:
            groups.setdefault((launch.device, launch.thread), []).append(launch)
    found: list[LaunchFinding] = []
    for (device, thread), group in groups.items():
        side = [launch for launch in group if not on_default_stream(launch)]
        if not side:
            continue
        first_side, last_side = min(s.seq for s in side), max(s.seq for s in side)
        by_kernel: dict[str, list[Launch]] = {}
        for launch in group:
            by_kernel.setdefault(launch.kernel, []).append(launch)
        for kernel, own in by_kernel.items():
            if not all(map(on_default_stream, own)):
                continue
            between = [launch for launch in own if first_side < launch.seq < last_side]
            if not between:
                continue
            shown = next((launch for launch in between if launch.call_site is not None), between[0])
            neighbours = list(dict.fromkeys(s.kernel for s in side))
            named = ", ".join(f"`{k}`" for k in neighbours[:NAMED_NEIGHBOURS])
            if len(neighbours) > NAMED_NEIGHBOURS:
                named += f" and {len(neighbours) - NAMED_NEIGHBOURS} more"
            found.append(
                LaunchFinding(
                    kind=FindingKind.DEFAULT_STREAM,
                    cause="wrong-device-stream",
                    kernel=kernel,
                    message=(
                        f"`{kernel}` ran on "
                        f"{device}'s default stream ({_streams([o.stream or 0 for o in own])}) while "
                        f"{named} of {_thread(thread)} ran on {device}'s side stream "
                        f"{_streams([s.stream or 0 for s in side])} before and after it: the caller's "
                        f"current stream was a side stream and this kernel left it, so it is not ordered "
                        "after the work queued there (stale inputs) and the caller does not wait for its "
                        "outputs; launch on torch.cuda.current_stream(x.device) (drop the stream context), "
                        "or order a stream of your own with wait_stream both ways and record_stream"
                    ),
                    launch_device=device,
                    tensors=shown.tensors,
                    first_seq=shown.seq,
                    count=len(own),
                    launch=shown,
                )
            )
    return found


def shows(finding: LaunchFinding, launch: Launch) -> bool:
    """Whether ``launch`` is one more launch of what ``finding`` (of :func:`wrong_stream`) named:
    its kernel, on its device's default stream, in its thread."""
    thread = finding.launch.thread if finding.launch is not None else launch.thread
    return (
        launch.kernel == finding.kernel
        and launch.device == finding.launch_device
        and launch.thread == thread
        and on_default_stream(launch)
    )


__all__ = ["DEFAULT_STREAMS", "on_default_stream", "shows", "wrong_stream"]
