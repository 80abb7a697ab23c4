"""Demo: one RL step of a small, randomly initialised MoE block with an lm_head (forward, per-token logp and entropy,
a clipped policy-gradient loss, backward), with the prime-kernels kernels where they can run and the PyTorch paths
otherwise. Prints which path ran for each part, the step time and, when both can run, how far apart they are."""
import time

import torch

import prime_kernels

TEMPERATURE, CLIP, ENTROPY_BONUS = 0.7, 0.2, 0.01


def make_model(device, dim, hidden, experts, vocab):
    g = torch.Generator(device="cpu").manual_seed(0)
    param = lambda *shape, scale: (torch.randn(*shape, generator=g) * scale).to(device, torch.bfloat16).requires_grad_()
    return {
        "router": param(dim, experts, scale=dim**-0.5),
        "w1": param(experts, hidden, dim, scale=dim**-0.5),
        "w3": param(experts, hidden, dim, scale=dim**-0.5),
        "w2": param(experts, dim, hidden, scale=hidden**-0.5),
        "lm_head": param(vocab, dim, scale=dim**-0.5),
    }


def moe_pytorch(x, w1, w2, w3, topk_ids, topk_weights):
    out = torch.zeros_like(x, dtype=torch.float32)
    for e in range(w1.shape[0]):
        token, slot = (topk_ids == e).nonzero(as_tuple=True)
        if token.numel():
            h = torch.nn.functional.silu(x[token] @ w1[e].T) * (x[token] @ w3[e].T)
            out.index_add_(0, token, (h @ w2[e].T).float() * topk_weights[token, slot, None])
    return out.to(x.dtype)


def logp_entropy_pytorch(hidden, lm_head, labels):
    logprobs = torch.log_softmax((hidden @ lm_head.T).float() / TEMPERATURE, dim=-1)
    entropy = -(logprobs.exp() * logprobs).sum(-1)
    return logprobs.gather(-1, labels[:, None]).squeeze(-1), entropy


def paths(device, use_kernels):
    """(moe function, logp/entropy function, their names) for this device."""
    moe, moe_name = moe_pytorch, "PyTorch per-expert loop"
    logp, logp_name = logp_entropy_pytorch, "PyTorch log_softmax"
    if use_kernels and prime_kernels.is_available("flash_moe", device):
        moe, moe_name = prime_kernels.load("flash_moe", device).moe, "flash_moe"
    if use_kernels and prime_kernels.is_available("linear_logp", device):
        linear = prime_kernels.load("linear_logp", device).linear_logp_entropy
        logp, logp_name = (lambda h, w, y: linear(h, w, y, TEMPERATURE)), "linear_logp (fused lm_head)"
    elif use_kernels and prime_kernels.is_available("fused_logp", device):
        fused = prime_kernels.load("fused_logp", device).logp_entropy
        logp, logp_name = (lambda h, w, y: fused(h @ w.T, y, TEMPERATURE)), "fused_logp (on materialised logits)"
    return moe, logp, moe_name, logp_name


def rl_step(model, x, labels, old_logp, advantages, moe, logp_entropy, top_k):
    router_probs = torch.softmax((x @ model["router"]).float(), dim=-1)
    topk_weights, topk_ids = router_probs.topk(top_k, dim=-1)
    hidden = x + moe(x, model["w1"], model["w2"], model["w3"], topk_ids.int(), topk_weights)
    logp, entropy = logp_entropy(hidden, model["lm_head"], labels)
    ratio = torch.exp(logp - old_logp)
    clipped = torch.minimum(ratio * advantages, ratio.clamp(1 - CLIP, 1 + CLIP) * advantages)
    loss = -clipped.mean() - ENTROPY_BONUS * entropy.mean()
    loss.backward()
    return loss.detach(), logp.detach(), entropy.detach()


def run(device, use_kernels, inputs, shape):
    model = make_model(device, *shape)
    moe, logp_entropy, moe_name, logp_name = paths(device, use_kernels)
    step = lambda: rl_step(model, *inputs, moe, logp_entropy, top_k=2)
    step()  # warm-up
    for p in model.values():
        p.grad = None
    if device == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    loss, logp, entropy = step()
    if device == "cuda":
        torch.cuda.synchronize()
    ms = (time.perf_counter() - start) * 1e3
    return {"moe": moe_name, "logp": logp_name, "ms": ms, "loss": loss, "logp_values": logp, "entropy": entropy,
            "grads": {k: p.grad.float() for k, p in model.items()}}


def main():
    device = "cuda" if torch.cuda.is_available() else "cpu"
    tokens, dim, hidden, experts, vocab = (8192, 2048, 768, 16, 151936) if device == "cuda" else (256, 256, 128, 8, 4096)
    g = torch.Generator(device="cpu").manual_seed(1)
    x = (torch.randn(tokens, dim, generator=g)).to(device, torch.bfloat16)
    labels = torch.randint(0, vocab, (tokens,), generator=g).to(device)
    old_logp = (-torch.rand(tokens, generator=g) * 10).to(device)
    advantages = torch.randn(tokens, generator=g).to(device)
    print(f"\nDemo: one RL step, MoE block ({experts} experts, top-2, dim {dim}, hidden {hidden}) + lm_head "
          f"(vocab {vocab}), {tokens} tokens on {device}, T={TEMPERATURE}")

    inputs, shape = (x, labels, old_logp, advantages), (dim, hidden, experts, vocab)
    fast = run(device, True, inputs, shape)
    print(f"ran: MoE via {fast['moe']}; logp/entropy via {fast['logp']}; step {fast['ms']:.1f} ms; "
          f"loss {float(fast['loss']):.5f}, mean entropy {float(fast['entropy'].mean()):.4f}")
    if (fast["moe"], fast["logp"]) == (paths(device, False)[2], paths(device, False)[3]):
        print("no prime-kernels kernel can run here; the PyTorch paths ran (see the status table for why)")
        return
    if device == "cpu":
        print("(on the CPU the kernels run their reference C++ implementations, built for testing, not speed)")
    slow = run(device, False, inputs, shape)
    rel = lambda a, b: float((a - b).norm() / b.norm())
    grads = ", ".join(f"{k} {rel(fast['grads'][k], slow['grads'][k]):.1e}" for k in slow["grads"])
    print(f"PyTorch paths: step {slow['ms']:.1f} ms, loss {float(slow['loss']):.5f}; relative differences: "
          f"logp {rel(fast['logp_values'], slow['logp_values']):.1e}, entropy {rel(fast['entropy'], slow['entropy']):.1e}; "
          f"gradients: {grads}")


if __name__ == "__main__":
    main()
