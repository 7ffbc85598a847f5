"""The wheel users install holds every module and data file of the three source folders.

Every other test runs from the editable install, which maps the folders as they are and so hides
a package the wheel leaves out (a hand-written package list once dropped ``qmoe_doctor.lint.rules``,
and ``lint``, ``check`` and ``explain`` crashed from ``pip install .``). These tests build the
wheel from a copy of the sources, as ``pip install .`` does, and compare its file list with the
folders: qmoe_doctor/ as qmoe_doctor/, kernels/ and probes/ as qmoe_doctor/kernels/ and
qmoe_doctor/probes/. .ci/wheel_smoke.sh installs the wheel in a fresh venv and runs every command.
"""

from __future__ import annotations

import email
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
#: repository folder -> the folder it installs as
INSTALLED_AS = {"qmoe_doctor": "qmoe_doctor", "kernels": "qmoe_doctor/kernels", "probes": "qmoe_doctor/probes"}
BUILD_FILES = ("pyproject.toml", "setup.py", "README.md", "LICENSE")
_IGNORED = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info")


def copy_sources(dest: Path) -> Path:
    """What ``pip install .`` reads: the build files and the three source folders."""
    for name in BUILD_FILES:
        shutil.copy2(REPO / name, dest / name)
    for folder in INSTALLED_AS:
        shutil.copytree(REPO / folder, dest / folder, ignore=_IGNORED)
    return dest


def build_wheel(src: Path, out: Path) -> Path:
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(out), str(src)],
        check=True,
        capture_output=True,
        text=True,
        timeout=600,
    )
    (wheel,) = out.glob("qmoe_doctor-*.whl")
    return wheel


def expected_files(src: Path) -> set[str]:
    """Every file of the source folders (modules and data alike), under its installed path."""
    out: set[str] = set()
    for folder, installed in INSTALLED_AS.items():
        for path in (src / folder).rglob("*"):
            if path.is_file() and "__pycache__" not in path.parts and path.suffix != ".pyc":
                out.add(f"{installed}/{path.relative_to(src / folder).as_posix()}")
    return out


def wheel_files(wheel: Path) -> set[str]:
    with zipfile.ZipFile(wheel) as zf:
        return {n for n in zf.namelist() if not n.split("/", 1)[0].endswith(".dist-info")}


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(the copied sources, the wheel built from them)."""
    src = copy_sources(tmp_path_factory.mktemp("src"))
    return src, build_wheel(src, tmp_path_factory.mktemp("dist"))


def test_the_wheel_holds_every_module_and_data_file_of_the_three_folders(built: tuple[Path, Path]) -> None:
    src, wheel = built
    want, got = expected_files(src), wheel_files(wheel)
    assert "qmoe_doctor/lint/rules/unguarded_launch.py" in want  # the subpackage a package list once missed
    assert want - got == set(), "left out of the wheel"
    assert got - want == set(), "in the wheel but not in the source folders"
    for data in (
        "qmoe_doctor/monitor/bootstrap/sitecustomize.py",
        "qmoe_doctor/py.typed",
        "qmoe_doctor/kernels/configs-nvidia-h100-80gb-hbm3-sm90-132sm.json",
    ):
        assert data in got
    assert not any(name.startswith(("kernels/", "probes/")) for name in got), "never a top-level kernels package"


def test_the_wheel_metadata_is_what_a_package_index_shows(built: tuple[Path, Path]) -> None:
    _, wheel = built
    with zipfile.ZipFile(wheel) as zf:
        names = zf.namelist()
        meta = email.message_from_bytes(zf.read(next(n for n in names if n.endswith(".dist-info/METADATA"))))
        entry_points = zf.read(next(n for n in names if n.endswith(".dist-info/entry_points.txt"))).decode()
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names)
    assert meta["License-Expression"] == "Apache-2.0"
    urls = dict(value.split(", ", 1) for value in meta.get_all("Project-URL", []))
    assert {"Homepage", "Documentation", "Source", "Issues"} <= set(urls)
    classifiers = meta.get_all("Classifier", [])
    assert "Programming Language :: Python :: 3.11" in classifiers
    assert "Environment :: GPU :: NVIDIA CUDA" in classifiers
    assert meta["Requires-Python"] == ">=3.10"
    assert "qmoe-doctor = qmoe_doctor.cli.app:main" in entry_points
    assert "Tested with" in (meta.get_payload() or "")  # the README's versions table, on the index page


def test_a_folder_the_build_does_not_discover_fails_the_comparison(tmp_path: Path) -> None:
    """The comparison catches what discovery misses: a subfolder of modules without an
    ``__init__.py`` is no package to setuptools, so its modules stay out of the wheel."""
    (tmp_path / "src").mkdir()
    src = copy_sources(tmp_path / "src")
    (src / "qmoe_doctor" / "newpart").mkdir()
    (src / "qmoe_doctor" / "newpart" / "rules.py").write_text("X = 1\n")
    wheel = build_wheel(src, tmp_path / "dist")
    assert expected_files(src) - wheel_files(wheel) == {"qmoe_doctor/newpart/rules.py"}


def test_the_project_urls_and_the_docs_links_agree() -> None:
    """SARIF's helpUri links a cause's page under the docs URL the package index shows."""
    import tomllib

    from qmoe_doctor.core.causes import DOCS_URL, PROJECT_URL

    urls = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["urls"]
    assert urls["Source"] == PROJECT_URL
    assert DOCS_URL.startswith(urls["Source"]) and urls["Documentation"].startswith(DOCS_URL)
