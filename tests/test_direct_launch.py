"""The direct launch path (:mod:`tp_replayssm.direct_launch`), on CPU with a fake Triton kernel.

What runs here: the table that maps each kernel argument to the input it is a view of (checked against
``ops.kernel_args`` itself), the recording of a plan from a launch, the replay of a plan with integer
addresses, the refusals (unknown launcher options, arguments that are not views of an input, several
launches, a launch hook set), and the metadata key. The real compiled kernel runs through this path in
the GPU tests (``tests/test_op_gpu.py``), which compare it with the reference and with Helion's
dispatch.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from tp_replayssm import direct_launch, ops
from tp_replayssm._validation import validate_decode_inputs
from tp_replayssm.testing import random_decode_inputs, random_head_params


def _decode_inputs(lower_bound: float | None = None):  # noqa: ANN202
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
    inputs = (inp.mixed_qkv, inp.a, inp.b, params.A_log, params.dt_bias, state, d, k, g, out, slots, pos, flush)
    dims = validate_decode_inputs(*inputs[:5], None, *inputs[5:12], flush, lower_bound)
    return dims, inputs


@pytest.mark.parametrize("lower_bound", [None, -5.0])
def test_kernel_arg_table_matches_kernel_args(lower_bound: float | None) -> None:
    dims, inputs = _decode_inputs(lower_bound)
    scale = 0.25
    args = ops.kernel_args(dims, *inputs[:5], scale, *inputs[5:], True, lower_bound, 16)
    assert len(args) == len(ops.KERNEL_ARG_INPUTS)
    storages = [t.untyped_storage().data_ptr() for t in inputs]
    assert len(set(storages)) == len(inputs)  # every input its own storage: the check below can fail
    for i, (arg, j) in enumerate(zip(args, ops.KERNEL_ARG_INPUTS)):
        if isinstance(arg, torch.Tensor):
            assert j is not None, f"kernel argument {i} is a tensor but the table names no input"
            assert arg.untyped_storage().data_ptr() == storages[j], f"kernel argument {i} is not a view of input {j}"
        else:
            assert j is None, f"kernel argument {i} is {arg!r}, the table says input {j}"
    positions = {name: i for i, name in ops.KERNEL_SCALAR_ARGS.items()}
    assert args[positions["scale"]] is scale
    assert args[positions["lower_bound"]] == ops._lower_bound_arg(lower_bound)


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


def _host(jit: _FakeJit, extra: dict | None = None, twice: bool = False):  # noqa: ANN202
    """A stand-in for Helion's generated host code: reorders arguments, adds a size constant."""

    def host(x: torch.Tensor, y: torch.Tensor, scale: float, stride: int, *, _launcher) -> None:  # noqa: ANN001
        for _ in range(2 if twice else 1):
            _launcher(jit, (6,), y, x, stride, scale, 128, num_warps=4, num_stages=1, **(extra or {}))

    return host


def _views():  # noqa: ANN202
    base_x = torch.zeros(64)
    base_y = torch.zeros(8, 8)
    x = base_x[4:20]  # a view 16 bytes into its input
    return (base_x, base_y), (x, base_y.t(), 0.5, 7), (0, 1, None, None)


def test_record_then_replay_with_integer_addresses(monkeypatch: pytest.MonkeyPatch) -> None:
    jit = _FakeJit()
    cache = direct_launch.PlanCache("fake")
    inputs, args, arg_inputs = _views()
    plan = cache.record(("k",), _host(jit), args, arg_inputs, inputs, {2: "scale"})
    assert plan is not None and jit.compiled.handles == 1
    assert plan.grid == (6, 1, 1)
    assert plan.sources == (("input", 1, 0), ("input", 0, 16), ("const", 7), ("scalar", "scale"), ("const", 128))
    assert jit.runs[0]["num_warps"] == 4 and jit.runs[0]["warmup"] is True

    monkeypatch.setattr(direct_launch, "current_stream", lambda index: 1234 + index)
    monkeypatch.setattr(direct_launch, "current_device", lambda: 0)
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

    def compile_config(self, config: object):  # noqa: ANN201
        assert config is self.config
        return _host(self.jit)


def test_launch_takes_the_normal_path_once_then_the_plan(monkeypatch: pytest.MonkeyPatch) -> None:
    jit = _FakeJit()
    kern = _FakeHelionKernel(jit)
    cache = direct_launch.PlanCache("fake")
    monkeypatch.setattr(direct_launch, "current_stream", lambda index: 1234)
    monkeypatch.setattr(direct_launch, "current_device", lambda: 0)
    monkeypatch.setattr(direct_launch, "device_guard", lambda device: contextlib.nullcontext())
    cuda = torch.device("cuda", 0)
    made: list[tuple] = []

    def launch(inputs, args, scale: float) -> None:  # noqa: ANN001
        cache.launch(kern, kern.config, lambda: made.append(args) or args, inputs, cuda, ("extra",),
                     (0, 1, None, None), {"scale": scale}, {2: "scale"})

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
    cache.launch(cpu_kern, cpu_kern.config, lambda: args, inputs, torch.device("cpu"), (), (0, 1, None, None))
    assert cpu_kern.normal_calls == 1 and len(cache.plans) == 2  # off CUDA: never a plan
    # another kernel pinned to the same config (a candidate swapped in by benchmarks/tune_decode.py
    # --kernel) is part of the key: it launches itself and records its own plan, never the first one's
    other = _FakeHelionKernel(jit)
    other.config = kern.config
    cache.launch(other, kern.config, lambda: args2, inputs2, cuda, ("extra",), (0, 1, None, None),
                 {"scale": 0.25}, {2: "scale"})
    assert other.normal_calls == 1 and cache.hits == 1 and len(cache.plans) == 3


