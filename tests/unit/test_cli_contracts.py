"""The parent never imports torch or triton: the one runtime check of that contract.

A CUDA fault poisons the process that made it, so the parent (all of ``qmoe_doctor`` but the
``kernels`` and ``probes`` subpackages) must survive every probe: it imports neither torch nor
triton (nor matplotlib, which bench imports only to draw). The static side is import-linter's
(``.ci/import_contracts``); this checks what a user's process really loads, in a fresh
interpreter: every parent module, the CLI, each command's ``--help``, and ``env --json`` (which
reads NVML, never CUDA).
"""

from __future__ import annotations

import os
import subprocess
import sys

CHILD_SIDE = ("torch", "triton", "matplotlib")

_CODE = """
import importlib, json, pkgutil, sys
import qmoe_doctor, qmoe_doctor.cli
from typer.testing import CliRunner
from qmoe_doctor.cli.app import COMMANDS, app

names = [m.name for m in pkgutil.walk_packages(qmoe_doctor.__path__, 'qmoe_doctor.')
         if not m.name.startswith(('qmoe_doctor.kernels', 'qmoe_doctor.probes'))]
assert 'qmoe_doctor.cli.app' in names and len(names) > 20, names
for name in names:
    importlib.import_module(name)
runner = CliRunner()
for command in [None, *COMMANDS]:
    result = runner.invoke(app, ([command] if command else []) + ['--help'])
    assert result.exit_code == 0, (command, result.output)
result = runner.invoke(app, ['env', '--json'])
assert result.exit_code == 0 and json.loads(result.stdout)['kind'] == 'inventory', result.output
print(json.dumps(sorted(m for m in CHILD_SIDE if m in sys.modules)))
"""


def test_parent_and_every_command_help_leave_torch_and_triton_out() -> None:
    code = f"CHILD_SIDE = {CHILD_SIDE!r}\n" + _CODE
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "COLUMNS": "120"}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-1] == "[]", proc.stdout
