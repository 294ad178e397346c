"""The gRPC router: validation, routing, KV hand-off, streaming, pool control.

Imports no torch: it reaches the engine ranks only through Ray handles.
"""

from pdserve.router.client import AsyncClient, Client, Completion
from pdserve.router.config import PoolConfig, RouterConfig

__all__ = ["AsyncClient", "Client", "Completion", "PoolConfig", "RouterConfig"]
