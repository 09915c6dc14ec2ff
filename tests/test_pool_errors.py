"""ReplaySSMStatePool on bad input and in debug mode: the constructor's config checks, bad devices, decode and state
calls with bad arguments (errors that name the caller's arguments and ``slots``), and the debug mode's slot and
cursor checks before any op runs.
"""

from __future__ import annotations

import pytest
import torch

from _pool_helpers import B, DEV, KD, L, S, SMALL, VD, i32, make_pool, params_for, small_inputs
from tp_replayssm import KDAHeads, ReplaySSMStatePool, SlotError
from tp_replayssm.pool import step as pool_module  # (the pool delegates its decode here)
from tp_replayssm.pool.memory import slots_that_fit
from tp_replayssm.pool.agreement import DEBUG_ENV
from tp_replayssm.testing import random_decode_inputs, random_head_params


@pytest.mark.parametrize(
    "kw, needle",
    [
        (dict(heads=(1, 2, 16, 16)), "heads"),
        (dict(num_layers=0), "num_layers"),
        (dict(num_slots=-1), "num_slots"),
        (dict(ring_length=0), "ring_length"),
        (dict(ring_length=2.0), "ring_length"),
        (dict(state_dtype=torch.float16), "state_dtype"),
        (dict(cache_dtype=torch.int8), "cache_dtype"),
        (dict(tp_size=3), "tp=3"),
        (dict(tp_size=2, tp_rank=2), "tp_rank"),
        (dict(heads=KDAHeads(3, 6, 16, 16), tp_size=2, tp_rank=0), "H=3"),
        (dict(ring_layout="pre-decayed"),
         r"`ring_layout` must be one of \['predecayed', 'sglang'\]; got 'pre-decayed'"),
        (dict(ring_layout="spec"), r"`ring_layout` must be one of \['predecayed', 'sglang'\]; got 'spec'"),  # not a layout name
        (dict(ring_layout=None), "`ring_layout`.*got None"),
        (dict(ring_layout="predecayed", cache_dtype=torch.float16), "cache dtype.*float16"),
    ],
)
def test_constructor_rejects_bad_config(kw, needle):
    heads = kw.pop("heads", SMALL)
    with pytest.raises(ValueError, match=needle):
        make_pool(heads, **kw)


def test_default_ring_layout_is_predecayed():
    """The pool's default ring layout is "predecayed" (k ring per value head); "sglang" keeps SGLang's k ring, one
    key per q/k head ``[NL, S, H_l, L, K]``. An fp16 cache needs the sglang layout, and the error says so."""
    heads = KDAHeads(2, 8, KD, VD)  # local shard of tp=2: H_l = 1, HV_l = 4
    pool = make_pool(heads, num_layers=3, tp_rank=1, tp_size=2)
    assert pool.ring_layout == "predecayed" and pool.predecayed
    assert tuple(pool.k_cache.shape) == (3, S, 4, L, KD)
    sglang = make_pool(heads, num_layers=3, tp_rank=1, tp_size=2, ring_layout="sglang")
    assert sglang.ring_layout == "sglang" and not sglang.predecayed
    assert tuple(sglang.k_cache.shape) == (3, S, 1, L, KD)
    for p in (pool, sglang):  # the other tensors do not depend on the layout
        assert tuple(p.checkpoint.shape) == (3, S, 4, VD, KD) and tuple(p.d_cache.shape) == (3, S, 4, L, VD)
        assert tuple(p.g_cache.shape) == (3, S, 4, L, KD) and tuple(p.cursors.shape) == (S + 1,)
    with pytest.raises(ValueError, match="ring_layout='sglang'"):
        make_pool(cache_dtype=torch.float16)
    assert make_pool(cache_dtype=torch.float16, ring_layout="sglang").cache_dtype == torch.float16


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a machine without CUDA")
def test_cuda_device_without_cuda_is_a_clear_error():
    """A CUDA device (by name, torch.device or index) on a machine without CUDA: a ValueError naming `device`, the
    device asked for and the missing CUDA, not torch's bare AssertionError; in the pool and in export_state."""
    pool = make_pool(num_layers=1)
    ids = pool.alloc(1)
    for device, shown in (("cuda", "cuda"), ("cuda:0", "cuda:0"), ("cuda:1", "cuda:1"),
                          (torch.device("cuda", 1), "cuda:1"), (0, "cuda:0")):
        with pytest.raises(ValueError, match="`device`") as info:
            ReplaySSMStatePool(SMALL, num_layers=1, num_slots=S, ring_length=L, device=device)
        assert f"`device` is {shown} " in str(info.value) and "no CUDA device" in str(info.value), info.value
        with pytest.raises(ValueError, match="`device`") as info:
            pool.export_state(ids, device=device)
        assert str(info.value).startswith("ReplaySSMStatePool.export_state: `device` is "), info.value
        assert f"`device` is {shown} " in str(info.value) and "no CUDA device" in str(info.value), info.value
    with pytest.raises(ValueError, match="`device` must name a torch device; got 'gpu'"):
        pool.export_state(ids, device="gpu")


