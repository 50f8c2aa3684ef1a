"""The router in front of vLLM engine processes: :class:`VLLMCluster`, and the routing
policy wrapper :class:`ThroughStore` that a migration becomes on engines whose every
computed block is already in the shared store.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks.toy_engine import EngineCluster
from engine_bindings.router import (
    ClusterView,
    Decision,
    Request,
    RoutingPolicy,
    SimResult,
    get_policy,
)

from ._engine import VLLMEngineConfig, write_model
from ._instance import vllm_instance_main

__all__ = ["ThroughStore", "VLLMCluster"]


class VLLMCluster(EngineCluster):
    """``instances`` vLLM engine processes (vLLM's CPU build) sharing one tensordb
    store, behind the router of :class:`EngineCluster`: the weights are committed to
    the store once and every engine loads them from it; with ``cfg.use_store`` each
    engine's ``TensorDBConnector`` saves every prompt block it computes to one shared
    namespace and loads the prefix it lacks from there. Processes start with ``spawn``
    (each imports vLLM: about 10-20 s for two on two cores). ``home``, ``url`` and
    ``timeout`` as :class:`EngineCluster`; ``self.info[i]``: the engine's vLLM release,
    its KV cache in blocks and threads."""

    def __init__(self, instances: int, cfg: VLLMEngineConfig | None = None, *,
                 home: str | Path | None = None, url: str | None = None,
                 timeout: float = 300.0, seed: int = 0) -> None:
        cfg = cfg or VLLMEngineConfig()
        self._seed = seed
        os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")  # inherited by the engines
        super().__init__(instances, cfg, vllm_instance_main, vocab=cfg.vocab, home=home,
                         url=url, start_method="spawn", timeout=timeout)

    def _model_dir(self) -> Path:
        return Path(self.connect_kw["home"]) / "model"

    def _prepare(self) -> None:
        """The model: config.json beside the store, weights in it."""
        write_model(self.db, self.cfg, self._model_dir(), self._seed)

    def _target_args(self) -> tuple[Any, ...]:
        return (str(self._model_dir()),)

    def run(self, requests: Sequence[Request], policy: str | RoutingPolicy, *,
            ewma_tau: float = 5.0, seed: int = 0) -> SimResult:
        """As :meth:`EngineCluster.run`, the policy's migrations made routes
        (:class:`ThroughStore`): these engines take no migration but the store's."""
        pol = get_policy(policy)
        if not isinstance(pol, ThroughStore):
            pol = ThroughStore(pol)
        return super().run(requests, pol, ewma_tau=ewma_tau, seed=seed)

    def __enter__(self) -> VLLMCluster:
        return self


class ThroughStore(RoutingPolicy):
    """Routing policy ``inner`` (a name or an object) on engines that save every block
    they compute to the shared store: a migration (``Decision.migrate_from``) is then
    the target loading the blocks from the store through its KV connector, so the
    decision goes out as a plain route to the target, for the real engines and the
    simulator alike. ``migrations`` counts the decisions that asked for one since the
    last ``reset``. Results carry the inner policy's name."""

    name = "through_store"

    def __init__(self, inner: str | RoutingPolicy = "migrate", **kw: Any) -> None:
        self.inner = get_policy(inner, **kw)
        self.name = self.inner.name  # type: ignore[misc]
        self.migrations = 0

    def route(self, request: Request, view: ClusterView) -> Decision:
        d = self.inner.route(request, view)
        if d.migrate_from is None:
            return d
        self.migrations += 1
        return Decision(d.instance)

    def reset(self) -> None:
        self.inner.reset()
        self.migrations = 0
