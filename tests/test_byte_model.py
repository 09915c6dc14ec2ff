"""The decode byte model (tp_replayssm.kernels.byte_model) against hand-counted small cases, then the benchmark that
measures against it (benchmarks/bench_decode.py): its shape lists, arguments, dry run, report and, on CPU tensors,
its step closures and checks. CPU, fast (no interpreter, no GPU)."""

from __future__ import annotations

import dataclasses

import pytest

from tp_replayssm.kernels.byte_model import (
    DecodeConfig,
    dtype_bytes,
    floor_us,
    packed_bytes,
    replay_bytes,
    replay_phase_bytes,
)

# B=2 rows, H=1 q/k head, HV=2 value heads (GQA r=2), K=4, V=2, L=4; fp32 state, bf16 ring and activations.
SMALL = DecodeConfig(batch=2, num_q_heads=1, num_v_heads=2, key_dim=4, value_dim=2, ring_length=4,
                     state_dtype="fp32", cache_dtype="bf16", act_dtype="bf16")
# By hand:
#   state [B, HV, V, K] fp32           = 2*2*2*4*4              = 128
#   ring entry, both rows: d [HV, V] bf16 = 2*2*2 = 8, k [H, K] bf16 = 1*4*2 = 8, g [HV, K] fp32 = 2*4*4 = 32
#                                      -> 48 per row            =  96
#   mixed_qkv [B, 2*H*K + HV*V] bf16   = 2*(8+4)*2              =  48
#   a [B, HV*K] bf16                   = 2*8*2                  =  32
#   b [B, HV] bf16                     = 2*2*2                  =   8
#   ssm_state_indices, write_pos int32 = 2*4 + 2*4              =  16
#   -> inputs                                                   = 104
#   A_log [HV] + dt_bias [HV*K] fp32   = 2*4 + 8*4              =  40
#   out [B, 1, HV, V] bf16             = 2*2*2*2                =  16
STATE, ENTRY, INPUTS, PARAMS, OUT = 128, 96, 104, 40, 16


def test_small_pieces():
    assert SMALL.state_total == STATE
    assert SMALL.ring_entry_total == ENTRY
    assert SMALL.params_in == PARAMS
    assert SMALL.out_total == OUT


@pytest.mark.parametrize(
    "cursor, expected",
    [
        # state read + ring read (c entries) + ring write (1 entry) + inputs + params + out
        (0, STATE + 0 * ENTRY + ENTRY + INPUTS + PARAMS + OUT),  # 384
        (1, STATE + 1 * ENTRY + ENTRY + INPUTS + PARAMS + OUT),  # 480
        (2, STATE + 2 * ENTRY + ENTRY + INPUTS + PARAMS + OUT),  # 576
        # flush: state read + state write + 3 entries read, nothing appended
        (3, STATE + STATE + 3 * ENTRY + INPUTS + PARAMS + OUT),  # 704
    ],
)
def test_small_phases(cursor, expected):
    assert replay_phase_bytes(SMALL, cursor).total == expected


def test_small_cycle_mean():
    r = replay_bytes(SMALL)
    assert r.state_read == 128
    assert r.state_write == 32  # 128 once per 4 steps
    assert r.ring_read == 144  # (0+1+2+3)/4 = 1.5 entries of 96
    assert r.ring_write == 72  # 3 of 4 steps append 96
    assert r.inputs == 104 and r.params == 40 and r.outputs == 16
    assert r.total == 536 == (384 + 480 + 576 + 704) / 4
    assert r.total == sum(replay_phase_bytes(SMALL, c).total for c in range(4)) / 4


def test_small_packed():
    p = packed_bytes(SMALL)
    # state read + write every step; q,k,v,g,beta = 48+32+8; indices 8; params 40; out 16
    assert (p.state_read, p.state_write, p.ring_read, p.ring_write) == (128, 128, 0, 0)
    assert p.inputs == 48 + 32 + 8 + 8
    assert p.total == 408


def test_ring_of_one_flushes_every_step():
    cfg = DecodeConfig(2, 1, 2, key_dim=4, value_dim=2, ring_length=1)
    r = replay_bytes(cfg)
    assert r.ring_read == 0 and r.ring_write == 0
    assert r.state_write == r.state_read == 128
    # same as packed, plus write_pos [B] int32
    assert r.total == packed_bytes(cfg).total + 2 * 4 == 416


