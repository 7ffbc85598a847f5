"""Property-based fuzzing of every input the doctor parses (Hypothesis).

The property, for each input and each way in: **a result, or one line saying what is wrong
with exit 2 (or the command's documented code); never a traceback, never rich's MarkupError,
never an unbounded run.** Each input is fuzzed twice: through its library function (many cheap
examples; the library raises its own error type, or returns a record) and through the command
line, in-process with ``typer.testing.CliRunner`` (fewer examples; stdout and stderr are searched
for "Traceback" and "MarkupError", the exit code is one the command documents, and an exit 2
prints exactly one ``error:`` line).

Inputs and where they come from:

* ``--kernel`` references (``KernelRef.parse`` / ``validate``; ``scan --kernel`` with the scan's
  workflow replaced by a stub): built from the grammar's own pieces plus any text.
* ``--gpus`` strings (``cli.devices.select_devices`` on the fake NVML machines of
  ``fake_nvml.py``; ``env --gpus``), checked against an oracle: a comma list of distinct ASCII
  indices the machine has is taken in that order, anything else refused.
* Hugging Face configs (``core.audit.load_hf_config``; ``audit --config``): JSON built from the
  config's own keys with values of every type, integers of thousands of digits, deep nesting,
  and the text then cut, or salted with bytes that are not UTF-8.
* compute-sanitizer logs and tracebacks (``diagnose.explain.explain_text``; ``explain FILE``):
  DERIVED VARIANTS of our recorded files (tests/fixtures/sanitizer/*/, tests/fixtures/tracebacks/*/): cut, lines
  shuffled, dropped and repeated, random bytes, numbers made huge, rich markup inserted.
* kernel sources (``lint FILE``): text built from Python and Triton pieces, and deep expressions.

Budget: every test sets ``max_examples`` and ``deadline`` so the whole module runs in well under a
minute on two CPU cores (``pytest --durations`` shows it). The deadline is per example and
generous: it catches a blow-up (a quadratic parse of a huge number, a hang), not a slow machine.
Run deeper by hand with ``QMOE_FUZZ_SCALE=20`` (see ``budget``). No example database is written
(the CI checkout stays clean); a failure prints the example to reproduce it.
"""

from __future__ import annotations

import gzip
import json
import os
import re
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
import typer
from fake_nvml import FakeNvml, four_mixed, two_h200_nvswitch
from hypothesis import HealthCheck, assume, example, given, settings
from hypothesis import strategies as st
from recorded_logs import ALL_LOGS, ALL_TRACEBACKS, first_records, read
from typer.testing import CliRunner, Result

from qmoe_doctor.cli import devices as devices_mod
from qmoe_doctor.cli.app import app
from qmoe_doctor.cli.commands import scan as scan_cmd
from qmoe_doctor.cli.errors import CliError
from qmoe_doctor.core import knobs
from qmoe_doctor.core.audit import MAX_CONFIG_INT, ConfigError, load_hf_config
from qmoe_doctor.core.kernel_ref import KernelRef, KernelRefError
from qmoe_doctor.core.records import to_jsonable
from qmoe_doctor.diagnose.explain import Explanation, NothingToExplain, explain_text
from qmoe_doctor.machine.inventory import GpuSelectionError, collect_inventory

# --- budget ---------------------------------------------------------------------------------------

#: The profile every test here builds on: no example database (nothing written to the
#: checkout), fixtures reused across examples on purpose (each example overwrites the one file
#: it writes), a failing example printed as a blob to reproduce it.
settings.register_profile(
    "qmoe-fuzz",
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
    print_blob=True,
)
#: By hand, to fuzz deeper: ``QMOE_FUZZ_SCALE=20 pytest tests/unit/test_fuzz_inputs.py`` runs
#: twenty times each test's CI budget, with no deadline.
SCALE = max(1, int(os.environ.get("QMOE_FUZZ_SCALE", "1") or "1"))


