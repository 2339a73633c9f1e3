"""Errors the engine raises for requests it cannot take; the service maps them to gRPC status codes."""


class InvalidRequest(ValueError):
    """A request is malformed; `field` names the offending field (INVALID_ARGUMENT)."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field


class EngineDead(RuntimeError):
    """The engine stopped (shut down or crashed); no request can be served (UNAVAILABLE)."""


class QueueFull(RuntimeError):
    """The engine's waiting queue is full (RESOURCE_EXHAUSTED); retry later."""


class DuplicateRequest(ValueError):
    """A request with this id is already running (ALREADY_EXISTS)."""


class SessionNotFound(KeyError):
    """No open session has this id: never opened, closed, or expired (NOT_FOUND)."""

    def __str__(self) -> str:
        return str(self.args[0])


class SessionBusy(RuntimeError):
    """The session is generating a turn; one call at a time (FAILED_PRECONDITION)."""


class ContextFull(ValueError):
    """The session's context would exceed the context length (OUT_OF_RANGE)."""


class KVTransferInvalid(ValueError):
    """A KV transfer does not fit what the receiving engine serves: layout, shape, dtype, codec or chunk order
    (INVALID_ARGUMENT)."""


class KVTransferCorrupt(ValueError):
    """A KV transfer's payload does not match its header's checksum or length (DATA_LOSS)."""


class KVWeightVersionMismatch(RuntimeError):
    """A KV transfer was computed with other weights than the receiving engine serves (FAILED_PRECONDITION);
    prefill again under the served version. `kv_version`, `served_version`: the two versions, when known."""

    def __init__(self, message: str, kv_version: int | None = None, served_version: int | None = None):
        super().__init__(message)
        self.kv_version = kv_version
        self.served_version = served_version


class NotAdmitted(QueueFull):
    """engine.session_admission kv: the sessions' KV working set does not fit now; the session queues
    (AsyncEngine asks again until it is admitted, at the latest after session_admission_wait_s)."""
