"""The Helion decode op (run by the Triton interpreter on CPU: the ``interpreter`` fixture) against the PyTorch
reference and the float64 plain recurrence, over several ring cycles, one run per kernel path in both ring layouts;
the reference itself against the float64 recurrence. Kernel paths the library would not choose for these tiny shapes
run with an edited launch plan (``_decode_scenario.planned_op``), and each such test checks that the plan reached the
kernel.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tp_replayssm import ops, reference
from tp_replayssm.kernels import args as kernel_args
from tp_replayssm.kernels.plan import DecodePlan
from _decode_scenario import OUT_TOL, Scenario, planned_op, record_kernel_args, run_scenario
from _op_helpers import BF16_OPERANDS, CASES, PREDECAYED_CASES, _check_rebases, _with_tensor_core_chunks


@pytest.mark.parametrize("name", list(CASES))
def test_kernel_matches_reference_and_plain_recurrence(name: str, interpreter: None) -> None:
    sc = CASES[name]
    worst = run_scenario(sc, ops.replayssm_decode)
    assert worst.flushes > 0 and (sc.L == 1 or worst.appends > 0)
    assert worst.out_vs_reference <= OUT_TOL[sc.act_dtype], worst
    # vs float64 without a ring: only the cache/state/activation roundings separate them
    bf16_somewhere = torch.bfloat16 in (sc.act_dtype, sc.state_dtype, sc.cache_dtype)
    limit = 3e-2 if bf16_somewhere else (3e-3 if sc.act_dtype == torch.float16 else 1e-4)
    assert worst.out_vs_plain64 <= limit, worst
    state_limit = 3e-2 if (sc.state_dtype == torch.bfloat16 or sc.cache_dtype == torch.bfloat16) else 1e-4
    assert worst.state_vs_plain64 <= state_limit, worst


# the kernel-path cases, both ring layouts
PATH_CASES = {**{n: CASES[n] for n in ("gqa-bf16ring-fp32state", "strided-layer-view-2-vtiles")},
              **{f"predecayed-{n}": sc for n, sc in PREDECAYED_CASES.items()}}
# (case, tiny-batch path, vector tiles): one run per kernel path, not the product of the three.
# - The library plan of each case (no vector tiles; the batch path but for strided's) in each layout, gate and ring
#   dtype; the sglang cases' own plans already run in test_kernel_matches_reference_and_plain_recurrence.
# - sglang: the vector tiles with either flush (bf16 ring: tensor cores; fp32: rank-1 replay); the tiny path's reverse
#   scan feeding the tensor-core flush (gqa), and both scans held to 1e-4 in the all-fp32 strided case.
# - pre-decayed: the vector and key tiles where heads rebase (the flush branch zeroes the deltas through the tiles'
#   ring rows); the key tiles with either flush (the tensor-core one reloads the keys as [Lb, K], the rank-1 replay
#   reads them per entry); the tiny path (whole-ring loads, and the key tiles' masking) once, in the cheapest case:
#   it is the same code in every mode and ring dtype.
# - The sglang layout's kernel reads no key tiles (2 runs as 1).
PATHS = [
    ("gqa-bf16ring-fp32state", False, 1), ("gqa-bf16ring-fp32state", True, 0),
    ("strided-layer-view-2-vtiles", False, 0), ("strided-layer-view-2-vtiles", False, 1),
    ("predecayed-gqa-bf16ring-fp32state", False, 0), ("predecayed-gqa-bf16ring-fp32state", True, 0),
    ("predecayed-gqa-bf16ring-fp32state", True, 2), ("predecayed-fp32-widest-bound", False, 0),
    ("predecayed-gqa-rebasing-softplus", False, 0), ("predecayed-gqa-rebasing-softplus", False, 1),
    ("predecayed-gqa-rebasing-softplus", False, 2), ("predecayed-fp32-rebasing-softplus", False, 0),
    ("predecayed-fp32-rebasing-softplus", False, 2),
]


@pytest.mark.parametrize("name,tiny,tiles", PATHS,
                         ids=[f"{n}-{'tiny-batch-path' if t else 'batch-path'}-{('row', 'vector', 'key')[v]}-tiles"
                              for n, t, v in PATHS])
def test_both_kernel_paths_match_reference_and_ignore_dead_entries(name: str, tiny: bool, tiles: int,
                                                                   monkeypatch: pytest.MonkeyPatch,
                                                                   interpreter: None) -> None:
    """The kernel's two constexpr paths (``DecodePlan.tiny_batch``): live-entry ring loads with the forward-scan
    suffix sums, and whole-ring loads (before the cursor is known) with the reverse scan. Ring entries
    past each cursor are NaN in the scenario, so a missing mask shows up as non-finite output; the
    all-fp32 cases hold both suffix-sum forms to 1e-4 of the float64 recurrence. In both ring layouts:
    ``ring_layout="predecayed"`` (cumulative gates, keys ``k * exp(-G)`` per value head) against its
    reference and the float64 recurrence read back through ``replay_predecayed_ring``; row 0 of an empty
    ring, which that kernel loads for ``G_{c-1}``, is NaN too and must be masked. The rebasing cases (softplus
    gates strong enough that ``G`` passes -75 inside a ring cycle) zero a head's deltas, so its older keys, up
    to exp(75), must contribute exactly 0. Each with the append loop's ``[Vc, K]`` checkpoint tiles and its vector
    tiles (``DecodePlan.vector_tiles`` 1: ``[Ko, Vc, Ki, kv]`` tiles, the ring entries written before the loop), and
    in the pre-decayed layout with its key tiles too (2: ``wk``, ``wq`` from ``[Ko, Lb, Ki, kv]`` tiles of the keys,
    the flush's keys loaded in the flush branch)."""
    sc = PATH_CASES[name]
    seen = record_kernel_args(monkeypatch, "tiny_batch", "vector_tiles")
    worst = run_scenario(sc, planned_op(tiny_batch=tiny, vector_tiles=tiles))
    assert set(seen) == {(tiny, tiles)}, seen  # the edited plan reached the kernel
    assert worst.flushes > 0 and worst.appends > 0
    _check_rebases(sc, worst.rebases)
    assert worst.out_vs_reference <= OUT_TOL[sc.act_dtype], worst
    limit = 3e-2 if sc.cache_dtype == torch.bfloat16 else 1e-4
    assert worst.out_vs_plain64 <= limit and worst.state_vs_plain64 <= limit, worst


@pytest.mark.parametrize("mma,tiles", [(False, 0), (False, 1), (True, 0)],
                         ids=["register-chunks", "register-chunks-vector-tiles", "tensor-core-chunks"])
def test_both_chunk_paths_match_reference(mma: bool, tiles: int, monkeypatch: pytest.MonkeyPatch,
                                          interpreter: None) -> None:
    """The kernel's every-step chunk paths (``DecodePlan.tensor_core_chunks``) on a bf16 checkpoint with bf16
    rings: row reductions in registers, or bf16 MMAs against the ``hi + mid + lo`` split of the fp32
    vectors. With fp32 activations ``out`` must match the reference to 2e-5: plain bf16 vectors fail that
    (checked by mutation; a two-part split passes at this size, the third part is margin that costs only
    prologue instructions). Ring entries past the cursor are NaN, so an unmasked MMA operand shows up as
    non-finite output."""
    seen = record_kernel_args(monkeypatch, "chunks_on_tensor_cores", "vector_tiles")
    worst = run_scenario(BF16_OPERANDS, planned_op(_with_tensor_core_chunks, tensor_core_chunks=mma,
                                                   vector_tiles=tiles))
    assert set(seen) == {(mma, tiles)}, seen
    assert worst.flushes > 0 and worst.appends > 0
    assert worst.out_vs_reference <= OUT_TOL[torch.float32], worst
    assert worst.out_vs_plain64 <= 3e-2 and worst.state_vs_plain64 <= 3e-2, worst


@pytest.mark.parametrize("tiles", [1, 2], ids=["vector-tiles-two-chunks", "key-tiles-one-chunk"])
def test_predecayed_vector_tiles_with_a_bf16_checkpoint(tiles: int, monkeypatch: pytest.MonkeyPatch,
                                                        interpreter: None) -> None:
    """The library's pre-decayed one-warp programs with a bf16 checkpoint take vector tiles over several chunks
    (``DecodePlan.vector_tiles`` 1: HV4 B128's 64:16:1) and key tiles over one (2: 16:16:1); key tiles only ever meet
    a bf16 checkpoint, whose 16-byte vectors split K into ``kv = 8`` elements (``Ko = 1`` at this K = 32, 4 at
    K = 128), not the fp32 cases' 4. Here: both, on the register chunks with bf16 rings and gates that rebase
    (through the flush branch, ``predecayed_ring`` 2, as uncapped programs do), against the reference and the
    float64 recurrence; ring entries past each cursor are NaN."""
    sc = dataclasses.replace(BF16_OPERANDS, L=8, steps=12, flush_prob=0.05, predecayed=True, A_log_shift=4.5)

    def register_chunks(plan: DecodePlan) -> DecodePlan:
        vt = plan.value_tile  # one chunk for the key tiles, as the library pairs them
        return dataclasses.replace(plan, tensor_core_chunks=False, value_chunk=vt if tiles == 2 else vt // 2,
                                   vector_tiles=tiles)

    seen = record_kernel_args(monkeypatch, "predecayed_ring", "vector_tiles", "k_vecs")
    worst = run_scenario(sc, planned_op(register_chunks))
    assert {(mode, forced) for mode, forced, _ in seen} == {(2, tiles)}, seen
    assert {k_vecs.shape[3] for _, _, k_vecs in seen} == {8}  # the bf16 checkpoint's 16-byte vectors
    assert worst.flushes > 0 and worst.appends > 0
    _check_rebases(sc, worst.rebases)
    assert worst.out_vs_reference <= OUT_TOL[torch.float32], worst
    assert worst.out_vs_plain64 <= 3e-2 and worst.state_vs_plain64 <= 3e-2, worst


@pytest.mark.parametrize("K,dtype,shape", [(128, torch.bfloat16, (4, 4, 8)), (128, torch.float32, (8, 4, 4)),
                                           (16, torch.bfloat16, (1, 2, 8)), (24, torch.float32, (3, 2, 4)),
                                           (20, torch.bfloat16, (5, 1, 4))])
def test_vector_tiles_view_holds_the_checkpoint_rows(K: int, dtype: torch.dtype, shape: tuple) -> None:
    """``kernels.args.vector_tiles_view``: ``[Ko, span, Ki, kv]`` with ``kv`` elements a 16-byte vector where K allows
    (else the largest divisor), ``Ki`` of them per thread (``VECTORS_PER_LANE``), and element ``[o, r, i, e]`` =
    row ``r`` of the rows view at column ``(o*Ki + i)*kv + e`` (checked against the padded, strided cache it views)."""
    cache = torch.randn(3, 2, 5, K + 3).to(dtype)[..., :K]  # padded rows: strides the kernel must follow
    rows, _ = kernel_args.rows_view(cache)
    tiles = kernel_args.vector_tiles_view(rows, K, cache.element_size())
    ko, ki, kv = shape
    assert (tiles.shape[0], tiles.shape[2], tiles.shape[3]) == shape and tiles.shape[1] == rows.shape[0]
    cols = torch.arange(K).reshape(ko, ki, kv)
    for r in (0, 7, rows.shape[0] - 1):
        for o in range(ko):
            assert torch.equal(tiles[o, r], rows[r, cols[o]]), (r, o)


def test_reference_matches_plain_recurrence_tightly_in_fp32() -> None:
    sc = Scenario(act_dtype=torch.float32, cache_dtype=torch.float32, steps=10, flush_prob=0.3)
    worst = run_scenario(sc, reference.replayssm_decode)
    assert worst.out_vs_plain64 < 1e-5 and worst.state_vs_plain64 < 1e-5, worst
