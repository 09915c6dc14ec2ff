"""The verify's plans (tp_replayssm/kernels/verify_plan.py) and launch arguments, without running a kernel: the
tensor-core form's choice, value tiles, plan edits, fold form and register caps on an H200's problems; every plan field
reaching the kernel; the packed cache row views and the index dtype they allow; the operands that carry the forward
substitution (float64 algebra).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tp_replayssm.kernels import verify_plan


def test_packed_row_views_address_the_cache_and_count_its_extent() -> None:
    """``kernels.args.rows_view(t, packed=True)``: where the outer strides are multiples of the last dim (the pool's
    caches) a ``[rows, last]`` view with strides ``(last, 1)``, the outer strides in rows and the tensor's extent as its
    element count; row ``i*s0 + j*s1 + l*s2`` is ``t[i, j, l]`` in both forms; a padded cache (strides not multiples)
    keeps the overlapping ``(1, 1)`` view."""
    from tp_replayssm.kernels.args import rows_view

    cache = torch.randn(3, 2, 5, 8)
    padded = torch.randn(3, 2, 5, 11)[..., :8]
    for t, unit in ((cache, 8), (padded, 1)):
        view, (s0, s1, s2) = rows_view(t, packed=True)
        assert view.stride() == (unit, 1) and view.shape[1] == 8
        for i, j, l in ((0, 0, 0), (1, 1, 3), (2, 1, 4)):
            assert torch.equal(view[i * s0 + j * s1 + l * s2], t[i, j, l])
        assert rows_view(t)[0].stride() == (1, 1)  # the decode kernel's form is unchanged
    assert rows_view(cache, packed=True)[0].numel() == cache.numel()
    assert rows_view(cache)[0].numel() == 8 * (cache.numel() - 7)


def _bound_index_dtype(num_slots: int) -> torch.dtype:
    """The index dtype Helion binds the verify kernel with for a pool of ``num_slots`` slots (HV = 1, K = V = 128,
    fp32 checkpoint, B = 2; ``benchmarks/spec_regs.verify_example``'s call, nothing runs); the plan is the
    tensor-core form's."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    from spec_regs import verify_example

    kernel, args, plan = verify_example(2, 1, "fp32", "predecayed", False, 2, None, num_slots=num_slots)
    assert plan.tensor_cores, str(plan)
    return kernel.bind(args).env.index_dtype


@pytest.mark.filterwarnings("ignore:Accessing the data pointer of FakeTensor")
def test_verify_offsets_are_int32_where_every_argument_fits() -> None:
    """The tensor-core verify kernel indexes in int32 where every argument has fewer than 2^31 elements and in int64
    past that (fake tensors: nothing is allocated). 40000 slots fit (655M checkpoint elements) only because the packed
    row views count the caches' extent: the overlapping views would count 128 times that, 84G; a checkpoint of 2^31 +
    2^20 elements does not."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        assert _bound_index_dtype(40000) == torch.int32
        assert _bound_index_dtype(2**31 // (128 * 128) + 64) == torch.int64


# a verify problem on the H200 (132 SMs): HV32, K = V = 128, L = 16, T = 4, a chain, bf16 checkpoint and activations
H200_HV32 = dict(batch=1, drafts=4, num_q_heads=32, num_v_heads=32, key_dim=128, value_dim=128, ring_length=16,
                 state_dtype=torch.bfloat16, cache_dtype=torch.bfloat16, device_type="cuda", sm_count=132,
                 ring_layout="predecayed", tree=False, use_l2norm=True, use_lower_bound=False, gate_bounded=False,
                 activation_dtype=torch.bfloat16)


def test_tensor_core_value_tiles_by_waves() -> None:
    """The tensor-core form's value tile on a 132-SM GPU (2 programs per SM): the narrowest of 32 / 64 rows whose grid
    fits one wave (264 programs); with a bf16 checkpoint, failing that, two waves (528); else all of V. HV32 at
    B = 1 / 4 / 8 / 32: 32 / 64 / 64 / 128 rows with a bf16 checkpoint, 32 / 64 / 128 / 128 with fp32."""
    base = dict(H200_HV32)
    for state, tiles in ((torch.bfloat16, (32, 64, 64, 128)), (torch.float32, (32, 64, 128, 128))):
        got = [verify_plan.plan_verify(verify_plan.VerifyProblem(**{**base, "batch": b, "state_dtype": state}))
               for b in (1, 4, 8, 32)]
        assert [p.value_tile for p in got] == list(tiles), (state, [str(p) for p in got])
        assert [p.tile_readers for p in got] == [128 // t for t in tiles]
    small_gpu = verify_plan.VerifyProblem(**{**base, "batch": 8, "sm_count": 66})  # 132 / 264 programs a wave
    assert verify_plan.plan_verify(small_gpu).value_tile == 128


def test_every_plan_field_reaches_the_kernel() -> None:
    """A field of ``VerifyPlan`` is part of the launch's config (tile, warps, register cap), the form's choice
    (``tensor_cores``) or a constexpr of the tensor-core kernel; every constexpr of either form is a parameter of its
    kernel (the argument builder passes only the kernel's parameters: anything else would be dropped silently)."""
    import inspect

    from tp_replayssm.kernels import verify, verify_mma

    problem = verify_plan.VerifyProblem(**{**H200_HV32, "batch": 8, "num_q_heads": 2, "num_v_heads": 2})
    mma, cores = verify_plan.plan_verify(problem), verify_plan.plan_verify(problem, tensor_cores=False)
    assert mma.tensor_cores and not cores.tensor_cores
    fields = {f.name for f in dataclasses.fields(verify_plan.VerifyPlan)}
    derived = {"fold_chunk", "columns"}  # a module constant, and a property of the plan's draft block
    assert fields - {"value_tile", "num_warps", "maxnreg", "tensor_cores"} == set(mma.constexprs()) - derived
    for plan, kernel in ((mma, verify_mma.replayssm_verify_mma_kernel), (cores, verify.replayssm_verify_kernel)):
        params = set(inspect.signature(kernel).parameters)
        assert set(plan.constexprs()) <= params, sorted(set(plan.constexprs()) - params)


def test_plan_choices_belong_to_the_tensor_core_form() -> None:
    """``VerifyPlan.batched_reductions``, ``chunk_prefetch``, ``fold_in_chunks`` and ``maxnreg``: the library's values
    in its plans (the first two on in the tensor-core form; off, on, off and None in the CUDA-core form), constexprs of
    the tensor-core kernel when changed (the cap a launch option), refused (naming the field) on a CUDA-core plan; a
    cap outside ptxas's [24, 255] refused."""
    base = {**H200_HV32, "batch": 8, "num_q_heads": 2, "num_v_heads": 2}
    problem = verify_plan.VerifyProblem(**base)
    plan = verify_plan.plan_verify(problem)
    assert plan.tensor_cores and plan.batched_reductions and plan.constexprs()["batched_reductions"] is True
    separate = dataclasses.replace(plan, batched_reductions=False, merged_sums=False)
    separate.check(problem)
    assert separate.constexprs()["batched_reductions"] is False and "batched_reductions=False" in str(separate)
    assert plan.chunk_prefetch and dataclasses.replace(plan, chunk_prefetch=False).constexprs()["chunk_prefetch"] is False
    cuda_cores = verify_plan.plan_verify(problem, tensor_cores=False)
    assert not cuda_cores.batched_reductions and cuda_cores.chunk_prefetch
    for change in (dict(batched_reductions=True), dict(chunk_prefetch=False), dict(fold_in_chunks=True),
                   dict(maxnreg=128), dict(early_params=True), dict(merged_sums=True)):
        with pytest.raises(ValueError, match=f"`{next(iter(change))}`"):
            dataclasses.replace(cuda_cores, **change).check(problem)
    assert not cuda_cores.fold_in_chunks and "fold_in_chunks" not in cuda_cores.constexprs()
    assert not plan.early_params and dataclasses.replace(plan, early_params=True).constexprs()["early_params"] is True
    assert plan.merged_sums and plan.constexprs()["merged_sums"] is True and not cuda_cores.merged_sums
    assert dataclasses.replace(plan, merged_sums=False).constexprs()["merged_sums"] is False
    with pytest.raises(ValueError, match="`merged_sums` is a form of the batched reductions"):
        dataclasses.replace(plan, batched_reductions=False).check(problem)
    for cap in (0, 23, 256):  # a cap ptxas cannot take
        with pytest.raises(ValueError, match=f"`maxnreg` must be None or in \\[24, 255\\]; got {cap}"):
            dataclasses.replace(plan, maxnreg=cap).check(problem)


def test_fold_in_chunks_and_register_cap_rule() -> None:
    """``VerifyPlan.fold_in_chunks`` (a fold's checkpoint rows stored from the chunk loop) and ``maxnreg`` on a
    132-SM GPU, HV32, B = 1 / 8 / 32 / 128: with a bf16 checkpoint the chunk-loop fold and a 128-register cap
    everywhere; with fp32 the chunk-loop fold where one value tile covers V (not B = 1's 32-row tiles) and a
    168-register cap past four waves of two programs per SM (B = 128: 4096 programs; not B = 32's 1024). The CUDA-core
    form and the interpreter (no registers) have no cap; the fold form is a constexpr of the tensor-core kernel."""
    base = dict(H200_HV32)
    for state, folds, caps in ((torch.bfloat16, [True] * 4, [128] * 4),
                               (torch.float32, [False, True, True, True], [None, None, None, 168])):
        plans = [verify_plan.plan_verify(verify_plan.VerifyProblem(**{**base, "batch": b, "state_dtype": state}))
                 for b in (1, 8, 32, 128)]
        assert [p.fold_in_chunks for p in plans] == folds, (state, [str(p) for p in plans])
        assert [p.constexprs()["fold_in_chunks"] for p in plans] == folds
        assert [p.maxnreg for p in plans] == caps, (state, [str(p) for p in plans])
        assert all(f"maxnreg={c}" in str(p) for p, c in zip(plans, caps))
    problem = verify_plan.VerifyProblem(**{**base, "batch": 32})
    assert verify_plan.plan_verify(problem, tensor_cores=False).maxnreg is None
    assert verify_plan.plan_verify(dataclasses.replace(problem, device_type="cpu")).maxnreg is None


@pytest.mark.parametrize("T", [1, 2, 5, 15])
def test_substitution_folded_into_operands_matches_the_chunk_form(T: int) -> None:
    """``[Delta; Out] = A^T S^T + E^T V`` with the operands of ``verify_math.combination`` / ``output_columns`` /
    ``value_matrix`` equals ``solve_chunk``'s forward substitution on the products, in float64, for random couplings
    of a tree (the couplings of non-ancestors are zero) and random values."""
    from tp_replayssm.kernels import verify_math as vm

    gen = torch.Generator().manual_seed(T)
    K, Vc, N = 9, 7, max(16, 1 << (2 * T - 1).bit_length())
    dt = torch.float64
    parents = [-1] + [int(torch.randint(-1, t, (), generator=gen)) for t in range(1, T)]
    anc = vm.ancestry([torch.tensor(p) for p in parents], T)
    nk = [[anc[t][u] * torch.randn((), generator=gen, dtype=dt) for u in range(t)] for t in range(T)]
    mq = [[anc[t][u] * torch.randn((), generator=gen, dtype=dt) for u in range(t)]
          + [torch.randn((), generator=gen, dtype=dt)] for t in range(T)]
    betas = [torch.rand((), generator=gen, dtype=dt) for _ in range(T)]
    S = torch.randn(Vc, K, generator=gen, dtype=dt)
    aks = [torch.randn(1, K, generator=gen, dtype=dt) for _ in range(T)]
    aqs = [torch.randn(1, K, generator=gen, dtype=dt) for _ in range(T)]
    V = torch.zeros(N, Vc, dtype=dt)
    V[:T] = torch.randn(T, Vc, generator=gen, dtype=dt)
    deltas, outs = vm.solve_chunk([S @ a[0] for a in aks], [S @ a[0] for a in aqs], list(V[:T]), betas, nk, mq, T)
    alpha, gamma = vm.combination(betas, nk, mq, T)
    cols_d, cols_o = vm.output_columns(aks, aqs, alpha, gamma, T)
    n = torch.arange(N)
    At = vm.column_matrix(cols_d, cols_o, n[:, None], T)  # [N, K]
    Et = vm.value_matrix(alpha, gamma, n[None, :], n[:, None], T)  # [N, N]
    res = At @ S.T + Et @ V
    torch.testing.assert_close(res[:T], torch.stack(deltas), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(res[T:2 * T], torch.stack(outs), rtol=1e-12, atol=1e-12)
    assert (res[2 * T:] == 0).all()


def test_plan_chooses_the_tensor_core_form_where_it_runs() -> None:
    """A bf16 or fp32 checkpoint on pre-decayed bf16 rings, power-of-two widths and at most 15 drafts takes the
    tensor-core form (the CUDA-core one on request); the sglang layout, fp32 rings and 16 drafts the CUDA-core one,
    with the reason; a plan that cannot run a call is refused; equal problems get the same plan object."""
    base = {**H200_HV32, "batch": 32}
    plan = verify_plan.plan_verify(verify_plan.VerifyProblem(**base))
    assert verify_plan.plan_verify(verify_plan.VerifyProblem(**base)) is plan  # planned once per problem (host time)
    assert plan.tensor_cores and plan.num_warps == 4 and plan.value_chunk == 32 and plan.columns == 16
    assert plan.operand_parts == 2 and plan.constexprs()["fold_chunk"] == 16
    one_row = verify_plan.plan_verify(verify_plan.VerifyProblem(**{**base, "batch": 1}))
    assert one_row.value_tile == 32 and one_row.value_chunk == 32 and one_row.tile_readers == 4
    assert "columns" in plan.constexprs() and "doubling_steps" not in plan.constexprs()
    for change, why in ((dict(ring_layout="sglang"), "layout"), (dict(cache_dtype=torch.float32), "bf16"),
                        (dict(drafts=16, ring_length=20), "drafts"), (dict(key_dim=96), "key_dim")):
        problem = verify_plan.VerifyProblem(**{**base, **change})
        assert why in verify_plan.tensor_core_refusal(problem)
        other = verify_plan.plan_verify(problem)
        assert not other.tensor_cores
        import dataclasses

        with pytest.raises(ValueError, match="tensor_cores"):
            dataclasses.replace(other, tensor_cores=True, value_chunk=16, num_warps=1).check(problem)
        with pytest.raises(ValueError, match="tensor-core form cannot run"):
            verify_plan.plan_verify(problem, tensor_cores=True)
    assert not verify_plan.plan_verify(verify_plan.VerifyProblem(**base), tensor_cores=False).tensor_cores
    fp32 = verify_plan.VerifyProblem(**{**base, "state_dtype": torch.float32})
    assert verify_plan.plan_verify(fp32).tensor_cores and verify_plan.plan_verify(fp32).operand_parts == 2
    fp32_out = verify_plan.VerifyProblem(**{**base, "state_dtype": torch.float32, "activation_dtype": torch.float32})
    assert verify_plan.plan_verify(fp32_out).operand_parts == 3  # fp32-accurate products for fp32 outputs
    bf16_fp32_out = verify_plan.VerifyProblem(**{**base, "activation_dtype": torch.float32})
    assert verify_plan.plan_verify(bf16_fp32_out).operand_parts == 2
    assert not verify_plan.plan_verify(fp32, tensor_cores=False).tensor_cores
    assert verify_plan.plan_verify(verify_plan.VerifyProblem(**{**base, "drafts": 9})).columns == 32
