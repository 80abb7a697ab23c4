"""Entry-point hooks (group ``prime_kernels``): declared from kernel.toml; samples import the ops module only when
the conformance kit asks, so discovery never loads compiled code."""
from prime_kernels_core import hookimpl, manifest

KERNEL = "residual_rmsnorm"


@hookimpl
def prime_kernels_declare():
    return manifest.declare(__file__)


def _inputs(device, dtype, shape, requires_grad=False, seed=0):
    import torch

    gen = torch.Generator().manual_seed(seed)
    make = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float32).to(device=device, dtype=dtype)
    x, residual, weight = make(*shape), make(*shape), 1 + 0.1 * make(shape[-1])
    for t in (x, residual, weight):
        t.requires_grad_(requires_grad)
    return x, residual, weight


@hookimpl
def prime_kernels_sample_inputs(kernel, device):
    """Every declared op, on ``device``: a trainable fp32 case, a half-precision case with an odd hidden size, and an
    empty batch."""
    import torch

    if kernel != KERNEL:
        return []
    half = torch.bfloat16
    return [
        ("residual_rmsnorm", _inputs(device, torch.float32, (2, 3, 64), requires_grad=True), {"eps": 1e-6}),
        ("residual_rmsnorm", (*_inputs(device, half, (5, 1000), seed=1), 1e-5), {}),
        ("residual_rmsnorm", (*_inputs(device, torch.float32, (0, 32), seed=2), 1e-6), {}),
    ]


@hookimpl
def prime_kernels_surface_samples(kernel, device):
    """The public Python function, which torch.compile(fullgraph=True) must trace without a graph break."""
    import torch

    from . import ops

    if kernel != KERNEL:
        return []
    return [(ops.residual_rmsnorm, _inputs(device, torch.float32, (4, 256), seed=3), {"eps": 1e-6})]
