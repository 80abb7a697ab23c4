"""prime-kernels core: plugin discovery, gating, shape contracts, the build kit and the conformance kit."""
import pluggy

__version__ = "0.1.0"

hookimpl = pluggy.HookimplMarker("prime_kernels")
"""Decorator for a plugin's hook implementations (see prime_kernels_core.hookspecs)."""
