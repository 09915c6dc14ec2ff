"""The CPU-side profiling helpers in benchmarks/: the SASS instruction-mix reader (sass_loops.py), the
Nsight Compute source-page summary (ncu_hot.py) and tune_decode's swap of the kernel function for a
candidate file. Synthetic inputs with known answers; no GPU."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

import ncu_hot  # noqa: E402
import sass_loops  # noqa: E402

SASS = """
        /*0000*/                   LDG.E R2, desc[UR4][R2.64] ;                 /* 0x0000000402027981 */
        /*0010*/                   SHFL.BFLY PT, R5, R8, 0x10, 0x1f ;           /* 0x0e001f0008057f89 */
        /*0020*/                   STS [UR6], R10 ;                             /* 0x0000000aff007988 */
        /*0030*/                   BAR.SYNC.DEFER_BLOCKING 0x0 ;                /* 0x0000000000007b1d */
        /*0040*/                   LDS R46, [R60] ;                             /* 0x000000003c2e7984 */
        /*0050*/                   FFMA R1, R2, R3, R4 ;                        /* 0x0000000000007b1d */
        /*0060*/               @!P0 LDG.E.128 R52, desc[UR30][R4.64] ;         /* 0x0000001e04348981 */
        /*0070*/                   MUFU.EX2 R16, R45 ;                          /* 0x0000002d00107308 */
        /*0080*/               @P1 BRA 0x40 ;                                   /* 0x000000000014a947 */
        /*0090*/                   EXIT ;                                       /* 0x000000000000794d */
