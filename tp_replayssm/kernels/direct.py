"""Eager launches of a compiled Helion kernel without Helion's and Triton's per-call dispatch.

An eager ``kernel(*args)`` call costs ~70-80 us of host time on the H200 machine before the GPU sees anything:
Helion matches the arguments to a bound kernel and runs its generated host function, then Triton binds ~30
arguments, computes their specialization key and asks the driver for every pointer's attributes. All of that is a
pure function of the inputs' metadata. So the first call of a metadata key takes the normal path and records a
:class:`LaunchPlan` (the compiled Triton kernel, the grid, and where each launch argument comes from); later calls
with the same key go straight to the compiled kernel's C launcher with integer device addresses.

The key holds everything the compiled code or the argument values depend on besides the data addresses and the
runtime scalars: the kernel, its config, the caller's key (the decode kernel's :class:`~.plan.DecodePlan`), launcher
options, the device, and per input tensor its dtype, shape, strides and address modulo 16 (Triton specializes
pointers on 16-byte alignment). Each kernel argument that is a view of an input has a fixed byte offset from it
(:class:`LaunchArgs` says which input; the recorder checks the storage); integer arguments are functions of the key
and are recorded as constants. Only CUDA launches take this path; the interpreter and a launch hook set on Triton
(a profiler) keep the normal one, and ``TP_REPLAYSSM_DIRECT_LAUNCH=0`` turns it off. docs/kernel_design.md has more.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
from collections.abc import Callable, Sequence
from typing import Any

import torch

logger = logging.getLogger(__name__)

ENABLED = os.environ.get("TP_REPLAYSSM_DIRECT_LAUNCH", "1") != "0"

# Source of one argument of the Triton launch: ("input", j, byte offset) = address of input tensor j
# plus an offset; ("scalar", name) = a runtime scalar of the call; ("const", value).
Source = tuple


@dataclasses.dataclass(frozen=True)
class LaunchArgs:
    """A kernel's positional arguments, ``values``; ``sources[i]``: the index in the launch's ``inputs`` of the
    tensor ``values[i]`` is a view of (None for a scalar); ``scalars``: the positions of the runtime scalars (whose
    value may change between launches of one plan), by name."""

    values: tuple
    sources: tuple[int | None, ...]
    scalars: dict[int, str]


def ordered_args(params: Sequence[str], tensors: dict[str, tuple[torch.Tensor, str]], values: dict[str, object],
                 inputs: dict[str, int], runtime: Sequence[str] = ("scale", "lower_bound")) -> LaunchArgs:
    """A kernel's :class:`LaunchArgs` in its signature's order ``params``: ``tensors`` maps a parameter to (its value,
    the name of the input it views), ``values`` maps every other parameter to its value, ``inputs`` maps input names to
    their index in the launch's inputs, and the parameters named in ``runtime`` are runtime scalars."""
    args, sources, scalars = [], [], {}
    for i, name in enumerate(params):
        if name in tensors:
            value, source = tensors[name]
            args.append(value)
            sources.append(inputs[source])
        else:
            args.append(values[name])
            sources.append(None)
            if name in runtime:
                scalars[i] = name
    return LaunchArgs(tuple(args), tuple(sources), scalars)


def cache_strides(*strides: tuple[int, int, int]) -> dict[str, int]:
    """The decode-family kernels' cache stride arguments, ``st_* / dr_* / kr_* / gr_*`` (slot, head, row), from the
    outer strides of the checkpoint's and the three rings' row views, in that order."""
    names = ("st_s", "st_h", "st_v", "dr_s", "dr_h", "dr_l", "kr_s", "kr_h", "kr_l", "gr_s", "gr_h", "gr_l")
    return dict(zip(names, (v for st in strides for v in st)))


@dataclasses.dataclass(frozen=True)
class LaunchPlan:
    """One recorded launch: call ``run(grid..., stream, function, metadata, None, None, None, *args)``."""

    run: Callable[..., Any]
    function: int
    packed_metadata: Any
    grid: tuple[int, int, int]
    sources: tuple[Source, ...]

    def launch(self, addresses: Sequence[int], scalars: dict[str, object], stream: int) -> None:
        args = [addresses[s[1]] + s[2] if s[0] == "input" else scalars[s[1]] if s[0] == "scalar" else s[1]
                for s in self.sources]
        self.run(*self.grid, stream, self.function, self.packed_metadata, None, None, None, *args)


