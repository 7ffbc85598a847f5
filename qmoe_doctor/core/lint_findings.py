"""What a lint run finds, as records: the rule ids, a finding, a path that could not be linted,
an entry that is not a source (stdlib only).

They live in core because reports hold them (``check``'s ``LintResult``) and the report writers
read them; the lint itself (``qmoe_doctor.lint``) makes them and re-exports them. A *finding* is
a fault in a source that was linted. An *error* is a path the user asked for that could not be
linted (missing, unreadable, too large, does not parse): the command exits 2. A *skip* is an
entry met while walking a folder that is not a source at all (a FIFO, a device, a socket, a
broken symbolic link, a folder that cannot be listed): it is named with its reason and the run
goes on. Records are frozen and JSON-ready (``records.to_jsonable``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from qmoe_doctor.core.compat import StrEnum


class Rule(StrEnum):
    UNGUARDED_LAUNCH = "unguarded-launch"
    INT32_OFFSET = "int32-offset"
    CACHED_DEVICE_PROPERTY = "cached-device-property"
    STREAM_WITHOUT_DEVICE = "stream-without-device"
    DEFAULT_DEVICE_ALLOC = "default-device-alloc"
    AUTOTUNE_INPLACE = "autotune-inplace"
    CURRENT_DEVICE_PROPERTY = "current-device-property"


@dataclass(frozen=True, slots=True, kw_only=True)
class RuleInfo:
    """What is fixed about a rule: the cause it points at and the generic fix."""

    rule: Rule
    cause: str  # a key of qmoe_doctor.core.causes.CAUSES
    summary: str
    fix: str


RULES: dict[Rule, RuleInfo] = {
    info.rule: info
    for info in (
        RuleInfo(
            rule=Rule.UNGUARDED_LAUNCH,
            cause="missing-device-guard",
            summary="Triton launch outside torch.cuda.device(...): runs on the current device",
            fix="with torch.cuda.device(x.device):\n    kernel[grid](x, ...)",
        ),
        RuleInfo(
            rule=Rule.INT32_OFFSET,
            cause="int32-offset-overflow",
            summary="global index x stride formed in int32 inside a @triton.jit kernel",
            fix="offset = index.to(tl.int64) * stride  # cast the index where the product is formed",
        ),
        RuleInfo(
            rule=Rule.CACHED_DEVICE_PROPERTY,
            cause="per-device-state-cached",
            summary="properties of the current device cached once for every device",
            fix="@functools.cache\ndef num_sms(device_index: int) -> int: ...  # keyed by device",
        ),
        RuleInfo(
            rule=Rule.STREAM_WITHOUT_DEVICE,
            cause="wrong-device-stream",
            summary="stream taken without the tensors' device",
            fix="with torch.cuda.device(x.device):\n    stream = torch.cuda.current_stream(x.device)",
        ),
        RuleInfo(
            rule=Rule.DEFAULT_DEVICE_ALLOC,
            cause="default-device-buffer",
            summary='buffer allocated with device="cuda" in a kernel wrapper',
            fix="buf = torch.empty(n, dtype=torch.int32, device=x.device)",
        ),
        RuleInfo(
            rule=Rule.AUTOTUNE_INPLACE,
            cause="autotune-inplace-rerun",
            summary="autotuned in-place/accumulating kernel without restore_value/reset_to_zero",
            fix='@triton.autotune(configs=..., key=[...], restore_value=["y_ptr"])',
        ),
        RuleInfo(
            rule=Rule.CURRENT_DEVICE_PROPERTY,
            cause="per-device-state-cached",
            summary="the current device's properties, read outside a device guard, size a launch",
            fix="sms = torch.cuda.get_device_properties(x.device).multi_processor_count",
        ),
    )
}


@dataclass(frozen=True, slots=True, kw_only=True)
class LintFinding:
    """One finding: where (1-based line and column), which rule and cause, what, and the fix."""

    path: str
    line: int
    col: int
    rule: Rule
    cause: str  # a key of qmoe_doctor.core.causes.CAUSES
    message: str
    fix: str  # a code snippet for this finding
    source: str = ""  # the source line, stripped

    @property
    def location(self) -> str:
        return f"{self.path}:{self.line}:{self.col}"

    def as_line(self) -> str:
        """``path:line:col: rule [cause] message`` (editors and grep read this)."""
        return f"{self.location}: {self.rule} [{self.cause}] {self.message}"


@dataclass(frozen=True, slots=True, kw_only=True)
class LintError:
    """A path that could not be linted. ``missing``: it does not exist (or is a broken link);
    ``unreadable``: not a regular file, no permission, larger than the cap, not decodable;
    ``syntax``: it does not parse, or is nested too deeply to parse or analyse."""

    path: str
    kind: Literal["missing", "unreadable", "syntax"]
    message: str  # one line, without the path
    line: int | None = None
    col: int | None = None
    source: str = ""  # the offending source line (syntax errors)

    def as_line(self) -> str:
        where = self.path
        if self.line is not None:
            where += f":{self.line}"
            if self.col is not None:
                where += f":{self.col}"
        return f"{where}: {self.message}"


@dataclass(frozen=True, slots=True, kw_only=True)
class LintSkip:
    """An entry met while walking a folder that is not a source: named, not linted, not an error.
    ``special-file``: a FIFO, device or socket (opening one could block or never end);
    ``broken-link``: a symbolic link to nothing (or a loop); ``unlistable``: a folder that
    cannot be listed."""

    path: str
    kind: Literal["special-file", "broken-link", "unlistable"]
    reason: str  # one line, without the path

    def as_line(self) -> str:
        return f"{self.path}: skipped: {self.reason}"


__all__ = ["RULES", "LintError", "LintFinding", "LintSkip", "Rule", "RuleInfo"]
