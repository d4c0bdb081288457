"""The installed Kiln's version, as /version and KServe's server metadata report it."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version


def kiln_version() -> str:
    try:
        return version("kiln")
    except PackageNotFoundError:  # run from a source tree that was never installed
        return "0+unknown"