class PlanCache:
    """Launch plans of one kernel by metadata key; ``None`` marks a key that cannot have one."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.plans: dict[tuple, LaunchPlan | None] = {}
        self.hits = 0  # direct launches so far (tests read it)
        # the kernels and configs named (by id) in keys, kept alive so that an id is never reused
        self._named: dict[int, Any] = {}

    def launch(self, kernel: Any, config: Any, make_args: Callable[[], LaunchArgs],
               inputs: Sequence[torch.Tensor], device: torch.device, key: tuple,
               scalars: dict[str, object] | None = None, options: dict[str, object] | None = None) -> None:
        """Launch the Helion ``kernel`` pinned to ``config`` on ``make_args()``, whose tensors are views of
        ``inputs``. On CUDA: directly when this call's key has a plan, else the normal way (under a device guard),
        recording a plan. The full key is ``kernel``, ``config``, ``key``, ``options``, the device and
        :func:`tensor_key` of ``inputs``; ``scalars`` are the runtime scalars' values by name. ``options`` are
        Triton compile options that Helion's config cannot carry (``{"maxnreg": 168}``). ``make_args`` runs only on
        the normal path."""
        options = {k: v for k, v in options.items() if v is not None} if options else {}
        direct = device.type == "cuda" and ENABLED
        if direct:
            addresses, meta = tensor_key(inputs)
            # objects in the key (kernel, config, a plan) by identity, kept alive so that an id is never reused
            ids = tuple(k if isinstance(k, _PLAIN) else self._named.setdefault(id(k), (id(k), k))[0]
                        for k in (kernel, config, *key))
            opts = tuple(sorted(options.items())) if options else ()
            full_key = (*ids, opts, device.index, meta)
            if self.try_launch(full_key, addresses, scalars or {}, device):
                return
        largs = make_args()
        args = largs.values
        recording = direct and full_key not in self.plans
        with device_guard(device):
            # Helion's generated host code for these arguments: needed to pass options, and to record
            host = kernel.bind(args).compile_config(config) if options or recording else None
            if options:
                host(*args, _launcher=_with_options(options))
            else:
                kernel(*args)
            if recording:
                self.record(full_key, host, args, largs.sources, inputs, largs.scalars, options)

    def try_launch(self, key: tuple, addresses: Sequence[int], scalars: dict[str, object],
                   device: torch.device) -> bool:
        """Launch through the plan of ``key`` if there is one; False means: take the normal path."""
        plan = self.plans.get(key)
        if plan is None or not _hooks_off():
            return False
        stream = current_stream(device.index)
        if current_device() == device.index:
            plan.launch(addresses, scalars, stream)
        else:  # the compiled function belongs to the device's context
            with torch.cuda.device(device):
                plan.launch(addresses, scalars, stream)
        self.hits += 1
        return True

    def record(self, key: tuple, host: Callable[..., Any], args: Sequence[object],
               arg_inputs: Sequence[int | None], inputs: Sequence[torch.Tensor],
               scalar_names: dict[int, str], options: dict[str, object] | None = None) -> LaunchPlan | None:
        """Record the plan of ``key`` by running Helion's generated host function ``host(*args)`` with a
        launcher that compiles (or finds) the Triton kernel without launching it. ``arg_inputs[i]`` is the
        index in ``inputs`` of the tensor that ``args[i]`` is a view of (None for non-tensors);
        ``scalar_names`` names the positions of ``args`` that hold runtime scalars. The caller has
        already launched the kernel for this call the normal way, with the same ``options``."""
        if key in self.plans:
            return self.plans[key]
        calls: list[tuple] = []

        def recorder(triton_kernel: Any, grid: tuple[int, ...], *largs: object, **kwargs: object) -> Any:
            # Helion's own launcher, so Triton sees the very options of the launch that just ran (and
            # returns that compiled kernel from its cache), with the launch itself turned off
            compiled = None
            kwargs = {**kwargs, **(options or {})}
            if set(kwargs) <= _REPLAYED_OPTIONS:
                compiled = helion_launcher(_CompileOnly(triton_kernel), grid, *largs, **kwargs)
            calls.append((grid, largs, kwargs, compiled))
            return compiled

        from helion.runtime import default_launcher as helion_launcher

        plan = None
        try:
            host(*args, _launcher=recorder)
            plan = _plan_from(calls, args, arg_inputs, inputs, scalar_names)
        except Exception as exc:  # noqa: BLE001 - any surprise means: no plan, normal path
            logger.warning("%s: no direct launch plan (%s: %s); eager calls keep Helion's dispatch",
                           self.name, type(exc).__name__, exc)
        if plan is None:
            logger.info("%s: launch not recordable, eager calls keep Helion's dispatch", self.name)
        self.plans[key] = plan
        return plan


_PLAIN = (int, float, str, bool, type(None))

# Launcher options that only shape the compiled kernel (the plan replays that kernel as compiled)
_REPLAYED_OPTIONS = frozenset({"num_warps", "num_stages", "maxnreg", "launch_pdl"})


def _with_options(options: dict[str, object]) -> Callable[..., Any]:
    """Helion's default launcher with extra Triton compile options."""
    from helion.runtime import default_launcher

    def launcher(triton_kernel: Any, grid: tuple[int, ...], *args: object, **kwargs: object) -> Any:
        return default_launcher(triton_kernel, grid, *args, **kwargs, **options)

    return launcher


