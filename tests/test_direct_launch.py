"""The direct launch path (:mod:`tp_replayssm.kernels.direct`), on CPU with a fake Triton kernel.

What runs here: the map from each kernel argument to the input it is a view of (``LaunchArgs.sources``, as
``kernels.args.decode_kernel_args`` derives it, checked against the storages), the recording of a plan from a
launch, the replay of a plan with integer addresses, the refusals (unknown launcher options, arguments that are not
views of an input, several launches, a launch hook set), and the metadata key. The real compiled kernel runs
through this path in the GPU tests (``tests/test_op_gpu.py``), which compare it with the reference and with
Helion's dispatch.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable

import pytest
import torch

from tp_replayssm.kernels import direct
from tp_replayssm.kernels.args import decode_kernel_args
from tp_replayssm.kernels.decode import replayssm_decode_kernel
from tp_replayssm.kernels.launch import plan_for
from tp_replayssm.testing import random_decode_inputs, random_head_params
from tp_replayssm.kernels.guard import ERROR_WORDS, SlotGuard
from tp_replayssm.validation import CALL_TENSORS, DecodeCall, DecodeDims, validate_decode


def _decode_call(lower_bound: float | None = None) -> tuple[DecodeDims, DecodeCall, tuple[torch.Tensor, ...]]:
    """``(dims, call, inputs)``: a small call with every tensor in its own storage; ``inputs`` are its tensors in
    ``CALL_TENSORS`` order (the launch's inputs)."""
    B, H, HV, K, V, L, S = 3, 2, 4, 16, 16, 4, 5
    inp = random_decode_inputs(B, H, HV, K, V)
    params = random_head_params(HV, K)
    state = torch.zeros(S, HV, V, K)
    d = torch.zeros(S, HV, L, V, dtype=torch.bfloat16)
    k = torch.zeros(S, H, L, K, dtype=torch.bfloat16)
    g = torch.zeros(S, HV, L, K)
    out = torch.zeros(B, 1, HV, V, dtype=inp.mixed_qkv.dtype)
    slots = torch.tensor([0, -1, 3], dtype=torch.int32)
    pos = torch.zeros(B, dtype=torch.int32)
    flush = torch.zeros(B, dtype=torch.int32)
    call = DecodeCall(inp.mixed_qkv, inp.a, inp.b, params.A_log, params.dt_bias, None, state, d, k, g, out, slots,
                      pos, flush, True, lower_bound)
    dims = validate_decode(call)
    guard = SlotGuard(torch.zeros(ERROR_WORDS, dtype=torch.int32), torch.zeros(1, dtype=torch.int32))
    return dims, call, (*(getattr(call, name) for name in CALL_TENSORS), *guard)


@pytest.mark.parametrize("lower_bound", [None, -5.0])
def test_kernel_arg_sources_name_the_call_tensor_each_argument_views(lower_bound: float | None) -> None:
    """``decode_kernel_args(...).sources`` names, for every tensor argument of the kernel, the input (the call's
    tensors in ``CALL_TENSORS`` order, then the slot guard's record and code) that shares its storage, and None for
    every other argument; the runtime scalars sit where ``scalars`` says."""
    dims, call, inputs = _decode_call(lower_bound)
    scale = 0.25
    plan = plan_for(call, dims, ring_layout="sglang", cursor_table=False, advance=False)
    largs = decode_kernel_args(call, dims, plan, scale, call.force_flush, SlotGuard(*inputs[-2:]))
    args = largs.values
    assert len(args) == len(largs.sources) == len(inspect.signature(replayssm_decode_kernel).parameters)
    storages = [t.untyped_storage().data_ptr() for t in inputs]
    assert len(set(storages)) == len(inputs)  # every input its own storage: the check below can fail
    for i, (arg, j) in enumerate(zip(args, largs.sources)):
        if isinstance(arg, torch.Tensor):
            assert j is not None, f"kernel argument {i} is a tensor but its source names no input"
            assert arg.untyped_storage().data_ptr() == storages[j], f"kernel argument {i} is not a view of input {j}"
        else:
            assert j is None, f"kernel argument {i} is {arg!r}, its source says input {j}"
    positions = {name: i for i, name in largs.scalars.items()}
    assert set(positions) == {"scale", "lower_bound"}
    assert args[positions["scale"]] is scale
    assert args[positions["lower_bound"]] == (0.0 if lower_bound is None else lower_bound)


class _FakeCompiled:
    def __init__(self) -> None:
        self.function = 0xF00
        self.packed_metadata = ("meta",)
        self.handles = 0
        self.launches: list[tuple] = []

    def _init_handles(self) -> None:
        self.handles += 1

    def run(self, *args: object) -> None:
        self.launches.append(args)


class _FakeJit:
    """Stands for a Triton JITFunction: ``run(warmup=True)`` returns the compiled kernel, launching nothing."""

    def __init__(self) -> None:
        self.compiled = _FakeCompiled()
        self.runs: list[dict] = []

    def run(self, *args: object, grid: tuple, warmup: bool, **kwargs: object) -> _FakeCompiled:
        self.runs.append(dict(grid=grid, warmup=warmup, **kwargs))
        assert warmup, "recording must not launch"
        return self.compiled


def _host(jit: _FakeJit, extra: dict | None = None, twice: bool = False) -> Callable[..., None]:
    """A stand-in for Helion's generated host code: reorders arguments, adds a size constant."""

    def host(x: torch.Tensor, y: torch.Tensor, scale: float, stride: int, *, _launcher: Callable[..., object]) -> None:
        for _ in range(2 if twice else 1):
            _launcher(jit, (6,), y, x, stride, scale, 128, num_warps=4, num_stages=1, **(extra or {}))

    return host


# where each argument of _views' comes from: its inputs 0 and 1, then two scalars
SOURCES = (0, 1, None, None)


def _views() -> tuple[tuple, tuple, tuple]:
    """``(inputs, args, sources)``: two input tensors and a kernel's arguments, views of them and two scalars."""
    base_x = torch.zeros(64)
    base_y = torch.zeros(8, 8)
    x = base_x[4:20]  # a view 16 bytes into its input
    return (base_x, base_y), (x, base_y.t(), 0.5, 7), SOURCES


def test_record_then_replay_with_integer_addresses(monkeypatch: pytest.MonkeyPatch) -> None:
    jit = _FakeJit()
    cache = direct.PlanCache("fake")
    inputs, args, arg_inputs = _views()
    plan = cache.record(("k",), _host(jit), args, arg_inputs, inputs, {2: "scale"})
    assert plan is not None and jit.compiled.handles == 1
    assert plan.grid == (6, 1, 1)
    assert plan.sources == (("input", 1, 0), ("input", 0, 16), ("const", 7), ("scalar", "scale"), ("const", 128))
    assert jit.runs[0]["num_warps"] == 4 and jit.runs[0]["warmup"] is True

    monkeypatch.setattr(direct, "current_stream", lambda index: 1234 + index)
    monkeypatch.setattr(direct, "current_device", lambda: 0)
    addresses = [1000, 2000]
    assert cache.try_launch(("k",), addresses, {"scale": 0.125}, torch.device("cuda", 0))
    assert cache.hits == 1
    assert jit.compiled.launches == [(6, 1, 1, 1234, 0xF00, ("meta",), None, None, None, 2000, 1016, 7, 0.125, 128)]
    assert not cache.try_launch(("other",), addresses, {"scale": 0.125}, torch.device("cuda", 0))
    assert cache.hits == 1


class _FakeHelionKernel:
    """Stands for a Helion kernel pinned to one config: calling it launches the normal way (counted);
    ``bind(args).compile_config(config)`` gives the generated host code."""

    def __init__(self, jit: _FakeJit) -> None:
        self.jit = jit
        self.normal_calls = 0
        self.config = object()

    def __call__(self, *args: object) -> None:
        self.normal_calls += 1

    def bind(self, args: tuple) -> _FakeHelionKernel:
        return self

    def compile_config(self, config: object) -> Callable[..., None]:
        assert config is self.config
        return _host(self.jit)


def test_launch_takes_the_normal_path_once_then_the_plan(monkeypatch: pytest.MonkeyPatch) -> None:
    jit = _FakeJit()
    kern = _FakeHelionKernel(jit)
    cache = direct.PlanCache("fake")
    monkeypatch.setattr(direct, "current_stream", lambda index: 1234)
    monkeypatch.setattr(direct, "current_device", lambda: 0)
    monkeypatch.setattr(direct, "device_guard", lambda device: contextlib.nullcontext())
    cuda = torch.device("cuda", 0)
    made: list[tuple] = []

    def launch(inputs: tuple, args: tuple, scale: float) -> None:
        cache.launch(kern, kern.config, lambda: made.append(args) or direct.LaunchArgs(args, SOURCES, {2: "scale"}),
                     inputs, cuda, ("extra",), {"scale": scale})

    inputs, args, _ = _views()
    launch(inputs, args, 0.5)  # normal launch, then the plan is recorded
    assert kern.normal_calls == 1 and len(made) == 1 and cache.hits == 0 and not jit.compiled.launches
    inputs2, args2, _ = _views()  # fresh tensors, same metadata: the plan, no argument building
    launch(inputs2, args2, 0.25)
    assert kern.normal_calls == 1 and len(made) == 1 and cache.hits == 1
    (launched,) = jit.compiled.launches
    assert launched[9:] == (inputs2[1].data_ptr(), inputs2[0].data_ptr() + 16, 7, 0.25, 128)
    launch((inputs2[0][:40], inputs2[1]), args2, 0.25)  # another shape of input 0: a new key, normal path
    assert kern.normal_calls == 2 and cache.hits == 1
    cpu_kern = _FakeHelionKernel(jit)
    cache.launch(cpu_kern, cpu_kern.config, lambda: direct.LaunchArgs(args, SOURCES, {}), inputs, torch.device("cpu"),
                 ())
    assert cpu_kern.normal_calls == 1 and len(cache.plans) == 2  # off CUDA: never a plan
    # another kernel pinned to the same config (a candidate swapped in by benchmarks/tune_decode.py
    # --kernel) is part of the key: it launches itself and records its own plan, never the first one's
    other = _FakeHelionKernel(jit)
    other.config = kern.config
    cache.launch(other, kern.config, lambda: direct.LaunchArgs(args2, SOURCES, {2: "scale"}), inputs2, cuda,
                 ("extra",), {"scale": 0.25})
    assert other.normal_calls == 1 and cache.hits == 1 and len(cache.plans) == 3


def test_compile_options_reach_triton_on_both_paths(monkeypatch: pytest.MonkeyPatch) -> None:
    """A launch plan's register cap (``options``) goes to Triton through Helion's launcher on the normal
    path and into the recorded plan's compile; it is part of the key; None means no option."""
    import helion.runtime

    seen: list[tuple[bool, dict]] = []

    def helion_launcher(triton_kernel: object, grid: tuple, *args: object, **kwargs: object) -> object:
        recording = isinstance(triton_kernel, direct._CompileOnly)
        seen.append((recording, kwargs))
        return triton_kernel.run(*args, grid=grid, **kwargs) if recording else None

    monkeypatch.setattr(helion.runtime, "default_launcher", helion_launcher)
    monkeypatch.setattr(direct, "current_stream", lambda index: 1234)
    monkeypatch.setattr(direct, "current_device", lambda: 0)
    monkeypatch.setattr(direct, "device_guard", lambda device: contextlib.nullcontext())
    jit = _FakeJit()
    kern = _FakeHelionKernel(jit)
    cache = direct.PlanCache("fake")
    inputs, args, arg_inputs = _views()

    def launch(options: dict) -> None:
        cache.launch(kern, kern.config, lambda: direct.LaunchArgs(args, arg_inputs, {2: "scale"}), inputs,
                     torch.device("cuda", 0), (), {"scale": 0.5}, options)

    launch({"maxnreg": 64})
    capped = {"num_warps": 4, "num_stages": 1, "maxnreg": 64}
    assert kern.normal_calls == 0  # not kernel(*args): the generated host code with Helion's launcher
    assert seen == [(False, capped), (True, capped)]  # the launch, then the recording of the same kernel
    assert jit.runs == [dict(grid=(6,), warmup=True, **capped)]
    launch({"maxnreg": 64})
    assert cache.hits == 1 and len(seen) == 2 and jit.compiled.launches
    launch({"maxnreg": None})  # no cap: another key, the plain normal path, its own plan
    assert kern.normal_calls == 1 and cache.hits == 1 and len(cache.plans) == 2
    assert seen[-1] == (True, {"num_warps": 4, "num_stages": 1})
    # Helion's own launcher options that only shape the compiled kernel are replayed (PDL, a cap)
    pdl = _host(jit, extra={"launch_pdl": True})
    assert cache.record(("pdl",), pdl, args, arg_inputs, inputs, {2: "scale"}) is not None


@pytest.mark.parametrize("case", ["launcher_option", "two_launches", "foreign_tensor", "ambiguous_tensor"])
def test_unrecordable_launches_keep_the_normal_path(case: str) -> None:
    jit = _FakeJit()
    cache = direct.PlanCache("fake")
    inputs, args, arg_inputs = _views()
    host = _host(jit)
    if case == "launcher_option":
        host = _host(jit, extra={"launch_cooperative_grid": True})
    elif case == "two_launches":
        host = _host(jit, twice=True)
    elif case == "foreign_tensor":
        args = (torch.zeros(16), *args[1:])  # not a view of input 0
    elif case == "ambiguous_tensor":
        args = (args[0], args[0], *args[2:])  # one object in two argument positions
    assert cache.record(("k",), host, args, arg_inputs, inputs, {2: "scale"}) is None
    assert ("k",) in cache.plans  # remembered: no second attempt per call
    assert not cache.try_launch(("k",), [0, 0], {"scale": 1.0}, torch.device("cuda", 0))
    assert not jit.compiled.launches


def test_a_launch_hook_turns_the_direct_path_off(monkeypatch: pytest.MonkeyPatch) -> None:
    knobs = pytest.importorskip("triton").knobs
    jit = _FakeJit()
    cache = direct.PlanCache("fake")
    inputs, args, arg_inputs = _views()
    assert cache.record(("k",), _host(jit), args, arg_inputs, inputs, {2: "scale"}) is not None
    monkeypatch.setattr(direct, "current_stream", lambda index: 1)
    monkeypatch.setattr(direct, "current_device", lambda: 0)
    hook = knobs.runtime.launch_enter_hook
    if hasattr(hook, "add"):  # a HookChain (newer triton); None on triton 3.6
        monkeypatch.setattr(hook, "calls", [lambda *a: None])
    else:
        monkeypatch.setattr(knobs.runtime, "launch_enter_hook", lambda *a: None)
    assert not cache.try_launch(("k",), [0, 0], {"scale": 1.0}, torch.device("cuda", 0))
    assert not jit.compiled.launches


def test_tensor_key_sees_dtype_shape_strides_and_alignment() -> None:
    base = torch.zeros(4, 40)
    views = {
        "plain": base[:, :32],
        "dtype": base.to(torch.float64)[:, :32],
        "shape": base[:3, :32],
        "strides": base.t().contiguous().t()[:, :32],
        "misaligned": base[:, 1:33],  # 4 bytes off: not 16-byte aligned
        "aligned_offset": base[:, 4:36],  # 16 bytes off: same alignment class as plain
    }
    keys = {name: direct.tensor_key([t])[1] for name, t in views.items()}
    assert keys["aligned_offset"] == keys["plain"]
    for name in ("dtype", "shape", "strides", "misaligned"):
        assert keys[name] != keys["plain"], name
    addresses, _ = direct.tensor_key([views["misaligned"]])
    assert addresses == [views["misaligned"].data_ptr()]


@pytest.mark.parametrize("lower_bound", [None, -5.0])
def test_the_generated_host_code_launches_views_of_the_inputs(lower_bound: float | None) -> None:
    """Helion's host code for the real kernel (built here for the interpreter, nothing launched): every
    tensor it hands Triton is a view of an input at a fixed offset, ``scale`` is passed as a runtime
    scalar, and the only launcher options are the warp and stage counts."""
    from tp_replayssm.kernels.decode import decode_kernel_for

    dims, call, inputs = _decode_call(lower_bound)
    scale = 0.3
    plan = plan_for(call, dims, ring_layout="sglang", cursor_table=False, advance=False)
    config = plan.config
    built = decode_kernel_args(call, dims, plan, scale, call.force_flush, SlotGuard(*inputs[-2:]))
    args = built.values
    kern = decode_kernel_for(config)
    host = kern.bind(args).compile_config(config)
    launches: list[tuple] = []
    host(*args, _launcher=lambda fn, grid, *largs, **kw: launches.append((grid, largs, kw)))
    assert len(launches) == 1
    grid, largs, kwargs = launches[0]
    assert set(kwargs) == {"num_warps", "num_stages"}
    assert grid == (dims.batch * dims.num_v_heads * -(-dims.value_dim // config.block_sizes[0]),)
    sources = direct.launch_sources(largs, args, built.sources, inputs, built.scalars)
    assert sources is not None
    assert sources.count(("scalar", "scale")) == 1
    # every call tensor is used (the op's per-row cursors: the slot guard's tensors are not)
    assert {s[1] for s in sources if s[0] == "input"} == set(range(len(CALL_TENSORS)))
    q_k_v = sorted(s[2] for s in sources if s[0] == "input" and s[1] == 0)
    itemsize = inputs[0].element_size()
    assert q_k_v == [0, dims.num_q_heads * dims.key_dim * itemsize, 2 * dims.num_q_heads * dims.key_dim * itemsize]


def test_the_advance_kernel_host_code_launches_its_inputs() -> None:
    """The cursor advance kernel (dynamic shapes): its host code passes the five tensors (cursors, slots, flags,
    the slot guard's record and code), integers that the key determines (sizes, strides, the scratch index,
    ``ring_length``) and no runtime scalar."""
    from tp_replayssm.kernels import cursor as cursor_kernel

    B = 5
    inputs = (torch.zeros(9, dtype=torch.int32), torch.arange(B, dtype=torch.int32), torch.zeros(B, dtype=torch.int32),
              torch.zeros(ERROR_WORDS, dtype=torch.int32), torch.zeros(1, dtype=torch.int32))
    args = (*inputs, 16)
    block, warps = cursor_kernel.launch_choice(B)
    kern = cursor_kernel.advance_kernel_for(block, warps)
    launches: list[tuple] = []
    host = kern.bind(args).compile_config(kern.configs[0])
    host(*args, _launcher=lambda fn, grid, *la, **kw: launches.append((la, kw)))
    (largs, kwargs), = launches
    assert set(kwargs) == {"num_warps", "num_stages"}
    sources = direct.launch_sources(largs, args, (0, 1, 2, 3, 4, None), inputs, {})
    assert sources is not None
    assert sorted(s[1] for s in sources if s[0] == "input") == [0, 1, 2, 3, 4]
    consts = [s[1] for s in sources if s[0] == "const"]
    assert B in consts and 16 in consts and 8 in consts  # rows, ring length, scratch index