def test_force_flush_tensor_is_read():
    cfg = DecodeConfig(2, 1, 2, key_dim=4, value_dim=2, ring_length=4, force_flush=True)
    assert replay_bytes(cfg).total == 536 + 2 * 4


def test_bf16_state_halves_state_terms():
    cfg = DecodeConfig(2, 1, 2, key_dim=4, value_dim=2, ring_length=4, state_dtype="bf16")
    r = replay_bytes(cfg)
    assert (r.state_read, r.state_write) == (64, 16)
    assert r.total == 536 - 64 - 16


def test_lower_bound_does_not_change_bytes():
    a = DecodeConfig(8, 4, 8, ring_length=8)
    b = DecodeConfig(8, 4, 8, ring_length=8, lower_bound=-5.0)
    assert replay_bytes(a) == replay_bytes(b)
    assert packed_bytes(a) == packed_bytes(b)


def test_issue_headline_shape():
    # HV = H = 32, K = V = 128, B = 512, L = 16, fp32 state, bf16 ring and activations.
    cfg = DecodeConfig(512, 32, 32, ring_length=16)
    r = replay_bytes(cfg)
    assert r.state_read == 512 * 32 * 128 * 128 * 4 == 1_073_741_824
    assert r.state_write == 1_073_741_824 / 16
    entry = 512 * (32 * 128 * 2 + 32 * 128 * 2 + 32 * 128 * 4)
    assert r.ring_read == entry * 7.5 and r.ring_write == entry * 15 / 16
    assert r.total == pytest.approx(1.30343e9, rel=1e-5)
    # ~303 us at 4.3 TB/s; the issue's 296 us floor is this byte count at 4.40 TB/s
    assert floor_us(r.total, 4300) == pytest.approx(303.1, abs=0.1)
    assert floor_us(r.total, 4400) == pytest.approx(296.2, abs=0.1)
    # packed decode moves the state twice every step
    assert packed_bytes(cfg).total == pytest.approx(2.1685e9, rel=1e-4)


def test_gqa_ring_keys_per_qk_head():
    gqa = DecodeConfig(4, 16, 32)
    mha = DecodeConfig(4, 32, 32)
    # k ring entries are stored once per q/k head: 16 fewer K-vectors of bf16 per row
    assert mha.ring_entry_total - gqa.ring_entry_total == 4 * 16 * 128 * 2
    # q and k inputs shrink the same way
    assert mha.activations_in - gqa.activations_in == 4 * 2 * 16 * 128 * 2


def test_dtype_bytes():
    assert dtype_bytes("fp32") == 4 and dtype_bytes("torch.bfloat16") == 2 and dtype_bytes(2) == 2

    class FakeDtype:
        itemsize = 2

    assert dtype_bytes(FakeDtype()) == 2
    with pytest.raises(ValueError):
        dtype_bytes("complex7")
    with pytest.raises(TypeError):
        dtype_bytes(True)


def test_config_rejects_bad_sizes():
    with pytest.raises(ValueError, match="num_v_heads"):
        DecodeConfig(1, 3, 4)
    with pytest.raises(ValueError, match="ring_length"):
        DecodeConfig(1, 1, 1, ring_length=0)
    with pytest.raises(ValueError, match="cursor"):
        replay_phase_bytes(DecodeConfig(1, 1, 1, ring_length=4), 4)


def test_floor_us():
    assert floor_us(4.3e9, 4300) == pytest.approx(1000.0)  # 4.3 GB at 4.3 TB/s = 1 ms
    with pytest.raises(ValueError):
        floor_us(1, 0)


# --- the benchmark's shape plan and CPU behaviour (imports benchmarks/bench_decode.py; no GPU) ---------


def _bench_decode():
    import importlib
    import sys
    from pathlib import Path

    bench_dir = str(Path(__file__).resolve().parents[1] / "benchmarks")
    if bench_dir not in sys.path:
        sys.path.insert(0, bench_dir)
    return importlib.import_module("bench_decode")