class _CompileOnly:
    """A Triton ``JITFunction`` stand-in whose ``run`` compiles or finds the kernel but launches nothing."""

    def __init__(self, fn: Any) -> None:
        self.fn = fn

    def run(self, *args: object, **kwargs: object) -> Any:
        kwargs["warmup"] = True
        return self.fn.run(*args, **kwargs)


def current_stream(index: int) -> int:
    """The raw handle of the current CUDA stream of device ``index`` (what Triton launches on)."""
    return torch._C._cuda_getCurrentRawStream(index)


def current_device() -> int:
    return torch._C._cuda_getDevice()


def device_guard(device: torch.device) -> contextlib.AbstractContextManager:
    """``device`` made current for a CUDA launch; nothing elsewhere (the interpreter)."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def _hooks_off() -> bool:
    try:
        from triton import knobs
    except ImportError:  # pragma: no cover - older triton
        return True
    # None (triton 3.6) or an empty HookChain (newer triton) means: no hook registered
    return all(h is None or getattr(h, "calls", None) == [] for h in
               (knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook))


def _plan_from(calls: list[tuple], args: Sequence[object], arg_inputs: Sequence[int | None],
               inputs: Sequence[torch.Tensor], scalar_names: dict[int, str]) -> LaunchPlan | None:
    if len(calls) != 1:
        return None
    grid, largs, kwargs, compiled = calls[0]
    if compiled is None or not {"num_warps", "num_stages"} <= set(kwargs) <= _REPLAYED_OPTIONS:
        return None  # launcher options this recorder does not replay
    if len(grid) > 3 or not all(isinstance(g, int) for g in grid):
        return None
    sources = launch_sources(largs, args, arg_inputs, inputs, scalar_names)
    if sources is None:
        return None
    compiled._init_handles()
    grid3 = tuple(grid) + (1,) * (3 - len(grid))
    return LaunchPlan(compiled.run, compiled.function, compiled.packed_metadata, grid3, sources)


def launch_sources(largs: Sequence[object], args: Sequence[object], arg_inputs: Sequence[int | None],
                   inputs: Sequence[torch.Tensor], scalar_names: dict[int, str]) -> tuple[Source, ...] | None:
    """Where each argument ``largs`` of a Triton launch comes from (see :class:`PlanCache.record`), or
    None when one of them is not understood."""
    sources: list[Source] = []
    for value in largs:
        hits = [i for i, arg in enumerate(args) if arg is value]
        if isinstance(value, torch.Tensor):
            if len(hits) != 1 or arg_inputs[hits[0]] is None:
                return None
            j = arg_inputs[hits[0]]
            base = inputs[j]
            if value.untyped_storage().data_ptr() != base.untyped_storage().data_ptr():
                raise ValueError(f"kernel argument {hits[0]} is not a view of input {j}")
            sources.append(("input", j, value.data_ptr() - base.data_ptr()))
        elif isinstance(value, float) and len(hits) == 1 and hits[0] in scalar_names:
            sources.append(("scalar", scalar_names[hits[0]]))
        elif isinstance(value, (bool, int)) or value is None:
            sources.append(("const", value))  # a function of the key (sizes, strides, constexprs)
        else:
            return None
    return tuple(sources)


def tensor_key(tensors: Sequence[torch.Tensor]) -> tuple[list[int], tuple]:
    """``(addresses, key part)`` of the input tensors: the address of each, and per tensor its dtype,
    shape, strides and address modulo 16."""
    addresses = [t.data_ptr() for t in tensors]
    meta = tuple((t.dtype, t.shape, t.stride(), p & 15) for t, p in zip(tensors, addresses))
    return addresses, meta