"""


def test_sass_loops_counts_the_loop_body_between_target_and_backward_branch() -> None:
    ins = sass_loops.parse(SASS)
    assert [a for a, _ in ins] == list(range(0, 0xA0, 0x10))
    assert sass_loops.opcode("@!P0 LDG.E.128 R52, desc[UR30][R4.64]") == "LDG"
    whole = sass_loops.mix(ins)
    assert whole.split()[0] == "10" and "BAR=1" in whole and "SHFL=1" in whole and "shared=2" in whole
    loop = [x for x in ins if 0x40 <= x[0] <= 0x80]  # the @P1 BRA 0x40 at 0x80 closes a 5-instruction loop
    assert sass_loops.mix(loop).split()[0] == "5"
    assert "BAR=0" in sass_loops.mix(loop) and "global=1" in sass_loops.mix(loop) and "MUFU=1" in sass_loops.mix(loop)


def test_sass_loops_main_reports_each_backward_branch(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    f = tmp_path / "k.sass"
    f.write_text(SASS)
    sys.argv = ["sass_loops.py", str(f)]
    sass_loops.main()
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("kernel:") and len(lines) == 2
    assert lines[1].startswith("loop 0x0040-0x0080:") and " 5 instr" in lines[1]


def test_ncu_hot_ranks_instructions_by_samples_and_tolerates_extra_fields() -> None:
    csv_lines = [
        "==PROF== banner line that is not CSV\n",
        '"Address","Source","Warp Stall Sampling (All Samples)","stall_long_sb","stall_barrier"\n',
        '"0x10","LDG.E R2, [R2]","30","27","0"\n',
        '"0x20","BAR.SYNC 0x0","60","0","55","trailing field ncu adds"\n',
        '"0x30","FFMA R1, R2, R3, R4","10","0","0"\n',
    ]
    out = ncu_hot.summarize(csv_lines, top=2)
    assert "  Warp Stall Sampling (All Samples): 100" in out
    ranked = [ln for ln in out if "%" in ln and "0x" in ln]
    assert len(ranked) == 2
    assert ranked[0].lstrip().startswith("60.0%") and "BAR.SYNC" in ranked[0] and "stall_barrier=55" in ranked[0]
    assert ranked[1].lstrip().startswith("30.0%") and "stall_long_sb=27" in ranked[1]
    assert ncu_hot.summarize(["not csv\n"]) == ["ncu_hot: no rows"]


def test_profile_decode_takes_the_layout_and_a_forced_launch_choice(capsys: pytest.CaptureFixture[str]) -> None:
    """``profile_decode.py --ring-layout`` / ``--config`` (the launch-choice form of ``launch_args``) and its cursor
    check, at argument time (the rest needs a GPU)."""
    import profile_decode
    from launch_args import LaunchSpec

    args = profile_decode.parse_args(["--hv", "4", "--batch", "128", "--state", "bf16", "--ring-layout", "predecayed",
                                      "--config", "64:16:1:mma5"])
    assert (args.hv, args.batch, args.state, args.ring_layout) == (4, 128, "bf16", "predecayed")
    assert args.config == LaunchSpec(64, 16, 1, mma=True, stages=5)
    defaults = profile_decode.parse_args([])
    assert defaults.ring_layout == "spec" and defaults.config is None and defaults.cursor == 8
    for bad in (["--cursor", "16"], ["--config", "64:16"], ["--ring-layout", "ring"]):
        with pytest.raises(SystemExit):
            profile_decode.parse_args(bad)
    err = capsys.readouterr().err
    assert "--cursor must be in [0, 16), got 16" in err and "VT:VC:WARPS" in err


def test_tune_decode_swaps_the_kernel_function_and_restores_it(tmp_path: Path) -> None:
    import tune_decode
    from experiments.variants import load_kernel

    from tp_replayssm import kernel

    original = kernel.replayssm_decode_kernel
    candidate = tmp_path / "cand.py"
    candidate.write_text("def replayssm_decode_kernel(*args):\n    return 'candidate'\n")
    try:
        kernel._BY_CONFIG[0] = ("stale", "entry")
        tune_decode.use_kernel(load_kernel(str(candidate)))
        assert kernel.replayssm_decode_kernel is not original
        assert kernel.replayssm_decode_kernel() == "candidate"
        assert not kernel._BY_CONFIG  # compiled kernels of the previous function are dropped
    finally:
        tune_decode.use_kernel(None)
    assert kernel.replayssm_decode_kernel is original


def test_tune_decode_candidates_use_the_shared_launch_choice_form(capsys: pytest.CaptureFixture[str]) -> None:
    """``tune_decode.py --cands`` parses the same ``VT:VC:WARPS[:MAXNREG[:PER_SM]][:mma[N]]`` as ``bench_decode.py
    --config`` (``benchmarks/launch_args.py``), at argument time, and builds the launch choice it names."""
    import tune_decode
    from launch_args import LaunchSpec, switch

    from tp_replayssm import configs

    args = tune_decode.parse_args(["--cands", "64:16:1:168:2", "32:16:1:mma", "64:16:1:mma5", "--tiny-batch", "off"])
    assert args.cands == [LaunchSpec(64, 16, 1, 168, 2), LaunchSpec(32, 16, 1, mma=True),
                          LaunchSpec(64, 16, 1, mma=True, stages=5)]
    assert switch(args.tiny_batch) is False and switch(args.rebase_pass) is None and switch("on") is True
    assert [c.launch_choice() for c in tune_decode.parse_args([]).cands] == [
        configs.LaunchChoice(configs.launch_config(vt, w), vc) for vt, vc, w in
        ((128, 16, 1), (64, 16, 1), (32, 16, 1), (128, 16, 4))]
    capped = args.cands[0].launch_choice()
    assert (capped.maxnreg, capped.value_chunk, capped.mma_chunks) == (168, 16, False)
    assert capped.config.config["num_sm_multiplier"] == 2 and capped.config.config["block_sizes"] == [64]
    mma = args.cands[1].launch_choice()
    assert mma.mma_chunks and mma.config is configs.launch_config(32, 1, chunk_stages=3) and mma.maxnreg is None
    deep = args.cands[2].launch_choice()
    assert deep.mma_chunks and deep.config.config["range_num_stages"] == [0, 5, 0]
    with pytest.raises(SystemExit):
        tune_decode.parse_args(["--cands", "64:16"])
    assert "VT:VC:WARPS" in capsys.readouterr().err


def test_tune_decode_cycles_past_the_l2_by_default() -> None:
    """Small batches must stream from DRAM as in an engine with many layers: the default footprint is
    4x the H200's 60 MiB L2 (at most 256 sets); footprint 0 is the old rule (at most 16 sets)."""
    import tune_decode

    def footprint_mib(B: int, HV: int, sets: int, state: torch.dtype) -> float:
        return sets * B * HV * (128 * 128 * state.itemsize + 16 * 128 * 8) / 2**20

    for B, HV in [(1, 8), (8, 8), (8, 32), (128, 32)]:
        for state in (torch.float32, torch.bfloat16):
            sets = tune_decode.slot_sets(B, HV, 16, state, 240.0)
            assert 1 <= sets <= 256
            assert footprint_mib(B, HV, sets, state) >= 240.0 or sets == 256
    assert tune_decode.slot_sets(1, 8, 16, torch.float32, 240.0) == 256  # 0.6 MiB a set
    assert tune_decode.slot_sets(512, 32, 16, torch.float32, 240.0) == 1
    assert tune_decode.slot_sets(1, 8, 16, torch.float32, 0) == 16  # the old rule: 8 MiB, L2-resident


