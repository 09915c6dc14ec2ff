"""The Helion decode op (run by the Triton interpreter on CPU: the ``interpreter`` fixture) against the PyTorch
reference and the float64 plain recurrence, over several ring cycles; the reference itself; and the input
validation of both. Kernel paths the library would not choose for these tiny shapes run with an edited launch plan
(``_decode_scenario.planned_op``), and each such test checks that the plan reached the kernel."""

from __future__ import annotations

import dataclasses
import functools
import os
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from tp_replayssm import ops, reference, validation
from tp_replayssm.kernels import args as kernel_args
from tp_replayssm.kernels.decode import replayssm_decode_kernel
from tp_replayssm.kernels.launch import run_decode
from tp_replayssm.kernels.plan import DecodePlan
from tp_replayssm.validation import DecodeCall, DecodeDims
from _decode_scenario import OUT_TOL, SENTINEL, Scenario, planned_op, record_kernel_args, run_scenario

REPO = Path(__file__).resolve().parents[1]

CASES = {
    # GQA r=2, bf16 activations and rings, fp32 checkpoint, l2norm, softplus gate
    "gqa-bf16ring-fp32state": Scenario(),
    # H = HV, bf16 checkpoint, fp32 rings, fp16 activations, no l2norm, bounded gate, L=3
    "bf16state-fp32ring-bounded": Scenario(H=4, HV=4, L=3, act_dtype=torch.float16, state_dtype=torch.bfloat16,
                                            cache_dtype=torch.float32, l2norm=False, lower_bound=-5.0, steps=7),
    # L = 1: every step flushes
    "ring-length-1": Scenario(L=1, act_dtype=torch.float32, cache_dtype=torch.float32, steps=3, B=3),
    # layer slice of a [2, S, ...] pool (strided views), two value tiles (V=64), a [B,HV,K], dt_bias [HV,K]
    "strided-layer-view-2-vtiles": Scenario(V=64, layer_view=True, a_3d=True, act_dtype=torch.float32,
                                            cache_dtype=torch.float32, steps=6, B=3, HV=2, H=1),
}


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


PREDECAYED_CASES = {
    # GQA r=2 (keys per value head), bf16 rings and activations, fp32 checkpoint, l2norm
    "gqa-bf16ring-fp32state": Scenario(lower_bound=-5.0, predecayed=True),
    # all fp32 (the rank-1 replay flush of non-bf16 rings), no l2norm, L=5 at the widest bound without a
    # rebase: (L-1) * 18.75 = 75, keys up to exp(75)
    "fp32-widest-bound": Scenario(H=4, HV=4, L=5, act_dtype=torch.float32, cache_dtype=torch.float32, l2norm=False,
                                  lower_bound=-18.75, predecayed=True, steps=8, flush_prob=0.1),
    # softplus gates ~exp(4.5) times the usual: cumulative gates pass -75 within the ring and heads rebase
    "gqa-rebasing-softplus": Scenario(L=8, steps=12, predecayed=True, A_log_shift=4.5, flush_prob=0.05),
    # all fp32, the rank-1 flush, a rebase now and then among appends (held to 1e-4 of float64)
    "fp32-rebasing-softplus": Scenario(H=4, HV=4, L=8, act_dtype=torch.float32, cache_dtype=torch.float32,
                                       predecayed=True, A_log_shift=3.0, steps=12, flush_prob=0.05, seed=1),
}


def _check_rebases(sc: Scenario, rebases: int) -> None:
    """A pre-decayed case with ``A_log_shift`` must rebase (else it tests nothing new); one whose bound allows
    no rebase, ``(L-1) * |lower_bound| <= 75``, must not."""
    if sc.A_log_shift:
        assert rebases > 0, "the rebasing case never rebased"
    elif sc.predecayed and sc.lower_bound is not None and (sc.L - 1) * abs(sc.lower_bound) <= 75:
        assert rebases == 0, f"{rebases} rebases under a bound that allows none"


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


# bf16 checkpoint and rings (the interpreter's plan takes the tensor-core chunks), fp32 activations: out held to
# fp32 accuracy
BF16_OPERANDS = Scenario(act_dtype=torch.float32, state_dtype=torch.bfloat16)


def _with_tensor_core_chunks(plan: DecodePlan) -> DecodePlan:
    assert plan.tensor_core_chunks  # the interpreter's plan takes the MMAs whenever both operands are bf16
    return plan


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


# ---------------------------------------------------------------- CPU tensors: the torch path, or the interpreter


