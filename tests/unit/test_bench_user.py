"""``qmoe-doctor bench --kernel REF``, child side (``probes/bench_user.py``): any --kernel form
resolves to the rows the benchmark adds beside ours, their names, and the reason when the kernel
cannot take this run's operands."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from qmoe_doctor.core.kernel_ref import KernelRef
from qmoe_doctor.kernels.backward import moe_grouped_gemm_dx_torch
from qmoe_doctor.kernels.grouped_gemm import moe_grouped_gemm_torch
from qmoe_doctor.kernels.testing import rel_err
from qmoe_doctor.probes.bench_user import LABEL_MAX, UserKernelSkipped, impl_label, load_user_kernel
from qmoe_doctor.probes.loader import KernelResolutionError

USER_FILE = '''
import torch

CALLS = []

def grouped(x, w, m_sizes):
    """A user's kernel of the probes' signature (here the obvious loop) that wants contiguous w."""
    assert w.is_contiguous(), "this kernel asserts contiguity, like many public ones"
    CALLS.append(tuple(w.shape))
    out = torch.zeros(x.shape[0], w.shape[1], dtype=x.dtype)
    row = 0
    for e, n in enumerate(m_sizes.tolist()):
        out[row:row + n] = x[row:row + n] @ w[e].T
        row += n
    return out
'''


def _operands() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    x, w, dy = torch.randn(20, 16, generator=gen), torch.randn(3, 8, 16, generator=gen), torch.randn(20, 8, generator=gen)
    return x, w, dy, torch.tensor([5, 0, 15], dtype=torch.int32)


def test_a_file_kernel_gets_forward_and_dx_rows(tmp_path: Path) -> None:
    path = tmp_path / "my_moe.py"
    path.write_text(USER_FILE)
    user = load_user_kernel(f"{path}:grouped")
    assert user.label == "kernel my_moe.py:grouped" and user.block_label == "MoEBlock + kernel my_moe.py:grouped"
    x, w, dy, sizes = _operands()
    assert rel_err(user.forward(x, w, sizes)(), moe_grouped_gemm_torch(x, w, sizes)) < 1e-6
    dx = user.dx(dy, w, sizes)  # the transposed stack is made contiguous here, once
    assert rel_err(dx(), moe_grouped_gemm_dx_torch(dy, w, sizes)) < 1e-6


@pytest.mark.parametrize("text", ["builtin", "torch:grouped_mm", "specimen:unguarded", "qmoe_doctor.kernels.grouped_gemm:moe_grouped_gemm_torch"])
def test_every_kernel_form_resolves_with_a_name(text: str) -> None:
    user = load_user_kernel(text)
    assert user.ref == str(KernelRef.parse(text)) and callable(user.fn)
    assert user.label == impl_label(KernelRef.parse(text)) and user.label.endswith(text[-20:])


def test_an_adapters_declared_limits_become_the_rows_note(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "bf16_only.py").write_text(
        "from qmoe_doctor.probes.adapters import SimpleAdapter\n"
        "from qmoe_doctor.kernels.grouped_gemm import moe_grouped_gemm_torch\n"
        "ADAPTER = SimpleAdapter(wrap=lambda t: t, dtypes=frozenset({'bfloat16'}), supports_cpu=False,\n"
        "                        default_target='qmoe_doctor.kernels.grouped_gemm:moe_grouped_gemm_torch')\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    user = load_user_kernel("adapter:bf16_only.ADAPTER")
    x, w, dy, sizes = _operands()
    with pytest.raises(UserKernelSkipped, match=r"declares dtypes \['bfloat16'\]; this run is float32"):
        user.forward(x, w, sizes)()
    with pytest.raises(UserKernelSkipped, match="no CPU path"):
        user.dx(dy.bfloat16(), w.bfloat16(), sizes)()


def test_a_long_reference_is_shortened_and_a_broken_one_is_a_resolution_error(tmp_path: Path) -> None:
    long = KernelRef.parse("a.very.long.module.path.that.goes.on.and.on.for.ever:kernel")
    assert len(impl_label(long)) <= len("kernel ") + LABEL_MAX and impl_label(long).endswith("for.ever:kernel")
    with pytest.raises(KernelResolutionError):
        load_user_kernel(f"{tmp_path / 'missing.py'}:fn")
