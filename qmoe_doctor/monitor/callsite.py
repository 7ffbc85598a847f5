"""Where a launch came from: the frame that wrote ``kernel[grid](...)`` (the launch site), the
first frame outside torch, triton, qmoe-doctor and the standard library (the call site: a
library's wrapper line when a pip-installed library launched the kernel), the first frame
outside site-packages / dist-packages as well (the user's own line), and the function between
them that ``scan`` can call as ``fn(x, w, m_sizes)`` (the wrapper). Code objects are classified
once each, by the folder of their file."""

from __future__ import annotations

import os
import sys
import sysconfig
import threading
from types import CodeType, FrameType
from typing import Any, NamedTuple

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
    PACKAGE = "package"  # another installed package: a file under site-packages / dist-packages
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


#: Folders pip (site-packages) and Debian's python3 packages (dist-packages) install into.
_PACKAGE_FOLDERS = frozenset({"site-packages", "dist-packages"})


def _installed(real: str) -> bool:
    """The file lies under a site-packages or dist-packages folder (a pip-installed library)."""
    return not _PACKAGE_FOLDERS.isdisjoint(real.split(os.sep))


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
            root_place = next((p for root, p in self._roots if real.startswith(root)), None)
            if root_place is not None:
                place = root_place
            else:
                place = Place.PACKAGE if _installed(real) else Place.USER
        self._cache[code] = place
        return place


def _site(frame: FrameType) -> SourceSite:
    return SourceSite(file=frame.f_code.co_filename, line=frame.f_lineno, function=frame.f_code.co_name)


class Sites(NamedTuple):
    """Where one launch came from (each None, or "", when no frame is)."""

    launch: SourceSite | None  # the first frame outside triton and the monitor
    call: SourceSite | None  # the first frame outside torch, triton, qmoe-doctor, the stdlib
    user: SourceSite | None  # the first of those outside site-packages / dist-packages too
    wrapper: str  # a --kernel reference to a function scan can call as fn(x, w, m_sizes)


#: The dimensions of x (M, K), w (E, N, K) or flattened (E*N, K), and m_sizes (E,).
_WRAPPER_DIMS = ((2,), (2, 3), (1,))
#: Decorators followed (``functools.wraps`` sets ``__wrapped__``) to the function a frame runs.
_MAX_UNWRAP = 8


def wrapper_ref(frame: FrameType, tensor_type: type | None) -> str:
    """``module:function`` when ``frame`` runs a module-level function (a decorated one
    included) that takes three required positional arguments and was called with three tensors
    of x's, w's and m_sizes' dimensions: a reference ``scan --kernel`` can call. "" otherwise:
    a method or a closure (no reference reaches it), another signature, a function of the
    program's ``__main__`` (loading the script again would run it)."""
    if tensor_type is None:
        return ""
    code = frame.f_code
    module = frame.f_globals.get("__name__")
    if not isinstance(module, str) or not module or module == "__main__":
        return ""
    fn: Any = frame.f_globals.get(code.co_name)
    for _ in range(_MAX_UNWRAP):
        if fn is None or getattr(fn, "__code__", None) is code:
            break
        fn = getattr(fn, "__wrapped__", None)
    if fn is None or getattr(fn, "__code__", None) is not code:
        return ""
    required = code.co_argcount - len(getattr(fn, "__defaults__", None) or ())
    kwonly = code.co_varnames[code.co_argcount : code.co_argcount + code.co_kwonlyargcount]
    kwdefaults = getattr(fn, "__kwdefaults__", None) or {}
    if required != 3 or any(name not in kwdefaults for name in kwonly):
        return ""
    values = frame.f_locals
    for name, dims in zip(code.co_varnames[:3], _WRAPPER_DIMS, strict=True):
        value = values.get(name)
        if not isinstance(value, tensor_type) or value.dim() not in dims:  # type: ignore[attr-defined]
            return ""
    return f"{module}:{code.co_name}"


def find_sites(places: Places, frame: FrameType | None, tensor_type: type | None = None) -> Sites:
    """The sites of a launch from ``frame`` outwards (``tensor_type``: torch.Tensor, to find the
    wrapper; None: none is looked for). The user's line is None when no frame within
    MAX_FRAMES is one (a thread that autograd started runs no user frame); the wrapper is the
    innermost one within MAX_FRAMES, past the user's first frame too (a program's own wrapper
    calls its own launch helper)."""
    launch: SourceSite | None = None
    call: SourceSite | None = None
    user: SourceSite | None = None
    wrapper = "" if tensor_type is not None else None
    for _ in range(MAX_FRAMES):
        if frame is None:
            break
        place = places.place(frame.f_code)
        if launch is None and place not in (Place.TRITON, Place.MONITOR):
            launch = _site(frame)
        if wrapper == "" and place in (Place.DOCTOR, Place.PACKAGE, Place.USER):
            wrapper = wrapper_ref(frame, tensor_type)
        if call is None and place in (Place.PACKAGE, Place.USER):
            call = _site(frame)
        if user is None and place is Place.USER:
            user = _site(frame)
        if user is not None and wrapper != "":
            break  # the user's own wrapper may lie past the user's first frame: walked on for it
        frame = frame.f_back
    return Sites(launch, call, user, wrapper or "")


def call_path(places: Places, frame: FrameType | None) -> list[str]:
    """The files of the frames from the launch out to the call site (inclusive) that are
    neither triton, torch, the standard library nor the monitor: the code a launch came through."""
    files: list[str] = []
    for _ in range(MAX_FRAMES):
        if frame is None:
            break
        place = places.place(frame.f_code)
        if place in (Place.DOCTOR, Place.PACKAGE, Place.USER) and frame.f_code.co_filename not in files:
            files.append(frame.f_code.co_filename)
        if place in (Place.PACKAGE, Place.USER):
            break
        frame = frame.f_back
    return files


__all__ = ["MAX_FRAMES", "Place", "Places", "Sites", "call_path", "find_sites", "wrapper_ref"]
