"""Fuzz-style sweep (issue 22): every public function and raw op of flash_moe, each argument in turn replaced by a bad
or edge value (non-tensors, other dtypes, shapes one off, empty, non-contiguous, meta, NaN; ints at and past int32
and int64, negative, of other types). Each case must give a clean result or a TypeError / ValueError / RuntimeError
whose message names an argument of the call; a crash, any other exception, or a result for a tensor on another device
than the others' (meta, or CPU among CUDA tensors) fails; prime_kernels_core.fuzz runs the sweep."""
from __future__ import annotations

import pytest

from prime_kernels_core import fuzz

KERNEL = "flash_moe"
M, DIM, HIDDEN, E, TOP_K = 8, 128, 128, 4, 2


def cpu_targets() -> dict:
    """name -> (callable, valid keyword arguments): small CPU problems, the same in every process."""
    import torch

    from prime_kernels_flash_moe import ops

    g = torch.Generator().manual_seed(0)
    x = torch.randn(M, DIM, generator=g).to(torch.bfloat16)
    w1, w3 = ((torch.randn(E, HIDDEN, DIM, generator=g) / DIM**0.5).to(torch.bfloat16) for _ in range(2))
    w2 = (torch.randn(E, DIM, HIDDEN, generator=g) / HIDDEN**0.5).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(E, generator=g)[:TOP_K] for _ in range(M)]).to(torch.int32)
    tw = torch.rand(M, TOP_K, generator=g)
    s, e, n = ops.moe_align(ids, E)
    w = torch.cat([w1, w3], 1)
    xq, xs = ops.quantize_mxfp8(x, exponent_block=ops.MXFP8_ALIGN)
    wq, ws = ops.quantize_mxfp8(w, exponent_block=ops.MXFP8_ALIGN)
    w2q, w2s = ops.quantize_mxfp8(w2, exponent_block=ops.MXFP8_ALIGN)
    wsp, w2sp = ops.pack_scales_blocked(ws), ops.pack_scales_blocked(w2s)
    align = dict(sorted_token_ids=s, expert_ids=e, num_tokens_post_padded=n)
    gate_up = torch.ops.flash_moe.moe_gate_up(x, w1, w3, s, e, n, TOP_K, ops.BLOCK_M)
    f = torch.ops.flash_moe
    mx = dict(x=xq, x_scales=xs, w=wq, w_scales=wsp, w2=w2q, w2_scales=w2sp)
    out = lambda: torch.empty(M, DIM, dtype=torch.bfloat16)  # noqa: E731  (fresh per call: the ops write it)
    swiglu = dict(gate_up=gate_up, grad_h=torch.randn(M * TOP_K, HIDDEN).to(torch.bfloat16),
                  row_weights=tw.reshape(-1), valid=torch.ones(M * TOP_K, dtype=torch.bool))
    return {
        "moe": (ops.moe, dict(x=x, w1=w1, w2=w2, w3=w3, topk_ids=ids, topk_weights=tw, expert_start=0,
                              deterministic=False, num_experts=None, mxfp8=False, recompute_gate_up=False)),
        "moe(mxfp8)": (ops.moe, dict(x=x, w1=w1, w2=w2, w3=w3, topk_ids=ids, topk_weights=tw, mxfp8=True)),
        "moe_align": (ops.moe_align, dict(topk_ids=ids, num_experts=E, block_m=ops.BLOCK_M, bpc=1, expert_start=0,
                                          num_local_experts=None, block_align=1)),
        "fused_moe_bf16": (ops.fused_moe_bf16, dict(x=x, w=w, w2=w2, **align, topk_weights=tw, out=out, top_k=TOP_K,
                                                    block_m=ops.BLOCK_M)),
        "fused_moe_mxfp8": (ops.fused_moe_mxfp8, dict(**mx, **align, topk_weights=tw, out=out, top_k=TOP_K,
                                                      block_m=ops.BLOCK_M)),
        "quantize_mxfp8": (ops.quantize_mxfp8, dict(t=x, block=ops.MXFP8_SCALE_BLOCK, exponent_block=None)),
        "dequantize_mxfp8": (ops.dequantize_mxfp8, dict(data=xq, scales=xs, block=ops.MXFP8_SCALE_BLOCK,
                                                        dtype=torch.float32)),
        "share_exponents_mxfp8": (ops.share_exponents_mxfp8, dict(data=xq, scales=xs)),
        "pack_scales_blocked": (ops.pack_scales_blocked, dict(scales=ws)),
        "unpack_scales_blocked": (ops.unpack_scales_blocked, dict(packed=wsp)),
        "unsupported_shape_reason": (ops.unsupported_shape_reason, dict(dim=DIM, hidden_dim=HIDDEN, mxfp8=False)),
        "flash_moe::moe_align": (f.moe_align, dict(topk_ids=ids, num_experts=E, block_m=ops.BLOCK_M, bpc=1,
                                                   expert_start=0, num_local_experts=-1, block_align=1)),
        "flash_moe::fused_moe_bf16": (f.fused_moe_bf16, dict(x=x, w=w, w2=w2, **align, topk_weights=tw, out=out,
                                                             top_k=TOP_K, block_m=ops.BLOCK_M, block_n=64, warp_n=64,
                                                             stages=3, bpc=1, cpc=1, split=True)),
        "flash_moe::moe_forward": (f.moe_forward, dict(x=x, w1=w1, w3=w3, w2=w2, **align, topk_weights=tw,
                                                       top_k=TOP_K, block_m=ops.BLOCK_M, deterministic=False,
                                                       save_gate_up=True, num_experts=2 * E)),
        "flash_moe::moe_gate_up": (f.moe_gate_up, dict(x=x, w1=w1, w3=w3, **align, top_k=TOP_K, block_m=ops.BLOCK_M,
                                                       num_experts=-1)),
        "flash_moe::swiglu_backward": (f.swiglu_backward, swiglu),
        "flash_moe::moe_grad_gate_up": (f.moe_grad_gate_up, dict(grad_out=x, w2=w2, gate_up=gate_up, **align,
                                                                 topk_weights=tw, top_k=TOP_K, block_m=ops.BLOCK_M,
                                                                 num_experts=E)),
        "flash_moe::moe_grad_x": (f.moe_grad_x, dict(grad_gate=swiglu["grad_h"], grad_up=swiglu["grad_h"], w1=w1, w3=w3,
                                                     **align, top_k=TOP_K, block_m=ops.BLOCK_M, deterministic=True,
                                                     num_experts=2 * E)),
        "flash_moe::moe_grad_weight": (f.moe_grad_weight, dict(rows=swiglu["grad_h"], source=x,
                                                               row_token=torch.arange(M * TOP_K, dtype=torch.int32) // TOP_K,
                                                               expert_ends=torch.tensor([3, 3, 9, M * TOP_K],
                                                                                        dtype=torch.int32),
                                                               source_major=False, fp32=False)),
        "flash_moe::quantize_mxfp8": (f.quantize_mxfp8, dict(t=x, block=ops.MXFP8_SCALE_BLOCK)),
        "flash_moe::share_exponents_mxfp8": (f.share_exponents_mxfp8, dict(data=xq, scales=xs)),
        "flash_moe::fused_moe_mxfp8": (f.fused_moe_mxfp8, dict(**mx, **align, topk_weights=tw, out=out, top_k=TOP_K,
                                                               block_m=ops.BLOCK_M, block_n=64, warp_n=4, stages=4,
                                                               bpc=1, split=True)),
        "flash_moe::moe_forward_mxfp8": (f.moe_forward_mxfp8, dict(**mx, **align, topk_weights=tw, top_k=TOP_K,
                                                                   block_m=ops.BLOCK_M, deterministic=False)),
        **lora_targets(ops, x, w1, w2, w3, ids, tw, g),
    }