def test_a_device_the_pool_cannot_run_on_is_a_clear_error():
    """A device type other than cpu and cuda (meta aside): a ValueError naming `device`, before any allocation."""
    for device in ("mps", "xla"):
        with pytest.raises(ValueError, match=f"`device` must be a cpu or cuda device; got {device}"):
            ReplaySSMStatePool(SMALL, num_layers=1, num_slots=S, ring_length=L, device=device)


def test_cuda_devices_resolve_on_a_cuda_machine(monkeypatch: pytest.MonkeyPatch):
    """On a machine with CUDA (emulated: two visible devices, the current one cuda:1), every way of naming a visible
    CUDA device resolves to it (an explicit index is kept, ``"cuda"`` and None are the current device) and one past the
    visible devices is a ValueError naming `device`; other device types are still refused."""
    from tp_replayssm.tp import devices

    monkeypatch.setattr(devices, "current_cuda_device", lambda: torch.device("cuda", 1))
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    for device, want in (("cuda:0", "cuda:0"), (torch.device("cuda", 0), "cuda:0"), (0, "cuda:0"), ("cuda:1", "cuda:1"),
                         ("cuda", "cuda:1"), (None, "cuda:1"), ("cpu:0", "cpu")):
        assert devices.resolve_device(device, "pool") == torch.device(want), device
    with pytest.raises(ValueError, match="pool: `device` is cuda:2 but only 2 CUDA device"):
        devices.resolve_device("cuda:2", "pool")
    with pytest.raises(ValueError, match="pool: `device` must be a cpu or cuda device; got mps"):
        devices.resolve_device("mps", "pool")


def test_cpu_backend_variable_reads_as_the_debug_variable(monkeypatch: pytest.MonkeyPatch):
    """TP_REPLAYSSM_CPU_BACKEND: empty is unset (the torch path), case and spaces do not matter, anything else is a
    ValueError naming the variable and its values."""
    from tp_replayssm.kernels.backend import CPU_BACKEND_ENV, cpu_backend

    for value, want in (("", "torch"), (" Torch ", "torch"), ("INTERPRETER", "interpreter")):
        monkeypatch.setenv(CPU_BACKEND_ENV, value)
        assert cpu_backend() == want, value
    monkeypatch.setenv(CPU_BACKEND_ENV, "gpu")
    with pytest.raises(ValueError, match=r"TP_REPLAYSSM_CPU_BACKEND must be one of \['torch', 'interpreter'\]; "
                                         r"got 'gpu'"):
        cpu_backend()


