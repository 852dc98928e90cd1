"""Typed errors for bad input at the pipeline boundary.

Every error carries the request field it is about (``field``) and a message that says what was
wrong and what was expected, so the server can map it to an INVALID_ARGUMENT status verbatim.
"""

from __future__ import annotations

from collections.abc import Iterable


class PolicyInputError(ValueError):
    """A request field the pipeline cannot use.

    Attributes:
        field: the request field at fault, e.g. ``"state"`` or ``"images['wrist']"``.
        message: what was wrong and what was expected.
    """

    def __init__(self, field: str, message: str) -> None:
        self.field = field
        self.message = message
        super().__init__(f"{field}: {message}")


class UnregisteredEmbodiment(PolicyInputError):
    """The embodiment name is not in the registry (the pipeline's lookup).

    Not the transport's ``engine.api.UnknownEmbodiment``, which means "not served by this server"
    (the served embodiments are a subset of the registered ones) and carries a wire reason.
    """

    def __init__(self, name: str, known: Iterable[str]) -> None:
        self.name = name
        self.known = sorted(known)
        super().__init__(
            "embodiment", f"unknown embodiment {name!r}; expected one of {', '.join(self.known)}"
        )


class InvalidImage(PolicyInputError):
    """A camera image with the wrong shape, dtype, size or key."""

    def __init__(self, message: str, field: str = "images") -> None:
        super().__init__(field, message)


class InvalidState(PolicyInputError):
    """A proprio state vector with the wrong length or non-finite values."""

    def __init__(self, message: str, field: str = "state") -> None:
        super().__init__(field, message)


class InvalidActions(PolicyInputError):
    """Given actions (forward dynamics, history rows) with the wrong shape or non-finite values."""

    def __init__(self, message: str, field: str = "actions") -> None:
        super().__init__(field, message)


class InvalidChunkSize(PolicyInputError):
    """An action chunk size outside the allowed range."""

    def __init__(self, value: object, minimum: int, maximum: int) -> None:
        self.value = value
        self.minimum = minimum
        self.maximum = maximum
        super().__init__(
            "chunk_size", f"got {value!r}; expected an integer in [{minimum}, {maximum}]"
        )


class EmptyInstruction(PolicyInputError):
    """An instruction that is empty or only whitespace where the mode needs one."""

    def __init__(self, mode: str) -> None:
        self.mode = mode
        super().__init__(
            "instruction",
            f"got an empty instruction; mode {mode!r} needs a non-empty text describing the task",
        )


class InvalidMode(PolicyInputError):
    """A generation mode the pipeline does not know."""

    def __init__(self, mode: str, known: Iterable[str]) -> None:
        self.mode = mode
        self.known = sorted(known)
        super().__init__("mode", f"unknown mode {mode!r}; expected one of {', '.join(self.known)}")


class InvalidSamplerSettings(PolicyInputError):
    """A sampler name, step count, shift or guidance value out of range."""


class InvalidNoise(PolicyInputError):
    """Initial noise of the wrong shape or dtype, or not finite."""

    def __init__(self, message: str, field: str = "noise") -> None:
        super().__init__(field, message)
