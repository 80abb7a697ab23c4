"""The shape contract: what a kernel module exports about the inputs it accepts, so callers check at setup, not mid-step."""
from __future__ import annotations

from typing import Protocol, runtime_checkable


class UnsupportedShapeError(ValueError):
    """A shape the kernel's contract rejects; the message is the contract's own reason."""


@runtime_checkable
class ShapeContract(Protocol):
    """A kernel module exports its tile constants (``BLOCK_M``, ...; read from its manifest) and this function.

    ``unsupported_shape_reason`` returns None for shapes the kernel handles, else one sentence naming what was found
    and what is needed. It is the one place a kernel's alignment rules live; callers never hardcode them.
    """

    def unsupported_shape_reason(self, *args, **kwargs) -> str | None: ...


def check_shape(kernel_module: ShapeContract, *args, **kwargs) -> None:
    """Raise UnsupportedShapeError with the kernel's reason when it rejects these shapes."""
    if not isinstance(kernel_module, ShapeContract):
        raise TypeError(f"{getattr(kernel_module, '__name__', kernel_module)!r} does not export unsupported_shape_reason")
    reason = kernel_module.unsupported_shape_reason(*args, **kwargs)
    if reason is not None:
        raise UnsupportedShapeError(reason)