def test_decode_and_state_calls_reject_bad_input():
    pool = make_pool(num_layers=2)
    ids = pool.alloc(2)
    p = params_for(2)
    inp = small_inputs()
    pad = i32([-1] * B)
    args = (inp.mixed_qkv, inp.a, inp.b, p.A_log, p.dt_bias)
    for layer in (-1, 2, True, 0.0, None):
        bad_layer = rf"`layer` must be an int in \[0, num_layers=2\); got {layer}"
        with pytest.raises(ValueError, match=r"ReplaySSMStatePool\.decode: " + bad_layer):
            pool.decode(layer, *args, pad)
        with pytest.raises(ValueError, match=r"ReplaySSMStatePool\.read_state: " + bad_layer):
            pool.read_state(layer, ids)
        with pytest.raises(ValueError, match=r"ReplaySSMStatePool\.load_state: " + bad_layer):
            pool.load_state(layer, ids, torch.zeros(2, 2, VD, KD, device=DEV))
    for bad in (pad.long(), pad[None], [-1] * B):
        with pytest.raises(ValueError, match="slots"):
            pool.decode(0, *args, bad)
        with pytest.raises(ValueError, match="slots"):
            pool.advance(bad)
    with pytest.raises(ValueError, match="mixed_qkv"):  # the op's own check passes through
        pool.decode(0, inp.mixed_qkv[:, :-1], *args[1:], pad)
    for bound in (5.0, float("inf")):  # a gate that grows the state, or none at all
        with pytest.raises(ValueError, match=r"`lower_bound` must be None or a finite float <= 0"):
            pool.decode(0, *args, pad, lower_bound=bound)
    with pytest.raises(ValueError, match="`out` must be of dtype torch.float32; got torch.float16"):
        pool.decode(0, *args, pad, out=torch.empty(B, 1, 2, VD, dtype=torch.float16, device=DEV))
    for ff in (pad.long(), i32([0] * (B - 1)), [0] * B):
        with pytest.raises(ValueError, match="force_flush"):
            pool.advance(pad, ff)
    for states, needle in [(torch.zeros(2, 2, KD, VD + 1), r"\[n, HV_l, V, K\]"),
                           (torch.zeros(1, 2, VD, KD), "shape"),
                           (torch.zeros(2, 2, VD, KD, dtype=torch.int32), "dtype"),
                           (torch.zeros(2, 2, VD, KD, device="meta"), "meta"),
                           (None, "states")]:
        with pytest.raises(ValueError, match=needle):
            pool.load_state(0, ids, states)
    with pytest.raises(ValueError, match="slots"):
        pool.read_state(0, ids.float())
    with pytest.raises(ValueError, match="slots"):
        pool.load_state(0, ids.to("meta"), torch.zeros(2, 2, VD, KD, device=DEV))


def test_decode_batch_mismatch_names_the_tensor_and_slots():
    """The call's batch is the dim-0 size most per-row tensors share, so the error names the tensor that
    disagrees (``mixed_qkv``, not its neighbour ``a``); the pool's errors call the row slots ``slots``."""
    pool = make_pool(num_layers=1)
    pool.alloc(2)
    p = params_for(2)
    inp = small_inputs()
    pad = i32([-1] * B)
    D = inp.mixed_qkv.shape[1]
    for bad in (inp.mixed_qkv[: B - 1], torch.cat([inp.mixed_qkv, inp.mixed_qkv[:2]])):  # too few rows, too many
        for kw in ({}, {"force_flush": i32([0] * B)}):
            with pytest.raises(ValueError, match="`mixed_qkv`") as info:
                pool.decode(0, bad, inp.a, inp.b, p.A_log, p.dt_bias, pad, **kw)
            text = str(info.value)
            assert "`a`" not in text and f"B = {B}" in text, text
            assert f"must be of shape [{B}, {D}]" in text and f"got shape {list(bad.shape)}" in text, text
    with pytest.raises(ValueError, match="`slots`") as info:
        pool.decode(0, inp.mixed_qkv, inp.a, inp.b, p.A_log, p.dt_bias, pad[: B - 1])
    assert "ssm_state_indices" not in str(info.value), info.value
    with pytest.raises(ValueError, match="`force_flush`") as info:
        pool.decode(0, inp.mixed_qkv, inp.a, inp.b, p.A_log, p.dt_bias, pad, force_flush=pad[: B - 1])
    assert "ssm_state_indices" not in str(info.value), info.value


def test_later_decode_errors_name_the_callers_arguments():
    """After a layer's first decode (whose placement check names a misplaced input as a PlacementError) the call's
    own checks still speak of the caller's arguments: a misplaced ``mixed_qkv`` is named against the pool's device
    (not the pool's own tensors against it), and a wrong width gives the width this rank's shard expects (the
    pre-decayed layout cannot infer the q/k heads from the caches)."""
    pool = make_pool(num_layers=1)
    assert pool.ring_layout == "predecayed"
    pool.alloc(2)
    p = params_for(2)
    inp = small_inputs()
    pad = i32([0, 1, -1, -1])
    pool.decode(0, inp.mixed_qkv, inp.a, inp.b, p.A_log, p.dt_bias, pad)
    with pytest.raises(ValueError, match="not on it: mixed_qkv \\(meta\\)$") as info:
        pool.decode(0, inp.mixed_qkv.to("meta"), inp.a, inp.b, p.A_log, p.dt_bias, pad)
    assert f"must be on the pool's device {DEV}" in str(info.value), info.value
    D = inp.mixed_qkv.shape[1]
    with pytest.raises(ValueError, match=rf"`mixed_qkv` must be of shape \[{B}, {D}\]; got \[{B}, {D - 1}\]"):
        pool.decode(0, inp.mixed_qkv[:, 1:], inp.a, inp.b, p.A_log, p.dt_bias, pad)