@pytest.mark.parametrize("ring_layout", ["sglang", "predecayed"])
def test_op_on_cpu_tensors_takes_the_torch_path_by_default(ring_layout: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Without the interpreter backend the op on CPU tensors runs the PyTorch path: bit for bit the reference
    (outputs and every cache; a flush row, an append row, a padding row with a forced flush), and no kernel
    launch."""
    from tp_replayssm.kernels import launch

    monkeypatch.setattr(launch, "launch_decode", lambda *a: pytest.fail("the kernel launched on the torch path"))
    overrides = dict(force_flush=torch.tensor([0, 0, 1], dtype=torch.int32),
                     write_pos=torch.tensor([L - 1, 1, 0], dtype=torch.int32), lower_bound=-5.0)
    if ring_layout == "predecayed":
        overrides["k_cache"] = torch.randn(S, HV, L, K, dtype=torch.bfloat16)
    t = _tensors(**overrides)
    mine = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in t.items()}
    result = ops.replayssm_decode(**mine, ring_layout=ring_layout)
    reference.replayssm_decode(**t, ring_layout=ring_layout)
    assert result[0] is mine["out"] and result[1] is mine["initial_state"]
    for k in ("out", "initial_state", "d_cache", "k_cache", "g_cache"):
        assert torch.equal(mine[k].view(torch.uint8), t[k].view(torch.uint8)), k
    assert (mine["out"][2] == 0).all()  # the padding row


_NO_INTERPRETER_SCRIPT = """
import torch
import triton  # imported without TRITON_INTERPRET
from tp_replayssm import ops
from tp_replayssm.kernels.backend import use_cpu_backend
B, H, HV, K, V, L, S = 2, 1, 2, 16, 16, 3, 3
t = dict(mixed_qkv=torch.randn(B, 2 * H * K + HV * V), a=torch.randn(B, HV * K), b=torch.randn(B, HV),
         A_log=torch.randn(HV), dt_bias=torch.randn(HV * K), scale=None, initial_state=torch.randn(S, HV, V, K),
         d_cache=torch.randn(S, HV, L, V), k_cache=torch.randn(S, H, L, K), g_cache=torch.randn(S, HV, L, K),
         out=torch.full((B, 1, HV, V), 7.0), ssm_state_indices=torch.tensor([0, 2], dtype=torch.int32),
         write_pos=torch.tensor([L - 1, 0], dtype=torch.int32))
before = {k: v.clone() for k, v in t.items() if isinstance(v, torch.Tensor)}
try:
    with use_cpu_backend("interpreter"):
        ops.replayssm_decode(**t)
except ValueError as e:
    unwritten = all(torch.equal(t[k], v) for k, v in before.items())
    print("RESULT", "unwritten" if unwritten else "written", e)
else:
    print("RESULT no error")
"""


@pytest.mark.timeout(120)
def test_interpreter_backend_without_triton_interpret_is_refused() -> None:
    """The interpreter backend needs ``TRITON_INTERPRET=1`` set before triton's import: in a process started without
    it, asking for the interpreter raises a ``ValueError`` naming the variable, before anything is written."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("TRITON_INTERPRET", "HELION_INTERPRET", "TP_REPLAYSSM_CPU_BACKEND")}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    proc = subprocess.run([sys.executable, "-c", _NO_INTERPRETER_SCRIPT], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=110)
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
    assert proc.returncode == 0 and line is not None, proc.stderr[-3000:]
    assert line.startswith("RESULT unwritten ") and "TRITON_INTERPRET=1" in line, line


# ---------------------------------------------------------------- validation

B, H, HV, K, V, L, S = 3, 2, 4, 16, 16, 4, 5


def _tensors(**overrides: object) -> dict[str, object]:
    t: dict[str, object] = dict(
        mixed_qkv=torch.randn(B, 2 * H * K + HV * V, dtype=torch.bfloat16),
        a=torch.randn(B, HV * K, dtype=torch.bfloat16),
        b=torch.randn(B, HV, dtype=torch.bfloat16),
        A_log=torch.randn(HV),
        dt_bias=torch.randn(HV * K),
        scale=None,
        initial_state=torch.randn(S, HV, V, K),
        d_cache=torch.randn(S, HV, L, V, dtype=torch.bfloat16),
        k_cache=torch.randn(S, H, L, K, dtype=torch.bfloat16),
        g_cache=torch.randn(S, HV, L, K),
        out=torch.full((B, 1, HV, V), 7.0, dtype=torch.bfloat16),
        ssm_state_indices=torch.tensor([0, 2, -1], dtype=torch.int32),
        write_pos=torch.tensor([0, 1, 0], dtype=torch.int32),
        force_flush=None,
        use_qk_l2norm_in_kernel=True,
        lower_bound=None,
    )
    t.update(overrides)
    return t


BAD_INPUTS = {
    "mixed_qkv": (dict(mixed_qkv=torch.randn(B, 2 * H * K + HV * V + 1, dtype=torch.bfloat16)), r"\[3, 129\]"),
    "mixed_qkv-dtype": (dict(mixed_qkv=torch.randn(B, 2 * H * K + HV * V, dtype=torch.float64)), "float64"),
    "a": (dict(a=torch.randn(B, HV * K + 1, dtype=torch.bfloat16)), r"\[3, 65\]"),
    "b": (dict(b=torch.randn(B, HV + 1, dtype=torch.bfloat16)), r"\[3, 5\]"),
    "A_log": (dict(A_log=torch.randn(HV, dtype=torch.bfloat16)), "bfloat16"),
    "dt_bias": (dict(dt_bias=torch.randn(HV * K + 2)), r"\[66\]"),
    "initial_state": (dict(initial_state=torch.randn(S, HV, V, K, dtype=torch.float16)), "float16"),
    "d_cache": (dict(d_cache=torch.randn(S, HV, L, V + 1, dtype=torch.bfloat16)), r"\[5, 4, 4, 17\]"),
    "k_cache": (dict(k_cache=torch.randn(S, H, L, K)), "float32"),
    "g_cache": (dict(g_cache=torch.randn(S, HV, L, K, dtype=torch.bfloat16)), "bfloat16"),
    "out": (dict(out=torch.zeros(B, HV, V, dtype=torch.bfloat16)), r"\[3, 4, 16\]"),
    "ssm_state_indices": (dict(ssm_state_indices=torch.tensor([0, 1, 2])), "int64"),
    "write_pos": (dict(write_pos=torch.zeros(B + 1, dtype=torch.int32)), r"\[4\]"),
    "force_flush": (dict(force_flush=torch.zeros(B, dtype=torch.bool)), "bool"),
    "scale": (dict(scale=float("nan")), "nan"),
    "lower_bound": (dict(lower_bound=float("inf")), "inf"),
    "k_cache-heads": (dict(k_cache=torch.randn(S, 3, L, K, dtype=torch.bfloat16)), "H = 3"),
    "initial_state-layout": (dict(initial_state=torch.randn(S, HV, K, V).transpose(2, 3)), "stride"),
    "d_cache-ring": (dict(d_cache=torch.randn(S, HV, 0, V, dtype=torch.bfloat16)), r"\[5, 4, 4, 16\]; got \[5, 4, 0, "
                                                                                 r"16\]"),
    "d_cache-no-ring": (dict(d_cache=torch.randn(S, HV, 0, V, dtype=torch.bfloat16), k_cache=torch.randn(
        S, H, 0, K, dtype=torch.bfloat16), g_cache=torch.randn(S, HV, 0, K)), "L = 0"),
    # the ring whose length disagrees with the other two is the one named
    "d_cache-ring-length": (dict(d_cache=torch.randn(S, HV, L + 1, V, dtype=torch.bfloat16)),
                            r"\[5, 4, 4, 16\]; got \[5, 4, 5, 16\]"),
    # H from k_cache and from mixed_qkv's width disagree: both named
    "k_cache-value-heads": (dict(k_cache=torch.randn(S, HV, L, K, dtype=torch.bfloat16)),
                            r"`mixed_qkv`'s width 128 = 2\*H\*K \+ HV\*V gives H = 2 q/k heads, but `k_cache` "
                            r"\[S, H, L, K\] has H = 4"),
    "use_qk_l2norm_in_kernel": (dict(use_qk_l2norm_in_kernel="yes"), r"must be a bool; got 'yes'"),
}


def _refused_and_unwritten(call: Callable[..., object], t: dict[str, object], match: str) -> str:
    """``call(**t)`` raises a ``ValueError`` matching ``match`` and leaves every tensor of ``t`` as it was; returns
    the message."""
    snapshot = {k: v.clone() for k, v in t.items() if isinstance(v, torch.Tensor)}
    with pytest.raises(ValueError, match=match) as info:
        call(**t)
    for k, v in snapshot.items():
        assert torch.equal(t[k], v), f"{k} was written"
    return str(info.value)


@pytest.mark.parametrize("impl", [ops.replayssm_decode, reference.replayssm_decode], ids=["op", "reference"])
@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_bad_input_raises_naming_argument_and_writes_nothing(impl: Callable[..., object], case: str) -> None:
    overrides, actual = BAD_INPUTS[case]
    message = _refused_and_unwritten(impl, _tensors(**overrides), f"`{case.split('-')[0]}`")
    assert re.search(actual, message), message


@pytest.mark.parametrize("impl", [ops.replayssm_decode, reference.replayssm_decode], ids=["op", "reference"])
def test_tensors_off_the_common_device_are_all_named(impl: Callable[..., object]) -> None:
    """Every tensor off the device most of the call's tensors share is named."""
    t = _tensors()
    t["d_cache"] = t["d_cache"].to("meta")
    t["write_pos"] = t["write_pos"].to("meta")
    with pytest.raises(ValueError, match=r"every tensor must be on one device; most are on cpu") as info:
        impl(**t)
    msg = str(info.value)
    assert "d_cache (meta)" in msg and "write_pos (meta)" in msg and "k_cache" not in msg, msg


def test_fake_cuda_tensors_on_another_gpu_are_named() -> None:
    """The SGLang failure mode: activations on cuda:1, caches left on cuda:0 (fake CUDA tensors)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        t = {k: (v.to("cuda:1") if isinstance(v, torch.Tensor) else v) for k, v in _tensors().items()}
        for name in ("initial_state", "k_cache", "g_cache"):
            t[name] = torch.empty(t[name].shape, dtype=t[name].dtype, device="cuda:0")
        with pytest.raises(ValueError) as info:
            ops.replayssm_decode(**t)
    msg = str(info.value)
    assert "cuda:1" in msg and all(f"{n} (cuda:0)" in msg for n in ("initial_state", "k_cache", "g_cache")), msg
    assert "d_cache" not in msg


def test_validation_runs_in_full_once_per_signature(monkeypatch: pytest.MonkeyPatch) -> None:
    """The op's checks (``validation.validate_decode_once``) run in full once per metadata signature; a repeat
    checks only ``scale`` and ``lower_bound``, and every bad input of ``BAD_INPUTS`` is still refused, naming its
    argument, after the good signature was accepted."""
    calls: list[int] = []
    full = validation.validate_decode
    monkeypatch.setattr(validation, "validate_decode", lambda *a, **k: calls.append(1) or full(*a, **k))
    monkeypatch.setattr(validation, "_ACCEPTED", {})

    def once(t: dict[str, object], **flags: bool) -> DecodeDims:
        return validation.validate_decode_once(DecodeCall(**t), **flags)

    dims = once(_tensors())
    assert calls == [1] and dims == DecodeDims(B, H, HV, K, V, L, S)
    assert once(_tensors(scale=0.5, lower_bound=-5.0)) == dims and calls == [1]  # fresh tensors, same metadata
    for case, (overrides, actual) in BAD_INPUTS.items():
        with pytest.raises(ValueError, match=f"`{case.split('-')[0]}`") as info:
            once(_tensors(**overrides))
        assert re.search(actual, str(info.value)), (case, str(info.value))
    with pytest.raises(ValueError, match="`out` must be a torch.Tensor"):
        once(_tensors(out="not a tensor"))
    with pytest.raises(ValueError, match="`out`"):  # a transposed view: same shape, other strides
        once(_tensors(out=torch.zeros(B, 1, V, HV, dtype=torch.bfloat16).transpose(2, 3)))
    t = _tensors()
    t["d_cache"] = t["d_cache"].to("meta")
    with pytest.raises(ValueError, match=r"d_cache \(meta\)"):
        once(t)
    n_full = len(calls)
    # the flags and the presence of force_flush are part of the signature
    once(_tensors(write_pos=torch.zeros(S + 1, dtype=torch.int32)), cursor_table=True)
    once(_tensors(force_flush=torch.zeros(B, dtype=torch.int32)))
    assert len(calls) == n_full + 2 and len(validation._ACCEPTED) == 3
    monkeypatch.setattr(validation, "ACCEPTED_MAX", 3)  # a full table is emptied before the next entry
    once(_tensors(mixed_qkv=torch.randn(B, 2 * H * K + HV * V, dtype=torch.float32),
                  out=torch.zeros(B, 1, HV, V, dtype=torch.float32)))
    assert len(validation._ACCEPTED) == 1


def test_empty_batch_is_a_no_op() -> None:
    t = _tensors(
        mixed_qkv=torch.randn(0, 2 * H * K + HV * V, dtype=torch.bfloat16),
        a=torch.randn(0, HV * K, dtype=torch.bfloat16), b=torch.randn(0, HV, dtype=torch.bfloat16),
        out=torch.empty(0, 1, HV, V, dtype=torch.bfloat16),
        ssm_state_indices=torch.empty(0, dtype=torch.int32), write_pos=torch.empty(0, dtype=torch.int32),
    )
    before = t["initial_state"].clone()
    ops.replayssm_decode(**t)
    assert torch.equal(t["initial_state"], before)


def test_scenario_detects_a_wrong_kernel() -> None:
    """The harness itself can fail: an op that forgets the ring (always flushes from S0) is caught."""

    def forgetful(*args: object, **kwargs: object) -> tuple[torch.Tensor, torch.Tensor]:
        args = list(args)
        args[12] = torch.zeros_like(args[12])  # write_pos := 0: ring ignored
        return reference.replayssm_decode(*args, **kwargs)

    with pytest.raises(AssertionError):
        run_scenario(dataclasses.replace(CASES["gqa-bf16ring-fp32state"], steps=4), forgetful)


# ---------------------------------------------------------------- rows that would address outside their slot


def _out_of_range_case(ring_layout: str) -> tuple[dict[str, object], dict[str, object], list[torch.Tensor]]:
    """``(call, clean call, guards)``: a call whose rows 1, 3 and 4 name slot ``S`` or ``S + 1`` or a cursor outside
    ``[0, L-1]`` (some with a forced flush), among rows 0 and 2 that decode slots 0 and 2 (one appending, one
    flushing at ``L-1``); and the same call with those rows marked as padding (slot -1). The caches are views
    ``[1:S+1]`` of buffers with sentinel-filled guard slots on either side, so a write outside the caches shows in
    the buffers (``guards``: the buffers, compared whole); slots 1, 3 and 4, which only the bad rows name, are
    sentinel-filled too."""
    gen = torch.Generator().manual_seed(5)
    n_rows = 5
    k_heads = HV if ring_layout == "predecayed" else H
    shapes = dict(initial_state=((S, HV, V, K), torch.float32), d_cache=((S, HV, L, V), torch.bfloat16),
                  k_cache=((S, k_heads, L, K), torch.bfloat16), g_cache=((S, HV, L, K), torch.float32))
    t = _tensors(mixed_qkv=torch.randn(n_rows, 2 * H * K + HV * V, generator=gen).bfloat16(),
                 a=torch.randn(n_rows, HV * K, generator=gen).bfloat16(),
                 b=torch.randn(n_rows, HV, generator=gen).bfloat16(),
                 out=torch.full((n_rows, 1, HV, V), float("nan"), dtype=torch.bfloat16),
                 ssm_state_indices=torch.tensor([0, S, 2, 1, 3], dtype=torch.int32),
                 write_pos=torch.tensor([1, 0, L - 1, L, -1], dtype=torch.int32),
                 force_flush=torch.tensor([0, 1, 0, 1, 0], dtype=torch.int32))
    guards = []
    for name, (shape, dtype) in shapes.items():
        buffer = torch.full((S + 2, *shape[1:]), SENTINEL, dtype=dtype)
        live = 0.1 * torch.randn(2, *shape[1:], generator=gen)
        if name == "g_cache":
            live = -live.abs()  # log-gates (cumulative ones in the pre-decayed layout: decreasing is enough here)
            if ring_layout == "predecayed":
                live = live.cumsum(2)
        buffer[[1, 3]] = live.to(dtype)  # slots 0 and 2 of the view
        t[name] = buffer[1:S + 1]
        guards.append(buffer)
    clean = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in t.items()}
    clean["ssm_state_indices"] = torch.tensor([0, -1, 2, -1, -1], dtype=torch.int32)
    clean_guards = []
    for name in shapes:  # the clean call's caches: views of copies of the same buffers
        buffer = t[name]._base.clone()
        clean[name] = buffer[1:S + 1]
        clean_guards.append(buffer)
    return t, clean, guards + clean_guards


def _check_out_of_range_rows_are_padding(impl: Callable[..., object], ring_layout: str) -> None:
    t, clean, buffers = _out_of_range_case(ring_layout)
    before = [b.clone() for b in buffers[:4]]
    impl(**clean, ring_layout=ring_layout)
    impl(**t, ring_layout=ring_layout)
    bad = [1, 3, 4]
    assert (t["out"][bad] == 0).all(), "a row outside its slot's range must output zeros"
    assert torch.equal(t["out"].view(torch.int16), clean["out"].view(torch.int16)), "the other rows changed"
    for name, got, want, was in zip(("initial_state", "d_cache", "k_cache", "g_cache"), buffers[:4], buffers[4:],
                                    before):
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), f"{name}: not what the clean call wrote"
        for index in (0, 2, 4, 5, S + 1):  # the guard slots and the slots only bad rows name: still sentinels
            assert torch.equal(got[index].view(torch.uint8), was[index].view(torch.uint8)), (name, index)
    assert not torch.equal(buffers[0], before[0])  # the flushing row wrote its checkpoint


@pytest.mark.parametrize("ring_layout", ["sglang", "predecayed"])
def test_reference_treats_rows_outside_their_slot_as_padding(ring_layout: str) -> None:
    """A row whose slot is ``>= S`` or whose cursor is outside ``[0, L-1]`` would address memory outside its slot:
    the reference treats it as a padding row (zero output, nothing written, a forced flush ignored), and the other
    rows' outputs and writes equal those of a call where it is padding, bit for bit."""
    _check_out_of_range_rows_are_padding(reference.replayssm_decode, ring_layout)


@pytest.mark.parametrize("ring_layout", ["sglang", "predecayed"])
def test_kernel_treats_rows_outside_their_slot_as_padding(ring_layout: str, interpreter: None) -> None:
    """The same contract for the Helion kernel (the interpreter)."""
    _check_out_of_range_rows_are_padding(ops.replayssm_decode, ring_layout)


# ---------------------------------------------------------------- the pool's entry point (cursor table)


def test_cursor_table_entry_matches_row_cursors_bitwise(monkeypatch: pytest.MonkeyPatch, interpreter: None) -> None:
    """``run_decode(..., cursor_table=True)`` (the kernel reads ``cursors[slot]``) == ``replayssm_decode`` with
    ``write_pos = cursors[slots]``: same outputs and caches, bit for bit, flush and padding rows included."""
    gen = torch.Generator().manual_seed(11)
    t = _tensors(ssm_state_indices=torch.tensor([4, -1, 1], dtype=torch.int32),
                 force_flush=torch.tensor([0, 1, 0], dtype=torch.int32))
    for k, v in t.items():
        if isinstance(v, torch.Tensor) and v.is_floating_point() and k not in ("mixed_qkv", "a", "b"):
            t[k] = (0.1 * torch.randn(v.shape, generator=gen)).to(v.dtype)
    t["out"] = torch.full((B, 1, HV, V), float("nan"), dtype=torch.bfloat16)
    cursors = torch.tensor([0, L - 1, 2, 1, 2, 3], dtype=torch.int32)  # [S + 1]; slot 1 flushes at L-1
    rows = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in t.items()}
    rows["write_pos"] = cursors[rows["ssm_state_indices"].clamp(0, S).long()]
    seen = record_kernel_args(monkeypatch, "cursors_by_slot")
    ops.replayssm_decode(**rows)
    table = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in t.items()}
    table["write_pos"] = cursors.clone()
    run_decode(DecodeCall(**table), ring_layout="sglang", cursor_table=True)
    assert seen == [(False,), (True,)]
    for k in ("out", "initial_state", "d_cache", "k_cache", "g_cache"):
        assert torch.equal(table[k], rows[k]), k
    assert torch.equal(table["write_pos"], cursors)  # read only
    assert not torch.equal(rows["initial_state"], t["initial_state"])  # the flush row did write


