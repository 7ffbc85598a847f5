"""The monitor's call sites (``monitor/callsite.py``) on real frames, in this process: the library's
line, the user's own line (the first frame outside site-packages / dist-packages), and the
wrapper a ``scan --kernel`` reference can name. Each row of the table is one edge: a decorated
wrapper, a flattened weight, a closure, another signature, arguments that are not (x, w,
m_sizes)-shaped tensors, the program's own ``__main__``.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch

from qmoe_doctor.monitor.callsite import Place, Places, Sites, find_sites

MODULE = """\
import functools
import sys

from qmoe_doctor.monitor.callsite import Places, find_sites
import torch

SEEN = []


def _probe():
    # where the monitor stands at a launch: a few frames inside the wrapper
    SEEN.append(find_sites(Places(), sys._getframe(1), torch.Tensor))


def _launch(x, w, y, m_sizes):
    _probe()


def grouped_gemm(x, w, m_sizes, *, out=None):
    _launch(x, w, None, m_sizes)


def _traced(fn):
    @functools.wraps(fn)
    def inner(*args, **kwargs):
        return fn(*args, **kwargs)
    return inner


@_traced
def decorated(x, w, m_sizes):
    _launch(x, w, None, m_sizes)


def four(x, w, m_sizes, bias):
    _launch(x, w, None, m_sizes)


def needs_config(x, w, m_sizes, *, config):
    _launch(x, w, None, m_sizes)


def make_closure():
    def forward(x, w, m_sizes):
        _launch(x, w, None, m_sizes)
    return forward
"""


def load(tmp_path: Path, folder: str, name: str, module_name: str | None = None) -> ModuleType:
    path = tmp_path / folder / f"{name}.py"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(MODULE)
    spec = importlib.util.spec_from_file_location(module_name or name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


X, W, SIZES = torch.randn(4, 8), torch.randn(2, 8, 8), torch.tensor([2, 2], dtype=torch.int32)


def sites_of(module: ModuleType, fn: str, *args: object, **kwargs: object) -> Sites:
    module.SEEN.clear()
    getattr(module, fn)(*args, **kwargs)
    (sites,) = module.SEEN
    assert isinstance(sites, Sites)
    return sites


@pytest.mark.parametrize(
    ("call", "args", "kwargs", "expected"),
    [
        ("grouped_gemm", (X, W, SIZES), {}, "lib_ops:grouped_gemm"),  # a keyword-only default is fine
        ("decorated", (X, W, SIZES), {}, "lib_ops:decorated"),  # functools.wraps: the name reaches it
        ("grouped_gemm", (X, W.reshape(16, 8), SIZES), {}, "lib_ops:grouped_gemm"),  # w flattened (E*N, K)
        ("four", (X, W, SIZES, None), {}, ""),  # four required arguments: scan calls three
        ("needs_config", (X, W, SIZES), {"config": 1}, ""),  # a required keyword-only argument
        ("grouped_gemm", (X, W, X), {}, ""),  # m_sizes not 1-D: not (x, w, m_sizes)-shaped
        ("grouped_gemm", (X.numpy(), W, SIZES), {}, ""),  # not a tensor
    ],
)
def test_the_wrapper_is_a_module_level_function_of_three_tensors(
    tmp_path: Path, call: str, args: tuple[object, ...], kwargs: dict[str, object], expected: str
) -> None:
    module = load(tmp_path, "site-packages", "lib_ops")
    assert sites_of(module, call, *args, **kwargs).wrapper == expected


def test_a_closure_is_not_named(tmp_path: Path) -> None:
    module = load(tmp_path, "site-packages", "lib_ops")
    module.SEEN.clear()
    module.make_closure()(X, W, SIZES)
    assert module.SEEN[0].wrapper == ""  # no reference reaches a function made inside another


def test_the_programs_own_main_is_not_named(tmp_path: Path) -> None:
    module = load(tmp_path, "work", "train", module_name="__main__")
    # loading the script again to call its wrapper would run the whole program
    assert sites_of(module, "grouped_gemm", X, W, SIZES).wrapper == ""


@pytest.mark.parametrize("folder", ["site-packages", "dist-packages"])
def test_a_library_line_is_the_call_site_and_the_users_line_is_the_first_outside_it(
    tmp_path: Path, folder: str
) -> None:
    module = load(tmp_path, f"venv/lib/python3/{folder}", "lib_ops")
    sites = sites_of(module, "grouped_gemm", X, W, SIZES)  # called from this test: the user's code
    assert sites.launch is not None and sites.launch.function == "_launch"
    assert sites.call is not None and sites.call.function == "_launch" and folder in sites.call.file
    assert sites.user is not None and sites.user.file == __file__ and sites.user.function == "sites_of"
    assert Places().place(module._launch.__code__) is Place.PACKAGE


def test_user_code_is_its_own_call_site(tmp_path: Path) -> None:
    module = load(tmp_path, "project", "my_ops")
    sites = sites_of(module, "grouped_gemm", X, W, SIZES)
    assert sites.call is not None and sites.call == sites.user and sites.call.function == "_launch"
    assert sites.wrapper == "my_ops:grouped_gemm"


def test_no_wrapper_is_looked_for_without_the_tensor_type() -> None:
    sites = find_sites(Places(), sys._getframe(), None)
    assert sites.wrapper == "" and sites.user is not None and sites.user.file == __file__
