"""The one ``--kernel`` grammar: ``KernelRef.parse`` for every form, checked in the parent,
resolved in the child, rendered into repro scripts, always from the same record.

qmoe-doctor calls every kernel as ``fn(x, w, m_sizes) -> y`` (x (M, K) rows sorted by expert,
w (E, N, K), m_sizes (E,) int32 rows per expert). The forms::

    builtin                      our moe_grouped_gemm
    torch:grouped_mm             torch._grouped_mm behind our signature (a control that should pass)
    specimen:NAME                a deliberately faulty specimen (`qmoe-doctor specimens`)
    module.path:function         imported with importlib (in the probe child)
    path/to/file.py:function     loaded from the file (in the probe child)
    adapter:NAME                 a kernel adapter's own default kernel (its ``default_target``)
    adapter:NAME:TARGET          the adapter applied to TARGET, any form above but an adapter

An adapter turns a kernel of another signature into that callable; NAME is one of ours
(:data:`BUILTIN_ADAPTERS`: ``flat-weights`` for ``fn(x, w2d (E*N, K), m_sizes)``; ``routed`` and
``routed-rows`` for kernels that take the router's ids, :data:`Protocol`), an entry point
of the group ``qmoe_doctor.adapters`` (how a kernel library ships one) or the dotted
``module.attr`` of an adapter object. The protocol and its loading live on the child side
(``qmoe_doctor.probes.adapters``).

Three stages, three places, one record:

* ``KernelRef.parse(text)`` (anywhere): the form, or ``KernelRefError``. ``str(ref)`` gives the
  canonical text back; it is what ``ProbeSpec.kernel`` carries across the process boundary.
* ``ref.validate()`` (the parent, before any child starts): what can be known without importing
  the kernel, whose package imports torch: the specimen exists, the file is a regular file, the
  module's top-level package is installed (found by the import system's finders, nothing
  executed), the adapter is an installed entry point or a dotted path.
* ``qmoe_doctor.probes.loader.load_kernel`` (the child): imports and checks the signature.

``source_path()`` finds the kernel's source file without importing it (what ``check`` lints) and
``standalone()`` the plain reference a repro script can import without qmoe-doctor.

Stdlib only; imports nothing of ours outside ``core``.
"""

from __future__ import annotations

import ast
import importlib.machinery
import importlib.metadata
import importlib.util
import os
import re
import sys
from collections.abc import Sequence
from dataclasses import dataclass, replace
from importlib.machinery import ModuleSpec
from pathlib import Path
from typing import Literal

from qmoe_doctor.core import knobs
from qmoe_doctor.core.compat import StrEnum
from qmoe_doctor.core.inputs import InputError, check_regular_file, read_bytes, shown_path
from qmoe_doctor.core.specimens import SPECIMEN_PACKAGE, get_specimen

#: How the probes call a kernel: ``m_sizes``, ``fn(x, w, m_sizes) -> y`` (rows sorted by expert);
#: ``routed``, ``fn(hidden_states (T, H), w (E, N, H), topk_ids (T, k), topk_weights (T, k)[,
#: expert_map]) -> out (T, N)``, the slots' rows reduced with their weights; ``routed-rows``, the
#: same arguments -> out (T*k, N), row t*k + j = hidden_states[t] @ w[topk_ids[t, j]].T unweighted.
#: A slot routed to no local expert (-1, an id outside [0, E), an expert_map entry of -1 or past
#: the local count) adds nothing to ``out`` and its ``routed-rows`` row is zero. The parent plans
#: each protocol's cells from the reference alone (``KernelRef.protocol``), before any child
#: imports the kernel: a built-in adapter's name (``adapter:routed:TARGET``) or a specimen's
#: registry entry says which.
Protocol = Literal["m_sizes", "routed", "routed-rows"]
ROUTED_PROTOCOLS: tuple[Protocol, ...] = ("routed", "routed-rows")

#: Entry-point group a kernel library registers its adapter under (its pyproject.toml):
#: ``[project.entry-points."qmoe_doctor.adapters"]  mylib = "mylib.qmoe:ADAPTER"``. Public: kernel
#: libraries ship under this name, so it never follows the module's own path.
ENTRY_POINT_GROUP = "qmoe_doctor.adapters"



