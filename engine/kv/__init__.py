"""The engine's side of the KV hand-off: the payload's format (``payload``,
``payload_tensors``), a PROMPT engine's export of it (``export``) and a COMPLETION
engine's import of KV streamed ahead of a hand-off (``partial_imports``). The transports
that carry a payload between ranks live in ``pdserve.kv_transfer``."""
