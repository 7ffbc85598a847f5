"""Kernel adapters, parent side: the ``--kernel adapter:...`` syntax and which adapters exist.

qmoe-doctor calls every kernel as ``fn(x, w, m_sizes) -> y`` (x (M, K) rows sorted by expert,
w (E, N, K), m_sizes (E,) int32 rows per expert). A kernel with another signature plugs in
through an *adapter*: a small object that turns the user's kernel into that callable and says
what the kernel can take (dtypes, contiguous inputs only, CPU tensors or not). The protocol and
its loading live on the child side, in ``qmoe_doctor.probes.adapters``; this module only parses
references and reads package metadata, so the parent never imports an adapter (an adapter
module imports the kernel library, which imports torch).

``--kernel`` forms::

    adapter:NAME               the adapter's own default kernel (its ``default_target``)
    adapter:NAME:TARGET        the adapter applied to TARGET, which is module:attr,
                               path/to/file.py:attr, builtin or specimen:NAME

NAME is an entry point in the group ``qmoe_doctor.core.kernel_ref`` (how a kernel library ships its
adapter), or a dotted ``module.attr`` path to an adapter object (no packaging needed).
"""

from __future__ import annotations

import importlib.metadata
import re
from dataclasses import dataclass
from pathlib import Path

#: Entry-point group a kernel library registers its adapter under (pyproject.toml):
#: ``[project.entry-points."qmoe_doctor.core.kernel_ref"]  mylib = "mylib.qmoe:ADAPTER"``
ENTRY_POINT_GROUP = "qmoe_doctor.core.kernel_ref"
ADAPTER_PREFIX = "adapter:"
#: Kernel references the loader resolves by name (no module import needed to name them).
NAMED_REFS = ("builtin", "torch:grouped_mm")

_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.\-]*")

__all__ = [
    "ADAPTER_PREFIX",
    "ENTRY_POINT_GROUP",
    "AdapterRef",
    "installed_adapters",
    "is_adapter_ref",
    "parse_adapter_ref",
    "validate_adapter_ref",
]


@dataclass(frozen=True, slots=True, kw_only=True)
class AdapterRef:
    """``adapter:NAME[:TARGET]`` taken apart."""

    name: str  # entry-point name, or module.attr of an adapter object
    target: str | None  # the kernel reference the adapter wraps; None: its default_target

    @property
    def dotted(self) -> bool:
        """NAME may be a ``module.attr`` path (used when no entry point has that name)."""
        return "." in self.name.strip(".")


def is_adapter_ref(ref: str) -> bool:
    return ref.startswith(ADAPTER_PREFIX)


def parse_adapter_ref(ref: str) -> AdapterRef:
    """Split ``adapter:NAME[:TARGET]``. Raises ValueError with the expected form."""
    if not is_adapter_ref(ref):
        raise ValueError(f"{ref!r} is not an adapter reference (adapter:NAME[:TARGET])")
    name, sep, target = ref[len(ADAPTER_PREFIX) :].partition(":")
    if not _NAME.fullmatch(name):
        raise ValueError(
            f"{ref!r}: expected adapter:NAME or adapter:NAME:TARGET, NAME an installed adapter "
            "(entry point) or module.attr of an adapter object"
        )
    if not sep:
        return AdapterRef(name=name, target=None)
    if target in NAMED_REFS:
        return AdapterRef(name=name, target=target)
    where, colon, attr = target.rpartition(":")
    if not colon or not where or not attr:
        raise ValueError(
            f"{ref!r}: the target {target!r} must be module:attr, path/to/file.py:attr, "
            "builtin or specimen:NAME"
        )
    return AdapterRef(name=name, target=target)


def installed_adapters() -> dict[str, str]:
    """Adapters registered by installed distributions: name -> ``module:attr``. Reads package
    metadata only; nothing is imported."""
    return {ep.name: ep.value for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)}


def validate_adapter_ref(ref: str) -> AdapterRef:
    """What the parent can check without importing the adapter (the child checks the rest):
    the form, that NAME exists, that a file target exists. Raises ValueError."""
    parsed = parse_adapter_ref(ref)
    installed = installed_adapters()
    if parsed.name not in installed and not parsed.dotted:
        known = ", ".join(sorted(installed)) or "none installed"
        raise ValueError(
            f"{ref!r}: no adapter named {parsed.name!r} in the entry-point group {ENTRY_POINT_GROUP!r} "
            f"({known}); give an installed adapter's name or the module.attr of an adapter object"
        )
    target = parsed.target
    if target is not None and target not in NAMED_REFS:
        where, _, name = target.rpartition(":")
        if where == "specimen":
            from qmoe_doctor.core.specimens import get_specimen

            try:
                get_specimen(name)
            except KeyError as exc:
                raise ValueError(str(exc.args[0])) from None
        elif where.endswith(".py") and not Path(where).is_file():
            raise ValueError(f"{ref!r}: kernel file {where!r} does not exist")
    return parsed