@dataclass(frozen=True, slots=True, kw_only=True)
class BuiltinAdapter:
    """An adapter that ships with qmoe-doctor: ``adapter:NAME:TARGET`` with no packaging. Its
    object lives on the child side (``obj``, imported only there); the rest is what ``qmoe-doctor
    specimens`` and the docs show."""

    name: str  # NAME in adapter:NAME:TARGET
    obj: str  # module:attr of the adapter object (child side: it imports torch)
    takes: str  # the signature of the kernels it adapts
    summary: str  # one line: what it passes the kernel
    # the kernel ``adapter:NAME`` alone means (``module:function``); None: a target is required
    default_target: str | None = None
    protocol: Protocol = "m_sizes"  # the cells the scan plans for the kernels it adapts


#: The adapters of ours, by name. Reserved: an installed entry point of the same name is never
#: consulted. ``flat-weights`` has no default target: the kernel is the user's
#: (``adapter:NAME:TARGET``); ``routed`` and ``routed-rows`` alone mean our routed kernels.
BUILTIN_ADAPTERS: dict[str, BuiltinAdapter] = {
    a.name: a
    for a in (
        BuiltinAdapter(
            name="flat-weights",
            obj="qmoe_doctor.probes.adapters:FLAT_WEIGHTS",
            takes="fn(x, w2d, m_sizes) -> y, w2d (E*N, K): expert e's weight is rows e*N .. e*N + N - 1",
            summary="w (E, N, K) passed as (E*N, K): a view of the same storage where w's layout has one "
            "(storage offsets and padded rows reach the kernel as they are), else a copy of the same "
            "layout kind (a transposed w stays strided)",
        ),
        BuiltinAdapter(
            name="routed",
            obj="qmoe_doctor.probes.routed:ROUTED",
            takes="fn(hidden_states (T, H), w (E, N, H), topk_ids (T, k), topk_weights (T, k)[, expert_map]) "
            "-> out (T, N), each token's slots reduced with their weights",
            summary="the router's ids and weights: the routed cells feed routing edges (ids past E, -1 slots, "
            "expert maps, the kernel's own routing step when it exposes one); the other cells pass x's rows "
            "as T = M tokens, k = 1, each row's expert from m_sizes, weight 1",
            default_target="qmoe_doctor.kernels.routed:routed_moe",
            protocol="routed",
        ),
        BuiltinAdapter(
            name="routed-rows",
            obj="qmoe_doctor.probes.routed:ROUTED_ROWS",
            takes="fn(hidden_states (T, H), w (E, N, H), topk_ids (T, k), topk_weights (T, k)[, expert_map]) "
            "-> out (T*k, N), row t*k + j unweighted, zero for a slot routed nowhere",
            summary="as routed, the output one row per (token, slot): the sorted-token-ids style's first GEMM",
            default_target="qmoe_doctor.kernels.routed:routed_moe_rows",
            protocol="routed-rows",
        ),
    )
}

#: Every form, for help texts and error messages.
FORMS = (
    "builtin, torch:grouped_mm, specimen:NAME, module.path:function, path/to/file.py:function "
    "or adapter:NAME[:TARGET]"
)

#: Where our own kernel lives once installed (kernels/grouped_gemm.py in the repository).
BUILTIN_MODULE = "qmoe_doctor.kernels.grouped_gemm"
BUILTIN_FUNCTION = "moe_grouped_gemm"
#: The torch control's wrapper (child side): what a script imports for ``torch:grouped_mm``.
TORCH_CONTROL = "qmoe_doctor.probes.loader:torch_grouped_mm"

_ADAPTER_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.\-]*")
_SPECIMEN_NAME = re.compile(r"[A-Za-z0-9_]+")


class RefKind(StrEnum):
    BUILTIN = "builtin"
    TORCH = "torch"  # torch:grouped_mm
    SPECIMEN = "specimen"
    MODULE = "module"  # module.path:function
    FILE = "file"  # path/to/file.py:function
    ADAPTER = "adapter"  # adapter:NAME[:TARGET]


class KernelRefError(ValueError):
    """A kernel reference that is malformed or names nothing: one line, naming the reference."""

    def __init__(self, text: str, problem: str) -> None:
        shown = repr(text) if len(text) <= 200 else f"{text[:200]!r}... ({len(text)} characters)"
        super().__init__(f"--kernel {shown}: {problem}")
        self.text = text
        self.problem = problem


