"""What runs in a vLLM instance's process: :func:`vllm_instance_main`, the message
loop around a :class:`VLLMEngine`, speaking the protocol of the toy engine's
instances (``benchmarks.toy_engine.instance_main``) so that the same router
(``EngineCluster``) and calibration drive it.
"""

from __future__ import annotations

import queue
import traceback
from pathlib import Path
from typing import Any

from tensordb.errors import InvalidInput

from ._engine import VLLMEngine, VLLMEngineConfig

__all__ = ["vllm_instance_main"]


def vllm_instance_main(index: int, cfg: VLLMEngineConfig, connect: dict[str, Any],
                       inbox: Any, outbox: Any, model_dir: str) -> None:
    """The body of instance process ``index``: start a vLLM engine of ``cfg`` on the
    store of ``connect`` serving ``model_dir``'s model, then serve.

    Messages in (``inbox``, in order): ``("job", Job)`` adds a request to the engine,
    which steps while it has any (messages are read between steps, as vLLM's own
    front end adds requests); ``("reset",)`` and ``("calibrate", spec)`` wait for the
    engine to drain, then empty its local cache and the store of what it served
    (``VLLMEngine.reset``), or run ``VLLMEngine.measure(**spec)``; ``("stop",)`` ends
    the process. Messages out (``outbox``): ``("ready", index, info)``, ``("start",
    index, -1, added, removed)`` (the local cache's change, in the router's keys, as a
    step is scheduled), ``("done", index, Served)``, ``("reset", index)``,
    ``("calibrated", index, result)``, ``("error", index, text)``."""
    try:
        engine = VLLMEngine(cfg, Path(model_dir), Path(connect["home"]), index,
                            on_change=lambda a, r: outbox.put(("start", index, -1, a, r)))
    except Exception:  # the router must hear of it, not wait forever
        outbox.put(("error", index, traceback.format_exc()))
        return

    def send(served: list[Any]) -> None:
        for s in served:
            outbox.put(("done", index, s))

    outbox.put(("ready", index, engine.info))
    try:
        while True:
            if engine.busy:
                try:
                    msg = inbox.get_nowait()
                except queue.Empty:
                    try:
                        send(engine.step())
                    except Exception:
                        outbox.put(("error", index, traceback.format_exc()))
                        return
                    continue
            else:
                msg = inbox.get()
            kind = msg[0]
            try:
                if kind == "job":
                    engine.submit(msg[1])
                elif kind == "reset":
                    send(engine.drain())
                    engine.reset()
                    outbox.put(("reset", index))
                elif kind == "calibrate":
                    send(engine.drain())
                    outbox.put(("calibrated", index, engine.measure(**msg[1])))
                elif kind == "stop":
                    break
                else:
                    raise InvalidInput(f"vLLM instance {index}: unknown message {kind!r}")
            except Exception:
                outbox.put(("error", index, traceback.format_exc()))
    finally:
        engine.close()
