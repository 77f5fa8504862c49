"""The distribution as a user installs it, cheapest first.

1. static: both packages report pyproject.toml's version, carry the ``py.typed`` marker, and the LICENSE is
   the Apache-2.0 text pyproject.toml declares;
2. build: a wheel built from a copy of the source tree ships both markers, the license file and the
   version (a few seconds; setuptools >= 77 comes with torch >= 2.13).
"""

import importlib.resources
import pathlib
import shutil
import subprocess
import sys
import zipfile

import pytest

import distcomm
import distcomm_attention

tomllib = pytest.importorskip("tomllib")  # Python >= 3.11

ROOT = pathlib.Path(__file__).resolve().parent.parent
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
PACKAGES = ("distcomm", "distcomm_attention")


def test_version_is_pyprojects():
    """`__version__` comes from the installed metadata, so it cannot drift from pyproject.toml."""
    version = PYPROJECT["project"]["version"]
    assert distcomm.__version__ == version
    assert distcomm_attention.__version__ == version


@pytest.mark.parametrize("package", PACKAGES)
def test_py_typed_marker(package):
    """Type checkers read the packages' annotations only when ``py.typed`` is there (PEP 561)."""
    assert importlib.resources.files(package).joinpath("py.typed").is_file()
    assert "py.typed" in PYPROJECT["tool"]["setuptools"]["package-data"][package]


def test_license_is_apache_2():
    """pyproject.toml's license expression and the LICENSE file it ships agree."""
    assert PYPROJECT["project"]["license"] == "Apache-2.0"
    assert PYPROJECT["project"]["license-files"] == ["LICENSE"]
    text = (ROOT / "LICENSE").read_text()
    assert text.lstrip().startswith("Apache License\n")
    assert "Version 2.0, January 2004" in text
    assert "END OF TERMS AND CONDITIONS" in text


# What the CUDA wheel of torch 2.13.0 pins exactly (its METADATA); triton and the CUDA libraries come with torch.
TORCH_PINNED = ("triton", "cuda-toolkit", "cuda-bindings", "nvidia-cudnn-cu13", "nvidia-cusparselt-cu13",
                "nvidia-nccl-cu13", "nvidia-nvshmem-cu13")


def test_extras_pin_nothing_torch_pins():
    """A pin of a package that torch pins makes pip's resolution impossible on an ordinary machine: the test
    extra's ``triton==3.6.0`` against torch 2.13.0's ``triton==3.7.1`` did."""
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    constrained = []
    for extra, requirements in PYPROJECT["project"]["optional-dependencies"].items():
        for text in requirements:
            req = Requirement(text)
            if canonicalize_name(req.name) in TORCH_PINNED and str(req.specifier):
                constrained.append((extra, text))
    assert not constrained


def test_built_wheel_ships_markers_license_and_version(tmp_path):
    """What `pip install distcomm` would unpack: both py.typed markers, the license and the version."""
    pytest.importorskip("setuptools", minversion="77")
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(ROOT / name, src / name)
    for package in PACKAGES:
        shutil.copytree(ROOT / package, src / package, ignore=shutil.ignore_patterns("__pycache__"))
    out = tmp_path / "dist"
    code = ("import sys, setuptools.build_meta as b; "
            "print(b.build_wheel(sys.argv[1]))")
    built = subprocess.run([sys.executable, "-c", code, str(out)], cwd=src, capture_output=True, text=True)
    assert built.returncode == 0, built.stdout[-3000:] + built.stderr[-3000:]
    wheel = out / built.stdout.strip().splitlines()[-1]
    version = PYPROJECT["project"]["version"]
    assert wheel.name.startswith(f"distcomm-{version}-py3-none-any")
    names = set(zipfile.ZipFile(wheel).namelist())
    assert {"distcomm/py.typed", "distcomm_attention/py.typed"} <= names
    assert f"distcomm-{version}.dist-info/licenses/LICENSE" in names
    metadata = zipfile.ZipFile(wheel).read(f"distcomm-{version}.dist-info/METADATA").decode()
    assert "License-Expression: Apache-2.0" in metadata