def budget(examples: int, deadline_ms: int) -> settings:
    """This test's bounded CI budget: ``examples`` examples, each under ``deadline_ms``."""
    return settings(
        settings.get_profile("qmoe-fuzz"),
        max_examples=examples * SCALE,
        deadline=deadline_ms if SCALE == 1 else None,
    )


pytestmark = pytest.mark.timeout(300)  # a hang fails the test instead of the CI job

# --- the property, through the CLI ----------------------------------------------------------------

runner = CliRunner()
MARKUP = ("[/]", "[bold red]", "[/bold]", "[link=file:///etc/passwd]x[/link]", "[[", "]]", "\\[", ":smile:")


def invoke(args: Sequence[str], **kwargs: Any) -> Result:
    return runner.invoke(app, list(args), **kwargs)


def assert_clean(result: Result, codes: set[int], args: Sequence[str] = ()) -> None:
    """A result or one line: the documented exit codes, no traceback, no markup crash, an exit 2
    with exactly one ``error:`` line on stderr."""
    shown = f"args={list(args)!r}\nexit={result.exit_code}\nstdout={result.stdout[-2000:]}\nstderr={result.stderr[-2000:]}"
    exc = result.exception
    assert exc is None or isinstance(exc, SystemExit), f"{type(exc).__name__}: {exc}\n{shown}"
    everything = result.stdout + result.stderr
    assert "Traceback" not in everything, shown
    assert "MarkupError" not in everything, shown
    assert result.exit_code in codes, shown
    if result.exit_code == 2:
        errors = [ln for ln in result.stderr.splitlines() if ln.startswith("error: ")]
        assert len(errors) == 1, shown


# --- kernel references ----------------------------------------------------------------------------

_REF_PIECES = st.sampled_from(
    [
        "builtin", "torch", "grouped_mm", "specimen", "adapter", "unmasked_rows", "fn", "k", "os",
        "os.path", "json", "qmoe_doctor.kernels", ":", "::", ".", "..", "/", "./", "../", ".py",
        "k.py", "dir.py", "-", "_", " ", "\t", "\n", "\x00", "é", "名", "1", "C:\\", "*", "~",
        "$HOME", *MARKUP,
    ]
)  # fmt: skip
REF_TEXT = st.one_of(st.text(max_size=30), st.lists(_REF_PIECES, max_size=9).map("".join))


@pytest.fixture
def ref_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A working directory with a kernel file, a folder named like one, and a FIFO named like
    one (validate must never open it), so file references can name something real."""
    (tmp_path / "k.py").write_text("def fn(x, w, m_sizes):\n    return x\n")
    (tmp_path / "dir.py").mkdir()
    if hasattr(os, "mkfifo"):
        os.mkfifo(tmp_path / "fifo.py")
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv(knobs.QMOE_CHILD_PYTHON, raising=False)
    return tmp_path


def _library_verdict(text: str) -> KernelRef | KernelRefError:
    try:
        ref = KernelRef.parse(text)
    except KernelRefError as exc:
        assert exc.text == text
        return exc
    # the canonical text is what crosses the process boundary: it must name the same reference
    assert KernelRef.parse(str(ref)) == ref, (text, str(ref))
    try:
        return ref.validate()
    except KernelRefError as exc:
        return exc


@budget(300, 2000)
@given(text=REF_TEXT)
@example(text="fifo.py:fn")
@example(text="./dir.py:fn")
@example(text="adapter:x.y:adapter:z")
@example(text="[/]/k.py:fn")
def test_fuzz_kernel_ref_parse_and_validate(text: str, ref_folder: Path) -> None:
    """parse/validate return a reference or raise KernelRefError, whose message names the
    reference and is one line."""
    verdict = _library_verdict(text)
    if isinstance(verdict, KernelRefError):
        assert "\n" not in str(verdict), str(verdict)
        # parse names the text as given; validate names the canonical reference
        assert str(verdict).startswith(("--kernel '", '--kernel "')), str(verdict)


REACHED = 99  # the stub workflow's exit: the reference was accepted and handed on


@budget(80, 5000)
@given(text=REF_TEXT)
@example(text="specimen:[/]")
@example(text="k.py:fn\n[/]")
def test_fuzz_kernel_ref_through_the_cli(
    text: str, ref_folder: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``scan --kernel TEXT``: the CLI accepts exactly what the library accepts (reaching the
    stubbed workflow) and refuses the rest with one line, exit 2."""
    assume("\x00" not in text)  # no real command line holds a NUL
    monkeypatch.setattr(scan_cmd, "run_scan", lambda plan, **kw: (_ for _ in ()).throw(typer.Exit(REACHED)))
    args = ["scan", "--cpu", "--only", "single", "--kernel", text, "--log-dir", str(ref_folder / "logs")]
    result = invoke(args)
    assert_clean(result, {2, REACHED}, args)
    accepted = not isinstance(_library_verdict(text), KernelRefError)
    assert (result.exit_code == REACHED) == accepted, (text, result.stderr)


