"""The compiled parts of qmq: qmq/store/_speedups.pyx (qmq/store/speedups.py),
qmq/store/_sync_thread.pyx (qmq/store/flush.py), qmq/_ids.pyx (qmq/ids.py), qmq/client/_wire.pyx
(qmq/client/messages.py) and qmq/broker/_sending.pyx (qmq/broker/sending.py). Everything else is
in pyproject.toml. All are optional: without Cython, a C compiler or zlib's headers, qmq installs
and runs their pure-Python versions, only slower (`qmq broker` logs which it uses; qmq/compiled.py)."""

from setuptools import Extension, setup

try:
    from Cython.Build import cythonize
except ImportError:  # no Cython at build time: the pure-Python loops
    ext_modules = []
else:
    ext_modules = cythonize(
        [
            Extension("qmq.store._speedups", ["qmq/store/_speedups.pyx"], libraries=["z"], optional=True),
            Extension("qmq.store._sync_thread", ["qmq/store/_sync_thread.pyx"], libraries=["z"], optional=True),
            Extension("qmq._ids", ["qmq/_ids.pyx"], optional=True),
            Extension("qmq.client._wire", ["qmq/client/_wire.pyx"], optional=True),
            Extension("qmq.broker._sending", ["qmq/broker/_sending.pyx"], optional=True),
        ],
        compiler_directives={"language_level": 3},
        quiet=True,
    )

setup(ext_modules=ext_modules)