def test_cursor_table_of_the_wrong_shape_is_refused_before_anything_is_written() -> None:
    t = _tensors()  # write_pos per row, not the table [S + 1]
    _refused_and_unwritten(lambda **t: run_decode(DecodeCall(**t), ring_layout="sglang", cursor_table=True), t,
                           r"`cursors`.*\[6\].*\[3\]")


def test_cache_row_views_are_cached_per_tensor_and_dropped_with_it() -> None:
    import gc

    big = torch.zeros(2, S, HV, L, V)
    layer = big[1]
    gc.collect()  # entries of earlier tests' dead tensors go now, not in the count below
    first = kernel_args.rows_view(layer)
    assert kernel_args.rows_view(layer) is first  # same tensor object: no new views
    assert first[0].data_ptr() == layer.data_ptr() and first[1] == tuple(layer.stride()[:3])
    n = len(kernel_args._ROWS_VIEWS)
    del layer, first
    gc.collect()
    assert len(kernel_args._ROWS_VIEWS) == n - 1  # the entry died with its tensor
    t = torch.zeros(S, HV, L, V)
    view = kernel_args.rows_view(t)
    t.set_(torch.zeros(S, HV, L, V).untyped_storage(), 0, t.shape, t.stride())  # new data pointer: rebuilt
    assert kernel_args.rows_view(t)[0].data_ptr() == t.data_ptr() != view[0].data_ptr()