def test_standard_shapes_cover_the_regimes():
    bd = _bench_decode()
    shapes = bd.shapes_from_args(bd.parse_args([]))
    assert len(shapes) == len(set(shapes))
    assert {s.HV for s in shapes if s.H == s.HV} == {32, 16, 12, 8, 4}
    assert any(s.HV == 2 * s.H for s in shapes)
    assert {s.L for s in shapes} == {8, 16}
    assert {s.B for s in shapes} == {1, 8, 32, 128, 512}
    assert {s.state for s in shapes} == {"fp32", "bf16"}
    assert {s.lb for s in shapes} == {None, -5.0}
    for hv in (32, 8):  # full B sweep with both state dtypes at L = 16
        for st in ("fp32", "bf16"):
            assert {s.B for s in shapes if s.HV == s.H == hv and s.state == st and s.L == 16 and s.lb is None} \
                == {1, 8, 32, 128, 512}


def test_grid_flags_and_dry_run(capsys):
    bd = _bench_decode()
    shapes = bd.shapes_from_args(bd.parse_args(["--heads", "16x32,4", "--batch", "1,8", "--lower-bound", "none,-5"]))
    assert len(shapes) == 2 * 2 * 2 * 2
    assert bd.main(["--quick", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "HV32 B512 L16 fp32" in out and "predecayed ring layout" in out
    assert "128/16/1w vt1 pd2" in out  # the library's plan of that shape (the pool's step)
    assert bd.main(["--heads", "8", "--batch", "128", "--state", "bf16", "--dry-run", "--override",
                    "value_tile=64,tiny_batch=true"]) == 0
    assert " 64/16/1w " in capsys.readouterr().out


def test_launch_plan_override_layout_and_replay_op_flags(capsys):
    """``--override field=value,...`` (plan_args: DecodePlan's fields, checked when the arguments are parsed; every
    shape's plan checked before any GPU work), ``--ring-layout`` (the pool's pre-decayed layout by default) and
    ``--replay-op [NAME=]MODULE:FN``."""
    bd = _bench_decode()
    args = bd.parse_args(["--override", "value_tile=32,value_chunk=32,num_warps=4,tiny_batch=true"])
    assert args.override == {"value_tile": 32, "value_chunk": 32, "num_warps": 4, "tiny_batch": True}
    assert bd.parse_args(["--override", "maxnreg=none"]).override == {"maxnreg": None}
    defaults = bd.parse_args([])
    assert defaults.override == {} and defaults.ring_layout == "predecayed" and defaults.replay_op == []
    plans = bd.plans_for(bd.Shape(8, 8, 512, 16, "fp32", None), bd.parse_args(["--override", "value_tile=64",
                                                                                "--fused-advance"]))
    assert set(plans) == {"op", "pool", "fused"} and {p.value_tile for p in plans.values()} == {64}
    assert not plans["op"].cursor_table and plans["pool"].cursor_table and plans["fused"].advance_readers == 8 * 2
    for bad in (["--override", "32:32:4"], ["--override", "vt=32"], ["--override", "value_tile=x"],
                ["--ring-layout", "spec"], ["--cache-dtype", "fp16"], ["--replay-op", "no_function"]):
        with pytest.raises(SystemExit):
            bd.parse_args(bad)
    err = capsys.readouterr().err
    assert "'vt=32'" in err and "value_tile: expected an int" in err and "needs --ring-layout sglang" in err
    assert "expected [NAME=]MODULE:FN; got 'no_function'" in err
    assert bd.parse_args(["--cache-dtype", "fp16", "--ring-layout", "sglang"]).cache_dtype == "fp16"
    assert bd.replay_op_name("sglang_port.kda:decode") == ("decode", "sglang_port.kda:decode")
    assert bd.replay_op_name("sg=ports.sg:Ops.decode") == ("sg", "ports.sg:Ops.decode")
    # an override some shape cannot run: refused before any GPU work, naming the shape and the field
    assert bd.main(["--heads", "8", "--batch", "1", "--dry-run", "--override", "predecayed_ring=0"]) == 2
    out = capsys.readouterr().out
    assert "HV8 B1 L16 fp32" in out and "`predecayed_ring`" in out


def test_no_cuda_exits_with_a_message(capsys, monkeypatch):
    bd = _bench_decode()
    monkeypatch.setattr(bd.torch.cuda, "is_available", lambda: False)
    assert bd.main(["--quick"]) == 2
    assert "no CUDA device" in capsys.readouterr().out


def test_report_shows_where_fla_is_faster():
    """The table prints ``xFLA = fla_us / ours_us`` as it is (below 1.00 where FLA is faster), says which side won
    each shape, and ends with the count of the shapes FLA wins; shapes not timed on both sides are not counted."""
    import bench_report

    def row(label, ours, fla, **extra):
        r = dict(H=8, HV=8, B=8, L=16, state="fp32", lower_bound=None, label=label, ours_us=ours, fla_us=fla,
                 ours_check="ok", **extra)
        if ours and fla:
            r["speedup_vs_fla"] = fla / ours
        return r

    rows = [row("HV8 B1 L16 fp32", 4.0, 3.0), row("HV8 B8 L16 fp32", 5.0, 10.0), row("HV8 B32 L16 fp32", 5.0, None,
                                                                                      fla_error="ImportError")]
    lines = bench_report.table_lines(rows, [])
    head = lines[0].split()
    assert head[head.index("xFLA") + 1] == "win"
    first, second, third = (line.split() for line in lines[2:5])
    assert first[head.index("xFLA")] == "0.75" and first[head.index("win")] == "FLA"
    assert second[head.index("xFLA")] == "2.00" and second[head.index("win")] == "ours"
    assert third[head.index("win")] == "-" and "!fla: ImportError" in lines[4]
    assert lines[-1] == ("FLA faster at 1 of 2 shapes timed on both sides (xFLA down to 0.75 at HV8 B1 L16 fp32): "
                         "HV8 B1 L16 fp32")
    assert bench_report.fla_summary([rows[1]]) == "FLA faster at 0 of 1 shapes timed on both sides"


@pytest.mark.parametrize("layout", ["sglang", "predecayed"])
def test_pool_steps_match_the_row_cursor_steps(layout):
    """``--advance pool`` (the default): ours reads the pool's cursor table and the pool's advance moves it
    (``--fused-advance``: the decode itself); over two full cycles of two slot sets (CPU tensors, tiny shape) every
    output, checkpoint and ring entry equals the row-cursor path's, and the table is back at its start after each
    cycle. Both ring layouts (pre-decayed: GQA keys per value head, cumulative gates)."""
    import copy

    import torch

    bd = _bench_decode()
    from bench_steps import ours_op, pool_steps, replay_steps

    predecayed = layout == "predecayed"
    args = bd.parse_args(["--footprint-mb", "0.02", "--ring-layout", layout])
    shape = bd.Shape(H=1 if predecayed else 2, HV=2, B=3, L=4, state="fp32", lb=-5.0 if predecayed else None,
                     K=16, V=16)
    buf = bd.Buffers(shape, args, torch.device("cpu"), l2_bytes=0, need_fla=False)
    assert buf.n_sets >= 2 and buf.k.shape[1] == 2 and buf.ring_layout == layout
    if predecayed:  # a consistent pre-decayed ring: kt * exp(G) is a unit key
        keys = buf.k.float() * torch.exp(buf.g)
        torch.testing.assert_close(keys.norm(dim=-1), torch.ones(keys.shape[:-1]), rtol=2e-2, atol=0)
    row = copy.deepcopy(buf)
    fbuf = copy.deepcopy(buf)
    start = buf.cursor_table.clone()
    advance = bd.make_advance("torch", shape.L)
    op = ours_op(layout)
    pooled = pool_steps(buf, shape, l2norm=True)
    rowed = replay_steps(op, row, shape, l2norm=True, advance=advance)
    fused = pool_steps(fbuf, shape, l2norm=True, fused=True)
    assert len(pooled) == len(rowed) == len(fused) == buf.n_sets * shape.L
    assert all(adv is None for _, adv in fused)  # --fused-advance: the decode moves the cursors
    for _ in range(2):
        for (step, adv), (rstep, radv), (fstep, _) in zip(pooled, rowed, fused):
            step(), adv(), rstep(), radv(), fstep()
        assert torch.equal(buf.cursor_table, start)
        assert torch.equal(fbuf.cursor_table[:-1], start[:-1])  # (padding rows' scratch entry: not moved)
    for name in ("state", "d", "k", "g"):
        assert torch.equal(getattr(buf, name), getattr(row, name)), name
        assert torch.equal(getattr(fbuf, name), getattr(row, name)), name
    for out, rout, fout in zip(buf.out, row.out, fbuf.out):
        assert torch.equal(out, rout) and torch.equal(fout, rout)


def test_steps_run_the_plan_they_are_given():
    """``--override``: ours' op and pool steps pass their plan to the launch, which refuses one that does not fit
    the call (here a row-cursor plan on the cursor table) before anything is written."""
    import torch

    bd = _bench_decode()
    from bench_steps import ours_op, pool_steps

    args = bd.parse_args(["--footprint-mb", "0.02", "--override", "value_tile=8"])
    shape = bd.Shape(H=2, HV=2, B=3, L=4, state="fp32", lb=None, K=16, V=16)
    plans = bd.plans_for(shape, args)
    buf = bd.Buffers(shape, args, torch.device("cpu"), l2_bytes=0, need_fla=False)
    for step, adv in pool_steps(buf, shape, l2norm=True, plan=plans["pool"], sets=[0]):
        step(), adv()
    before = buf.state.clone()
    with pytest.raises(ValueError, match="cursor_table"):
        pool_steps(buf, shape, l2norm=True, plan=plans["op"], sets=[0])[0][0]()
    with pytest.raises(ValueError, match="cursor_table"):
        ours_op("predecayed", plans["pool"])(buf.mixed[0], buf.a[0], buf.b[0], buf.A_log, buf.dt_bias, None,
                                             buf.state, buf.d, buf.k, buf.g, buf.out[0], buf.slots[0],
                                             buf.wp_const[0], None, use_qk_l2norm_in_kernel=True)
    assert torch.equal(buf.state, before)


def test_keys_per_value_head_count_the_predecayed_k_ring():
    """The pre-decayed layout's k ring holds one entry per value head: under GQA (H=16, HV=32) every ring
    entry carries HV*K keys instead of H*K; with H = HV nothing changes."""
    gqa = DecodeConfig(8, 16, 32, ring_length=16)
    per_hv = dataclasses.replace(gqa, keys_per_value_head=True)
    assert per_hv.ring_entry_total - gqa.ring_entry_total == 8 * 16 * 128 * 2  # B * (HV - H) * K * bf16
    same = DecodeConfig(8, 32, 32, ring_length=16)
    assert dataclasses.replace(same, keys_per_value_head=True).ring_entry_total == same.ring_entry_total
    assert replay_bytes(per_hv).total > replay_bytes(gqa).total


def test_replay_check_accepts_rebases_and_catches_a_missing_one():
    """``bench_decode --ring-layout predecayed --A-log-shift``: with gates strong enough that heads rebase, an
    appending row's checkpoint is rewritten in those heads. The one-step check must pass the op (rebased heads match
    the reference, the others stay bit-identical, the rebases counted) and fail an op that skips the checkpoint write
    of a rebase."""
    import functools

    import torch

    bd = _bench_decode()
    from bench_steps import check_replay, ours_op
    from tp_replayssm import reference

    ref = functools.partial(reference.replayssm_decode, ring_layout="predecayed")
    args = bd.parse_args(["--footprint-mb", "0.02", "--ring-layout", "predecayed", "--A-log-shift", "6"])
    shape = bd.Shape(H=1, HV=2, B=4, L=4, state="fp32", lb=None, K=16, V=16)
    buf = bd.Buffers(shape, args, torch.device("cpu"), l2_bytes=0, need_fla=False)
    good = check_replay(ours_op("predecayed"), ref, buf, shape, True)
    assert good["rebased"] > 0 and good["untouched_ok"] and good["pad_ok"], good
    assert max(good["err_out"], good["err_state"], good["err_ring"]) < 1e-2, good

    def no_rebase_write(*a, **kw):  # the reference, then the appending rows' checkpoints put back
        state, slots, wp = a[6], a[11], a[12]
        keep = (slots >= 0) & (wp != shape.L - 1)
        saved = state[slots[keep].long()].clone()
        ref(*a, **kw)
        state[slots[keep].long()] = saved

    bad = check_replay(no_rebase_write, ref, buf, shape, True)
    assert bad["err_state"] > 1e-2, bad
