"""pdserve: LLM serving with prefill and decode disaggregated.

`LLM`, `SamplingParams` and the router clients `Client` / `AsyncClient` are imported
lazily, so a client never pays for importing torch and the offline API never imports
gRPC.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "CompletionOutput", "Client", "AsyncClient"]

if TYPE_CHECKING:
    from pdserve.engine.llm import LLM, CompletionOutput
    from pdserve.router.client import AsyncClient, Client
    from pdserve.scheduler.sampling_params import SamplingParams


def __getattr__(name: str) -> Any:
    if name in ("LLM", "CompletionOutput"):
        # lazy: the offline API (engine.llm) imports torch; a client never needs it
        from pdserve.engine import llm

        return getattr(llm, name)
    if name in ("Client", "AsyncClient"):
        # lazy: the router's client imports gRPC; the offline API never needs it
        from pdserve.router import client

        return getattr(client, name)
    if name == "SamplingParams":
        # lazy: `import pdserve` (the parent of every module) loads nothing itself
        from pdserve.scheduler.sampling_params import SamplingParams

        return SamplingParams
    raise AttributeError(f"module 'pdserve' has no attribute {name!r}")