@pytest.mark.skipif(torch.cuda.is_available(), reason="the shim patches the Triton interpreter (CPU runs)")
def test_interpreter_shim_multiplies_bf16_dot_operands_as_values() -> None:
    """Triton 3.9's interpreter stores bf16 as raw uint16 bits and its ``tl.dot`` multiplied those bits as
    integers; after ``install_libdevice_shim`` a bf16 dot with fp32 accumulation equals the exact product
    of the bf16 values (what kernel variants with tensor-core products compute on the GPU)."""
    import triton
    import triton.language as tl

    from tp_replayssm.kernels.interpreter import install_libdevice_shim

    install_libdevice_shim()

    @triton.jit
    def dot16(a_ptr, b_ptr, c_ptr):  # noqa: ANN001, ANN202 - a Triton kernel
        i = tl.arange(0, 16)
        a = tl.load(a_ptr + i[:, None] * 16 + i[None, :])
        b = tl.load(b_ptr + i[:, None] * 16 + i[None, :])
        tl.store(c_ptr + i[:, None] * 16 + i[None, :], tl.dot(a, b, out_dtype=tl.float32))

    gen = torch.Generator().manual_seed(0)
    a, b = (torch.randn(16, 16, generator=gen).bfloat16() for _ in range(2))
    c = torch.full((16, 16), float("nan"))
    dot16[(1,)](a, b, c)
    torch.testing.assert_close(c, a.double().matmul(b.double()).float(), rtol=1e-6, atol=1e-5)


