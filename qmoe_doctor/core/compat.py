"""Small shims so the package runs on Python 3.10 (CI has 3.11, GPU machines 3.12)."""

from __future__ import annotations

import enum
import sys

if sys.version_info >= (3, 11):
    from enum import StrEnum
else:  # pragma: no cover - exercised only on 3.10

    class StrEnum(str, enum.Enum):
        def __str__(self) -> str:
            return str(self.value)


__all__ = ["StrEnum"]
