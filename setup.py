# Copyright (c) deepspeed_offload_patch contributors.
# SPDX-License-Identifier: Apache-2.0

from setuptools import find_packages, setup

setup(
    name="deepspeed_offload_patch",
    version="0.1.0",
    description="Keeps DeepSpeed's ZeRO-1/2 offload overflow flag on the device: no host sync per gradient",
    license="Apache-2.0",
    packages=find_packages(include=["deepspeed_offload_patch", "deepspeed_offload_patch.*"]),
    python_requires=">=3.9",
    # torch first, as its own install step (a bare deepspeed install pulls a CUDA build); see README.md.
    install_requires=["deepspeed", "torch", "packaging>=20.0"],
    extras_require={"dev": ["pytest", "yapf==0.43.0", "flake8", "codespell"]},
    classifiers=["License :: OSI Approved :: Apache Software License", "Programming Language :: Python :: 3"],
)
