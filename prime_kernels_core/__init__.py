"""prime-kernels core: plugin discovery, gating, shape contracts, the build kit and the conformance kit."""
import pluggy

__version__ = "0.1.0"

# The entry-point group plugins register under, and pluggy's project name for their hooks.
ENTRY_POINT_GROUP = "prime_kernels"

hookimpl = pluggy.HookimplMarker(ENTRY_POINT_GROUP)
"""Decorator for a plugin's hook implementations (see prime_kernels_core.hookspecs)."""
