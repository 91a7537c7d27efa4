"""Build hook for the one C extension, ``kvtier.kernels._fileio`` (everything else is in
pyproject.toml). The extension is optional: without a C compiler or the xxHash header
(Debian: ``libxxhash-dev``; ``make`` installs it) the install still succeeds, and the file
L3 backend uses its pure-Python path (``kvtier.kernels.file_io.NATIVE`` is then False)."""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "kvtier.kernels._fileio",
            sources=["kernels/_fileio.c", "kernels/_xxh3_avx2.c"],
            extra_compile_args=["-O3", "-std=c11", "-D_GNU_SOURCE"],
            optional=True,
        )
    ]
)
