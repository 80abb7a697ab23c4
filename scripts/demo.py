"""Demo: per-token log-probabilities and entropy of a sampled batch, with the fused_logp kernel where it can run,
else with the PyTorch path trainers use today; says which ran and, when both can, how far apart they are."""
import time

import torch

import prime_kernels


def pytorch_path(logits, labels, temperature):
    logprobs = torch.log_softmax(logits.float() / temperature, dim=-1)
    entropy = -(logprobs.exp() * logprobs).sum(-1)
    return logprobs.gather(-1, labels.unsqueeze(-1)).squeeze(-1), entropy


def timed(fn, device):
    fn()
    if device == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    out = fn()
    if device == "cuda":
        torch.cuda.synchronize()
    return out, (time.perf_counter() - start) * 1e3


def main():
    device = "cuda" if torch.cuda.is_available() else "cpu"
    batch, seq, vocab, temperature = (8, 2048, 151936, 0.7) if device == "cuda" else (2, 64, 32000, 0.7)
    logits = torch.randn(batch, seq, vocab, device=device, dtype=torch.bfloat16) * 3
    labels = torch.randint(0, vocab, (batch, seq), device=device)
    print(f"\nDemo: logp and entropy for {batch}x{seq} tokens over a {vocab}-token vocabulary on {device}, T={temperature}")

    reason = prime_kernels.unavailable_reason("fused_logp", device)
    (ref_logp, ref_ent), ref_ms = timed(lambda: pytorch_path(logits, labels, temperature), device)
    if reason is None:
        flp = prime_kernels.load("fused_logp", device)
        (logp, ent), ms = timed(lambda: flp.logp_entropy(logits, labels, temperature), device)
        print(f"ran: fused_logp kernel on {device} ({ms:.2f} ms; PyTorch path {ref_ms:.2f} ms)")
        print(f"max |logp difference| {float((logp - ref_logp).abs().max()):.2e}, "
              f"max |entropy difference| {float((ent - ref_ent).abs().max()):.2e}")
    else:
        logp, ent = ref_logp, ref_ent
        print(f"ran: PyTorch path ({ref_ms:.2f} ms), because fused_logp is unavailable: {reason}")
    print(f"mean logp {float(logp.mean()):.4f}, mean entropy {float(ent.mean()):.4f}")


if __name__ == "__main__":
    main()
