"""Bindings of tensordb into engines: torch, safetensors, vLLM, SGLang, the router.

Bindings use the public ``tensordb`` API only.
"""

from __future__ import annotations

__all__: list[str] = []
