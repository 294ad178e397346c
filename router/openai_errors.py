"""An OpenAI request's refusal (``HTTPError``: a status, a message, the body's field it
names), its OpenAI error object, and the typed read of one body field that raises it:
shared by the request's parts (openai_request.py, openai_structured.py, openai_tools.py)
and the HTTP front."""

from __future__ import annotations

import json
from typing import Any

ERROR_TYPE = {400: "BadRequestError", 401: "AuthenticationError", 403: "PermissionDeniedError",
              404: "NotFoundError", 409: "ConflictError", 429: "RateLimitError",
              503: "ServiceUnavailableError", 500: "InternalServerError"}


class HTTPError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param = status, message, param


def error_body(err: HTTPError) -> dict:
    return {"error": {"message": err.message, "type": ERROR_TYPE.get(err.status, "Error"),
                      "param": err.param, "code": err.status}}


def body_field(body: dict, name: str, kinds: tuple, default: Any = None) -> Any:
    """``body[name]`` checked to be one of ``kinds``; ``default`` when absent or null."""
    if name not in body or body[name] is None:
        return default
    value = body[name]
    if isinstance(value, bool) and bool not in kinds:  # JSON true is not a number here
        raise HTTPError(400, f"{name} must be {_kind_names(kinds)}, got {json.dumps(value)}",
                        name)
    if not isinstance(value, kinds):
        raise HTTPError(400, f"{name} must be {_kind_names(kinds)}, got {json.dumps(value)[:80]}",
                        name)
    return value


def _kind_names(kinds: tuple) -> str:
    names = {bool: "a boolean", int: "an integer", float: "a number", str: "a string",
             list: "a list", dict: "an object"}
    return " or ".join(dict.fromkeys(names[k] for k in kinds))
