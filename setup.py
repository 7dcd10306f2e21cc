"""The compiled part of qmq: qmq/store/_speedups.pyx (qmq/store/speedups.py). Everything else is in
pyproject.toml. The extension is optional: without Cython, a C compiler or zlib's headers, qmq
installs and runs on its pure-Python loops, only slower (`qmq broker` logs which it uses)."""

from setuptools import Extension, setup

try:
    from Cython.Build import cythonize
except ImportError:  # no Cython at build time: the pure-Python loops
    ext_modules = []
else:
    ext_modules = cythonize(
        [Extension("qmq.store._speedups", ["qmq/store/_speedups.pyx"], libraries=["z"], optional=True)],
        compiler_directives={"language_level": 3},
        quiet=True,
    )

setup(ext_modules=ext_modules)
