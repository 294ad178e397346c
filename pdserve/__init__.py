"""pdserve: LLM serving with prefill and decode disaggregated."""

__version__ = "0.1.0"
