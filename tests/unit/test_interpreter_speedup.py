"""kernels/interpreter.py: importing our kernels under TRITON_INTERPRET=1 turns off the
interpreter's int32 overflow check, whose assertion the interpreter discards (debug is off):
the same values with it on and off, wrapped int32 products included, and nothing changed when
debug is on."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import triton
import triton.language as tl
from triton.runtime import interpreter as interp

import qmoe_doctor.kernels  # noqa: F401  (installs it)
from qmoe_doctor.kernels import interpreter as speedup
from qmoe_doctor.kernels.grouped_gemm import interpreting, moe_grouped_gemm

pytestmark = pytest.mark.skipif(not interpreting(), reason="the interpreter is off (a GPU machine)")


@triton.jit
def _wrapping_kernel(a_ptr, b_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    a = tl.load(a_ptr + offs, mask=mask)
    b = tl.load(b_ptr + offs, mask=mask)
    tl.store(out_ptr + offs, a * b + a - b, mask=mask)  # int32: wraps past 2**31 - 1


@pytest.fixture
def check_on() -> object:
    """The interpreter's options with the overflow check on, for the length of a test."""
    saved = interp.interpreter_builder.options
    yield lambda on: setattr(
        interp.interpreter_builder, "options", dataclasses.replace(saved, sanitize_overflow=on)
    )
    interp.interpreter_builder.options = saved


def test_importing_our_kernels_turned_the_discarded_check_off() -> None:
    assert speedup.state().startswith("installed"), speedup.state()
    options = interp.interpreter_builder.options
    assert options.sanitize_overflow is False and options.debug is False


def test_wrapping_int32_arithmetic_is_the_same_with_the_check_on_and_off(check_on) -> None:
    gen = torch.Generator().manual_seed(0)
    a = torch.randint(-(2**31), 2**31 - 1, (300,), dtype=torch.int32, generator=gen)
    b = torch.randint(-(2**31), 2**31 - 1, (300,), dtype=torch.int32, generator=gen)
    want = (a.to(torch.int64) * b + a - b).to(torch.int32)  # two's complement wrap, as on a GPU
    got = {}
    for on in (True, False):
        check_on(on)
        out = torch.empty_like(a)
        _wrapping_kernel[(3,)](a, b, out, 300, BLOCK=128)
        got[on] = out
    assert torch.equal(got[True], got[False])
    assert torch.equal(got[False], want)


def test_our_grouped_gemm_is_bit_identical_with_the_check_on_and_off(check_on) -> None:
    gen = torch.Generator().manual_seed(1)
    x, w = torch.randn(40, 32, generator=gen), torch.randn(3, 16, 32, generator=gen)
    sizes = torch.tensor([13, 0, 27], dtype=torch.int32)
    got = {}
    for on in (True, False):
        check_on(on)
        got[on] = moe_grouped_gemm(x, w, sizes)
    assert torch.equal(got[True], got[False])


def test_debug_on_or_no_option_leaves_the_interpreter_as_it_is(monkeypatch: pytest.MonkeyPatch) -> None:
    saved = interp.interpreter_builder.options
    monkeypatch.setattr(speedup, "_state", "not installed")
    monkeypatch.setattr(interp.interpreter_builder, "options", dataclasses.replace(saved, debug=True, sanitize_overflow=True))
    assert "debug option is on" in speedup.speed_up()
    assert interp.interpreter_builder.options.sanitize_overflow is True
    monkeypatch.setattr(speedup, "_state", "not installed")
    monkeypatch.setattr(interp.interpreter_builder, "options", None)
    assert "no options to change" in speedup.speed_up()
    monkeypatch.setattr(speedup, "_state", "not installed")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert speedup.speed_up() == "not installed"  # a GPU run: nothing touched
