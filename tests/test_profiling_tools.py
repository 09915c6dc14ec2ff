"""The CPU side of the benchmark tools in benchmarks/: launch plans from the command line (plan_args.py), the SASS
instruction-mix reader (sass_loops.py), the Nsight Compute source-page summary (ncu_hot.py), the argument parsing and
problem set-up of tune_decode.py / profile_decode.py / bench_pool_overhead.py, plot_results.py's merged table and
sass_hashes.py's program list. Synthetic inputs with known answers; no GPU, no interpreter."""

from __future__ import annotations

import argparse
import re
import dataclasses
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

import ncu_hot  # noqa: E402
import plan_args  # noqa: E402
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
    sass_loops.main([str(f)])
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
    # newer ncu versions put a quoted "Kernel Name" line above the header
    banner = ['"Kernel Name","_helion_replayssm_verify_mma_kernel",\n'] + csv_lines[1:]
    assert [ln for ln in ncu_hot.summarize(banner, top=2) if "%" in ln and "0x" in ln] == ranked


# --- plan_args: launch plans from a command line -----------------------------------------------------------------


def test_override_arg_parses_fields_and_values() -> None:
    assert plan_args.override_arg("") == {}
    assert plan_args.override_arg("value_tile=64,vector_tiles=0") == {"value_tile": 64, "vector_tiles": 0}
    assert plan_args.override_arg(" maxnreg = none , tiny_batch=true,evict_state_first=off") == {
        "maxnreg": None, "tiny_batch": True, "evict_state_first": False}
    assert plan_args.override_arg("tensor_core_chunks=False,predecayed_ring=3") == {
        "tensor_core_chunks": False, "predecayed_ring": 3}


@pytest.mark.parametrize("text, named", [
    ("vt=64", "'vt=64'"),  # not a DecodePlan field
    ("value_tile", "'value_tile'"),  # no value
    ("value_tile=64,count_after_loads=1", "'count_after_loads=1'"),  # a field DecodePlan does not have
])
def test_override_arg_rejects_unknown_fields_naming_them(text: str, named: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError) as err:
        plan_args.override_arg(text)
    assert named in str(err.value) and "value_tile" in str(err.value)  # the item, and the fields it may name