def test_sharding_errors_name_the_call():
    """A tensor-parallel size the heads cannot split over is refused by the call the user made."""
    heads = KDAHeads(2, 4, KD, VD)
    with pytest.raises(ValueError, match=r"^ReplaySSMStatePool: value heads must split evenly .*tp=3"):
        ReplaySSMStatePool(heads, num_layers=1, num_slots=S, ring_length=L, device="cpu", tp_size=3, tp_rank=0)
    with pytest.raises(ValueError, match=r"^ReplaySSMStatePool: `tp_rank` must be an int in \[0, tp_size=2\)"):
        ReplaySSMStatePool(heads, num_layers=1, num_slots=S, ring_length=L, device="cpu", tp_size=2, tp_rank=2)
    with pytest.raises(ValueError, match=r"^slots_that_fit: value heads must split evenly"):
        slots_that_fit(heads, tp_size=3, num_layers=1, ring_length=L, budget_bytes=2**20)


def test_cpu_with_an_index_is_the_cpu():
    """``device="cpu:0"`` (or ``torch.device("cpu", 0)``) names the CPU, where torch keeps every tensor on "cpu"."""
    for device in ("cpu:0", torch.device("cpu", 0)):
        pool = ReplaySSMStatePool(SMALL, num_layers=1, num_slots=S, ring_length=L, device=device)
        assert pool.device == torch.device("cpu")
        ids = pool.alloc(1)
        inp = random_decode_inputs(1, 1, 2, KD, VD, dtype=torch.float32)
        p = random_head_params(2, KD)
        out = pool.decode(0, inp.mixed_qkv, inp.a, inp.b, p.A_log, p.dt_bias, ids)
        assert out.device == torch.device("cpu") and torch.isfinite(out).all()


@pytest.mark.parametrize("debug", [False, True], ids=["eager", "debug"])
def test_every_slot_error_speaks_of_slots(debug):
    """Every pool method that takes slot ids calls them by its own argument's name (``slots``; ``src``/``dst`` in
    fork), never ``ssm_state_indices`` (the raw op's name): wrong type, dtype, rank or length, and ids out of range
    (raised at the call, or by ``check()`` from the record)."""
    pool = make_pool(num_layers=1, conv_kernel_size=4, debug=debug)
    ids = pool.alloc(2)
    p = params_for(2)
    inp = small_inputs()
    pad = i32([-1] * B)
    qkv = (inp.mixed_qkv, inp.a, inp.b, p.A_log, p.dt_bias)
    T = 2
    drafts = random_decode_inputs(B * T, 1, 2, KD, VD, dtype=torch.float32, device=DEV)
    spec = (drafts.mixed_qkv.view(B, T, -1), drafts.a.view(B, T, -1), drafts.b.view(B, T, -1), p.A_log, p.dt_bias)
    weight = torch.randn(pool.conv_channels, 4, device=DEV)
    x = torch.randn(B, pool.conv_channels, device=DEV)
    states = torch.zeros(2, 2, VD, KD, device=DEV)
    shard = pool.export_state(ids)
    far = i32([S + 5, -1, -1, -1])  # an id out of range
    bad_ids = (pad.long(), pad.float(), pad[None], pad[: B - 1], [-1] * B)  # dtype, rank, length, not a tensor
    calls = {
        "decode": [lambda s=s: pool.decode(0, *qkv, s) for s in bad_ids + (far,)]
        + [lambda: pool.decode(0, *qkv, pad[: B - 1], conv_weight=weight)],
        "advance": [lambda s=s: pool.advance(s) for s in bad_ids[:3] + (bad_ids[4], far)],
        "verify": [lambda s=s: pool.verify(0, *spec, s) for s in bad_ids + (far,)],
        "conv_update": [lambda s=s: pool.conv_update(0, x, weight, s) for s in bad_ids + (far,)],
        "export_state": [lambda s=s: pool.export_state(s) for s in (pad.float(), pad[None, None], [S + 5], "0")],
        "import_state": [lambda s=s: pool.import_state(s, shard) for s in (ids.float(), [S + 5, ids[1].item()])],
        "load_state": [lambda s=s: pool.load_state(0, s, states) for s in (ids.float(), ids[None], [0, 1],
                                                                           i32([S + 5, ids[1].item()]))],
        "read_state": [lambda s=s: pool.read_state(0, s) for s in (ids.float(), ids[None], [0], i32([S + 5]))],
        "read_conv_state": [lambda s=s: pool.read_conv_state(0, s) for s in (ids.float(), ids[None], i32([S + 5]))],
        "free": [lambda s=s: pool.free(s) for s in (ids.float(), ids[None, None], [S + 5], "0")],
    }
    for method, attempts in calls.items():
        for i, attempt in enumerate(attempts):
            with pytest.raises(ValueError) as info:  # SlotError included
                attempt()
                pool.check()  # (eager: a bad id is a padding row, recorded)
            text = str(info.value)
            assert f"ReplaySSMStatePool.{method}" in text, (method, i, text)
            assert "slot" in text and "ssm_state_indices" not in text, (method, i, text)
    # commit: eager, the verify of `far` above opened the step (its row refused); debug refused that verify at the
    # call, so a good verify opens it
    if debug:
        pool.verify(0, *spec, pad)
    for s in (pad.long(), pad[None], pad[: B - 1], [-1] * B):
        with pytest.raises(ValueError, match="ReplaySSMStatePool.commit: `slots`") as info:
            pool.commit(s, i32([0] * B))
        assert "ssm_state_indices" not in str(info.value)
    # eager: the kernel refuses the row, check() reports it; debug: not the step's slots (raised at the call)
    with pytest.raises(ValueError if debug else SlotError, match=r"ReplaySSMStatePool.commit") as info:
        pool.commit(far, i32([0] * B))
        pool.check()
    assert "ssm_state_indices" not in str(info.value)
    if debug:
        pool.commit(pad, i32([0] * B))
    # fork names its own arguments
    for src, dst in ((ids[:1].long(), ids[1:]), (ids[:1], ids[1:][None]), (ids, ids[:1])):
        with pytest.raises(ValueError, match="ReplaySSMStatePool.fork: `src`|`dst`|`src` and `dst`") as info:
            pool.fork(src, dst)
        assert "ssm_state_indices" not in str(info.value)
    with pytest.raises(SlotError, match="ReplaySSMStatePool.fork") as info:
        pool.fork(i32([S + 5]), ids[1:])
        pool.check()
    assert "ssm_state_indices" not in str(info.value)