# --- --gpus ---------------------------------------------------------------------------------------

_GPU_PIECES = st.sampled_from(
    [
        "0", "1", "2", "3", "4", "9", "10", "007", "all", "ALL", "All", " ", "\t", ",", ",,", "-1",
        "+1", "0x1", "1e0", "1.0", "1_0", "²", "١", "０", "٣", "🄂", "[/]", "[bold]", "cuda:0",
        "GPU-6a1c9e0b", "99999999999999999999", "7" * 4400, "\n", "\x00",
    ]
)  # fmt: skip
GPUS_TEXT = st.one_of(st.none(), st.text(max_size=12), st.lists(_GPU_PIECES, max_size=7).map("".join))
MACHINES = {"two-h200": two_h200_nvswitch, "four-mixed": four_mixed, "no-gpu": lambda: FakeNvml([])}


def _expected_gpus(spec: str | None, known: Sequence[int]) -> tuple[int, ...] | None:
    """The oracle: what --gpus selects on a machine with GPUs ``known``, or None (refused)."""
    if spec is None or spec.strip().lower() == "all":
        return tuple(known)
    parts = [p.strip() for p in spec.strip().split(",")]
    if not all(p.isascii() and p.isdigit() and len(p) <= 6 for p in parts):
        return None
    indices = tuple(int(p) for p in parts)
    if len(set(indices)) != len(indices) or not set(indices) <= set(known):
        return None
    return indices


@pytest.fixture
def machine_env(monkeypatch: pytest.MonkeyPatch) -> Iterator[pytest.MonkeyPatch]:
    """The CLI reads os.environ: a GPU machine running the tests may have these set."""
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.delenv("CUDA_DEVICE_ORDER", raising=False)
    yield monkeypatch


@budget(250, 2000)
@given(spec=GPUS_TEXT, machine=st.sampled_from(sorted(MACHINES)), cpu=st.booleans())
@example(spec="7" * 4400, machine="two-h200", cpu=False)
@example(spec="١", machine="four-mixed", cpu=False)
@example(spec="０", machine="four-mixed", cpu=False)
def test_fuzz_gpus_selection(
    spec: str | None, machine: str, cpu: bool, machine_env: pytest.MonkeyPatch
) -> None:
    """``select_devices``: the GPUs the oracle names, in that order, or a refusal in one line."""
    fake = MACHINES[machine]()
    machine_env.setitem(sys.modules, "pynvml", fake.module())
    known = [g.index for g in collect_inventory(environ={}).gpus]
    try:
        chosen = devices_mod.select_devices(spec, cpu=cpu, cpu_fallback="the CPU tier", announce=False)
    except (CliError, GpuSelectionError) as exc:
        message = exc.message if isinstance(exc, CliError) else str(exc)
        assert message and len(message) < 3000, message
        if not cpu and spec is not None and spec.strip() and known:
            assert _expected_gpus(spec, known) is None, (spec, message)
        return
    if cpu:
        assert spec is None and chosen.gpus == ()
    elif not known:  # --gpus all is the default spelt out: the CPU fallback too
        assert (spec is None or spec.strip().lower() == "all") and chosen.gpus == () and chosen.fallback
    else:
        assert chosen.indices == _expected_gpus(spec, known), spec


