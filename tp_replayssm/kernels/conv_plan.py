"""The conv kernel's launch plan and its byte count (:mod:`tp_replayssm.kernels.conv` launches it).

:func:`plan_conv` maps a call's sizes to a frozen :class:`ConvPlan`: the kernel (``form``) and its block of channels,
warps, tap width and slot-count step. Two kernels share the contract (docs/conv.md):

- ``"once"`` (:mod:`.conv_once`, one token per row, the library's choice for one-token calls): one-warp programs of
  ``32 * k`` channels, ``k`` channels per thread. A program's fixed work (slot, cursor, the count of rows naming the
  slot, addresses) is shared by its channels and its per-channel work is ~25 instructions, so ``k`` is as large as
  the grid allows: the largest ``k`` in :data:`ONCE_CHANNELS_PER_THREAD` that still gives ``MIN_PROGRAMS_PER_SM``
  programs per SM (latency at small batches: many short programs; issue rate at large ones: fewer, wider ones);
- ``"taps"`` (:func:`.conv.conv_update_kernel`, any number of tokens): ``block_d`` the largest power of two in
  ``[MIN_BLOCK_D, MAX_BLOCK_D]`` that still gives ``MIN_PROGRAMS_PER_SM`` programs per SM, 4 channels per thread.

A benchmark or a test that wants another launch passes its own plan (``dataclasses.replace(plan, form="taps")``);
:meth:`ConvPlan.check` refuses one that cannot run the call. docs/conv.md has the rules' reasons and predictions.
"""

from __future__ import annotations

import dataclasses
import functools

import helion

__all__ = ["CONV_FORMS", "MAX_BLOCK_D", "MIN_BLOCK_D", "MIN_PROGRAMS_PER_SM", "NAMED_BLOCK_MAX",
           "ONCE_CHANNELS_PER_THREAD", "ConvPlan", "conv_bytes", "plan_conv"]

# the kernels: "once" (kernels/conv_once.py, one token per row), "taps" (kernels/conv.py, any number of tokens)
CONV_FORMS = ("once", "taps")
# "taps": the channel block between the smallest that keeps a program's loads wide and the largest that keeps its
# tiles in registers; "once": channels per thread of its one-warp programs (16: 168 registers at W = 4, no spill)
MIN_BLOCK_D, MAX_BLOCK_D = 64, 1024
ONCE_CHANNELS_PER_THREAD = (2, 4, 8, 16)
MIN_PROGRAMS_PER_SM = 2
NAMED_BLOCK_MAX = 256  # rows per step of the slot scan


@dataclasses.dataclass(frozen=True)
class ConvPlan:
    """How a conv launch is compiled: ``block_d`` channels per program, ``num_warps``, ``width_block`` (the power of
    two >= W the taps are computed in), ``named_block`` (rows per step of the slot scan) and ``form``, the kernel
    (:data:`CONV_FORMS`; ``"once"`` runs one token per row only: :meth:`check`)."""

    block_d: int
    num_warps: int
    width_block: int
    named_block: int
    form: str = "taps"

    @property
    def config(self) -> helion.Config:
        """The Helion config (one object per distinct choice: compiled kernels are cached by it)."""
        return _config(self.block_d, self.num_warps, self.form)

    def check(self, tokens: int, kernel_size: int) -> None:
        """``ValueError`` unless this plan can run a call of ``tokens`` tokens per row and kernel ``kernel_size``."""
        if self.form not in CONV_FORMS:
            raise ValueError(f"ConvPlan: `form` must be one of {list(CONV_FORMS)}; got {self.form!r}")
        if self.form == "once" and tokens != 1:
            raise ValueError(f"ConvPlan: form 'once' runs one token per row; this call has {tokens}")
        if self.width_block < kernel_size or self.width_block & (self.width_block - 1):
            raise ValueError(f"ConvPlan: `width_block` must be a power of two >= W = {kernel_size}; got "
                             f"{self.width_block}")
        for name in ("block_d", "num_warps", "named_block"):
            value = getattr(self, name)
            if value < 1 or value & (value - 1):
                raise ValueError(f"ConvPlan: `{name}` must be a power of two; got {value}")


@functools.lru_cache(maxsize=None)
def _config(block_d: int, num_warps: int, form: str = "taps") -> helion.Config:
    extra = {"pid_type": "xyz"} if form == "once" else {}  # (row, block) program ids: no division by B
    return helion.Config(block_sizes=[block_d], indexing="pointer", num_warps=num_warps, num_stages=1, **extra)


def _pow2_at_least(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


@functools.lru_cache(maxsize=None)
def plan_conv(batch: int, channels: int, kernel_size: int, sm_count: int, tokens: int | None = None) -> ConvPlan:
    """The plan of a conv launch of ``batch`` rows, ``channels`` (D) and kernel ``kernel_size`` (W) on a device of
    ``sm_count`` SMs, for ``tokens`` per row: form ``"once"`` for one token, else ``"taps"`` (``tokens=None``: the
    ``"taps"`` plan, which runs any number). The slot scan's step is the batch's power of two in ``[16,
    NAMED_BLOCK_MAX]``; the blocks follow the module docstring."""
    named = min(NAMED_BLOCK_MAX, max(16, _pow2_at_least(batch)))
    width = _pow2_at_least(kernel_size)
    if tokens == 1:
        k = ONCE_CHANNELS_PER_THREAD[0]
        for more in ONCE_CHANNELS_PER_THREAD[1:]:
            if 32 * more > _pow2_at_least(channels) or batch * -(-channels // (32 * more)) < \
                    MIN_PROGRAMS_PER_SM * sm_count:
                break
            k = more
        return ConvPlan(block_d=32 * k, num_warps=1, width_block=width, named_block=named, form="once")
    block = min(MAX_BLOCK_D, max(MIN_BLOCK_D, _pow2_at_least(channels)))
    while block > MIN_BLOCK_D and batch * -(-channels // block) < MIN_PROGRAMS_PER_SM * sm_count:
        block //= 2
    return ConvPlan(block_d=block, num_warps=min(8, max(1, block // 128)), width_block=width, named_block=named)


def conv_bytes(batch: int, channels: int, kernel_size: int, *, tokens: int = 1, act_bytes: int = 2,
               window_bytes: int = 2, weight_bytes: int = 2, bias: bool = True) -> int:
    """The bytes one conv launch must move (its floor): per row the inputs read and the outputs written
    (``tokens * D`` each, ``act_bytes``), the window read and the new window written (``(W-1) * D`` each,
    ``window_bytes``), its slot id and cursor (4 bytes each); once the weights ``[D, W]`` (and bias ``[D]``)."""
    per_row = 2 * tokens * channels * act_bytes + 2 * (kernel_size - 1) * channels * window_bytes + 8
    return batch * per_row + channels * (kernel_size + (1 if bias else 0)) * weight_bytes
