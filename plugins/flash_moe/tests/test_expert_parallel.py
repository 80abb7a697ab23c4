"""flash_moe inside expert parallelism as trainers run it, on CPU with gloo (2 and 4 ranks, torch.multiprocessing).

Each rank holds a shard of the tokens (routed by the whole problem's top-k ids) and a contiguous shard of the experts.
Two data flows, both forward and backward through the collectives' autograd:

- torchtitan's ``expert_parallel`` (prime-rl's GroupedExperts): a rank sorts its slots by global expert (so by
  destination rank, then local expert), exchanges the per-expert counts with ``all_to_all_single``, then the rows;
  the receiving rank regroups them from source-rank-major to local-expert-major, each expert's run padded with zero
  rows to a multiple of ALIGN (counted in ``num_tokens_per_expert``) and PAST_END padding rows after the runs, runs
  ``ops.moe_sorted``, drops the padding rows, and sends the outputs back; the source rank sums a token's slots in
  fp32. The routing scores travel with the rows and reach ``moe_sorted`` as ``row_weights`` (flash_moe's fused
  combine: the gradient of each row's output is formed in fp32 there; torchtitan's own combine, scores applied on
  the source rank after the bf16 return trip, rounds that gradient to bf16 once more on the way back and measured
  up to 1.45x the single-process error on b2's gradient, 4 ranks).
- DeepEP's form: a token goes once to each rank that holds any of its experts, with its top-k ids there ``-1`` for
  the other ranks' slots; that rank runs ``ops.moe(..., expert_start=rank * E_local, num_experts=E)`` (the routing
  weights applied inside) and the source rank adds the partial sums it gets back.

The output and the gradients (x, the routing weights, every expert weight and bias, each rank's shard gathered) are
judged against the single-process ``ops.moe`` on the whole problem: the EP run's error against a float64
expert-by-expert reference at most 1.5x the single-process run's (the project's ratio rule). Families: SwiGLU
(separate weights) and gpt-oss (interleaved, transposed, both biases).
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed._functional_collectives import all_to_all_single_autograd

from prime_kernels_core.testing import assert_error_ratio, kernel_module
from prime_kernels_flash_moe import reference
from prime_kernels_flash_moe.layouts import ExpertLayout, join_pairs

KERNEL = "flash_moe"
ops = kernel_module(KERNEL, "prime_kernels_flash_moe.ops")
MAX_RATIO = 1.5
NUM_EXPERTS, TOP_K, TOKENS, DIM, HIDDEN = 8, 2, 96, 128, 64
ALIGN = 8  # torchtitan pads each local expert's rows to a multiple of the grouped GEMM's alignment
PAST_END = 5  # padding rows after the counted runs, which moe_sorted returns as zero
# (activation, layout, biases)
FAMILIES = {"swiglu": ("swiglu", ExpertLayout("separate"), False),
            "gpt_oss": ("gpt_oss", ExpertLayout("interleaved", transposed=True), True)}


def make_problem(family, seed=0):
    """The whole problem, identical on every rank: x, routing and every expert's tensors (bf16) in the family's layout.
    {name: tensor}; expert tensors have the expert dimension first."""
    activation, layout, biases = FAMILIES[family]
    g = torch.Generator().manual_seed(seed)
    gate, up = (torch.randn(NUM_EXPERTS, HIDDEN, DIM, generator=g) / DIM**0.5 for _ in range(2))
    down = torch.randn(NUM_EXPERTS, DIM, HIDDEN, generator=g) / HIDDEN**0.5
    if layout.gate_up == "separate":
        weights = {"w1": gate, "w3": up}
    else:
        weights = {"w1": join_pairs(gate, up, 1, layout.gate_up)}
    weights["w2"] = down
    if layout.transposed:
        weights = {n: w.transpose(1, 2).contiguous() for n, w in weights.items()}
    if biases:
        weights["b1"] = 0.5 * torch.randn(NUM_EXPERTS, 2 * HIDDEN, generator=g)
        weights["b2"] = 0.5 * torch.randn(NUM_EXPERTS, DIM, generator=g)
    ids = torch.stack([torch.randperm(NUM_EXPERTS, generator=g)[:TOP_K] for _ in range(TOKENS)])
    problem = {"x": torch.randn(TOKENS, DIM, generator=g), **weights,
               "topk_weights": torch.rand(TOKENS, TOP_K, generator=g).softmax(-1)}
    problem = {n: t.to(torch.bfloat16) if n != "topk_weights" else t for n, t in problem.items()}
    problem["ids"] = ids
    problem["grad_out"] = torch.randn(TOKENS, DIM, generator=g).to(torch.bfloat16)
    return problem


def family_kwargs(family, tensors):
    activation, layout, _ = FAMILIES[family]
    return dict(activation=activation, layout=layout, b1=tensors.get("b1"), b2=tensors.get("b2"))


EXPERT_TENSORS = ("w1", "w2", "w3", "b1", "b2")


def leaves(tensors, dtype=None):
    """Fresh leaves (optionally cast) of the differentiable tensors: x, topk_weights and the expert tensors."""
    return {n: t.detach().to(dtype or t.dtype).requires_grad_() for n, t in tensors.items()
            if n in ("x", "topk_weights", *EXPERT_TENSORS)}


def whole_problem(family, problem, fn, dtype=None):
    """(output, {name: gradient}) of one process computing the whole problem with ``fn`` (moe's signature)."""
    ls = leaves(problem, dtype)
    out = fn(ls["x"], ls["w1"], ls["w2"], ls.get("w3"), problem["ids"], ls["topk_weights"],
             **family_kwargs(family, ls))
    out.backward(problem["grad_out"].to(out.dtype))
    return out.detach(), {n: t.grad for n, t in ls.items()}


def expert_parallel_torchtitan(family, shard, group, rank, world):
    """This rank's output rows through torchtitan's all-to-all dispatch / moe_sorted / combine."""
    experts_local = NUM_EXPERTS // world
    ids = shard["ids"]
    slot_expert = ids.reshape(-1)
    order = torch.argsort(slot_expert, stable=True)  # slots grouped by global expert: by rank, then local expert
    counts = torch.bincount(slot_expert, minlength=NUM_EXPERTS)
    counts_in = torch.empty_like(counts)
    dist.all_to_all_single(counts_in, counts, group=group)  # [source rank][local expert]
    send_splits = counts.view(world, experts_local).sum(1).tolist()
    recv_splits = counts_in.view(world, experts_local).sum(1).tolist()
    routed = shard["x"][order // TOP_K]
    received = all_to_all_single_autograd(routed, recv_splits, send_splits, group)
    scores = all_to_all_single_autograd(shard["topk_weights"].reshape(-1)[order], recv_splits, send_splits, group)

    # source-rank-major -> local-expert-major, each expert's run padded to ALIGN rows, then PAST_END more rows;
    # index len(received) is the zero row the padding reads
    per_source = counts_in.view(world, experts_local)
    starts = (torch.cumsum(counts_in, 0) - counts_in).view(world, experts_local)
    rows, padded_counts = [], []
    for e in range(experts_local):
        run = [torch.arange(starts[s, e], starts[s, e] + per_source[s, e]) for s in range(world)]
        run = torch.cat(run)
        padded = -(-run.numel() // ALIGN) * ALIGN
        rows.append(torch.cat([run, torch.full((padded - run.numel(),), received.shape[0])]))
        padded_counts.append(padded)
    rows.append(torch.full((PAST_END,), received.shape[0]))
    permuted = torch.cat(rows)
    x_sorted = torch.cat([received, received.new_zeros(1, DIM)])[permuted]
    row_weights = torch.cat([scores, scores.new_zeros(1)])[permuted]
    y = ops.moe_sorted(x_sorted, shard["w1"], shard["w2"], shard.get("w3"), torch.tensor(padded_counts),
                       row_weights=row_weights, **family_kwargs(family, shard))
    assert torch.equal(y[-PAST_END:], torch.zeros_like(y[-PAST_END:])), "rows past the runs must come back zero"
    real = permuted < received.shape[0]
    unpermuted = y.new_zeros(received.shape).index_copy(0, permuted[real], y[real])
    returned = all_to_all_single_autograd(unpermuted, send_splits, recv_splits, group)
    return torch.zeros(ids.shape[0], DIM).index_add(0, order // TOP_K, returned.float()).to(torch.bfloat16)


def expert_parallel_deepep(family, shard, group, rank, world):
    """This rank's output rows through DeepEP's form: each token sent once per destination rank holding any of its
    experts, top-k ids -1 for the other ranks' slots, moe() with expert_start, partial sums added back."""
    experts_local = NUM_EXPERTS // world
    ids = shard["ids"]
    destination = ids // experts_local
    tokens = [torch.nonzero((destination == d).any(1)).squeeze(1) for d in range(world)]
    send_splits = [t.numel() for t in tokens]
    counts_in = torch.empty(world, dtype=torch.int64)
    dist.all_to_all_single(counts_in, torch.tensor(send_splits), group=group)
    recv_splits = counts_in.tolist()
    sent = torch.cat(tokens)
    ids_there = torch.cat([torch.where(destination[t] == d, ids[t], -1) for d, t in enumerate(tokens)])
    ids_received = torch.empty(sum(recv_splits), TOP_K, dtype=ids.dtype)
    dist.all_to_all_single(ids_received, ids_there, recv_splits, send_splits, group=group)
    x_received = all_to_all_single_autograd(shard["x"][sent], recv_splits, send_splits, group)
    w_received = all_to_all_single_autograd(shard["topk_weights"][sent], recv_splits, send_splits, group)
    partial = ops.moe(x_received, shard["w1"], shard["w2"], shard.get("w3"), ids_received, w_received,
                      expert_start=rank * experts_local, num_experts=NUM_EXPERTS, **family_kwargs(family, shard))
    returned = all_to_all_single_autograd(partial, send_splits, recv_splits, group)
    return torch.zeros(ids.shape[0], DIM).index_add(0, sent, returned.float()).to(torch.bfloat16)


FORMS = {"torchtitan": expert_parallel_torchtitan, "deepep": expert_parallel_deepep}


def gathered(t, group, world):
    """This rank's shard of ``t`` (first dimension) concatenated over ranks."""
    parts = [torch.empty_like(t) for _ in range(world)]
    dist.all_gather(parts, t.contiguous(), group=group)
    return torch.cat(parts)


def run_form(form, family, problem, group, rank, world):
    """(output, {name: gradient}) of the whole problem computed by ``world`` ranks in ``form``, gathered."""
    tokens, experts = TOKENS // world, NUM_EXPERTS // world
    rows, expert_rows = slice(rank * tokens, (rank + 1) * tokens), slice(rank * experts, (rank + 1) * experts)
    shard = {n: t[expert_rows] if n in EXPERT_TENSORS else t[rows] for n, t in problem.items()}
    ls = leaves(shard)
    out = FORMS[form](family, {**shard, **ls}, group, rank, world)
    out.backward(shard["grad_out"])
    return gathered(out.detach(), group, world), {n: gathered(t.grad, group, world) for n, t in ls.items()}


def check_rank(rank, world, init_file):
    torch.set_num_threads(1)  # the ranks share the machine's cores
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        group = dist.group.WORLD
        for family in FAMILIES:
            problem = make_problem(family, seed=world)
            results = {form: run_form(form, family, problem, group, rank, world) for form in FORMS}
            if rank != 0:
                continue
            single = whole_problem(family, problem, ops.moe)
            ref = whole_problem(family, problem, reference.moe_per_expert, torch.float64)
            for form, (out, grads) in results.items():
                label = f"{world} ranks {form} {family}"
                assert_error_ratio(f"{label} output", out, single[0], ref[0], MAX_RATIO)
                assert grads.keys() == single[1].keys()
                for name, grad in grads.items():
                    assert grad.dtype == problem[name].dtype and grad.shape == problem[name].shape, name
                    assert_error_ratio(f"{label} grad {name}", grad, single[1][name], ref[1][name], MAX_RATIO)
    finally:
        dist.destroy_process_group()


@pytest.mark.kernel(KERNEL, device="cpu")
@pytest.mark.parametrize("world", [2, 4])
def test_cpu_expert_parallel_gloo(world, tmp_path):
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available in this torch build")
    mp.spawn(check_rank, args=(world, str(tmp_path / "init")), nprocs=world, join=True)
