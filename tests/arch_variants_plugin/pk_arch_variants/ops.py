"""``scale(x, factor) -> x * factor`` (float32): the op of the arch-variants test plugin."""
import torch

from . import _C  # noqa: F401  (registers torch.ops.pk_arch_variants.scale)


@torch.library.register_fake("pk_arch_variants::scale")
def _(x, factor):
    torch._check(x.dtype == torch.float32, lambda: f"x must be float32, found {x.dtype}")
    return torch.empty_like(x, memory_format=torch.contiguous_format)


def scale(x: torch.Tensor, factor: float) -> torch.Tensor:
    return torch.ops.pk_arch_variants.scale(x, factor)
