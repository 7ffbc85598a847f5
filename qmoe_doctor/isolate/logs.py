"""Where a run's child logs go, and whether they stay.

A folder the user asked for (``--log-dir``) is created if needed and always kept. Otherwise the
logs go to a new ``qmoe-doctor-*`` folder in the temp dir, which is kept when the run found
something (``keep``), ended by an exception or a signal, and removed when it ended healthy, so
a healthy run leaves nothing behind. A folder kept because the run ended by an exception (a
kernel that does not import, Ctrl-C) is named on that exception (``core.events.kept_logs`` reads
it back), so that the message that ends the run can say where the logs are. The children's own temp files
(torchrun's ``torchelastic_*``, torch's ``torchinductor_*``) go to a ``child-tmp`` folder inside it
(``isolate.process.spawn`` points TMPDIR there), removed at the end whatever happened.
``reported`` is what a report should print as its log folder: the path while it will exist, ""
once it is gone::

    with LogDir.open(log_dir, prefix="qmoe-doctor-") as logs:
        report = run(..., log_dir=logs.path)
        if not report.healthy:
            logs.keep()
        report = replace(report, log_dir=logs.reported)
"""

from __future__ import annotations

import shutil
import tempfile
import threading
from pathlib import Path
from types import TracebackType

from qmoe_doctor.core.events import note_kept_logs

#: The children's temp folder inside a run's log folder (their TMPDIR), removed at the end.
CHILD_TMP = "child-tmp"

_made: set[Path] = set()  # the children's temp folders this process created (only these are removed)
_made_lock = threading.Lock()  # a scan's pair sessions start children from several threads


def child_tmp(folder: Path) -> Path:
    """The children's temp folder beside their log in ``folder``, created and remembered, so that
    ``LogDir.close`` removes it and never a folder of that name it did not make."""
    tmp = folder / CHILD_TMP
    with _made_lock:
        if tmp not in _made:
            try:
                tmp.mkdir()
            except FileExistsError:
                return tmp  # not made by this run (a folder of the user's, a killed run's): left as it is
            _made.add(tmp)
    return tmp


class LogDir:
    """A run's log folder: asked for (kept) or temporary (removed unless kept)."""

    def __init__(self, path: Path, *, asked: bool) -> None:
        self.path = path
        self.asked = asked
        self.kept = asked
        self.removed = False

    @classmethod
    def open(cls, asked: Path | str | None, *, prefix: str = "qmoe-doctor-") -> LogDir:
        """The folder the user asked for (created), or a new temporary one."""
        if asked:
            path = Path(asked)
            path.mkdir(parents=True, exist_ok=True)
            return cls(path, asked=True)
        return cls(Path(tempfile.mkdtemp(prefix=prefix)), asked=False)

    def keep(self) -> None:
        """Keep the logs after the run (something failed: they are the evidence)."""
        self.kept = True

    @property
    def reported(self) -> str:
        """The path a report should name: "" when the folder is removed at the end."""
        return str(self.path) if self.kept else ""

    def close(self) -> None:
        """Remove the children's temp folders, and the folder unless it was asked for or kept."""
        with _made_lock:
            mine = [tmp for tmp in _made if tmp.is_relative_to(self.path)]
            _made.difference_update(mine)
        for tmp in mine:
            shutil.rmtree(tmp, ignore_errors=True)
        if not self.kept and not self.removed:
            shutil.rmtree(self.path, ignore_errors=True)
            self.removed = True

    def __enter__(self) -> LogDir:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if exc_type is not None:
            self.keep()  # an error or a signal: what ran so far may be needed
            if exc is not None and not self.asked:  # the user knows where --log-dir is
                note_kept_logs(exc, self.path)
        self.close()


__all__ = ["CHILD_TMP", "LogDir", "child_tmp"]
