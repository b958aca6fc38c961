"""Typed errors: each carries an upper-case code that travels on the wire (MQTT, socket, CLI)."""

from __future__ import annotations


class EdgeError(Exception):
    """Base of every error the agent reports with a code; the message says what to do."""

    code = "INTERNAL"

    def __init__(self, message: str, *, code: str | None = None) -> None:
        super().__init__(message)
        if code is not None:
            self.code = code

    def to_dict(self) -> dict[str, str]:
        """The `error` object of a reply or event."""
        return {"code": self.code, "message": str(self)}


class ModelError(EdgeError):
    """The model file or its manifest cannot be used."""

    code = "MODEL_INVALID"


class BackendUnavailableError(EdgeError):
    """The requested backend cannot run on this device."""

    code = "BACKEND_UNAVAILABLE"


class InferenceError(EdgeError):
    """One inference call failed; the loop counts it and goes on."""

    code = "INFERENCE_FAILED"


class BatchSizeError(InferenceError):
    """The engine does not take a batch of this size (a batch fixed at 1, a TensorRT profile's max).

    Not a fault: the caller runs the same frames in calls the engine takes. Its own code lets the batcher
    tell it from a passing engine error without reading the message."""

    code = "BATCH_SIZE_UNSUPPORTED"
