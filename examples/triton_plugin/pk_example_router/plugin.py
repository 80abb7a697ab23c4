"""Entry-point hooks (group ``prime_kernels``): declared from kernel.toml; samples import the ops module (and so
Triton) only when the conformance kit asks, so discovery never imports Triton."""
from prime_kernels_core import hookimpl, manifest

KERNEL = "moe_router"
# DeepSeek-V3's routing (a shipped specialization on GPUs) and an odd one (7 experts, softmax, no renormalisation).
DEEPSEEK = dict(n_experts=256, n_groups=8, topk_groups=4, top_k=8, sigmoid=True, renormalize=True, scale=2.5)
ODD = dict(n_experts=7, n_groups=1, topk_groups=1, top_k=3, sigmoid=False, renormalize=False, scale=1.0)


@hookimpl
def prime_kernels_declare():
    return manifest.declare(__file__)


def _inputs(device, dtype, tokens, n_experts, requires_grad=False, seed=0):
    import torch

    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(tokens, n_experts, generator=gen).to(device=device, dtype=dtype)
    bias = (0.1 * torch.randn(n_experts, generator=gen)).to(device)
    return logits.requires_grad_(requires_grad), bias


def _route_args(device, dtype, tokens, config, requires_grad=False, seed=0):
    logits, bias = _inputs(device, dtype, tokens, config["n_experts"], requires_grad, seed)
    return (logits, bias, config["n_groups"], config["topk_groups"], config["top_k"], config["sigmoid"],
            config["renormalize"], config["scale"])


@hookimpl
def prime_kernels_sample_inputs(kernel, device):
    """Every declared op on ``device``: a trainable DeepSeek-V3 case, an odd softmax one in bf16, an empty batch, and
    the backward at experts chosen by a forward."""
    import torch

    from . import ops

    if kernel != KERNEL:
        return []
    route_args = _route_args(device, torch.float32, 4, ODD, seed=3)
    _, experts = ops.route(*route_args)
    grad = torch.randn(experts.shape, generator=torch.Generator().manual_seed(4)).to(device)
    return [
        ("route", _route_args(device, torch.float32, 3, DEEPSEEK, requires_grad=True), {}),
        ("route", _route_args(device, torch.bfloat16, 5, ODD, seed=1), {}),
        ("route", _route_args(device, torch.float32, 0, DEEPSEEK, seed=2), {}),
        ("route_backward", (route_args[0], experts, grad, ODD["sigmoid"], ODD["renormalize"], ODD["scale"]), {}),
    ]


@hookimpl
def prime_kernels_surface_samples(kernel, device):
    """The public Python function, which torch.compile(fullgraph=True) must trace without a graph break."""
    import torch

    from . import ops

    if kernel != KERNEL:
        return []
    logits, bias = _inputs(device, torch.float32, 6, DEEPSEEK["n_experts"], requires_grad=True, seed=5)
    return [(ops.moe_route, (logits, bias), dict(top_k=8, n_groups=8, topk_groups=4, score="sigmoid", scale=2.5))]
