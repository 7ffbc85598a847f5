"""Package discovery: every package under the three source folders goes into the wheel.

Metadata lives in pyproject.toml; this file only says which packages the wheel holds, because
pyproject.toml cannot find packages under a folder that installs under another name. kernels/ and
probes/ are top-level folders in the repository but install as qmoe_doctor.kernels and
qmoe_doctor.probes: a PyPI distribution named `kernels` (a GPU kernel loader) lives in our users'
environments, so we never install a top-level `kernels`. A hand-written package list once left
`qmoe_doctor.lint.rules` out of the wheel; tests/unit/test_wheel.py builds the wheel and fails when
any source file or data file of these folders is missing from it.
"""

from setuptools import find_packages, setup

#: installed name -> the repository folder it is read from (besides qmoe_doctor/ itself)
MAPPED_FOLDERS = {"qmoe_doctor.kernels": "kernels", "qmoe_doctor.probes": "probes"}


def discovered_packages() -> list[str]:
    """qmoe_doctor and its subpackages, then each mapped folder's packages under its installed name."""
    packages = find_packages(include=["qmoe_doctor", "qmoe_doctor.*"])
    for name, folder in MAPPED_FOLDERS.items():
        found = find_packages(include=[folder, folder + ".*"])
        packages += [name + package[len(folder) :] for package in found]
    return sorted(packages)


setup(
    packages=discovered_packages(),
    # a subpackage resolves under its nearest mapped parent (qmoe_doctor.kernels._details -> kernels/_details)
    package_dir={"qmoe_doctor": "qmoe_doctor", **MAPPED_FOLDERS},
)
