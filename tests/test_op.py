"""The Helion decode op (run by the Triton interpreter on CPU) against the PyTorch reference and the
float64 plain recurrence, over several ring cycles; plus the input validation of both."""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch

from tp_replayssm import _validation, configs, kernel, ops, reference
from _decode_scenario import OUT_TOL, Scenario, record_kernel_args, run_scenario

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
def test_kernel_matches_reference_and_plain_recurrence(name: str) -> None:
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


@pytest.mark.parametrize("tiles", [0, 1, 2], ids=["row-tiles", "vector-tiles", "key-tiles"])
@pytest.mark.parametrize("tiny", [False, True], ids=["batch-path", "tiny-batch-path"])
@pytest.mark.parametrize("name", list(PATH_CASES))
def test_both_kernel_paths_match_reference_and_ignore_dead_entries(name: str, tiny: bool, tiles: int,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """The kernel's two constexpr paths (configs.tiny_batch): live-entry ring loads with the forward-scan
    suffix sums, and whole-ring loads (before the cursor is known) with the reverse scan. Ring entries
    past each cursor are NaN in the scenario, so a missing mask shows up as non-finite output; the
    all-fp32 cases hold both suffix-sum forms to 1e-4 of the float64 recurrence. In both ring layouts:
    ``replayssm_decode_predecayed`` (cumulative gates, keys ``k * exp(-G)`` per value head) against its
    reference and the float64 recurrence read back through ``replay_predecayed_ring``; row 0 of an empty
    ring, which that kernel loads for ``G_{c-1}``, is NaN too and must be masked. The rebasing cases (softplus
    gates strong enough that ``G`` passes -75 inside a ring cycle) zero a head's deltas, so its older keys, up
    to exp(75), must contribute exactly 0. Each with the append loop's ``[Vc, K]`` checkpoint tiles and its vector
    tiles (``configs.vector_tiles`` 1: ``[Ko, Vc, Ki, kv]`` tiles, the ring entries written before the loop), and
    in the pre-decayed layout with its key tiles too (2: ``wk``, ``wq`` from ``[Ko, Lb, Ki, kv]`` tiles of the keys,
    the flush's keys loaded in the flush branch)."""
    sc = PATH_CASES[name]
    if tiles == 2 and not sc.predecayed:
        pytest.skip("the SPEC layout's kernel reads no key tiles (2 runs as 1)")
    if tiny and tiles == 1:  # (interpreter time) the tiny path only changes the key tiles' masking, tested with 2
        pytest.skip("the tiny path's whole-ring loads meet the vector tiles only in the key tiles (tiles = 2)")
    monkeypatch.setattr(configs, "FORCED_TINY_BATCH", tiny)
    monkeypatch.setattr(configs, "FORCED_VECTOR_TILES", tiles)
    worst = run_scenario(sc, ops.replayssm_decode_predecayed if sc.predecayed else ops.replayssm_decode)
    assert worst.flushes > 0 and worst.appends > 0
    _check_rebases(sc, worst.rebases)
    assert worst.out_vs_reference <= OUT_TOL[sc.act_dtype], worst
    limit = 3e-2 if sc.cache_dtype == torch.bfloat16 else 1e-4
    assert worst.out_vs_plain64 <= limit and worst.state_vs_plain64 <= limit, worst


# bf16 checkpoint and rings (the CPU choice takes the tensor-core chunks), fp32 activations: out held to
# fp32 accuracy
BF16_OPERANDS = Scenario(act_dtype=torch.float32, state_dtype=torch.bfloat16)


@pytest.mark.parametrize("mma,tiles", [(False, 0), (False, 1), (True, 0)],
                         ids=["register-chunks", "register-chunks-vector-tiles", "tensor-core-chunks"])
def test_both_chunk_paths_match_reference(mma: bool, tiles: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """The kernel's every-step chunk paths (``LaunchChoice.mma_chunks``) on a bf16 checkpoint with bf16
    rings: row reductions in registers, or bf16 MMAs against the ``hi + mid + lo`` split of the fp32
    vectors. With fp32 activations ``out`` must match the reference to 2e-5: plain bf16 vectors fail that
    (checked by mutation; a two-part split passes at this size, the third part is margin that costs only
    prologue instructions). Ring entries past the cursor are NaN, so an unmasked MMA operand shows up as
    non-finite output."""
    chosen = ops.select_config

    def forced(*args: object, **kwargs: object) -> configs.LaunchChoice:
        choice = chosen(*args, **kwargs)
        assert choice.mma_chunks  # the CPU choice takes the MMAs whenever both operands are bf16
        return choice._replace(mma_chunks=mma)

    monkeypatch.setattr(ops, "select_config", forced)
    monkeypatch.setattr(configs, "FORCED_VECTOR_TILES", tiles)
    worst = run_scenario(BF16_OPERANDS, ops.replayssm_decode)
    assert worst.flushes > 0 and worst.appends > 0
    assert worst.out_vs_reference <= OUT_TOL[torch.float32], worst
    assert worst.out_vs_plain64 <= 3e-2 and worst.state_vs_plain64 <= 3e-2, worst


@pytest.mark.parametrize("tiles", [1, 2], ids=["vector-tiles-two-chunks", "key-tiles-one-chunk"])
def test_predecayed_vector_tiles_with_a_bf16_checkpoint(tiles: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """The library's pre-decayed one-warp programs with a bf16 checkpoint take vector tiles over several chunks
    (``configs.vector_tiles`` 1: HV4 B128's 64:16:1) and key tiles over one (2: 16:16:1); key tiles only ever meet a
    bf16 checkpoint, whose 16-byte vectors split K into ``kv = 8`` elements (``Ko = 1`` at this K = 32, 4 at
    K = 128), not the fp32 cases' 4. Here: both, on the register chunks with bf16 rings and gates that rebase
    (through the flush branch, ``ops.predecayed_mode`` 2, as uncapped programs do), against the reference and the
    float64 recurrence; ring entries past each cursor are NaN."""
    sc = dataclasses.replace(BF16_OPERANDS, L=8, steps=12, flush_prob=0.05, predecayed=True, A_log_shift=4.5)
    chosen = ops.select_config

    def register_chunks(*args: object, **kwargs: object) -> configs.LaunchChoice:
        choice = chosen(*args, **kwargs)
        vt = choice.config.config["block_sizes"][0]  # one chunk for the key tiles, as the library pairs them
        return choice._replace(mma_chunks=False, value_chunk=vt if tiles == 2 else vt // 2)

    monkeypatch.setattr(ops, "select_config", register_chunks)
    monkeypatch.setattr(configs, "FORCED_VECTOR_TILES", tiles)
    seen = record_kernel_args(monkeypatch, "predecayed_ring", "vector_tiles", "k_vecs")
    worst = run_scenario(sc, ops.replayssm_decode_predecayed)
    assert {(mode, forced) for mode, forced, _ in seen} == {(2, tiles)}, seen
    assert {k_vecs.shape[3] for _, _, k_vecs in seen} == {8}  # the bf16 checkpoint's 16-byte vectors
    assert worst.flushes > 0 and worst.appends > 0
    _check_rebases(sc, worst.rebases)
    assert worst.out_vs_reference <= OUT_TOL[torch.float32], worst
    assert worst.out_vs_plain64 <= 3e-2 and worst.state_vs_plain64 <= 3e-2, worst


def test_tiny_batch_path_only_below_the_threshold() -> None:
    from tp_replayssm._validation import DecodeDims

    dims = DecodeDims(batch=configs.TINY_BATCH_BELOW // 4 - 1, num_q_heads=2, num_v_heads=4, key_dim=128,
                      value_dim=128, ring_length=16, num_slots=1024)
    assert configs.tiny_batch(dims)
    assert not configs.tiny_batch(dataclasses.replace(dims, batch=configs.TINY_BATCH_BELOW // 4))


@pytest.mark.parametrize("K,dtype,shape", [(128, torch.bfloat16, (4, 4, 8)), (128, torch.float32, (8, 4, 4)),
                                           (16, torch.bfloat16, (1, 2, 8)), (24, torch.float32, (3, 2, 4)),
                                           (20, torch.bfloat16, (5, 1, 4))])
def test_vector_tiles_view_holds_the_checkpoint_rows(K: int, dtype: torch.dtype, shape: tuple) -> None:
    """``ops._vector_tiles_view``: ``[Ko, span, Ki, kv]`` with ``kv`` elements a 16-byte vector where K allows
    (else the largest divisor), ``Ki`` of them per thread (``VECTORS_PER_LANE``), and element ``[o, r, i, e]`` =
    row ``r`` of the rows view at column ``(o*Ki + i)*kv + e`` (checked against the padded, strided cache it views)."""
    cache = torch.randn(3, 2, 5, K + 3).to(dtype)[..., :K]  # padded rows: strides the kernel must follow
    rows, _ = ops._rows_view(cache)
    tiles = ops._vector_tiles_view(rows, K, cache.element_size())
    ko, ki, kv = shape
    assert (tiles.shape[0], tiles.shape[2], tiles.shape[3]) == shape and tiles.shape[1] == rows.shape[0]
    cols = torch.arange(K).reshape(ko, ki, kv)
    for r in (0, 7, rows.shape[0] - 1):
        for o in range(ko):
            assert torch.equal(tiles[o, r], rows[r, cols[o]]), (r, o)


def test_vector_tiles_only_for_one_warp_register_chunks() -> None:
    """``configs.vector_tiles``: one-warp programs without tensor-core chunks (2, the pre-decayed key tiles too, where
    a program has one chunk), except fp32 checkpoints over value tiles below 64 rows (slower there on the H200), and
    keys of a power-of-two width only; ``FORCED_VECTOR_TILES`` never puts them on tensor-core chunks or such keys."""
    def tiles(vt: int, warps: int, dtype: torch.dtype, mma: bool = False, K: int = 128) -> int:
        return configs.vector_tiles(configs.LaunchChoice(configs.launch_config(vt, warps), 16, None, mma), dtype, K)
    bf16, fp32 = torch.bfloat16, torch.float32
    assert [tiles(64, 1, bf16), tiles(32, 1, bf16), tiles(16, 1, bf16)] == [1, 1, 2]
    assert [tiles(128, 1, fp32), tiles(64, 1, fp32), tiles(32, 1, fp32), tiles(16, 1, fp32)] == [1, 1, 0, 0]
    assert tiles(16, 1, bf16, K=64) == 2 and tiles(16, 1, bf16, K=96) == 0
    assert tiles(16, 4, bf16) == tiles(64, 2, bf16) == tiles(128, 1, bf16, mma=True) == 0
    try:
        configs.FORCED_VECTOR_TILES = 2
        assert tiles(16, 4, fp32) == 2 and tiles(128, 1, bf16, mma=True) == 0 and tiles(16, 4, fp32, K=24) == 0
        configs.FORCED_VECTOR_TILES = 0
        assert tiles(64, 1, bf16) == 0
    finally:
        configs.FORCED_VECTOR_TILES = None


def test_reference_matches_plain_recurrence_tightly_in_fp32() -> None:
    sc = Scenario(act_dtype=torch.float32, cache_dtype=torch.float32, steps=10, flush_prob=0.3)
    worst = run_scenario(sc, reference.replayssm_decode)
    assert worst.out_vs_plain64 < 1e-5 and worst.state_vs_plain64 < 1e-5, worst


def test_kernel_refuses_cpu_tensors_without_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.delenv("HELION_INTERPRET", raising=False)
    t = _tensors()
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        ops.replayssm_decode(**t)


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
    "d_cache-ring": (dict(d_cache=torch.randn(S, HV, 0, V, dtype=torch.bfloat16)), "L = 0"),
}


def _refused_and_unwritten(call, t: dict[str, object], match: str) -> str:  # noqa: ANN001
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
def test_bad_input_raises_naming_argument_and_writes_nothing(impl, case: str) -> None:  # noqa: ANN001
    overrides, actual = BAD_INPUTS[case]
    message = _refused_and_unwritten(impl, _tensors(**overrides), f"`{case.split('-')[0]}`")
    assert re.search(actual, message), message


@pytest.mark.parametrize("impl", [ops.replayssm_decode, reference.replayssm_decode], ids=["op", "reference"])
def test_tensors_off_the_activation_device_are_all_named(impl) -> None:  # noqa: ANN001
    t = _tensors()
    t["d_cache"] = t["d_cache"].to("meta")
    t["write_pos"] = t["write_pos"].to("meta")
    with pytest.raises(ValueError, match="same device|mixed_qkv's device") as info:
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
    """The op's checks (``_validation.validate_decode_inputs_once``) run in full once per metadata signature; a repeat
    checks only ``scale`` and ``lower_bound``, and every bad input of ``BAD_INPUTS`` is still refused, naming its
    argument, after the good signature was accepted."""
    calls: list[int] = []
    full = _validation.validate_decode_inputs
    monkeypatch.setattr(_validation, "validate_decode_inputs", lambda *a, **k: calls.append(1) or full(*a, **k))
    monkeypatch.setattr(_validation, "_ACCEPTED", {})

    def once(t: dict[str, object], **flags: bool) -> object:  # the op's arguments but the l2norm flag
        t = {k: v for k, v in t.items() if k != "use_qk_l2norm_in_kernel"}
        return _validation.validate_decode_inputs_once(**t, **flags)

    dims = once(_tensors())
    assert calls == [1] and dims == _validation.DecodeDims(B, H, HV, K, V, L, S)
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
    once(_tensors(write_pos=torch.zeros(S + 1, dtype=torch.int32)), cursors_by_slot=True)
    once(_tensors(force_flush=torch.zeros(B, dtype=torch.int32)))
    assert len(calls) == n_full + 2 and len(_validation._ACCEPTED) == 3
    monkeypatch.setattr(_validation, "ACCEPTED_MAX", 3)  # a full table is emptied before the next entry
    once(_tensors(mixed_qkv=torch.randn(B, 2 * H * K + HV * V, dtype=torch.float32),
                  out=torch.zeros(B, 1, HV, V, dtype=torch.float32)))
    assert len(_validation._ACCEPTED) == 1


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

    def forgetful(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        args = list(args)
        args[12] = torch.zeros_like(args[12])  # write_pos := 0: ring ignored
        return reference.replayssm_decode(*args, **kwargs)

    with pytest.raises(AssertionError):
        run_scenario(dataclasses.replace(CASES["gqa-bf16ring-fp32state"], steps=4), forgetful)


def test_gpu_config_choice_is_stable_and_cached() -> None:
    """The value-tile rule of the pinned GPU choices, and one Config object per choice (the op caches
    compiled kernels by config identity, so a fresh object per call would grow that cache forever)."""
    from tp_replayssm._validation import DecodeDims
    from tp_replayssm.configs import select_config

    cuda = torch.device("cuda", 0)

    def tiles(batch: int, hv: int, v: int = 128, k: int = 128,
              state: torch.dtype = torch.float32) -> tuple[int, int, int]:
        dims = DecodeDims(batch=batch, num_q_heads=hv, num_v_heads=hv, key_dim=k, value_dim=v, ring_length=16,
                          num_slots=batch)
        config, chunk, maxnreg, mma = select_config(dims, state, cuda)
        again = select_config(dims, state, cuda).config
        assert config is again and (maxnreg is None or (mma and maxnreg == 168))
        assert mma == (state == torch.bfloat16 and batch * hv >= 1024 and k <= 128)
        vt = config.config["block_sizes"][0]
        assert chunk <= vt and vt % chunk == 0
        return vt, chunk, config.config["num_warps"]

    # (value tile, value chunk, warps) per regime of B * HV (benchmarks/RESULTS.md, seventh session); one-warp
    # programs take the narrowest value tile whose grid fits one wave (132 SMs x 8 = 1056 programs)
    assert [tiles(1, 8), tiles(1, 32), tiles(8, 8), tiles(8, 32), tiles(16, 32), tiles(32, 32),
            tiles(512, 32)] == [(16, 16, 4), (32, 32, 4), (64, 32, 4), (32, 16, 1), (64, 16, 1), (128, 16, 1),
                                (128, 16, 1)]
    # 384 pairs: vt 32 would make 1536 programs; 792 pairs: vt 64 would make 1584; 272: vt 32, 1088
    assert tiles(32, 12) == (64, 16, 1) and tiles(66, 12) == (128, 16, 1) and tiles(34, 8) == (64, 16, 1)
    assert tiles(512, 32, v=64) == (64, 16, 1)
    assert tiles(512, 32, state=torch.bfloat16) == (128, 16, 1)
    # keys wider than 128 keep 4-warp programs (one warp's [16, K] tiles would spill), 8 KiB chunks
    assert tiles(512, 32, k=256) == (128, 16, 4) and tiles(512, 32, k=256, state=torch.bfloat16) == (128, 16, 4)
    assert tiles(8, 32, k=256) == (64, 16, 2)
    cpu, cpu_chunk, _, _ = select_config(DecodeDims(4, 2, 4, 16, 16, 4, 8), torch.float32, torch.device("cpu"))
    assert cpu.config["indexing"] == "pointer" and cpu_chunk < cpu.config["block_sizes"][0]


# ---------------------------------------------------------------- the pool's entry point (cursor table)


def test_cursor_table_entry_matches_row_cursors_bitwise() -> None:
    """``decode_with_cursor_table`` (the kernel reads ``cursors[slot]``) == ``replayssm_decode`` with
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
    ops.replayssm_decode(**rows)
    table = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in t.items() if k != "write_pos"}
    table["cursors"] = cursors.clone()
    ops.decode_with_cursor_table(**table)
    for k in ("out", "initial_state", "d_cache", "k_cache", "g_cache"):
        assert torch.equal(table[k], rows[k]), k
    assert torch.equal(table["cursors"], cursors)  # read only
    assert not torch.equal(rows["initial_state"], t["initial_state"])  # the flush row did write


def test_cursor_table_of_the_wrong_shape_is_refused_before_anything_is_written() -> None:
    t = _tensors()
    del t["write_pos"]
    t["cursors"] = torch.zeros(B, dtype=torch.int32)  # per row, not [S + 1]
    _refused_and_unwritten(ops.decode_with_cursor_table, t, r"`cursors`.*\[6\].*\[3\]")


def test_cache_row_views_are_cached_per_tensor_and_dropped_with_it() -> None:
    import gc

    big = torch.zeros(2, S, HV, L, V)
    layer = big[1]
    first = ops._rows_view(layer)
    assert ops._rows_view(layer) is first  # same tensor object: no new views
    assert first[0].data_ptr() == layer.data_ptr() and first[1] == tuple(layer.stride()[:3])
    n = len(ops._ROWS_VIEWS)
    del layer, first
    gc.collect()
    assert len(ops._ROWS_VIEWS) == n - 1  # the entry died with its tensor
    t = torch.zeros(S, HV, L, V)
    view = ops._rows_view(t)
    t.set_(torch.zeros(S, HV, L, V).untyped_storage(), 0, t.shape, t.stride())  # new data pointer: rebuilt
    assert ops._rows_view(t)[0].data_ptr() == t.data_ptr() != view[0].data_ptr()


@pytest.mark.skipif(torch.cuda.is_available(), reason="the shim patches the Triton interpreter (CPU runs)")
def test_interpreter_shim_multiplies_bf16_dot_operands_as_values() -> None:
    """Triton 3.9's interpreter stores bf16 as raw uint16 bits and its ``tl.dot`` multiplied those bits as
    integers; after ``install_libdevice_shim`` a bf16 dot with fp32 accumulation equals the exact product
    of the bf16 values (what kernel variants with tensor-core products compute on the GPU)."""
    import triton
    import triton.language as tl

    from tp_replayssm._interpreter import install_libdevice_shim

    install_libdevice_shim()

    @triton.jit
    def dot16(a_ptr, b_ptr, c_ptr):
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
# (its kernel-path cases, PREDECAYED_CASES, run with the SPEC layout's in test_both_kernel_paths_...)


def test_predecayed_layout_tensor_core_chunks_match_reference(monkeypatch: pytest.MonkeyPatch) -> None:
    """The pre-decayed prologue feeding the bf16 tensor-core chunk products (bf16 checkpoint and rings)."""
    chosen = ops.select_config
    monkeypatch.setattr(ops, "select_config", lambda *a, **k: chosen(*a, **k)._replace(mma_chunks=True))
    sc = dataclasses.replace(BF16_OPERANDS, lower_bound=-5.0, predecayed=True)
    worst = run_scenario(sc, ops.replayssm_decode_predecayed)
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


@pytest.mark.parametrize("mma,tiles", [(False, 0), (False, 1), (True, 0)],
                         ids=["register-chunks", "register-chunks-vector-tiles", "tensor-core-chunks"])
@pytest.mark.parametrize("name", list(REBASE_PASS_CASES))
def test_rebase_pass_of_register_capped_programs(name: str, mma: bool, tiles: int,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """Under a register cap (``LaunchChoice.maxnreg``: GPU tensor-core grids that it saves a wave, and fp32
    register-path grids that it fits into one, with 8-row chunks) a rebasing head runs the append loop and then
    a rebase pass of its own (``ops.predecayed_mode`` 3) instead of the flush branch (2): the same contract, held
    to the same limits. The CPU choice has no cap, so the test puts in the GPU's capped choices (the
    interpreter ignores the cap itself) and checks that mode 3 reached the kernel."""
    sc = REBASE_PASS_CASES[name]
    if mma and torch.float32 in (sc.state_dtype, sc.cache_dtype):
        pytest.skip("the tensor-core chunks need a bf16 checkpoint and rings")
    if tiles and sc.state_dtype != torch.float32:  # (interpreter time) the combinations the library makes: its capped
        # register programs are fp32 checkpoints over 128-row tiles in 8-row chunks, which take vector tiles (1)
        pytest.skip("vector tiles with the rebase pass: the library's capped register programs have fp32 checkpoints")
    chosen = ops.select_config
    monkeypatch.setattr(ops, "select_config", lambda *a, **k: chosen(*a, **k)._replace(
        maxnreg=168, mma_chunks=mma, value_chunk=16 if mma else 8))
    monkeypatch.setattr(configs, "FORCED_VECTOR_TILES", tiles)
    modes = record_kernel_args(monkeypatch, "predecayed_ring", "vector_tiles")
    worst = run_scenario(sc, ops.replayssm_decode_predecayed)
    assert set(modes) == {(3, tiles)}, modes  # the rebase pass, with the tiles asked for
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
    worst = run_scenario(sc, reference.replayssm_decode_predecayed)
    _check_rebases(sc, worst.rebases)
    assert worst.out_vs_plain64 < 1e-5 and worst.state_vs_plain64 < 1e-5, worst


def _predecayed_tensors(**overrides: object) -> dict[str, object]:
    return _tensors(**{"k_cache": torch.randn(S, HV, L, K, dtype=torch.bfloat16), "lower_bound": -5.0, **overrides})


PREDECAYED_BAD_INPUTS = {
    "lower_bound-nan": (dict(lower_bound=float("nan")), "None or a finite float.*nan"),
    "k_cache-per-qk-head": (dict(k_cache=torch.randn(S, H, L, K, dtype=torch.bfloat16)), r"\[5, 2, 4, 16\]"),
    "mixed_qkv-width": (dict(mixed_qkv=torch.randn(B, 2 * H * K + HV * V + K, dtype=torch.bfloat16)), "width 144"),
}


@pytest.mark.parametrize("impl", [ops.replayssm_decode_predecayed, reference.replayssm_decode_predecayed],
                         ids=["op", "reference"])
@pytest.mark.parametrize("case", list(PREDECAYED_BAD_INPUTS))
def test_predecayed_layout_bad_input_raises_naming_argument_and_writes_nothing(impl, case: str) -> None:  # noqa: ANN001
    overrides, actual = PREDECAYED_BAD_INPUTS[case]
    message = _refused_and_unwritten(impl, _predecayed_tensors(**overrides), f"`{case.split('-')[0]}`")
    assert re.search(actual, message), message


def test_predecayed_layout_refuses_fp16_rings() -> None:
    t = _predecayed_tensors(d_cache=torch.randn(S, HV, L, V, dtype=torch.float16),
                            k_cache=torch.randn(S, HV, L, K, dtype=torch.float16))
    with pytest.raises(ValueError, match="cache dtype.*float16"):
        ops.replayssm_decode_predecayed(**t)


def test_kernel_rebase_threshold_is_the_validation_bound() -> None:
    """The kernel spells the rebase bound as a literal (a module constant would become a kernel argument);
    it must be the one the reference, the pool and the docs use."""
    import inspect

    from tp_replayssm import _validation, kernel

    src = inspect.getsource(kernel.replayssm_decode_kernel)
    assert f"torch.amin(g_cum, dim=0) < -{_validation.PREDECAYED_MAX_LOG_DECAY!r}" in src
