"""The one compiled piece: storage_engine._stream, streaming copies for write paths.

Everything else is in pyproject.toml. The extension is optional: without a C compiler
the install still succeeds and the store copies with numpy instead (slower writes).
"""

from setuptools import Extension, setup

setup(ext_modules=[Extension("storage_engine._stream", ["storage_engine/_stream.c"],
                             extra_compile_args=["-O2"], optional=True)])