@budget(60, 5000)
@given(
    spec=GPUS_TEXT.filter(lambda s: s is not None and "\x00" not in s),
    machine=st.sampled_from(sorted(MACHINES)),
)
def test_fuzz_gpus_through_the_cli(spec: str, machine: str, machine_env: pytest.MonkeyPatch) -> None:
    """``env --gpus SPEC``: the inventory of the GPUs named (exit 0), or one line (exit 2)."""
    machine_env.setitem(sys.modules, "pynvml", MACHINES[machine]().module())
    args = ["env", "--gpus", spec]
    result = invoke(args)
    assert_clean(result, {0, 2}, args)


# --- Hugging Face configs -------------------------------------------------------------------------

CONFIG_KEYS = (
    "num_experts", "n_routed_experts", "num_local_experts", "num_experts_per_tok", "hidden_size",
    "moe_intermediate_size", "norm_topk_prob", "text_config", "_name_or_path", "model_type",
)  # fmt: skip


def _digits(n: int) -> str:
    return "9" * n


#: JSON values as text: every type, numbers JSON allows but Python refuses to convert (thousands
#: of digits), floats that overflow, and Python's JSON extensions (NaN, Infinity).
JSON_SCALAR = st.one_of(
    st.integers(min_value=-(2**70), max_value=2**70).map(str),
    st.integers(min_value=1, max_value=64).map(str),
    st.integers(min_value=4000, max_value=6000).map(_digits),
    st.sampled_from(["1e400", "-1e400", "NaN", "Infinity", "-Infinity", "0.5", "1.0", "-0", "1E3"]),
    st.sampled_from(["true", "false", "null"]),
    st.text(max_size=12).map(json.dumps),
    st.sampled_from(MARKUP).map(json.dumps),
)


def _nested(depth: int, opener: str) -> str:
    closer = {"[": "]", '{"a":': "}"}[opener]
    return opener * depth + "1" + closer * depth


JSON_VALUE = st.recursive(
    JSON_SCALAR,
    lambda inner: st.one_of(
        st.lists(inner, max_size=3).map(lambda xs: "[" + ",".join(xs) + "]"),
        st.lists(st.tuples(st.sampled_from(CONFIG_KEYS), inner), max_size=6).map(
            lambda kv: "{" + ",".join(f"{json.dumps(k)}:{v}" for k, v in kv) + "}"
        ),
    ),
    max_leaves=12,
) | st.tuples(st.integers(1, 200_000), st.sampled_from(["[", '{"a":'])).map(lambda t: _nested(*t))

CONFIG_OBJECT = st.lists(st.tuples(st.sampled_from(CONFIG_KEYS), JSON_VALUE), max_size=10).map(
    lambda kv: "{" + ",".join(f"{json.dumps(k)}: {v}" for k, v in kv) + "}"
)


@st.composite
def config_bytes(draw: st.DrawFn) -> bytes:
    """A config file: a JSON object of config keys, or any JSON value, then maybe cut, salted
    with bytes that are not UTF-8, or prefixed with a byte-order mark."""
    text = draw(st.one_of(CONFIG_OBJECT, JSON_VALUE, st.text(max_size=40)))
    data = text.encode("utf-8", "surrogatepass")
    mutation = draw(st.sampled_from(["none", "none", "cut", "bytes", "bom", "gzip"]))
    if mutation == "cut" and data:
        data = data[: draw(st.integers(0, len(data) - 1))]
    elif mutation == "bytes":
        at = draw(st.integers(0, len(data)))
        data = data[:at] + draw(st.binary(min_size=1, max_size=8)) + data[at:]
    elif mutation == "bom":
        data = b"\xef\xbb\xbf" + data
    elif mutation == "gzip":
        data = gzip.compress(data)
    return data