# ---------------------------------------------------------------- the pre-decayed ring layout
# (its kernel-path cases, PREDECAYED_CASES, run with the sglang layout's in test_both_kernel_paths_...)


def test_predecayed_layout_tensor_core_chunks_match_reference(monkeypatch: pytest.MonkeyPatch,
                                                              interpreter: None) -> None:
    """The pre-decayed prologue feeding the bf16 tensor-core chunk products (bf16 checkpoint and rings)."""
    sc = dataclasses.replace(BF16_OPERANDS, lower_bound=-5.0, predecayed=True)
    seen = record_kernel_args(monkeypatch, "predecayed_ring", "chunks_on_tensor_cores")
    worst = run_scenario(sc, planned_op(_with_tensor_core_chunks, tensor_core_chunks=True))
    assert set(seen) == {(1, True)}, seen
    assert worst.flushes > 0 and worst.appends > 0
    assert worst.out_vs_reference <= OUT_TOL[torch.float32], worst
    assert worst.out_vs_plain64 <= 3e-2 and worst.state_vs_plain64 <= 3e-2, worst


# rebasing cases for the rebase pass of register-capped programs: fp32 checkpoint with bf16 rings (register
# chunks), bf16 checkpoint and rings (both chunk paths), all fp32 (the rank-1 flush)
REBASE_PASS_CASES = {
    "gqa-fp32state": PREDECAYED_CASES["gqa-rebasing-softplus"],
    "bf16-operands": dataclasses.replace(BF16_OPERANDS, L=8, steps=12, flush_prob=0.05, predecayed=True,
                                         A_log_shift=4.5),
    "all-fp32": PREDECAYED_CASES["fp32-rebasing-softplus"],
}
# (case, tensor-core chunks, vector tiles): the rebase pass after each append loop, register chunks in row tiles
# and tensor-core chunks (bf16 checkpoint and rings), and the vector tiles of the library's capped register programs
# (fp32 checkpoints over 128-row tiles in 8-row chunks) with a bf16 ring and with an fp32 ring (the rank-1 flush)
REBASE_PASS_PATHS = [("bf16-operands", False, 0), ("bf16-operands", True, 0), ("gqa-fp32state", False, 1),
                     ("all-fp32", False, 1)]


