"""pdserve: LLM serving with prefill and decode disaggregated.

`LLM` and `SamplingParams` are imported lazily so that light parts of the package
(the router, the CLI client) never pay for importing torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "CompletionOutput"]

if TYPE_CHECKING:
    from pdserve.engine.llm import LLM, CompletionOutput
    from pdserve.scheduler.sampling_params import SamplingParams


def __getattr__(name: str) -> Any:
    if name in ("LLM", "CompletionOutput"):
        from pdserve.engine import llm

        return getattr(llm, name)
    if name == "SamplingParams":
        from pdserve.scheduler.sampling_params import SamplingParams

        return SamplingParams
    raise AttributeError(f"module 'pdserve' has no attribute {name!r}")
