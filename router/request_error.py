"""How the router refuses a request: a gRPC status code and a message naming the field
(the HTTP front maps the code to its status)."""

from __future__ import annotations

import grpc


class RequestError(Exception):
    """A request refused with a gRPC status code and a message naming the field."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


def invalid(message: str) -> RequestError:
    return RequestError(grpc.StatusCode.INVALID_ARGUMENT, message)