@pytest.mark.parametrize("name,mma,tiles", REBASE_PASS_PATHS,
                         ids=[f"{n}-{'tensor-core-chunks' if m else 'register-chunks'}{'-vector-tiles' if v else ''}"
                              for n, m, v in REBASE_PASS_PATHS])
def test_rebase_pass_of_register_capped_programs(name: str, mma: bool, tiles: int, monkeypatch: pytest.MonkeyPatch,
                                                 interpreter: None) -> None:
    """Under a register cap (``DecodePlan.maxnreg``: GPU tensor-core grids that it saves a wave, and fp32
    register-path grids that it fits into one, with 8-row chunks) a rebasing head runs the append loop and then
    a rebase pass of its own (``predecayed_ring`` 3) instead of the flush branch (2): the same contract, held
    to the same limits. The interpreter's plan has no cap, so the test puts in the GPU's capped plans (the
    interpreter ignores the cap itself) and checks that mode 3 reached the kernel."""
    sc = REBASE_PASS_CASES[name]
    seen = record_kernel_args(monkeypatch, "predecayed_ring", "vector_tiles")
    worst = run_scenario(sc, planned_op(maxnreg=168, predecayed_ring=3, tensor_core_chunks=mma,
                                        value_chunk=16 if mma else 8, vector_tiles=tiles))
    assert set(seen) == {(3, tiles)}, seen  # the rebase pass, with the tiles asked for
    assert worst.flushes > 0 and worst.appends > 0
    _check_rebases(sc, worst.rebases)
    assert worst.out_vs_reference <= OUT_TOL[sc.act_dtype], worst
    limit = 3e-2 if torch.bfloat16 in (sc.state_dtype, sc.cache_dtype) else 1e-4
    assert worst.out_vs_plain64 <= limit and worst.state_vs_plain64 <= limit, worst