def lora_targets(ops, x, w1, w2, w3, ids, tw, g, n=2, r=8) -> dict:
    """moe with two adapters, and the LoRA ops on the (expert, adapter) alignment."""
    import torch

    from prime_kernels_flash_moe.lora import group_ids

    def pair(n_in, n_out):
        return ((torch.randn(n, E, r, n_in, generator=g) / n_in**0.5).to(torch.bfloat16),
                (torch.randn(n, E, n_out, r, generator=g) / r**0.5).to(torch.bfloat16))

    (a_gate, b_gate), (a_up, b_up), (a_down, b_down) = pair(DIM, HIDDEN), pair(DIM, HIDDEN), pair(HIDDEN, DIM)
    gate, up, down = dict(a_gate=a_gate, b_gate=b_gate), dict(a_up=a_up, b_up=b_up), dict(a_down=a_down, b_down=b_down)
    scaling, adapter_ids = torch.tensor([0.5, 2.0]), torch.arange(M) % n
    s, e, c = ops.moe_align(group_ids(ids, adapter_ids, E, n, 0, E), E * n)
    align = dict(sorted_token_ids=s, expert_ids=e, num_tokens_post_padded=c)
    f = torch.ops.flash_moe
    gate_up = f.moe_lora_gate_up(x, w1, w3, s, e, c, TOP_K, ops.BLOCK_M, scaling, a_gate, b_gate, a_up, b_up)[0]
    grad = torch.randn(M * TOP_K, HIDDEN, generator=g).to(torch.bfloat16)
    lora = ops.MoeLora(scaling, a_gate, b_gate, a_up, b_up, a_down, b_down, adapter_ids=adapter_ids)
    return {
        "moe(lora)": (ops.moe, dict(x=x, w1=w1, w2=w2, w3=w3, topk_ids=ids, topk_weights=tw, lora=lora)),
        "flash_moe::moe_lora_forward": (f.moe_lora_forward, dict(
            x=x, w1=w1, w3=w3, w2=w2, **align, topk_weights=tw, top_k=TOP_K, block_m=ops.BLOCK_M,
            deterministic=False, save_gate_up=True, num_experts=-1, scaling=scaling, **gate, **up, **down)),
        "flash_moe::moe_lora_gate_up": (f.moe_lora_gate_up, dict(
            x=x, w1=w1, w3=w3, **align, top_k=TOP_K, block_m=ops.BLOCK_M, scaling=scaling, **gate, **up)),
        "flash_moe::moe_lora_grad_gate_up": (f.moe_lora_grad_gate_up, dict(
            grad_out=x, w2=w2, gate_up=gate_up, **align, topk_weights=tw, top_k=TOP_K, block_m=ops.BLOCK_M,
            scaling=scaling, **down)),
        "flash_moe::moe_lora_grad_x": (f.moe_lora_grad_x, dict(
            grad_gate=grad, grad_up=grad, w1=w1, w3=w3, **align, top_k=TOP_K, block_m=ops.BLOCK_M,
            deterministic=True, scaling=scaling, **gate, **up)),
    }


@pytest.mark.parametrize("device", [pytest.param("cpu", marks=pytest.mark.kernel(KERNEL, device="cpu")),
                                    pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.kernel(KERNEL)])])
def test_every_bad_input_gets_a_clean_result_or_an_error_naming_the_argument(device):
    failures = fuzz.sweep(__file__, device)
    assert not failures, "\n".join(failures)


@pytest.mark.kernel(KERNEL, device="cpu")
def test_a_case_that_kills_its_process_is_reported_and_the_rest_still_run():
    first, second = fuzz.all_cases(__file__)[:2]
    records = fuzz.run_in_children(__file__, [first, fuzz.ABORT, second], workers=1)
    assert [r["case"] for r in records] == [first, fuzz.ABORT, second]
    assert records[1]["outcome"] == "crash" and fuzz.verdict(records[1]).startswith("the process died")
    assert fuzz.verdict(records[0]) is None and fuzz.verdict(records[2]) is None
