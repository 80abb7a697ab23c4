"""The consumer API: which kernels are installed, whether each can run here, and the kernel modules themselves.

    import prime_kernels
    prime_kernels.status()                      # {"fused_logp": "available", "flash_moe": "<reason>"}
    fm = prime_kernels.load("flash_moe")        # raises KernelUnavailableError with the reason
"""
from prime_kernels_core.contracts import ShapeContract, UnsupportedShapeError, check_shape
from prime_kernels_core.registry import (
    KernelUnavailableError,
    is_available,
    load,
    log_status,
    refresh,
    spec,
    status,
    unavailable_reason,
)

__all__ = [
    "KernelUnavailableError", "ShapeContract", "UnsupportedShapeError", "check_shape", "is_available", "load",
    "log_status", "refresh", "spec", "status", "unavailable_reason",
]
