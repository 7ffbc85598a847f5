"""qmoe-doctor's launch monitor bootstrap: the ``sitecustomize`` of every Python process that
``qmoe-doctor run -- COMMAND`` starts (the run puts this folder first on PYTHONPATH; torchrun
ranks, multiprocessing workers and subprocesses inherit it).

At start-up it only installs a finder on ``sys.meta_path`` that waits for Triton's launch
modules (``triton.runtime.jit``, ``triton.runtime.interpreter``). Nothing else is imported: a
process that never imports Triton never loads the monitor, torch, or any qmoe-doctor module.
When one of them has been executed, ``qmoe_doctor.monitor.attach`` patches its launch path.

Then it runs the ``sitecustomize`` this one hides (the next one on ``sys.path``, if any), as
site.py would have: an error in it is printed the way site.py prints one, and start-up goes on.

Stdlib only, and no syntax newer than Python 3.8: it runs in whatever interpreter the command
starts. The two variables it reads are declared in ``qmoe_doctor.core.knobs`` (a test checks
that the spellings agree).
"""

from __future__ import annotations

import importlib.machinery
import os
import sys

TYPE_CHECKING = False  # typing costs milliseconds at every start-up; mypy reads the names below
if TYPE_CHECKING:
    from collections.abc import Sequence
    from types import ModuleType
    from typing import Any

# Declared in qmoe_doctor.core.knobs (QMOE_RUN_DIR, QMOE_RUN_HOME), spelt again here because this
# module imports nothing of ours before it attaches; tests/unit/test_run_hook.py checks they agree.
#: $QMOE_DOCTOR_RUN_DIR: where the records go; the monitor stays out of a process without it.
DIR_VARIABLE = "QMOE_DOCTOR_RUN_DIR"
#: $QMOE_DOCTOR_RUN_HOME: the folder holding the ``qmoe_doctor`` package that started the run, for
#: an interpreter that cannot import it (the command runs another venv's python).
HOME_VARIABLE = "QMOE_DOCTOR_RUN_HOME"
#: The modules whose execution attaches the monitor.
WATCHED = ("triton.runtime.jit", "triton.runtime.interpreter")
_HERE = os.path.dirname(os.path.realpath(__file__))


class _Loaded:
    """A loader that runs the real one, then hands the module to the monitor. Every other
    attribute (get_source, is_package, ...) is the real loader's."""

    def __init__(self, loader: Any) -> None:
        self._loader = loader

    def __getattr__(self, name: str) -> Any:
        return getattr(self._loader, name)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        module: ModuleType | None = self._loader.create_module(spec)
        return module

    def exec_module(self, module: ModuleType) -> None:
        self._loader.exec_module(module)
        _attach(module)


class _Watcher:
    """On sys.meta_path: for a watched module, the spec the other finders give, its loader
    wrapped; None (ask the next finder) for every other name."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None = None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname not in WATCHED:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec: importlib.machinery.ModuleSpec | None = finder.find_spec(fullname, path, target)
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _Loaded(spec.loader)  # type: ignore[assignment]
                return spec
        return None


def _import_monitor() -> Any:
    try:
        import qmoe_doctor.monitor.attach as attach
    except ImportError:
        home = os.environ.get(HOME_VARIABLE, "")
        if not home or "qmoe_doctor" in sys.modules:
            raise
        # this interpreter cannot import qmoe_doctor: load the package that started the run
        # (the name qmoe_doctor only: its folder's siblings stay off sys.path)
        from importlib.util import module_from_spec

        spec = importlib.machinery.PathFinder.find_spec("qmoe_doctor", [home])
        if spec is None or spec.loader is None:
            raise
        package = module_from_spec(spec)
        sys.modules["qmoe_doctor"] = package
        spec.loader.exec_module(package)
        import qmoe_doctor.monitor.attach as attach
    return attach


def _attach(module: ModuleType) -> None:
    try:
        _import_monitor().attach(module)
    except Exception as exc:  # the user's program goes on, unmonitored
        sys.stderr.write(
            f"qmoe-doctor: the launch monitor could not attach to {module.__name__}: "
            f"{type(exc).__name__}: {exc}\n"
        )


def _install() -> None:
    if not any(isinstance(f, _Watcher) for f in sys.meta_path):
        sys.meta_path.insert(0, _Watcher())
    for name in WATCHED:  # imported before this ran (by a .pth file, say)
        module = sys.modules.get(name)
        if module is not None:
            _attach(module)


def _chain() -> None:
    """Run the sitecustomize this one hides, under the name ``sitecustomize``."""
    rest = [p for p in sys.path if os.path.realpath(p or os.curdir) != _HERE]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", rest)
    if spec is None or spec.loader is None:
        return
    from importlib.util import module_from_spec  # only now: it costs milliseconds at every start-up

    module = module_from_spec(spec)
    sys.modules["sitecustomize"] = module
    try:
        spec.loader.exec_module(module)
    except Exception as exc:
        # what site.py prints for a failing sitecustomize; start-up goes on
        sys.stderr.write(f"Error in sitecustomize; set PYTHONVERBOSE for traceback:\n{type(exc).__name__}: {exc}\n")


if os.environ.get(DIR_VARIABLE):
    _install()
_chain()