def _valid_config(experts: int, top_k: int, hidden: int, inter: int, nest: bool) -> bytes:
    body = {
        "num_experts": experts,
        "num_experts_per_tok": top_k,
        "hidden_size": hidden,
        "moe_intermediate_size": inter,
    }
    return json.dumps({"text_config": body} if nest else body).encode()


def _check_config(path: Path) -> None:
    try:
        shape = load_hf_config(path)
    except ConfigError as exc:
        message = str(exc)
        assert "\n" not in message and str(path) in message and len(message) < 5000, message
        return
    for value in (shape.num_experts, shape.top_k, shape.hidden, shape.intermediate):
        assert isinstance(value, int) and not isinstance(value, bool) and 0 < value <= MAX_CONFIG_INT
    assert shape.top_k <= shape.num_experts and isinstance(shape.norm_topk_prob, bool)


@budget(250, 3000)
@given(data=config_bytes())
@example(data=b'{"num_experts": ' + b"9" * 3001 + b"}")
@example(data=b"[" * 100_000 + b"]" * 100_000)
@example(data=b'{"text_config": ' * 50_000 + b"1" + b"}" * 50_000)
@example(data=b"\xff\xfe{}")
def test_fuzz_config_loader(data: bytes, tmp_path: Path) -> None:
    """``load_hf_config``: a MoE shape of positive integers, or ConfigError in one line naming
    the file."""
    path = tmp_path / "config.json"
    path.write_bytes(data)
    _check_config(path)


@budget(100, 2000)
@given(
    experts=st.integers(1, MAX_CONFIG_INT),
    top_k=st.integers(1, 64),
    hidden=st.integers(1, MAX_CONFIG_INT),
    inter=st.integers(1, MAX_CONFIG_INT),
    nest=st.booleans(),
)
def test_fuzz_valid_configs_are_read(
    experts: int, top_k: int, hidden: int, inter: int, nest: bool, tmp_path: Path
) -> None:
    """The other half of the oracle: every well-formed MoE config is read, with its values."""
    path = tmp_path / "config.json"
    path.write_bytes(_valid_config(experts, top_k, hidden, inter, nest))
    if top_k > experts:
        with pytest.raises(ConfigError, match="larger than the expert count"):
            load_hf_config(path)
        return
    shape = load_hf_config(path)
    assert (shape.num_experts, shape.top_k, shape.hidden, shape.intermediate) == (
        experts,
        top_k,
        hidden,
        inter,
    )


@budget(60, 5000)
@given(data=config_bytes())
def test_fuzz_config_through_the_cli(data: bytes, tmp_path: Path) -> None:
    """``audit --config FILE``: the audit (exit 0), or one line (exit 2)."""
    path = tmp_path / "config.json"
    path.write_bytes(data)
    args = ["audit", "--config", str(path)]
    assert_clean(invoke(args), {0, 2}, args)


# --- compute-sanitizer logs and tracebacks --------------------------------------------------------


def _recorded_texts() -> list[str]:
    """Our recorded logs and tracebacks; the two 127 KB logs as their first three records (each
    holds 50 near-identical records; the mutations below need variety, not length)."""
    texts = []
    for path in ALL_LOGS + ALL_TRACEBACKS:
        text = read(path)
        texts.append(first_records(text, 3) if len(text) > 20_000 and path in ALL_LOGS else text)
    return texts


RECORDED_TEXTS = _recorded_texts()
_NUMBER = re.compile(r"0x[0-9a-fA-F]+|\d[\d,]*")


