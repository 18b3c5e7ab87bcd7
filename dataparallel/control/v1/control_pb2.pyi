from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Refusal(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    HELD: _ClassVar[Refusal]
    LEFT: _ClassVar[Refusal]
    RUN_OVER: _ClassVar[Refusal]

class Status(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    OK: _ClassVar[Status]
    TIMEOUT: _ClassVar[Status]
    PEER_LOST: _ClassVar[Status]
    AUTH_FAILED: _ClassVar[Status]
    BAD_MESSAGE: _ClassVar[Status]
    CLOSED: _ClassVar[Status]
    FAILED: _ClassVar[Status]
    PEER_LEFT: _ClassVar[Status]
HELD: Refusal
LEFT: Refusal
RUN_OVER: Refusal
OK: Status
TIMEOUT: Status
PEER_LOST: Status
AUTH_FAILED: Status
BAD_MESSAGE: Status
CLOSED: Status
FAILED: Status
PEER_LEFT: Status

class Empty(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class Hello(_message.Message):
    __slots__ = ("protocol", "job", "world_size", "nonce", "liveness_timeout", "host", "pid", "boot_id", "pid_namespace", "heartbeat")
    PROTOCOL_FIELD_NUMBER: _ClassVar[int]
    JOB_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    NONCE_FIELD_NUMBER: _ClassVar[int]
    LIVENESS_TIMEOUT_FIELD_NUMBER: _ClassVar[int]
    HOST_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    BOOT_ID_FIELD_NUMBER: _ClassVar[int]
    PID_NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_FIELD_NUMBER: _ClassVar[int]
    protocol: int
    job: str
    world_size: int
    nonce: bytes
    liveness_timeout: float
    host: str
    pid: int
    boot_id: str
    pid_namespace: int
    heartbeat: float
    def __init__(self, protocol: _Optional[int] = ..., job: _Optional[str] = ..., world_size: _Optional[int] = ..., nonce: _Optional[bytes] = ..., liveness_timeout: _Optional[float] = ..., host: _Optional[str] = ..., pid: _Optional[int] = ..., boot_id: _Optional[str] = ..., pid_namespace: _Optional[int] = ..., heartbeat: _Optional[float] = ...) -> None: ...

class Get(_message.Message):
    __slots__ = ("key", "timeout")
    KEY_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_FIELD_NUMBER: _ClassVar[int]
    key: str
    timeout: float
    def __init__(self, key: _Optional[str] = ..., timeout: _Optional[float] = ...) -> None: ...

class KeyValue(_message.Message):
    __slots__ = ("key", "value")
    KEY_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    key: str
    value: bytes
    def __init__(self, key: _Optional[str] = ..., value: _Optional[bytes] = ...) -> None: ...

class Add(_message.Message):
    __slots__ = ("key", "amount")
    KEY_FIELD_NUMBER: _ClassVar[int]
    AMOUNT_FIELD_NUMBER: _ClassVar[int]
    key: str
    amount: int
    def __init__(self, key: _Optional[str] = ..., amount: _Optional[int] = ...) -> None: ...

class CompareSet(_message.Message):
    __slots__ = ("key", "expected", "desired")
    KEY_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_FIELD_NUMBER: _ClassVar[int]
    DESIRED_FIELD_NUMBER: _ClassVar[int]
    key: str
    expected: bytes
    desired: bytes
    def __init__(self, key: _Optional[str] = ..., expected: _Optional[bytes] = ..., desired: _Optional[bytes] = ...) -> None: ...

class Key(_message.Message):
    __slots__ = ("key",)
    KEY_FIELD_NUMBER: _ClassVar[int]
    key: str
    def __init__(self, key: _Optional[str] = ...) -> None: ...

class Heartbeat(_message.Message):
    __slots__ = ("set",)
    SET_FIELD_NUMBER: _ClassVar[int]
    set: _containers.RepeatedCompositeFieldContainer[KeyValue]
    def __init__(self, set: _Optional[_Iterable[_Union[KeyValue, _Mapping]]] = ...) -> None: ...

class MultiCompareSet(_message.Message):
    __slots__ = ("items",)
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    items: _containers.RepeatedCompositeFieldContainer[CompareSet]
    def __init__(self, items: _Optional[_Iterable[_Union[CompareSet, _Mapping]]] = ...) -> None: ...

class MultiGet(_message.Message):
    __slots__ = ("keys", "timeout")
    KEYS_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_FIELD_NUMBER: _ClassVar[int]
    keys: _containers.RepeatedScalarFieldContainer[str]
    timeout: float
    def __init__(self, keys: _Optional[_Iterable[str]] = ..., timeout: _Optional[float] = ...) -> None: ...

class MultiSet(_message.Message):
    __slots__ = ("items",)
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    items: _containers.RepeatedCompositeFieldContainer[KeyValue]
    def __init__(self, items: _Optional[_Iterable[_Union[KeyValue, _Mapping]]] = ...) -> None: ...

class Keys(_message.Message):
    __slots__ = ("keys",)
    KEYS_FIELD_NUMBER: _ClassVar[int]
    keys: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, keys: _Optional[_Iterable[str]] = ...) -> None: ...

class Register(_message.Message):
    __slots__ = ("rank",)
    RANK_FIELD_NUMBER: _ClassVar[int]
    rank: int
    def __init__(self, rank: _Optional[int] = ...) -> None: ...

class Join(_message.Message):
    __slots__ = ("assign", "rank", "claimant", "peer")
    ASSIGN_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    CLAIMANT_FIELD_NUMBER: _ClassVar[int]
    PEER_FIELD_NUMBER: _ClassVar[int]
    assign: bool
    rank: int
    claimant: bytes
    peer: bytes
    def __init__(self, assign: _Optional[bool] = ..., rank: _Optional[int] = ..., claimant: _Optional[bytes] = ..., peer: _Optional[bytes] = ...) -> None: ...

class Collect(_message.Message):
    __slots__ = ("name", "sources", "want", "has_value", "value", "timeout")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SOURCES_FIELD_NUMBER: _ClassVar[int]
    WANT_FIELD_NUMBER: _ClassVar[int]
    HAS_VALUE_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_FIELD_NUMBER: _ClassVar[int]
    name: str
    sources: _containers.RepeatedScalarFieldContainer[int]
    want: bool
    has_value: bool
    value: bytes
    timeout: float
    def __init__(self, name: _Optional[str] = ..., sources: _Optional[_Iterable[int]] = ..., want: _Optional[bool] = ..., has_value: _Optional[bool] = ..., value: _Optional[bytes] = ..., timeout: _Optional[float] = ...) -> None: ...

class Request(_message.Message):
    __slots__ = ("id", "session", "hello", "set", "get", "add", "compare_set", "delete", "check", "num_keys", "collect", "register", "heartbeat", "leave", "multi_get", "multi_set", "append", "join", "multi_compare_set", "delete_many")
    ID_FIELD_NUMBER: _ClassVar[int]
    SESSION_FIELD_NUMBER: _ClassVar[int]
    HELLO_FIELD_NUMBER: _ClassVar[int]
    SET_FIELD_NUMBER: _ClassVar[int]
    GET_FIELD_NUMBER: _ClassVar[int]
    ADD_FIELD_NUMBER: _ClassVar[int]
    COMPARE_SET_FIELD_NUMBER: _ClassVar[int]
    DELETE_FIELD_NUMBER: _ClassVar[int]
    CHECK_FIELD_NUMBER: _ClassVar[int]
    NUM_KEYS_FIELD_NUMBER: _ClassVar[int]
    COLLECT_FIELD_NUMBER: _ClassVar[int]
    REGISTER_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_FIELD_NUMBER: _ClassVar[int]
    LEAVE_FIELD_NUMBER: _ClassVar[int]
    MULTI_GET_FIELD_NUMBER: _ClassVar[int]
    MULTI_SET_FIELD_NUMBER: _ClassVar[int]
    APPEND_FIELD_NUMBER: _ClassVar[int]
    JOIN_FIELD_NUMBER: _ClassVar[int]
    MULTI_COMPARE_SET_FIELD_NUMBER: _ClassVar[int]
    DELETE_MANY_FIELD_NUMBER: _ClassVar[int]
    id: int
    session: bytes
    hello: Hello
    set: KeyValue
    get: Get
    add: Add
    compare_set: CompareSet
    delete: Key
    check: Keys
    num_keys: Empty
    collect: Collect
    register: Register
    heartbeat: Heartbeat
    leave: Empty
    multi_get: MultiGet
    multi_set: MultiSet
    append: KeyValue
    join: Join
    multi_compare_set: MultiCompareSet
    delete_many: Keys
    def __init__(self, id: _Optional[int] = ..., session: _Optional[bytes] = ..., hello: _Optional[_Union[Hello, _Mapping]] = ..., set: _Optional[_Union[KeyValue, _Mapping]] = ..., get: _Optional[_Union[Get, _Mapping]] = ..., add: _Optional[_Union[Add, _Mapping]] = ..., compare_set: _Optional[_Union[CompareSet, _Mapping]] = ..., delete: _Optional[_Union[Key, _Mapping]] = ..., check: _Optional[_Union[Keys, _Mapping]] = ..., num_keys: _Optional[_Union[Empty, _Mapping]] = ..., collect: _Optional[_Union[Collect, _Mapping]] = ..., register: _Optional[_Union[Register, _Mapping]] = ..., heartbeat: _Optional[_Union[Heartbeat, _Mapping]] = ..., leave: _Optional[_Union[Empty, _Mapping]] = ..., multi_get: _Optional[_Union[MultiGet, _Mapping]] = ..., multi_set: _Optional[_Union[MultiSet, _Mapping]] = ..., append: _Optional[_Union[KeyValue, _Mapping]] = ..., join: _Optional[_Union[Join, _Mapping]] = ..., multi_compare_set: _Optional[_Union[MultiCompareSet, _Mapping]] = ..., delete_many: _Optional[_Union[Keys, _Mapping]] = ...) -> None: ...

class LostPeer(_message.Message):
    __slots__ = ("rank", "last_seen", "reason")
    RANK_FIELD_NUMBER: _ClassVar[int]
    LAST_SEEN_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    rank: int
    last_seen: float
    reason: str
    def __init__(self, rank: _Optional[int] = ..., last_seen: _Optional[float] = ..., reason: _Optional[str] = ...) -> None: ...

class Reply(_message.Message):
    __slots__ = ("id", "status", "error", "value", "number", "flag", "values", "session", "lost", "arrived", "answers", "refusal")
    ID_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    NUMBER_FIELD_NUMBER: _ClassVar[int]
    FLAG_FIELD_NUMBER: _ClassVar[int]
    VALUES_FIELD_NUMBER: _ClassVar[int]
    SESSION_FIELD_NUMBER: _ClassVar[int]
    LOST_FIELD_NUMBER: _ClassVar[int]
    ARRIVED_FIELD_NUMBER: _ClassVar[int]
    ANSWERS_FIELD_NUMBER: _ClassVar[int]
    REFUSAL_FIELD_NUMBER: _ClassVar[int]
    id: int
    status: Status
    error: str
    value: bytes
    number: int
    flag: bool
    values: _containers.RepeatedScalarFieldContainer[bytes]
    session: bytes
    lost: LostPeer
    arrived: _containers.RepeatedScalarFieldContainer[int]
    answers: bytes
    refusal: Refusal
    def __init__(self, id: _Optional[int] = ..., status: _Optional[_Union[Status, str]] = ..., error: _Optional[str] = ..., value: _Optional[bytes] = ..., number: _Optional[int] = ..., flag: _Optional[bool] = ..., values: _Optional[_Iterable[bytes]] = ..., session: _Optional[bytes] = ..., lost: _Optional[_Union[LostPeer, _Mapping]] = ..., arrived: _Optional[_Iterable[int]] = ..., answers: _Optional[bytes] = ..., refusal: _Optional[_Union[Refusal, str]] = ...) -> None: ...

class Frame(_message.Message):
    __slots__ = ("sealed",)
    SEALED_FIELD_NUMBER: _ClassVar[int]
    sealed: bytes
    def __init__(self, sealed: _Optional[bytes] = ...) -> None: ...
