"""Entry-point hooks: the kernels of kernel.toml, and samples.py's conformance samples (imported only when asked)."""
from prime_kernels_core.manifest import ManifestHooks

hooks = ManifestHooks(__file__, "prime_kernels_fused_logp.samples")