@st.composite
def mutated_log(draw: st.DrawFn) -> bytes:
    """DERIVED VARIANT of a recorded log or traceback: a few mutations, each a way a real log
    gets damaged (cut by a crash, interleaved by two processes, a corrupt disk, a hostile
    editor), then the bytes as a file would hold them."""
    text = draw(st.sampled_from(RECORDED_TEXTS))
    lines = text.splitlines(keepends=True)
    for _ in range(draw(st.integers(1, 4))):
        kind = draw(st.sampled_from(["cut", "shuffle", "drop", "repeat", "huge", "markup", "noise", "head"]))
        if not lines:
            break
        i = draw(st.integers(0, len(lines) - 1))
        if kind == "cut":  # ends mid-line
            lines = lines[:i] + [lines[i][: draw(st.integers(0, len(lines[i])))]]
        elif kind == "head":  # starts mid-line
            lines = [lines[i][draw(st.integers(0, len(lines[i]))) :]] + lines[i + 1 :]
        elif kind == "shuffle":
            j = draw(st.integers(0, len(lines) - 1))
            lines[i], lines[j] = lines[j], lines[i]
        elif kind == "drop":
            del lines[i]
        elif kind == "repeat":
            lines[i:i] = [lines[i]] * draw(st.integers(1, 200))
        elif kind == "huge":  # one number of the line grows to thousands of digits
            digits = draw(
                st.sampled_from(["9" * 5000, "0x" + "f" * 4000, "1" + "0" * 30, "1,000,000,000,000"])
            )
            lines[i] = _NUMBER.sub(digits.replace("\\", "\\\\"), lines[i], count=1)
        elif kind == "markup":
            at = draw(st.integers(0, len(lines[i])))
            lines[i] = lines[i][:at] + draw(st.sampled_from(MARKUP)) + lines[i][at:]
        else:  # random text
            at = draw(st.integers(0, len(lines[i])))
            lines[i] = lines[i][:at] + draw(st.text(max_size=12)) + lines[i][at:]
    data = "".join(lines).encode("utf-8", "surrogatepass")
    if draw(st.booleans()):
        at = draw(st.integers(0, len(data)))
        data = data[:at] + draw(st.binary(min_size=1, max_size=16)) + data[at:]
    return data


def _check_explanation(e: Explanation) -> None:
    assert e.headline and isinstance(e.findings, bool)
    for line in (*e.facts, *e.user_frames, *e.next_steps, *e.caveats):
        assert isinstance(line, str)
    json.dumps(to_jsonable(e))  # --json writes it: every number must print


_N = b"9" * 5000
_TB = b'Traceback (most recent call last):\n  File "k.py", line 3, in f\n'


@budget(300, 3000)
@given(data=mutated_log())
@example(
    data=_TB + b"ValueError: Pointer argument (at " + _N + b") cannot be accessed from Triton (cpu tensor?)\n"
)
@example(
    data=b"/k.py:"
    + _N
    + b": unknown: block: [1,0,0] Assertion `int32 overflow detected for operation mul` failed.\n"
    + _TB
    + b"RuntimeError: device-side assert triggered\n"
)
@example(
    data=b"/k.py:1: unknown: block: [1,0,0] Assertion `int"
    + _N
    + b" overflow detected for operation mul` failed.\n"
    + _TB
    + b"RuntimeError: device-side assert triggered\n"
)
@example(
    data=_TB + b"RuntimeError: Expected all tensors to be on the same device, cuda:" + _N + b" and cuda:1!\n"
)
def test_fuzz_explain_text(data: bytes) -> None:
    """``explain_text``: an Explanation whose every field prints, or NothingToExplain."""
    text = data.decode("utf-8", errors="replace")
    try:
        explanation = explain_text(text, source="fuzz.log")
    except NothingToExplain as exc:
        assert "\n" not in str(exc)
        return
    _check_explanation(explanation)