def test_tune_decode_captures_many_slot_sets_per_graph() -> None:
    """One graph per slot set (16 launches) put a gap between graph replays into every step (B = 1: 6.2
    instead of 3.9 us); every set must be timed exactly once, in graphs of >= 256 launches where possible."""
    import tune_decode

    for n_sets, L in [(1, 16), (16, 16), (17, 16), (256, 16), (5, 1), (300, 8), (3, 300)]:
        groups = tune_decode.graph_groups(n_sets, L)
        assert [i for g in groups for i in g] == list(range(n_sets))
        assert all(len(g) * L >= 256 for g in groups[:-1])
        assert all(len(g) == 1 or (len(g) - 1) * L < 256 for g in groups)
    assert len(tune_decode.graph_groups(256, 16)) == 16


from experiments import variants  # noqa: E402


@pytest.mark.parametrize("name", sorted(variants.VARIANTS))
def test_each_kernel_variant_applies_and_keeps_the_library_signature(name: str, tmp_path: Path) -> None:
    """tune_decode.py --kernel passes the library's argument tuple to a variant: every edit must still
    fit the current kernel (exactly once) and the parameters must not change."""
    import inspect

    from tp_replayssm import kernel

    text = variants.source(name)
    assert "VARIANT" in text or "dot_precision" in text
    fn = variants.load_kernel(str(variants.materialize(name, tmp_path)))
    assert list(inspect.signature(fn).parameters) == list(inspect.signature(kernel.replayssm_decode_kernel).parameters)


def test_kernel_variant_that_no_longer_fits_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown variant"):
        variants.source("no_such_variant")
    with pytest.raises(ValueError, match="found it 0 times"):
        variants.source("replay_flush", kernel_source='"""doc"""\ndef replayssm_decode_kernel():\n    pass\n')


def _bench_row(B: int, ours_us: float | None, **extra: object) -> dict[str, object]:
    row: dict[str, object] = dict(H=8, HV=8, K=128, V=128, B=B, L=16, state="bf16", cache="bf16", act="bf16",
                                  lower_bound=None, ours_us=ours_us, ours_op_us=ours_us, ours_pct_floor=60.0,
                                  fla_us=10.0, ours_check="ok" if ours_us else None)
    row.update(extra)
    return row


def test_plot_results_merges_parts_later_timed_rows_win(tmp_path: Path) -> None:
    """A sweep run in parts: a later file's timed row replaces the same shape's earlier row (a re-run after a
    change) and fills in a row the earlier part skipped; an untimed (skipped) row never replaces a timed
    one; the lower bound -5 and -5.0 are one shape. The Markdown table has one line per shape."""
    import json

    import plot_results

    first = tmp_path / "a.json"
    second = tmp_path / "b.json"
    first.write_text(json.dumps({"meta": {"gpu": "X"}, "results": [
        _bench_row(32, 9.0), _bench_row(128, 20.0), _bench_row(512, None, skipped="time budget"),
        _bench_row(8, 5.0, lower_bound=-5)]}))
    second.write_text(json.dumps({"meta": {}, "results": [
        _bench_row(128, 17.0), _bench_row(512, 70.0), _bench_row(32, None, skipped="time budget"),
        _bench_row(8, 4.0, lower_bound=-5.0)]}))
    rows, meta = plot_results.merge_results([first, second])
    assert meta == {"gpu": "X"}
    assert {(r["B"], plot_results._lb_key(r["lower_bound"])): r["ours_us"] for r in rows} == {
        (32, "none"): 9.0, (128, "none"): 17.0, (512, "none"): 70.0, (8, "-5"): 4.0}
    table = plot_results.table_markdown(rows).splitlines()
    assert len(table) == 2 + 4
    assert table[-1] == "| 16 | none | 8 | bf16 | 32 | 9.0 | 9.0 | - | 60 | 10.0 | 1.11 | ok |"
    out = tmp_path / "t.md"
    assert plot_results.main([str(first), str(second), "--table", str(out), "--no-plots"]) == 0
    assert out.read_text().splitlines() == table


def test_tune_decode_predecayed_problem_runs_the_layouts_op() -> None:
    """``tune_decode.py --ring-layout predecayed``: the problem's rings are a consistent pre-decayed layout (keys
    per value head, ``kt * exp(G)`` unit-scale keys) and ``op_launch`` runs the layout's op on them, matching
    its reference (interpreter, tiny shape, every cursor phase)."""
    import torch

    import tune_decode
    from tp_replayssm import reference

    prob = tune_decode.make_problem(2, 1, 2, 3, torch.float32, 1, K=16, V=16, predecayed=True, device="cpu")
    assert prob["kc"].shape == (2, 2, 3, 16)
    assert torch.isfinite(prob["kc"].float() * torch.exp(prob["g"])).all()
    launch = tune_decode.op_launch(None, predecayed=True, lower_bound=-5.0)
    slots = prob["slot_sets"][0]
    for c in range(3):
        want = {k: prob[k].clone() for k in ("st", "d", "kc", "g")}
        out = torch.empty_like(prob["out"])
        inp, p = prob["inputs"][c], prob["p"]
        reference.replayssm_decode_predecayed(inp.mixed_qkv, inp.a, inp.b, p.A_log, p.dt_bias, None, want["st"],
                                              want["d"], want["kc"], want["g"], out, slots, prob["cursors"][c], None,
                                              True, -5.0)
        launch(prob, slots, c)
        torch.testing.assert_close(prob["out"].float(), out.float(), rtol=2e-2, atol=2e-3)
        for k in want:
            torch.testing.assert_close(prob[k].float(), want[k].float(), rtol=2**-7, atol=1e-5)


