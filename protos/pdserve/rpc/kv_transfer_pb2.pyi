from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Optional as _Optional

DESCRIPTOR: _descriptor.FileDescriptor

class FetchRequest(_message.Message):
    __slots__ = ("attempt", "skip_blocks")
    ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    SKIP_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    attempt: str
    skip_blocks: int
    def __init__(self, attempt: _Optional[str] = ..., skip_blocks: _Optional[int] = ...) -> None: ...

class KVChunk(_message.Message):
    __slots__ = ("attempt", "data")
    ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    attempt: str
    data: bytes
    def __init__(self, attempt: _Optional[str] = ..., data: _Optional[bytes] = ...) -> None: ...

class PushResponse(_message.Message):
    __slots__ = ("attempt",)
    ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    attempt: str
    def __init__(self, attempt: _Optional[str] = ...) -> None: ...
