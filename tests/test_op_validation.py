"""The decode op's input validation and the reference's: bad inputs are refused naming the argument before anything
is written, tensors off the common device are named, the op's checks run in full once per signature, an empty batch
is a no-op, the scenario harness catches a wrong kernel, and rows that would address outside their slot are padding
rows (the reference and the kernel in the interpreter).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable

import pytest
import torch

from tp_replayssm import ops, reference, validation
from tp_replayssm.validation import DecodeCall, DecodeDims
from _decode_scenario import SENTINEL, run_scenario
from _op_helpers import B, CASES, H, HV, K, L, S, V, _refused_and_unwritten, _tensors


# ---------------------------------------------------------------- validation

with torch.inference_mode():  # an inference tensor, written by a call outside inference mode below
    _INFERENCE_G = torch.randn(S, HV, L, K)

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
    "scale-bool": (dict(scale=True), r"finite float; got True"),
    # the state whose slot count disagrees with the three rings is the one named
    "initial_state-slots": (dict(initial_state=torch.randn(S - 1, HV, V, K)), r"\[5, 4, 16, 16\]; got \[4, 4, 16, 16\]"),
    # tensors the call writes in place: torch would refuse the write after the call's earlier writes
    "d_cache-requires-grad": (dict(d_cache=torch.randn(S, HV, L, V, dtype=torch.bfloat16).requires_grad_()),
                              "requires_grad=True"),
    "out-requires-grad": (dict(out=torch.zeros(B, 1, HV, V, dtype=torch.bfloat16, requires_grad=True)),
                          "requires_grad=True"),
    "g_cache-inference": (dict(g_cache=_INFERENCE_G), r"inside torch.inference_mode\(\)"),
    # an expanded state: a flush of one slot would write every slot
    "initial_state-expanded": (dict(initial_state=torch.randn(1, HV, V, K).expand(S, HV, V, K)),
                               r"strides \[0, "),
}


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
