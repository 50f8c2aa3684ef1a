"""Tests of the engine bindings (a package, so that its conftest does not shadow the
suite's own ``conftest`` module)."""