@dataclass(frozen=True, slots=True, kw_only=True)
class KernelRef:
    """One ``--kernel`` reference taken apart. Build it with :meth:`parse`."""

    kind: RefKind
    # specimen:NAME and adapter:NAME: the NAME; module refs: the dotted module; file refs: the
    # path as given (the child resolves it from the same working directory)
    name: str = ""
    attr: str = ""  # module and file refs: the function (or, as an adapter's target, any object)
    target: KernelRef | None = None  # adapter:NAME:TARGET; None: the adapter's default_target

    # -- parsing and the canonical text ------------------------------------------------------

    @classmethod
    def parse(cls, text: str) -> KernelRef:
        """The reference ``text`` names. Raises KernelRefError saying what is wrong."""
        raw = text.strip()
        if not raw:
            raise KernelRefError(text, f"empty kernel reference; give one of {FORMS}")
        if raw.startswith("adapter:"):
            return cls._parse_adapter(text, raw)
        return cls._parse_plain(text, raw)

    @classmethod
    def _parse_adapter(cls, text: str, raw: str) -> KernelRef:
        name, colon, rest = raw.removeprefix("adapter:").partition(":")
        if not _ADAPTER_NAME.fullmatch(name):
            raise KernelRefError(
                text,
                "expected adapter:NAME or adapter:NAME:TARGET, NAME an installed adapter (entry point) "
                "or the module.attr of an adapter object",
            )
        if not colon:
            return cls(kind=RefKind.ADAPTER, name=name)
        if not rest.strip():
            raise KernelRefError(text, "the adapter's TARGET after 'adapter:NAME:' is empty")
        if rest.startswith("adapter:"):
            raise KernelRefError(text, "an adapter's TARGET cannot be another adapter")
        try:
            target = cls._parse_plain(rest, rest.strip())
        except KernelRefError as exc:
            raise KernelRefError(text, f"the adapter's TARGET {rest!r}: {exc.problem}") from None
        return cls(kind=RefKind.ADAPTER, name=name, target=target)

    @classmethod
    def _parse_plain(cls, text: str, raw: str) -> KernelRef:
        """Every form but an adapter."""
        if raw == "builtin":
            return cls(kind=RefKind.BUILTIN)
        if raw == "torch:grouped_mm":
            return cls(kind=RefKind.TORCH)
        if ":" not in raw:
            raise KernelRefError(
                text, f"expected module:function or path/to/file.py:function (the forms: {FORMS})"
            )
        if raw.startswith("specimen:"):
            name = raw.removeprefix("specimen:")
            if not _SPECIMEN_NAME.fullmatch(name):
                raise KernelRefError(text, "expected specimen:NAME; `qmoe-doctor specimens` lists them")
            return cls(kind=RefKind.SPECIMEN, name=name)
        # The last colon splits: a file path may hold colons (a Windows drive), a function not.
        where, _, attr = raw.rpartition(":")
        if not where:
            raise KernelRefError(text, "nothing before ':'; expected module:function or path/to/file.py:function")
        if not attr.isidentifier():
            raise KernelRefError(
                text,
                f"{attr!r} after the last ':' is not a function name; expected module:function or "
                "path/to/file.py:function",
            )
        if where.endswith(".py") or "/" in where or os.sep in where:
            return cls(kind=RefKind.FILE, name=where, attr=attr)
        if not all(part.isidentifier() for part in where.split(".")):
            raise KernelRefError(
                text,
                f"{where!r} is neither a module path (dotted names) nor a .py file; expected "
                "module:function or path/to/file.py:function",
            )
        return cls(kind=RefKind.MODULE, name=where, attr=attr)

    @property
    def protocol(self) -> Protocol:
        """How the probes call the kernel (:data:`Protocol`), known without importing it: a
        built-in adapter's, a specimen's registry entry, else ``m_sizes``."""
        if self.kind is RefKind.ADAPTER and self.name in BUILTIN_ADAPTERS:
            return BUILTIN_ADAPTERS[self.name].protocol
        if self.kind is RefKind.SPECIMEN:
            try:
                return get_specimen(self.name).protocol
            except KeyError:
                return "m_sizes"
        return "m_sizes"

    def default_target(self) -> KernelRef | None:
        """A built-in adapter's own kernel, for ``adapter:NAME`` with no target; else None."""
        if self.kind is not RefKind.ADAPTER or self.target is not None:
            return None
        builtin = BUILTIN_ADAPTERS.get(self.name)
        if builtin is None or builtin.default_target is None:
            return None
        return KernelRef.parse(builtin.default_target)

    def __str__(self) -> str:
        match self.kind:
            case RefKind.BUILTIN:
                return "builtin"
            case RefKind.TORCH:
                return "torch:grouped_mm"
            case RefKind.SPECIMEN:
                return f"specimen:{self.name}"
            case RefKind.ADAPTER:
                return f"adapter:{self.name}" + (f":{self.target}" if self.target is not None else "")
            case _:
                return f"{self.name}:{self.attr}"

    @property
    def path(self) -> Path:
        """A file reference's path, as given."""
        return Path(self.name)

    # -- the parent's check ------------------------------------------------------------------

    def validate(self) -> KernelRef:
        """What the parent can check without importing the kernel (the child checks the rest:
        that it imports and has the signature). Returns ``self``; raises KernelRefError."""
        self._validate()
        return self

    def _validate(self) -> None:
        text = str(self)
        match self.kind:
            case RefKind.SPECIMEN:
                try:
                    get_specimen(self.name)
                except KeyError as exc:
                    raise KernelRefError(text, str(exc.args[0])) from None
            case RefKind.FILE:
                try:
                    check_regular_file(self.path)
                except InputError as exc:
                    if str(exc).endswith(": no such file"):
                        raise KernelRefError(text, f"kernel file {shown_path(self.name)!r} does not exist") from None
                    raise KernelRefError(text, f"kernel file {exc}") from None
            case RefKind.MODULE:
                _check_findable(text, self.name, what="module")
            case RefKind.ADAPTER:
                if self.target is not None:
                    try:
                        self.target._validate()
                    except KernelRefError as exc:
                        raise KernelRefError(text, f"the adapter's TARGET: {exc.problem}") from None
                if self.name in BUILTIN_ADAPTERS:
                    if self.target is None and BUILTIN_ADAPTERS[self.name].default_target is None:
                        raise KernelRefError(
                            text,
                            f"the built-in adapter {self.name!r} adapts your kernel: name it, "
                            f"adapter:{self.name}:module:function or adapter:{self.name}:path/to/file.py:function",
                        )
                    return
                installed = installed_adapters()
                if self.name not in installed:
                    module, dot, _ = self.name.strip(".").rpartition(".")
                    if not dot:
                        known = ", ".join(sorted(installed)) or "none installed"
                        raise KernelRefError(
                            text,
                            f"no adapter named {self.name!r}: not one of ours ({', '.join(BUILTIN_ADAPTERS)}) "
                            f"nor in the entry-point group {ENTRY_POINT_GROUP!r} (installed: {known}); give "
                            "an adapter's name or the module.attr of an adapter object",
                        )
                    _check_findable(text, module, what="adapter module")
            case RefKind.BUILTIN | RefKind.TORCH:
                pass

    # -- what check lints, what a script imports ---------------------------------------------

    def source_path(self) -> Path | None:
        """The kernel's Python source file, found without importing it or its packages (a
        kernel package's ``__init__`` imports torch); None when there is none to find (the
        torch control, an adapter's default target, a module that is not installed here)."""
        match self.kind:
            case RefKind.BUILTIN:
                return module_source(BUILTIN_MODULE)
            case RefKind.SPECIMEN:
                try:
                    info = get_specimen(self.name)
                except KeyError:
                    return None
                return module_source(f"{SPECIMEN_PACKAGE}.{info.module}")
            case RefKind.MODULE:
                return module_source(self.name)
            case RefKind.FILE:
                return self.path if self.path.is_file() else None
            case RefKind.ADAPTER:
                target = self.target or self.default_target()
                return target.source_path() if target is not None else None
            case _:
                return None

    def source_site(self) -> tuple[Path, int] | None:
        """The kernel's source file and the 1-based line of its ``def`` (1 when the function is
        not defined at the top of that file, e.g. assigned or imported there), found by parsing,
        never importing; None when :meth:`source_path` finds no file. Where a report (SARIF)
        puts a diagnosis of the kernel."""
        path = self.source_path()
        if path is None:
            return None
        name = self.function_name()
        try:
            tree = ast.parse(read_bytes(path, gunzip=False))
        except (InputError, OSError, SyntaxError, ValueError, RecursionError):
            return path, 1
        for node in tree.body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == name:
                return path, node.lineno
        return path, 1

    def function_name(self) -> str:
        """The name of the kernel's function in :meth:`source_path` ("" when there is none)."""
        match self.kind:
            case RefKind.BUILTIN:
                return BUILTIN_FUNCTION
            case RefKind.SPECIMEN:
                try:
                    return KernelRef.parse(get_specimen(self.name).ref).attr
                except (KeyError, KernelRefError):
                    return ""
            case RefKind.ADAPTER:
                target = self.target or self.default_target()
                return target.function_name() if target is not None else ""
            case RefKind.TORCH:
                return ""
            case _:
                return self.attr

    def standalone(self) -> KernelRef | None:
        """The plain ``module:function`` or absolute ``file.py:function`` a script imports
        with no qmoe-doctor loader; None for an adapter (only the loader applies one)."""
        match self.kind:
            case RefKind.BUILTIN:
                return KernelRef(kind=RefKind.MODULE, name=BUILTIN_MODULE, attr=BUILTIN_FUNCTION)
            case RefKind.TORCH:
                return KernelRef.parse(TORCH_CONTROL)
            case RefKind.SPECIMEN:
                info = get_specimen(self.name)
                # a routed specimen is called through the routed adapter, which only the loader applies
                return KernelRef.parse(info.ref) if info.protocol == "m_sizes" else None
            case RefKind.ADAPTER:
                return None
            case _:
                return self.absolute()

    def absolute(self) -> KernelRef:
        """The same reference with file paths made absolute (a script may run elsewhere)."""
        if self.kind is RefKind.FILE:
            return replace(self, name=str(self.path.resolve()))
        if self.kind is RefKind.ADAPTER and self.target is not None:
            return replace(self, target=self.target.absolute())
        return self


