"""Errors the engine raises for requests it cannot take; the service maps them to gRPC status codes."""


class InvalidRequest(ValueError):
    """A request is malformed; `field` names the offending field (INVALID_ARGUMENT)."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field


class QueueFull(RuntimeError):
    """The engine's waiting queue is full (RESOURCE_EXHAUSTED); retry later."""


class DuplicateRequest(ValueError):
    """A request with this id is already running (ALREADY_EXISTS)."""
