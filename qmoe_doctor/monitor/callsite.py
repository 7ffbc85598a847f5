"""Where a launch came from: the frame that wrote ``kernel[grid](...)`` (the launch site) and
the first frame outside torch, triton, qmoe-doctor and the standard library (the user's call
site). Code objects are classified once each, by the folder of their file."""

from __future__ import annotations

import os
import sys
import sysconfig
import threading
from types import CodeType, FrameType

from qmoe_doctor.core.compat import StrEnum
from qmoe_doctor.core.launches import SourceSite

#: Frames walked at most, from the launch outwards (a deep model stays cheap to sample).
MAX_FRAMES = 64


class Place(StrEnum):
    MONITOR = "monitor"  # this package
    TRITON = "triton"
    TORCH = "torch"
    DOCTOR = "doctor"  # qmoe_doctor and its kernels/probes (which may live beside it)
    LIBRARY = "library"  # the standard library
    USER = "user"


#: Packages whose frames are not the user's, and what they are.
_ROOT_MODULES = (
    ("triton", Place.TRITON),
    ("torch", Place.TORCH),
    ("qmoe_doctor", Place.DOCTOR),
    ("qmoe_doctor.kernels", Place.DOCTOR),  # installed beside qmoe_doctor in an editable install
    ("qmoe_doctor.probes", Place.DOCTOR),
)


def _module_dir(name: str) -> str | None:
    module = sys.modules.get(name)
    paths = getattr(module, "__path__", None)
    if paths:
        return os.path.realpath(str(next(iter(paths))))
    file = getattr(module, "__file__", None)
    return os.path.dirname(os.path.realpath(file)) if file else None


class Places:
    """Classifies code objects by file, once each."""

    def __init__(self) -> None:
        self._cache: dict[CodeType, Place] = {}
        self._roots: list[tuple[str, Place]] = []
        self._loaded: tuple[bool, ...] = ()  # which of _ROOT_MODULES the roots were computed with
        self._lock = threading.Lock()

    def _compute_roots(self) -> list[tuple[str, Place]]:
        roots: list[tuple[str, Place]] = []
        monitor = os.path.dirname(os.path.realpath(__file__))
        roots.append((monitor + os.sep, Place.MONITOR))
        for name, place in _ROOT_MODULES:
            folder = _module_dir(name)
            if folder:
                roots.append((folder + os.sep, place))
        for key in ("stdlib", "platstdlib"):
            folder = sysconfig.get_paths().get(key)
            if folder:
                roots.append((os.path.realpath(folder) + os.sep, Place.LIBRARY))
        roots.sort(key=lambda r: -len(r[0]))  # most specific first (the monitor inside qmoe_doctor)
        return roots

    def place(self, code: CodeType) -> Place:
        found = self._cache.get(code)
        if found is not None:
            return found
        file = code.co_filename
        if file.startswith("<"):  # <frozen importlib._bootstrap>, <string>, <stdin>
            place = Place.LIBRARY if file.startswith("<frozen") else Place.USER
        else:
            real = os.path.realpath(file)
            with self._lock:
                # torch or the kernels may have been imported since the roots were computed
                loaded = tuple(name in sys.modules for name, _ in _ROOT_MODULES)
                if loaded != self._loaded:
                    self._roots, self._loaded = self._compute_roots(), loaded
            place = next((p for root, p in self._roots if real.startswith(root)), Place.USER)
        self._cache[code] = place
        return place


def _site(frame: FrameType) -> SourceSite:
    return SourceSite(file=frame.f_code.co_filename, line=frame.f_lineno, function=frame.f_code.co_name)


def find_sites(places: Places, frame: FrameType | None) -> tuple[SourceSite | None, SourceSite | None]:
    """(launch site, call site) from ``frame`` outwards: the first frame outside triton and the
    monitor, and the first frame of the user's own code (None when no frame is: a thread that
    autograd started runs no user frame)."""
    launch: SourceSite | None = None
    for _ in range(MAX_FRAMES):
        if frame is None:
            break
        place = places.place(frame.f_code)
        if launch is None and place not in (Place.TRITON, Place.MONITOR):
            launch = _site(frame)
        if place is Place.USER:
            return launch, _site(frame)
        frame = frame.f_back
    return launch, None


def call_path(places: Places, frame: FrameType | None) -> list[str]:
    """The files of the frames from the launch out to the user's call site (inclusive) that are
    neither triton, torch, the standard library nor the monitor: the code a launch came through."""
    files: list[str] = []
    for _ in range(MAX_FRAMES):
        if frame is None:
            break
        place = places.place(frame.f_code)
        if place in (Place.DOCTOR, Place.USER) and frame.f_code.co_filename not in files:
            files.append(frame.f_code.co_filename)
        if place is Place.USER:
            break
        frame = frame.f_back
    return files


__all__ = ["MAX_FRAMES", "Place", "Places", "call_path", "find_sites"]