@budget(80, 5000)
@given(data=mutated_log(), as_json=st.booleans(), gz=st.booleans())
def test_fuzz_explain_through_the_cli(data: bytes, as_json: bool, gz: bool, tmp_path: Path) -> None:
    """``explain FILE``: exit 0 (clean run) or 1 (a finding) with the explanation, or one line
    with exit 2; ``--json`` is one parsable document."""
    path = tmp_path / ("fuzz.log.gz" if gz else "fuzz.log")
    path.write_bytes(gzip.compress(data) if gz else data)
    args = ["explain", str(path), *(["--json"] if as_json else [])]
    result = invoke(args)
    assert_clean(result, {0, 1, 2}, args)
    if as_json and result.exit_code in (0, 1):
        assert json.loads(result.stdout)["kind"] == "explanation"


@budget(40, 5000)
@given(data=mutated_log())
def test_fuzz_explain_stdin(data: bytes) -> None:
    """``explain -``: the same through standard input."""
    result = invoke(["explain", "-"], input=data)
    assert_clean(result, {0, 1, 2}, ["explain", "-"])


# --- kernel sources through lint ------------------------------------------------------------------

_SOURCE_PIECES = st.sampled_from(
    [
        "(", ")", "[", "]", "{", "}", ":", ",", ".", " ", "\n", "    ", "+", "*", "-", "not ",
        "=", "x", "tl", "triton", "torch", "@triton.jit\n", "def k(x_ptr, stride_xm):\n",
        "tl.program_id(0)", "tl.load(", "kernel[grid](", "with torch.cuda.device(x):\n",
        "torch.empty(4, device='cuda')", "\\", "'", '"', "#", "\x00", "\xe9", "lambda: ", "if ",
        "# qmoe-doctor: ignore[", "int32-offset]", "# -*- coding: latin-1 -*-\n", "\ufeff",
        *MARKUP,
    ]
)  # fmt: skip

KERNEL_HEAD = "import torch\nimport triton\nimport triton.language as tl\n\n@triton.jit\ndef k(x_ptr, stride_xm):\n    pid = tl.program_id(0)\n"


def _deep_kernel(levels: int, shape: str) -> str:
    expr = {
        "sum": " + ".join(["pid * stride_xm"] * levels),
        "calls": "tl.load(" * levels + "pid" + ")" * levels,
        "parens": "(" * levels + "pid" + ")" * levels,
        "lists": "[" * levels + "pid" + "]" * levels,
    }[shape]
    return KERNEL_HEAD + f"    tl.store(x_ptr + {expr}, 1)\n"


LINT_SOURCE = st.one_of(
    st.lists(_SOURCE_PIECES, max_size=60).map("".join),
    st.builds(_deep_kernel, st.integers(1, 3000), st.sampled_from(["sum", "calls", "parens", "lists"])),
    st.text(max_size=200),
)


@budget(80, 8000)
@given(source=LINT_SOURCE, salt=st.binary(max_size=6), plain=st.booleans())
@example(source=_deep_kernel(3000, "calls"), salt=b"", plain=True)
@example(source=_deep_kernel(1000, "parens"), salt=b"", plain=False)
def test_fuzz_lint_through_the_cli(source: str, salt: bytes, plain: bool, tmp_path: Path) -> None:
    """``lint FILE``: exit 0 (clean) or 1 (findings), or one line naming the file with exit 2."""
    path = tmp_path / "kernel.py"
    path.write_bytes(source.encode("utf-8", "surrogatepass") + salt)
    args = ["lint", str(path), *(["--plain"] if plain else [])]
    result = invoke(args)
    assert_clean(result, {0, 1, 2}, args)
    if result.exit_code == 2:
        assert f"error: {path.as_posix()}" in result.stderr, result.stderr


def test_the_budget_is_bounded() -> None:
    """Every fuzz test here states its own example count and deadline (the CI budget)."""
    for name, fn in sorted(globals().items()):
        if name.startswith("test_fuzz_"):
            chosen = getattr(fn, "_hypothesis_internal_use_settings", None)
            assert (
                chosen is not None
                and chosen.max_examples <= 300 * SCALE
                and (chosen.deadline is not None or SCALE > 1)
            ), name
