"""The hooks a prime-kernels plugin implements. Its entry point (group ``prime_kernels``) names the module or object
holding them (``prime_kernels_core.manifest.ManifestHooks`` implements the common three from a manifest)."""
import pluggy

from . import ENTRY_POINT_GROUP

hookspec = pluggy.HookspecMarker(ENTRY_POINT_GROUP)


@hookspec
def prime_kernels_declare():
    """Return the KernelSpecs this plugin ships (prime_kernels_core.manifest.declare); never import compiled code here."""


@hookspec(firstresult=True)
def prime_kernels_extra_check(kernel, device):
    """Return a sentence saying why ``kernel`` cannot run on ``device`` (a Target; index None when it asks about a
    capability with no device present), or None; runs after every core rule."""


@hookspec
def prime_kernels_sample_inputs(kernel, device):
    """Return [(op_name, args, kwargs)] for the conformance kit: fake-tensor runs and torch.library.opcheck on ``device``."""


@hookspec
def prime_kernels_surface_samples(kernel, device):
    """Return [(callable, args, kwargs)]: Python-surface calls that torch.compile(fullgraph=True) must trace."""