def test_compile_options_reach_triton_on_both_paths(monkeypatch: pytest.MonkeyPatch) -> None:
    """A launch choice's register cap (``options``) goes to Triton through Helion's launcher on the normal
    path and into the recorded plan's compile; it is part of the key; None means no option."""
    import helion.runtime

    seen: list[tuple[bool, dict]] = []

    def helion_launcher(triton_kernel, grid, *args, **kwargs):  # noqa: ANN001, ANN202
        recording = isinstance(triton_kernel, direct_launch._CompileOnly)
        seen.append((recording, kwargs))
        return triton_kernel.run(*args, grid=grid, **kwargs) if recording else None

    monkeypatch.setattr(helion.runtime, "default_launcher", helion_launcher)
    monkeypatch.setattr(direct_launch, "current_stream", lambda index: 1234)
    monkeypatch.setattr(direct_launch, "current_device", lambda: 0)
    monkeypatch.setattr(direct_launch, "device_guard", lambda device: contextlib.nullcontext())
    jit = _FakeJit()
    kern = _FakeHelionKernel(jit)
    cache = direct_launch.PlanCache("fake")
    inputs, args, arg_inputs = _views()

    def launch(options: dict) -> None:
        cache.launch(kern, kern.config, lambda: args, inputs, torch.device("cuda", 0), (), arg_inputs,
                     {"scale": 0.5}, {2: "scale"}, options)

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
    cache = direct_launch.PlanCache("fake")
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
    cache = direct_launch.PlanCache("fake")
    inputs, args, arg_inputs = _views()
    assert cache.record(("k",), _host(jit), args, arg_inputs, inputs, {2: "scale"}) is not None
    monkeypatch.setattr(direct_launch, "current_stream", lambda index: 1)
    monkeypatch.setattr(direct_launch, "current_device", lambda: 0)
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
    keys = {name: direct_launch.tensor_key([t])[1] for name, t in views.items()}
    assert keys["aligned_offset"] == keys["plain"]
    for name in ("dtype", "shape", "strides", "misaligned"):
        assert keys[name] != keys["plain"], name
    addresses, _ = direct_launch.tensor_key([views["misaligned"]])
    assert addresses == [views["misaligned"].data_ptr()]


@pytest.mark.parametrize("lower_bound", [None, -5.0])
def test_the_generated_host_code_launches_views_of_the_inputs(lower_bound: float | None) -> None:
    """Helion's host code for the real kernel (built here for the interpreter, nothing launched): every
    tensor it hands Triton is a view of an input at a fixed offset, ``scale`` is passed as a runtime
    scalar, and the only launcher options are the warp and stage counts."""
    from tp_replayssm import kernel as decode_kernel
    from tp_replayssm.configs import select_config

    dims, inputs = _decode_inputs(lower_bound)
    scale = 0.3
    config, value_chunk, _, _ = select_config(dims, torch.float32, torch.device("cpu"))
    args = ops.kernel_args(dims, *inputs[:5], scale, *inputs[5:], True, lower_bound, value_chunk)
    kern = decode_kernel.decode_kernel_for(config)
    host = kern.bind(args).compile_config(config)
    launches: list[tuple] = []
    host(*args, _launcher=lambda fn, grid, *largs, **kw: launches.append((grid, largs, kw)))
    assert len(launches) == 1
    grid, largs, kwargs = launches[0]
    assert set(kwargs) == {"num_warps", "num_stages"}
    assert grid == (dims.batch * dims.num_v_heads * -(-dims.value_dim // config.block_sizes[0]),)
    sources = direct_launch.launch_sources(largs, args, ops.KERNEL_ARG_INPUTS, inputs,
                                           ops.KERNEL_SCALAR_ARGS)
    assert sources is not None
    assert sources.count(("scalar", "scale")) == 1
    assert {s[1] for s in sources if s[0] == "input"} == set(range(len(inputs)))  # every input is used
    q_k_v = sorted(s[2] for s in sources if s[0] == "input" and s[1] == 0)
    itemsize = inputs[0].element_size()
    assert q_k_v == [0, dims.num_q_heads * dims.key_dim * itemsize, 2 * dims.num_q_heads * dims.key_dim * itemsize]


def test_the_advance_kernel_host_code_launches_its_inputs() -> None:
    """The cursor advance kernel (dynamic shapes): its host code passes the three tensors, integers that
    the key determines (sizes, strides, the scratch index, ``ring_length``) and no runtime scalar."""
    from tp_replayssm import cursor_kernel

    B = 5
    inputs = (torch.zeros(9, dtype=torch.int32), torch.arange(B, dtype=torch.int32), torch.zeros(B, dtype=torch.int32))
    args = (*inputs, 16)
    block, warps = cursor_kernel.launch_choice(B)
    kern = cursor_kernel.advance_kernel_for(block, warps)
    launches: list[tuple] = []
    host = kern.bind(args).compile_config(kern.configs[0])
    host(*args, _launcher=lambda fn, grid, *la, **kw: launches.append((la, kw)))
    (largs, kwargs), = launches
    assert set(kwargs) == {"num_warps", "num_stages"}
    sources = direct_launch.launch_sources(largs, args, (0, 1, 2, None), inputs, {})
    assert sources is not None
    assert sorted(s[1] for s in sources if s[0] == "input") == [0, 1, 2]
    consts = [s[1] for s in sources if s[0] == "const"]
    assert B in consts and 16 in consts and 8 in consts  # rows, ring length, scratch index
