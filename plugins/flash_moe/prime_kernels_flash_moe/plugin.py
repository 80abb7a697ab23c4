"""Entry-point hooks: declared from kernel.toml; the samples import the ops module only when the conformance kit asks."""
from prime_kernels_core import hookimpl, manifest


@hookimpl
def prime_kernels_declare():
    return manifest.declare(__file__)


@hookimpl
def prime_kernels_sample_inputs(kernel, device):
    from . import samples

    return samples.op_samples(kernel, device)


@hookimpl
def prime_kernels_surface_samples(kernel, device):
    from . import samples

    return samples.surface_samples(kernel, device)
