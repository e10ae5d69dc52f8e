# Copyright (c) deepspeed_offload_patch contributors.
# SPDX-License-Identifier: Apache-2.0

import os
import shutil

from setuptools import find_packages, setup
from setuptools.command.build_py import build_py


class BuildWithPatches(build_py):
    """Ship patches/ inside the package (as _patches/), so `ds-offload-patch diff` works from a wheel."""

    def run(self):
        super().run()
        source = os.path.join(os.path.dirname(os.path.abspath(__file__)), "patches")
        shutil.copytree(source,
                        os.path.join(self.build_lib, "deepspeed_offload_patch", "_patches"),
                        dirs_exist_ok=True)


setup(
    name="deepspeed_offload_patch",
    version="0.1.0",
    description="Keeps DeepSpeed's ZeRO-1/2 offload overflow flag on the device: no host sync per gradient",
    license="Apache-2.0",
    packages=find_packages(include=["deepspeed_offload_patch", "deepspeed_offload_patch.*"]),
    package_data={"deepspeed_offload_patch": ["_bootstrap/sitecustomize.py"]},
    python_requires=">=3.9",
    # torch first, as its own install step (a bare deepspeed install pulls a CUDA build); see README.md.
    install_requires=["deepspeed", "torch", "packaging>=20.0"],
    extras_require={
        "bench": ["matplotlib"],
        "dev": ["pytest", "yapf==0.43.0", "flake8", "codespell", "nox", "matplotlib"],
    },
    entry_points={
        "console_scripts": ["ds-offload-patch=deepspeed_offload_patch.cli:main"],
        "pytest11": ["ds_offload_patch=deepspeed_offload_patch.pytest_plugin"],
    },
    cmdclass={"build_py": BuildWithPatches},
    classifiers=["License :: OSI Approved :: Apache Software License", "Programming Language :: Python :: 3"],
)