def test_pool_overhead_fused_step_matches_the_pool_step() -> None:
    """``bench_pool_overhead.py --fused-advance``: the step whose last decode moves the cursors leaves the pool as
    the step with ``pool.advance`` does (interpreter, tiny shape, two layers, one full cursor cycle of each slot
    set), and the cursors back at their start after the cycle."""
    import copy

    import bench_pool_overhead as bpo

    args = bpo.parse_args(["--layers", "2", "--ring", "3", "--key-dim", "16", "--value-dim", "16", "--state", "fp32",
                           "--act-dtype", "fp32", "--footprint-mb", "0.001", "--max-graph-steps", "12"])
    su = bpo.Setup(2, 2, args, torch.device("cpu"), 0, ops_fn=None)
    twin = copy.deepcopy(su)
    start = su.pool.cursors.clone()
    for si in range(su.n_sets):
        for t in range(su.L):
            su.pool_step(si, t)
            twin.pool_step(si, t, fused=True)
            assert torch.equal(su.pool.cursors[:-1], twin.pool.cursors[:-1]), (si, t)
    assert torch.equal(twin.pool.cursors[:-1], start[:-1])
    for name in ("checkpoint", "d_cache", "k_cache", "g_cache"):
        assert torch.equal(getattr(su.pool, name), getattr(twin.pool, name)), name
    for (_, _, _, out), (_, _, _, tout) in zip(su.inputs, twin.inputs):
        assert torch.equal(out, tout)


def test_sass_hashes_names_one_shape_per_compiled_program() -> None:
    """benchmarks/sass_hashes.py: every kind of program the library launches has one entry (no compile here)."""
    import sass_hashes

    from tp_replayssm._validation import DecodeDims
    from tp_replayssm.configs import LaunchChoice, select_config, vector_tiles

    kinds = sass_hashes.launch_kinds()
    assert len(kinds) >= 100  # launch_kinds raises if two kinds share a name
    assert {kw["predecayed"] for kw in kinds.values()} == {False, True}
    assert {(kw["tiny"], kw["mma_chunks"], kw["lower_bound"], kw["advance_cursors"] > 0) for kw in kinds.values()} \
        == {(t, m, lb, f) for t in (False, True) for m in (False, True) for lb in (False, True) for f in (False, True)
            if not (t and m)}  # tiny batches never take the tensor-core chunks
    # every value of the vector-tile switch, and the one cell under issue 5's target (HV4 B128 bf16 pre-decayed,
    # 64:16:1 vector tiles) as the program of some shape
    tiles = {vector_tiles(LaunchChoice(kw["config"], kw["vc"], kw["maxnreg"], kw["mma_chunks"]),
                          torch.float32 if kw["state"] == "fp32" else torch.bfloat16, 128) for kw in kinds.values()}
    assert tiles == {0, 1, 2}
    dims = DecodeDims(128, 4, 4, 128, 128, 16, 128)
    choice = select_config(dims, torch.bfloat16, torch.device("cuda", 0), predecayed=True)
    assert any(str(kw["config"]) == str(choice.config) and kw["vc"] == choice.value_chunk and kw["predecayed"]
               and kw["state"] == "bf16" and not kw["lower_bound"] and not kw["advance_cursors"]
               for kw in kinds.values())


def test_sass_hashes_ignore_addresses_and_encodings_not_instructions() -> None:
    import sass_hashes

    moved = SASS.replace("/*00", "/*01").replace("0x0000000402027981", "0x1111111111111111")
    assert sass_hashes.sass_digest(moved) == sass_hashes.sass_digest(SASS)
    digest, count = sass_hashes.sass_digest(SASS)
    assert count == 10 and len(digest) == 16
    assert sass_hashes.sass_digest(SASS.replace("FFMA R1, R2, R3, R4", "FMUL R1, R2, R3"))[0] != digest
    base = {"a": {"hash": "1"}, "b": {"hash": "2"}, "c": {"hash": "3"}}
    assert sass_hashes.compare({"a": {"hash": "1"}, "b": {"hash": "9"}, "d": {"hash": "4"}}, base) == [
        "b: 2 -> 9", "c: 3 -> missing", "d: missing -> 4"]
    assert sass_hashes.compare(base, base) == []