# ---------------------------------------------------------------------------------------------
# Finding modules without importing them
# ---------------------------------------------------------------------------------------------


def installed_adapters() -> dict[str, str]:
    """Adapters registered by installed distributions: name -> ``module:attr``. Reads package
    metadata only; nothing is imported."""
    return {ep.name: ep.value for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)}


def _child_paths() -> list[str]:
    """Where the probe child also looks for modules beyond this process's ``sys.path``: its
    working directory (``python -m`` puts it first) and PYTHONPATH as the child inherits it."""
    extra = [os.getcwd()]
    extra += [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    return [p for p in extra if p not in sys.path]


def _find_top_level(name: str, search: Sequence[str] = ()) -> ModuleSpec | None:
    """The spec of a top-level module: in ``search`` first, then the import system's finders;
    nothing executed."""
    if search:
        found = importlib.machinery.PathFinder.find_spec(name, list(search))
        if found is not None:
            return found
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        spec = None
    if spec is None:
        spec = importlib.machinery.PathFinder.find_spec(name, _child_paths())
    return spec


def _find_submodule(fullname: str, locations: Sequence[str]) -> ModuleSpec | None:
    """A submodule's spec from its parent's search locations, asking the meta-path finders as
    the import system would but without importing the parent (an editable install maps
    ``qmoe_doctor.kernels`` through a finder of its own)."""
    for finder in sys.meta_path:
        find = getattr(finder, "find_spec", None)
        if find is None:
            continue
        try:
            spec = find(fullname, list(locations))
        except Exception:  # a third-party finder that cannot answer for this name
            continue
        if spec is not None:
            return spec  # type: ignore[no-any-return]
    return None


def module_source(module: str, search: Sequence[str] = ()) -> Path | None:
    """The source file of a dotted module (a package's ``__init__.py``), found without executing
    it or any of its packages, its top-level package looked up in the folders ``search`` first
    (a file's own folder, which Python puts first on ``sys.path`` when it runs the file); None
    when it is not found or is not Python source."""
    parts = module.split(".")
    if not all(p.isidentifier() for p in parts):
        return None
    spec = _find_top_level(parts[0], search)
    for i in range(1, len(parts)):
        if spec is None or spec.submodule_search_locations is None:
            return None
        spec = _find_submodule(".".join(parts[: i + 1]), spec.submodule_search_locations)
    if spec is None or not spec.origin or not spec.origin.endswith(".py"):
        return None
    path = Path(spec.origin)
    return path if path.is_file() else None


def _check_findable(text: str, module: str, *, what: str) -> None:
    """Refuse a module whose top-level package this Python cannot find. Skipped when the probe
    children run another interpreter (QMOE_DOCTOR_CHILD_PYTHON): that one is the judge."""
    if os.environ.get(knobs.QMOE_CHILD_PYTHON):
        return
    top = module.split(".")[0]
    if _find_top_level(top) is None:
        raise KernelRefError(
            text,
            f"cannot find the {what} {module!r}: no top-level {top!r} is installed in this Python, "
            "in the working directory or on PYTHONPATH",
        )


__all__ = [
    "BUILTIN_ADAPTERS",
    "BUILTIN_FUNCTION",
    "BUILTIN_MODULE",
    "BuiltinAdapter",
    "ENTRY_POINT_GROUP",
    "FORMS",
    "ROUTED_PROTOCOLS",
    "KernelRef",
    "KernelRefError",
    "Protocol",
    "RefKind",
    "installed_adapters",
    "module_source",
]