@pytest.mark.parametrize("gate", ["bounded", "rebasing-softplus"])
def test_predecayed_reference_matches_plain_recurrence_tightly_in_fp32(gate: str) -> None:
    sc = Scenario(act_dtype=torch.float32, cache_dtype=torch.float32, steps=10, flush_prob=0.3, predecayed=True)
    if gate == "bounded":
        sc = dataclasses.replace(sc, lower_bound=-5.0)
    else:  # unbounded gates, strong enough that heads rebase between flushes
        sc = dataclasses.replace(sc, L=8, steps=14, flush_prob=0.05, A_log_shift=3.5)
    worst = run_scenario(sc, reference.replayssm_decode)
    _check_rebases(sc, worst.rebases)
    assert worst.out_vs_plain64 < 1e-5 and worst.state_vs_plain64 < 1e-5, worst


def _predecayed_tensors(**overrides: object) -> dict[str, object]:
    return _tensors(**{"k_cache": torch.randn(S, HV, L, K, dtype=torch.bfloat16), "lower_bound": -5.0, **overrides})


PREDECAYED_BAD_INPUTS = {
    "lower_bound-nan": (dict(lower_bound=float("nan")), "None or a finite float.*nan"),
    "lower_bound-positive": (dict(lower_bound=5.0), r"None or a finite float <= 0 .*; got 5\.0"),
    "k_cache-per-qk-head": (dict(k_cache=torch.randn(S, H, L, K, dtype=torch.bfloat16)), r"\[5, 2, 4, 16\]"),
    "mixed_qkv-width": (dict(mixed_qkv=torch.randn(B, 2 * H * K + HV * V + K, dtype=torch.bfloat16)), "width 144"),
}


