# Copyright (c) deepspeed_offload_patch contributors.
# SPDX-License-Identifier: Apache-2.0

import os
import re
import shutil

from setuptools import find_packages, setup
from setuptools.command.build_py import build_py

HERE = os.path.dirname(os.path.abspath(__file__))


def read(*parts: str) -> str:
    with open(os.path.join(HERE, *parts), encoding="utf-8") as f:
        return f.read()


def index_page(markdown: str) -> str:
    """README as an index page shows it. A link to a file of this project or to a heading works in a checkout, not on
    an index page: it becomes its text, with the path beside it; a last line says where those files are."""

    def plain(match: "re.Match[str]") -> str:
        text, target = match.group(1), match.group(2)
        if target.startswith("#"):
            return text
        path = target.split("#")[0]
        return text if path.strip("`") in text else f"{text} (`{path}`)"

    where = ("\n\nThe paths above name files of the source distribution: "
             "`pip download --no-deps --no-binary :all: deepspeed-offload-patch`.\n")
    return re.sub(r"\[([^\]]+)\]\((?!https?://|mailto:)([^)\s]+)\)", plain, markdown).rstrip("\n") + where


# The one place for the version: deepspeed_offload_patch/__init__.py.
VERSION = re.search(r'^__version__ = "([^"]+)"', read("deepspeed_offload_patch", "__init__.py"), re.M).group(1)


class BuildWithPatches(build_py):
    """Ship patches/ inside the package (as _patches/), so `ds-offload-patch diff` works from a wheel. The sdist
    carries patches/ (MANIFEST.in), so a wheel built from the sdist has them too."""

    def run(self):
        super().run()
        source = os.path.join(HERE, "patches")
        if not os.path.isfile(os.path.join(source, "README.md")):  # one folder per change below it
            raise FileNotFoundError(f"{source} is missing: build from a checkout or from the sdist, which carry it")
        shutil.copytree(source,
                        os.path.join(self.build_lib, "deepspeed_offload_patch", "_patches"),
                        dirs_exist_ok=True)


setup(
    name="deepspeed-offload-patch",
    version=VERSION,
    description="Keeps DeepSpeed's ZeRO-1/2 offload overflow flag on the device: no host sync per gradient",
    long_description=index_page(read("README.md")),
    long_description_content_type="text/markdown",
    license="Apache-2.0",
    license_files=["LICENSE"],
    keywords=["deepspeed", "zero", "offload", "overflow", "host synchronization", "monkey-patch", "pytorch"],
    project_urls={
        "Upstream fix": "https://github.com/deepspeedai/DeepSpeed/pull/8963",
        "DeepSpeed": "https://github.com/deepspeedai/DeepSpeed",
    },
    packages=find_packages(include=["deepspeed_offload_patch", "deepspeed_offload_patch.*"]),
    py_modules=["pytest_ds_offload_patch"],
    package_data={"deepspeed_offload_patch": ["_bootstrap/sitecustomize.py", "one_inf.json"]},
    python_requires=">=3.10",  # torch 2.13.0, which CI pins, has wheels for 3.10 - 3.14
    # torch first, as its own install step (a bare deepspeed install pulls a CUDA build); see README.md.
    install_requires=["deepspeed>=0.14.0", "torch", "packaging>=20.0"],
    extras_require={
        "bench": ["matplotlib"],
        # check-manifest: the sdist against git's file list; pypiserver: the index the release rehearsal uploads to;
        # sybil: runs the documents' transcripts and examples as tests (conftest.py).
        "dev": [
            "pytest", "yapf==0.43.0", "flake8", "codespell", "nox", "matplotlib", "build", "twine", "check-manifest",
            "pypiserver", "sybil"
        ],
    },
    entry_points={
        "console_scripts": ["ds-offload-patch=deepspeed_offload_patch.cli:main"],
        "pytest11": ["ds_offload_patch=pytest_ds_offload_patch"],
    },
    cmdclass={"build_py": BuildWithPatches},
    classifiers=[
        "Development Status :: 4 - Beta",
        "Framework :: Pytest",
        "Intended Audience :: Developers",
        "Intended Audience :: Science/Research",
        "Operating System :: POSIX :: Linux",
        "Programming Language :: Python :: 3",
        "Programming Language :: Python :: 3 :: Only",
        "Programming Language :: Python :: 3.10",
        "Programming Language :: Python :: 3.11",
        "Programming Language :: Python :: 3.12",
        "Programming Language :: Python :: 3.13",
        "Topic :: Scientific/Engineering :: Artificial Intelligence",
    ],
)
