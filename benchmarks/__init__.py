"""The benchmarks: one script per job of the store, each run as
``python benchmarks/NAME.py``, against the peers a user would pick instead.

A package so that harnesses the scripts share with the tests import by name:
``benchmarks.toy_engine`` (the engine processes that calibrate the routing simulator).
Nothing in the library imports this package.
"""