def test_override_arg_rejects_bad_values_naming_field_and_value(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(argparse.ArgumentTypeError, match=r"value_tile: expected an int; got 'big'"):
        plan_args.override_arg("value_tile=big")
    with pytest.raises(argparse.ArgumentTypeError, match=r"maxnreg: .* got '1.5'"):
        plan_args.override_arg("num_warps=1,maxnreg=1.5")
    ap = argparse.ArgumentParser()
    ap.add_argument("--override", type=plan_args.override_arg)
    with pytest.raises(SystemExit):
        ap.parse_args(["--override", "value_chunk=many"])
    assert "value_chunk: expected an int; got 'many'" in capsys.readouterr().err
    for text, message in (("early_qk=5", "early_qk: expected true or false; got '5'"),
                          ("maxnreg=lots", "maxnreg: expected an int or none"),
                          ("early_qk=false value_tile=64", "one field=value per item, items separated by commas"),
                          ("earlyqk=true", "(did you mean 'early_qk'?)")):
        with pytest.raises(argparse.ArgumentTypeError, match=re.escape(message)):
            plan_args.override_arg(text)


def test_build_plan_is_the_librarys_plan_with_the_override() -> None:
    from tp_replayssm.kernels.plan import plan_decode

    kw = dict(batch=128, heads=8, state="fp32", layout="predecayed")
    library = plan_decode(plan_args.problem(**kw))
    assert plan_args.build_plan(**kw) == library
    tiny = plan_args.build_plan(**kw, override="tiny_batch=true,evict_state_first=true")
    assert tiny == dataclasses.replace(library, tiny_batch=True, evict_state_first=True)
    assert plan_args.build_plan(**kw, override={"maxnreg": 168}).maxnreg == 168


def test_build_plan_rederives_the_fields_that_follow_an_override() -> None:
    """A field the library derives from others follows their override unless it is overridden too: the fused
    advance's reader count follows the value tile, the chunk stages and vector tiles the tensor-core switch, the
    pre-decayed rebase form (2/3) the register cap."""
    fused = dict(batch=128, heads=8, layout="predecayed", advance=True)
    base = plan_args.build_plan(**fused)
    assert (base.value_tile, base.advance_readers) == (128, 8)
    wide = plan_args.build_plan(**fused, override="value_tile=64")
    assert (wide.value_tile, wide.value_chunk, wide.advance_readers) == (64, 16, 16)
    narrow = plan_args.build_plan(**fused, override="value_tile=8")
    assert (narrow.value_chunk, narrow.advance_readers) == (8, 128)
    mma = plan_args.build_plan(batch=4096, heads=8, state="bf16")
    assert mma.tensor_core_chunks and mma.chunk_stages == 3 and mma.vector_tiles == 0 and mma.predecayed_ring == 3
    reg = plan_args.build_plan(batch=4096, heads=8, state="bf16", override="tensor_core_chunks=false,maxnreg=none")
    assert (reg.chunk_stages, reg.vector_tiles, reg.predecayed_ring) == (0, 1, 2)
    kept = plan_args.build_plan(batch=4096, heads=8, state="bf16", override="maxnreg=none,predecayed_ring=3")
    assert (kept.maxnreg, kept.predecayed_ring) == (None, 3)


@pytest.mark.parametrize("kw, override, field", [
    (dict(batch=128, heads=8, layout="predecayed"), "predecayed_ring=0", "predecayed_ring"),
    (dict(batch=128, heads=8, layout="sglang"), "predecayed_ring=2", "predecayed_ring"),
    (dict(batch=128, heads=8, advance=True), "advance_readers=3", "advance_readers"),
    (dict(batch=128, heads=8), "advance_readers=8", "advance_readers"),  # a count without the fused advance
    (dict(batch=128, heads=8), "cursor_table=true", "cursor_table"),
    (dict(batch=128, heads=8, ring_length=16), "ring_length=8", "ring_length"),
    (dict(batch=4096, heads=8, state="bf16"), "vector_tiles=1", "vector_tiles"),  # not on tensor-core chunks
])
def test_build_plan_refuses_an_override_the_call_cannot_run(kw: dict, override: str, field: str) -> None:
    with pytest.raises(ValueError, match=f"DecodePlan: `{field}`"):
        plan_args.build_plan(**kw, override=override)


# --- profile_decode.py / tune_decode.py ---------------------------------------------------------------------------


def test_profile_decode_takes_the_layout_and_a_plan_override(capsys: pytest.CaptureFixture[str]) -> None:
    """``profile_decode.py --ring-layout`` / ``--override`` (plan_args' form) and its cursor check, at argument
    time (the rest needs a GPU)."""
    import profile_decode

    args = profile_decode.parse_args(["--hv", "4", "--batch", "128", "--state", "bf16", "--ring-layout", "sglang",
                                      "--override", "value_tile=64,tensor_core_chunks=true,chunk_stages=5"])
    assert (args.hv, args.batch, args.state, args.ring_layout) == (4, 128, "bf16", "sglang")
    assert args.override == {"value_tile": 64, "tensor_core_chunks": True, "chunk_stages": 5}
    defaults = profile_decode.parse_args([])
    assert defaults.ring_layout == "predecayed" and defaults.override == {} and defaults.cursor == 8
    for bad in (["--cursor", "16"], ["--override", "64:16:1"], ["--ring-layout", "spec"]):
        with pytest.raises(SystemExit):
            profile_decode.parse_args(bad)
    err = capsys.readouterr().err
    assert "--cursor must be in [0, 16), got 16" in err and "expected field=value" in err and "'64:16:1'" in err


def test_tune_decode_candidates_are_plan_overrides(capsys: pytest.CaptureFixture[str]) -> None:
    """``tune_decode.py --override`` takes one plan_args string per candidate, parsed at argument time; the library's
    plan (``default``) is always timed first, alone with ``--default-only``."""
    import tune_decode

    args = tune_decode.parse_args(["--override", "value_tile=64,maxnreg=168", "tiny_batch=true", "--hv", "8"])
    assert args.override == [{"value_tile": 64, "maxnreg": 168}, {"tiny_batch": True}]
    assert tune_decode.candidates(args) == [{}, {"value_tile": 64, "maxnreg": 168}, {"tiny_batch": True}]
    assert [tune_decode.candidate_name(c) for c in tune_decode.candidates(args)] == [
        "default", "value_tile=64,maxnreg=168", "tiny_batch=True"]
    defaults = tune_decode.parse_args([])
    assert [c["value_tile"] for c in defaults.override] == [128, 64, 32, 128]
    assert defaults.override[-1]["num_warps"] == 4 and defaults.ring_layout == "predecayed"
    assert tune_decode.candidates(tune_decode.parse_args(["--default-only"])) == [{}]
    # the plans the candidates name, at one shape
    plans = [plan_args.build_plan(batch=512, heads=32, override=c) for c in tune_decode.candidates(args)]
    assert plans[1].value_tile == 64 and plans[1].maxnreg == 168 and plans[2].tiny_batch
    with pytest.raises(SystemExit):
        tune_decode.parse_args(["--override", "64:16:1"])
    with pytest.raises(SystemExit):
        tune_decode.parse_args(["--state", "fp16"])
    assert "expected field=value" in capsys.readouterr().err


def test_tune_decode_cycles_past_the_l2_by_default() -> None:
    """Small batches must stream from DRAM as in an engine with many layers: the default footprint is
    4x the H200's 60 MiB L2 (at most 256 sets); footprint 0 takes at most 16 sets (small batches then stay in the
    L2)."""
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
    assert tune_decode.slot_sets(1, 8, 16, torch.float32, 0) == 16  # footprint 0: 8 MiB, L2-resident


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


def _bench_row(B: int, ours_us: float | None, **extra: object) -> dict[str, object]:
    row: dict[str, object] = dict(H=8, HV=8, K=128, V=128, B=B, L=16, state="bf16", cache="bf16", act="bf16",
                                  lower_bound=None, ours_us=ours_us, ours_op_us=ours_us, ours_pct_floor=60.0,
                                  fla_us=10.0, ours_check="ok" if ours_us else None)
    row.update(extra)
    return row


def test_plot_results_merges_parts_later_timed_rows_win(tmp_path: Path) -> None:
    """A sweep run in parts: a later file's timed row replaces the same shape's earlier row (a re-run after a
    change) and fills in a row the earlier part skipped; an untimed (skipped) row never replaces a timed
    one; the lower bound -5 and -5.0 are one shape. The Markdown table has one line per shape, says which side is
    faster (an xFLA below 1.00 is printed as it is) and ends with the count of the shapes where FLA is faster."""
    import json

    import plot_results

    first = tmp_path / "a.json"
    second = tmp_path / "b.json"
    first.write_text(json.dumps({"meta": {"gpu": "X"}, "results": [
        _bench_row(32, 9.0), _bench_row(128, 20.0), _bench_row(512, None, skipped="time budget"),
        _bench_row(8, 5.0, lower_bound=-5)]}))
    second.write_text(json.dumps({"meta": {}, "results": [
        _bench_row(128, 17.0), _bench_row(512, 70.0, label="HV8 B512 L16 bf16"),
        _bench_row(32, None, skipped="time budget"),
        _bench_row(8, 4.0, lower_bound=-5.0)]}))
    rows, meta = plot_results.merge_results([first, second])
    assert meta == {"gpu": "X"}
    assert {(r["B"], plot_results._lb_key(r["lower_bound"])): r["ours_us"] for r in rows} == {
        (32, "none"): 9.0, (128, "none"): 17.0, (512, "none"): 70.0, (8, "-5"): 4.0}
    table = plot_results.table_markdown(rows).splitlines()
    assert len(table) == 2 + 4 + 2
    assert table[-3] == "| 16 | none | 8 | bf16 | 32 | 9.0 | 9.0 | - | 60 | 10.0 | 1.11 | ours | ok |"
    assert "| 16 | none | 8 | bf16 | 512 | 70.0 | 70.0 | - | 60 | 10.0 | 0.14 | FLA | ok |" in table
    assert table[-2:] == ["", "FLA faster at 2 of 4 shapes timed on both sides: HV8 B128 L16 bf16, "
                              "HV8 B512 L16 bf16"]
    out = tmp_path / "t.md"
    assert plot_results.main([str(first), str(second), "--table", str(out), "--no-plots"]) == 0
    assert out.read_text().splitlines() == table


def test_tune_decode_predecayed_problem_runs_the_layouts_op() -> None:
    """``tune_decode.py --ring-layout predecayed``: the problem's rings are a consistent pre-decayed layout (keys
    per value head, ``kt * exp(G)`` unit-scale keys) and ``op_launch`` runs the layout's op on them, matching
    its reference (CPU tensors: the library's torch path; tiny shape, every cursor phase). A plan that cannot run
    the call is refused before anything is written."""
    import tune_decode
    from tp_replayssm import reference

    prob = tune_decode.make_problem(2, 1, 2, 3, torch.float32, 1, K=16, V=16, ring_layout="predecayed", device="cpu")
    assert prob["kc"].shape == (2, 2, 3, 16)
    assert torch.isfinite(prob["kc"].float() * torch.exp(prob["g"])).all()
    plan = plan_args.build_plan(batch=2, heads=2, q_heads=1, key_dim=16, value_dim=16, ring_length=3,
                                layout="predecayed", lower_bound=-5.0, override="value_tile=8")
    slots = prob["slot_sets"][0]
    for launch in (tune_decode.op_launch(None, "predecayed", lower_bound=-5.0),
                   tune_decode.op_launch(plan, "predecayed", lower_bound=-5.0)):
        for c in range(3):
            want = {k: prob[k].clone() for k in ("st", "d", "kc", "g")}
            out = torch.empty_like(prob["out"])
            inp, p = prob["inputs"][c], prob["p"]
            reference.replayssm_decode(inp.mixed_qkv, inp.a, inp.b, p.A_log, p.dt_bias, None, want["st"], want["d"],
                                       want["kc"], want["g"], out, slots, prob["cursors"][c], None, True, -5.0,
                                       ring_layout="predecayed")
            launch(prob, slots, c)
            torch.testing.assert_close(prob["out"].float(), out.float(), rtol=2e-2, atol=2e-3)
            for k in want:
                torch.testing.assert_close(prob[k].float(), want[k].float(), rtol=2**-7, atol=1e-5)
    before = prob["st"].clone()
    sglang_plan = plan_args.build_plan(batch=2, heads=2, q_heads=1, key_dim=16, value_dim=16, ring_length=3,
                                       layout="sglang", lower_bound=-5.0)
    with pytest.raises(ValueError, match="predecayed_ring"):
        tune_decode.op_launch(sglang_plan, "predecayed", lower_bound=-5.0)(prob, slots, 0)
    assert torch.equal(prob["st"], before)


def test_pool_overhead_fused_step_matches_the_pool_step() -> None:
    """``bench_pool_overhead.py --fused-advance``: the step whose last decode moves the cursors leaves the pool as
    the step with ``pool.advance`` does (CPU tensors, tiny shape, two layers, one full cursor cycle of each slot
    set), and the cursors back at their start after the cycle. The pool and its bare twin share the ring layout."""
    import copy

    import bench_pool_overhead as bpo

    args = bpo.parse_args(["--layers", "2", "--ring", "3", "--key-dim", "16", "--value-dim", "16", "--state", "fp32",
                           "--act-dtype", "fp32", "--footprint-mb", "0.001", "--max-graph-steps", "12"])
    assert args.ring_layout == "predecayed"
    su = bpo.Setup(2, 2, args, torch.device("cpu"), 0, ops_fn=None)
    assert su.pool.ring_layout == "predecayed" and su.bare[0][2].shape == su.pool.k_cache[0].shape
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

    kinds = sass_hashes.launch_kinds()
    assert len(kinds) >= 100  # launch_kinds raises if two kinds share a name
    plans = [kw["plan"] for kw in kinds.values()]
    assert {p.predecayed_ring > 0 for p in plans} == {False, True}
    assert {(p.tiny_batch, p.tensor_core_chunks, p.use_lower_bound, p.advance_readers > 0) for p in plans} \
        == {(t, m, lb, f) for t in (False, True) for m in (False, True) for lb in (False, True) for f in (False, True)
            if not (t and m)}  # tiny batches never take the tensor-core chunks
    # every value of the vector-tile switch, and the program of HV4 B128 bf16 pre-decayed (64:16, one warp, the
    # append loop's vector tiles) as the one of some shape
    assert {p.vector_tiles for p in plans} == {0, 1, 2}
    target = plan_args.build_plan(batch=128, heads=4, state="bf16", layout="predecayed")
    assert (target.value_tile, target.value_chunk, target.num_warps, target.vector_tiles) == (64, 16, 1, 1)
    assert any(kw["plan"] == target and kw["state"] == "bf16" for kw in kinds.values())
    # the q/k before the verdict both ways on one config (bf16 pre-decayed on the pool's table: on up to 1024 pairs,
    # off at 2048), and the fused conv's modes with both counts' plans (mode 2: the relaxed count)
    early: dict[tuple, set] = {}
    for kw in kinds.values():
        p = kw["plan"]
        if not p.fused_conv:
            rest = (str(p.config), p.value_chunk, p.maxnreg, p.tensor_core_chunks, kw["state"], p.tiny_batch,
                    p.use_lower_bound, p.predecayed_ring, p.cursor_table, p.advance_readers > 0)
            early.setdefault(rest, set()).add(p.early_qk)
    assert {False, True} in early.values()
    convs = [p for p in plans if p.fused_conv]
    assert {p.fused_conv for p in convs} == {1, 2} and all(p.relaxed_conv_count == (p.fused_conv == 2 and p.early_qk)
                                                           for p in convs)


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


def test_bench_pool_step_forms_and_streaming_options() -> None:
    """``bench_pool_step.py``'s forms (the plain decode alone among them) and the options of the state-streaming
    measurements (``--layers``, ``--settle``, ``--conv``); an unknown form is refused when the arguments are parsed."""
    import bench_pool_step as bps

    args = bps.parse_args(["--forms", "decode,fused", "--layers", "8", "--settle", "--conv", "4"])
    assert args.form_list == ("decode", "fused") and args.layers == 8 and args.settle and args.conv == 4
    defaults = bps.parse_args([])
    assert defaults.form_list == ("decode+advance",) and defaults.layers == 1 and not defaults.settle
    assert defaults.conv == 0 and bps.parse_args(["--both"]).form_list == ("decode+advance", "fused")
    with pytest.raises(SystemExit):
        bps.parse_args(["--forms", "decode,verify"])
    args = bps.parse_args(["--override", "early_qk=false", "--fused-override", "value_tile=64"])
    assert args.override == {"early_qk": False} and args.fused_override == {"value_tile": 64}
    with pytest.raises(SystemExit):
        bps.parse_args(["--override", "no_such_field=1"])
    plain, fused = bps.step_plans(32, 8, "bf16", "predecayed", 16, 0, {"early_qk": False}, {})
    assert fused is None and not plain.early_qk and plain.cursor_table and not plain.advance_readers
    plain, fused = bps.step_plans(32, 8, "bf16", "predecayed", 16, 0, {}, {"value_tile": 128})
    assert plain is None and fused.value_tile == 128 and fused.advance_readers == 32  # derived fields follow
    # with the conv: the mode-2 count follows early_qk (the conv after the verdict is fenced) unless named
    plain, fused = bps.step_plans(32, 8, "bf16", "predecayed", 16, 4, {}, {"early_qk": False})
    assert fused.fused_conv == 2 and not fused.early_qk and not fused.relaxed_conv_count
    plain, fused = bps.step_plans(32, 8, "bf16", "predecayed", 16, 4, {}, {"value_tile": 128})
    assert fused.fused_conv == 1 and not fused.relaxed_conv_count
    plain, fused = bps.step_plans(32, 8, "bf16", "predecayed", 16, 4, {}, {"relaxed_conv_count": False})
    assert fused.fused_conv == 2 and fused.early_qk and not fused.relaxed_conv_count
