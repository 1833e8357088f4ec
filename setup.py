"""hvdcomp: all-reduce-compatible gradient compression for Horovod + PyTorch."""

from setuptools import find_packages, setup

setup(
    name="hvdcomp",
    version="0.1.0",
    description="All-reduce-compatible gradient compression (QSGD max-norm family, Birder) for Horovod and DDP",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    packages=find_packages(include=["hvdcomp", "hvdcomp.*"]),
    package_data={"hvdcomp.codec": ["native_kernels.cpp"]},  # built at first use (hvdcomp/codec/native.py)
    python_requires=">=3.9",
    install_requires=["torch>=2.1"],  # the codecs and the DDP hook need no Horovod
    extras_require={
        "horovod": ["horovod>=0.28.1,<0.29"],  # hvdcomp.transport._compat.SUPPORTED_HOROVOD
        "mpi": ["mpi4py>=3.1"],
        "examples": ["torchvision>=0.16", "tqdm>=4.60", "matplotlib>=3.5", "scikit-learn>=1.0"],
        "dev": ["pytest>=7", "hypothesis>=6", "ruff>=0.4"],
        "lightning": ["lightning>=2.4"],  # the README's Lightning example and its test
    },
    license="Apache-2.0",
)
