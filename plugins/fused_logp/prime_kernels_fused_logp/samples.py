"""Sample inputs for the conformance kit (fake-tensor runs, opcheck, torch.compile of the surface)."""
import torch


def _inputs(device, tokens=6, vocab=257, dtype=torch.bfloat16):
    logits = (torch.randn(tokens, vocab, device=device) * 3).to(dtype).requires_grad_(True)
    labels = torch.randint(0, vocab, (tokens,), device=device)
    labels[1] = -100
    return logits, labels


def _logits_op_samples(device):
    from . import ops

    logits, labels = _inputs(device)
    token_t = torch.rand(logits.shape[0], device=device) + 0.5
    _, entropy, stats = ops._op(logits.detach(), labels, 0.7, None, -100, True, True)
    grad = torch.randn(logits.shape[0], device=device)
    return [
        ("logp_entropy", (logits, labels, 0.7, None, -100, True, True), {}),
        ("logp_entropy", (logits, labels.int(), 1.0, token_t, -100, False, True), {}),
        ("logp_entropy", (logits, labels, 0.7, token_t, -100, True, False, True), {}),
        ("logp_entropy_backward", (grad, torch.randn_like(entropy), logits.detach(), labels, 0.7, None, stats, -100), {}),
        ("logp_entropy_backward", (grad, None, logits.detach(), labels, 0.7, None, stats, -100), {}),
        ("logp_entropy_backward", (grad, None, logits.detach(), labels, 0.7, None, stats, -100, True), {}),
        ("logp_entropy", (logits, labels, 0.7, token_t, -100, True, True, False, 5.0, 0.5), {}),
        ("logp_entropy_backward",
         (grad, torch.randn_like(entropy), logits.detach(), labels, 0.7, None, stats, -100, False, 5.0, 0.5), {}),
    ]


def _logits_surface_samples(device):
    from . import ops

    def step(logits, labels, temperature, softcap=None):
        return ops.logp_entropy(logits, labels, temperature, softcap=softcap)

    logits, labels = _inputs(device, dtype=torch.float32)
    per_token = torch.full((2, 3), 0.9, device=device)
    return [(step, (logits.view(2, 3, -1), labels.view(2, 3), 0.7), {}),
            (step, (logits.view(2, 3, -1), labels.view(2, 3), per_token), {}),
            (step, (logits.view(2, 3, -1), labels.view(2, 3), per_token), {"softcap": 4.0})]


def _linear_op_samples(device):
    from . import linear_ops  # noqa: F401  (registers the fake and autograd implementations)

    g = torch.Generator().manual_seed(0)
    n, h, v = 5, 16, 37
    hidden = (torch.randn(n, h, generator=g) * 0.5).to(torch.bfloat16).to(device)
    weight = (torch.randn(v, h, generator=g) * 0.5).to(torch.bfloat16).to(device)
    labels = torch.tensor([0, 36, -100, 7, 20], device=device)
    tt = torch.rand(n, generator=g).add(0.5).to(device)
    bias = torch.randn(v, generator=g).to(device)
    fwd = (hidden, weight, labels, 0.7, tt, bias, -100, True)
    _, _, stats = torch.ops.fused_logp.linear_logp_entropy(*fwd)
    glp, gent = torch.randn(n, generator=g).to(device), torch.randn(n, generator=g).to(device)
    return [
        ("linear_logp_entropy", fwd, {}),
        ("linear_logp_entropy", (hidden, weight, labels, 1.0, None, None, -100, False), {}),
        ("linear_logp_entropy", fwd + (True,), {}),
        ("linear_logp_entropy_backward",
         (glp, gent, hidden, weight, labels, 0.7, tt, bias, stats, -100, [True, True, True], False), {}),
        ("linear_logp_entropy_backward",
         (glp, None, hidden, weight, labels, 0.7, tt, None, stats, -100, [True, False, False], True), {}),
        ("linear_logp_entropy_backward",
         (glp, gent, hidden, weight, labels, 0.7, tt, bias, stats, -100, [True, True, True], False, True), {}),
        ("linear_logp_entropy", fwd + (False, 2.0, 0.5), {}),
        ("linear_logp_entropy_backward",
         (glp, gent, hidden, weight, labels, 0.7, tt, bias, stats, -100, [True, True, True], False, False, 2.0, 0.5),
         {}),
    ]


def _linear_surface_samples(device):
    from . import linear_ops

    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(2, 3, 16, generator=g).to(torch.bfloat16).to(device)
    weight = torch.randn(37, 16, generator=g).to(torch.bfloat16).to(device)
    labels = torch.randint(0, 37, (2, 3), generator=g).to(device)
    return [(linear_ops.linear_logp_entropy, (hidden, weight, labels, 0.7), {}),
            (linear_ops.linear_logp_entropy, (hidden, weight, labels, 0.7), {"softcap": 3.0, "logit_scale": 0.5})]


def op_samples(kernel, device):
    return {"fused_logp": _logits_op_samples, "linear_logp": _linear_op_samples}[kernel](device)


def surface_samples(kernel, device):
    return {"fused_logp": _logits_surface_samples, "linear_logp": _linear_surface_samples}[kernel](device)
