"""The package layout: the folders cli/ export/ models/ runtime/ server/ are kiln.cli, kiln.export...

Every subpackage below them is found (not listed by hand), so a wheel holds exactly what the
editable install runs. Everything else about the project is in pyproject.toml.
"""

from setuptools import find_packages, setup

FOLDERS = ("cli", "export", "models", "runtime", "server")

setup(
    packages=[f"kiln.{name}" for name in find_packages(include=[*FOLDERS, *(f"{f}.*" for f in FOLDERS)])],
    package_dir={f"kiln.{folder}": folder for folder in FOLDERS},
    # The CPU kernels' C source and header, compiled by the export on the machine that runs it.
    package_data={"kiln.export": ["*.c", "*.h"]},
)