def test_debug_mode_checks(monkeypatch):
    monkeypatch.delenv(DEBUG_ENV, raising=False)
    assert make_pool().debug is False
    monkeypatch.setenv(DEBUG_ENV, "1")
    pool = make_pool(num_layers=1)
    assert pool.debug is True
    assert make_pool(debug=False).debug is False

    def forbidden(*args, **kwargs):
        raise AssertionError("the op must not run when a debug check fails")

    monkeypatch.setattr(pool_module, "run_decode", forbidden)
    ids = pool.alloc(2).tolist()
    p = params_for(2)
    inp = small_inputs()
    args = (inp.mixed_qkv, inp.a, inp.b, p.A_log, p.dt_bias)
    free_slot = (set(range(S)) - set(ids)).pop()
    for rows, needle in [([ids[0], free_slot, -1, -1], "not allocated"), ([ids[0], S, -1, -1], "out of range"),
                         ([ids[0], ids[0], -1, -1], "more than once")]:
        with pytest.raises(SlotError, match=needle):  # a ValueError
            pool.decode(0, *args, i32(rows))
    pool.cursors[ids[1]] = L
    with pytest.raises(SlotError, match="cursors"):
        pool.decode(0, *args, i32([ids[1], -1, -1, -1]))
    with pytest.raises(SlotError, match="cursors"):
        pool.advance(i32([ids[1]]))
    pool.cursors[ids[1]] = 0
    with pytest.raises(SlotError, match="not allocated"):
        pool.advance(i32([free_slot]))
    before = pool.cursors.clone()
    with pytest.raises(SlotError, match="more than once"):  # a repeat is a bad row (section 5), as on the device
        pool.advance(i32([ids[0], ids[0], -1]))
    assert torch.equal(pool.cursors, before)
    with pytest.raises(SlotError, match="not allocated"):
        pool.read_state(0, i32([free_slot]))
    with pytest.raises(SlotError, match="more than once"):
        pool.load_state(0, i32([ids[0], ids[0]]), torch.zeros(2, 2, VD, KD, device=DEV))