@pytest.mark.parametrize("impl", [functools.partial(ops.replayssm_decode, ring_layout="predecayed"),
                                  functools.partial(reference.replayssm_decode, ring_layout="predecayed")],
                         ids=["op", "reference"])
@pytest.mark.parametrize("case", list(PREDECAYED_BAD_INPUTS))
def test_predecayed_layout_bad_input_raises_naming_argument_and_writes_nothing(impl: Callable[..., object],
                                                                               case: str) -> None:
    overrides, actual = PREDECAYED_BAD_INPUTS[case]
    message = _refused_and_unwritten(impl, _predecayed_tensors(**overrides), f"`{case.split('-')[0]}`")
    assert re.search(actual, message), message


def test_predecayed_layout_refuses_fp16_rings() -> None:
    t = _predecayed_tensors(d_cache=torch.randn(S, HV, L, V, dtype=torch.float16),
                            k_cache=torch.randn(S, HV, L, K, dtype=torch.float16))
    with pytest.raises(ValueError, match="cache dtype.*float16"):
        ops.replayssm_decode(**t, ring_layout="predecayed")


def test_kernel_rebase_threshold_is_the_validation_bound() -> None:
    """The kernel spells the rebase bound as a literal (a module constant would become a kernel argument);
    it must be the one the reference, the pool and the docs use."""
    import inspect

    src = inspect.getsource(replayssm_decode_kernel)
    assert f"torch.amin(g_cum, dim=0) < -{validation.PREDECAYED_MAX_LOG_DECAY!r}" in src
