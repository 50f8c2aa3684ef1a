"""The sanitizer build: the C extension (storage_engine/_stream.c and the KV library, storage_engine/kv/; and the client's
tensordb/client/_kv_wire.c) compiled
with AddressSanitizer and UndefinedBehaviorSanitizer (and -Wall -Wextra -Werror), then
the tests that drive its code run against it (`make asan`, in CI after `make test`).

The instrumented library is built into build/asan and loaded in place of the in-tree
one by tools/asan_plugin.py (a pytest plugin, `-p`, loaded before any test imports
storage_engine), with the sanitizer runtimes preloaded into the interpreter. Any
report aborts the process, so a finding fails the run. Leak detection is off: the
interpreter itself keeps allocations until exit. Child processes the tests start load
the ordinary build, except those of the race and kill-point tests, which load this one
(they import asan_plugin where $TENSORDB_ASAN_LIB is set).

Run:  .venv/bin/python tools/asan.py [pytest args...]   (default: the native-path tests)
"""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "build" / "asan"
SOURCES = ["storage_engine/_stream.c", *sorted(
    str(p.relative_to(ROOT)) for p in (ROOT / "storage_engine" / "kv").glob("*.c")),
    "storage_engine/xxhash/xxh_x86dispatch.c"]
#: the client's splice of the KV events' wire bytes (tensordb.client._kv_wire)
WIRE_SOURCES = ["tensordb/client/_kv_wire.c"]
FLAGS = ["-shared", "-fPIC", "-O1", "-g", "-fno-omit-frame-pointer",
         "-fsanitize=address,undefined", "-fno-sanitize-recover=undefined",
         "-Wall", "-Wextra", "-Werror", "-fvisibility=hidden"]
#: the tests whose calls reach the native code: the fills (pwrite, copy + hash), the KV
#: block store's index, arena, eviction, spill and event ring, and the fuzz cases of
#: damaged KV files, opened in this process (not those counting page faults or mmap
#: calls: the sanitizers' shadow memory takes both)
TESTS = ["tests/test_first_write.py", "tests/test_kv.py", "tests/test_kv_batch.py",
         "tests/test_kv_events.py", "tests/test_kv_fuzz.py", "tests/test_kv_race.py",
         "tests/test_kv_torture.py", "tests/test_kv_lockfree.py", "tests/test_scale.py",
         "tests/test_pool.py", "tests/test_costs.py", "-k",
         "not postgres and not fault and not filling"]


def runtime(name: str) -> str:
    """The path of a sanitizer runtime the compiler links (libasan.so, libubsan.so)."""
    got = subprocess.run(["gcc", f"-print-file-name={name}"], capture_output=True,
                         text=True, check=True).stdout.strip()
    if not os.path.isabs(got):
        raise SystemExit(f"gcc has no {name}: install its sanitizer runtime")
    return got


def build(name: str = "_stream", sources: list[str] = SOURCES) -> Path:
    OUT.mkdir(parents=True, exist_ok=True)
    lib = OUT / f"{name}{sysconfig.get_config_var('EXT_SUFFIX')}"
    cmd = ["gcc", *FLAGS, f"-I{sysconfig.get_paths()['include']}",
           *(str(ROOT / s) for s in sources), "-o", str(lib)]
    print(" ".join(cmd), flush=True)
    subprocess.run(cmd, check=True)
    return lib


def main(argv: list[str]) -> int:
    lib = build()
    wire = build("_kv_wire", WIRE_SOURCES)
    env = {**os.environ,
           "LD_PRELOAD": f"{runtime('libasan.so')}:{runtime('libubsan.so')}",
           "ASAN_OPTIONS": "detect_leaks=0:abort_on_error=1:halt_on_error=1",
           "UBSAN_OPTIONS": "halt_on_error=1:print_stacktrace=1",
           "TENSORDB_ASAN_LIB": str(lib), "TENSORDB_ASAN_WIRE_LIB": str(wire),
           "PYTHONPATH": str(ROOT / "tools"),
           # the race and kill-point tests' children load this build too: longer here
           "TENSORDB_KV_RACE_S": os.environ.get("TENSORDB_KV_RACE_S", "60"),
           "TENSORDB_KV_TORTURE_RUNS": os.environ.get("TENSORDB_KV_TORTURE_RUNS", "5")}
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "asan_plugin", *(argv or TESTS)]
    print(" ".join(cmd), flush=True)
    return subprocess.run(cmd, cwd=ROOT, env=env, check=False).returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
