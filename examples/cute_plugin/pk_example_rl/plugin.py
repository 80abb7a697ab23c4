"""Entry-point hooks (group ``prime_kernels``): declared from kernel.toml; samples import the ops module (and so the
CuTe DSL) only when the conformance kit asks, so discovery never imports it."""
from prime_kernels_core import hookimpl, manifest

KERNEL = "ppo_loss"


@hookimpl
def prime_kernels_declare():
    return manifest.declare(__file__)


def _inputs(device, dtype, shape, seed=0, requires_grad=False):
    """Log-probabilities of sampled tokens (negative), a nearby sampling policy's, and advantages."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    old = -torch.rand(shape, generator=gen) * 3
    logp = old + 0.2 * torch.randn(shape, generator=gen)
    advantages = torch.randn(shape, generator=gen)
    return (logp.to(device, dtype).requires_grad_(requires_grad), old.to(device, dtype), advantages.to(device))


@hookimpl
def prime_kernels_sample_inputs(kernel, device):
    """A trainable [batch, sequence] case, bf16 with dual-clip and an asymmetric clip, and an empty batch."""
    import torch

    if kernel != KERNEL:
        return []
    return [
        ("ppo_loss", (*_inputs(device, torch.float32, (3, 17), requires_grad=True), 0.2, 0.2, None), {}),
        ("ppo_loss", (*_inputs(device, torch.bfloat16, (33,), seed=1), 0.2, 0.28, 3.0), {}),
        ("ppo_loss", (*_inputs(device, torch.float32, (0, 8), seed=2), 0.2, 0.2, None), {}),
    ]


@hookimpl
def prime_kernels_surface_samples(kernel, device):
    """The public Python function, which torch.compile(fullgraph=True) must trace without a graph break."""
    import torch

    from . import ops

    if kernel != KERNEL:
        return []
    return [(ops.ppo_clip_loss, _inputs(device, torch.float32, (4, 9), seed=3, requires_grad=True),
             dict(eps_low=0.2, eps_high=0.28, dual_clip=3.0))]
