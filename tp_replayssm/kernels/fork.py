"""The pool's fork in one launch (:meth:`tp_replayssm.pool.ReplaySSMStatePool.fork`).

A fork makes every layer's checkpoint, rings (d, k, g), conv window and the cursor of slot ``dst[i]`` byte copies
of slot ``src[i]``'s. Every pool tensor is ``[NL, S', ...]`` (``S' = S`` or ``S + 1``) with a contiguous slot block
``t[layer, slot]``, so each is copied as int32 words (:func:`word_view`): ``W_t`` words per slot block, at word
``layer * ls_t + slot * ss_t`` of the tensor's word view.

One program per (chunk, layer, pair): the grid is ``[C, NL, n]`` (:func:`plan_fork`), fixed by the shapes alone,
so a captured fork replays with any ids. Chunk ``c`` of a pair and layer copies words ``[c * b_t, (c + 1) * b_t)``
of every tensor's slot block (masked to ``W_t``), with per-tensor blocks ``b_t`` (powers of two) sized so that
every tensor spreads over the same ``C`` chunks: each program moves about the same bytes. A program

1. reads its pair's ids (a padding pair's programs, ``dst < 0``, stop there) and issues the loads of its chunks
   from ``src`` (their addresses depend on ``src`` only, so their latency overlaps the verdict's loads);
2. decides the pair's verdict exactly as :func:`tp_replayssm.pool.lifecycle.pair_verdict` does: ``src`` and
   ``dst`` in ``[0, S)``, allocated (cursor in ``[0, L-1]``; a free slot's is ``FREE_CURSOR``), ``dst`` the
   ``dst`` of this pair alone and the ``src`` of none, ``src`` the ``dst`` of none (a source may feed several
   pairs), among the call's non-padding pairs (a scan of the call's ids);
3. stores its chunks into ``dst`` only for a good pair. The pair's first program (chunk 0, layer 0) also copies
   the cursor, or, for a refused pair, records it in the pool's error record (as the decode kernel records a
   refused row), with the slot at fault (``src`` when the source is bad, else ``dst``).

No two programs of a call write one word, and no verdict depends on another program's writes: a good pair's
``dst`` is named once in the call and its ``src`` is no pair's ``dst``, so no program writes what another reads,
and its own programs find ``dst``'s cursor valid before the copy and after it (then the source's). Refused and padding pairs write nothing.
On sm_90+ it is launched with programmatic dependent launch like the other kernels. :func:`fork_bytes` counts what
a call moves; docs/lifecycle.md has the grid and bytes of the Kimi-Linear shapes.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import logging
import weakref
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

import helion
import helion.language as hl

from . import direct
from .guard import SlotGuard

if TYPE_CHECKING:
    from ..pool.pool import ReplaySSMStatePool

__all__ = ["DIRECT_PLANS", "FORK_TENSORS", "ForkPlan", "PoolWords", "fork_bytes", "fork_kernel", "fork_kernel_for",
           "launch_fork", "plan_fork", "pool_words", "word_view"]

logger = logging.getLogger(__name__)

# the pool tensors a fork copies per layer, in the kernel's argument order (the cursor table besides)
FORK_TENSORS = ("checkpoint", "d_cache", "k_cache", "g_cache", "conv_state")


def fork_kernel(
    src: torch.Tensor,  # [n] int32
    dst: torch.Tensor,  # [n] int32, < 0 = padding pair
    cursors: torch.Tensor,  # [S + 1] int32: the pool's cursor table (a free slot's cursor is FREE_CURSOR)
    ckpt_w: torch.Tensor,  # int32 words of pool.checkpoint (word_view)
    d_w: torch.Tensor,  # words of pool.d_cache
    k_w: torch.Tensor,  # words of pool.k_cache
    g_w: torch.Tensor,  # words of pool.g_cache
    conv_w: torch.Tensor,  # words of pool.conv_state (a cursor view without conv state: never read)
    slot_errors: torch.Tensor,  # [ERROR_WORDS] int32: the pool's record of bad rows (kernels.guard)
    call_code: torch.Tensor,  # [1] int32: what this call records there
    num_slots: int,  # S
    ring_length: int,  # L: an allocated slot's cursor is in [0, L-1]
    ckpt_words: int, ckpt_ls: int, ckpt_ss: int,  # per tensor: words per slot block, layer and slot strides (words)
    d_words: int, d_ls: int, d_ss: int,
    k_words: int, k_ls: int, k_ss: int,
    g_words: int, g_ls: int, g_ss: int,
    conv_words: int, conv_ls: int, conv_ss: int,
    num_layers: hl.constexpr,  # NL (constants: the program id splits by multiplications, not divisions)
    chunks: hl.constexpr,  # C
    ckpt_block: hl.constexpr,  # words per chunk of each tensor (powers of two)
    d_block: hl.constexpr,
    k_block: hl.constexpr,
    g_block: hl.constexpr,
    conv_block: hl.constexpr,
    has_conv: hl.constexpr,
    named_block: hl.constexpr,  # pairs per step of the scan that counts how often a slot is named
) -> torch.Tensor:
    """Copy the good pairs' slots, every layer; refuse and record the bad ones (module docstring)."""
    n = src.size(0)
    hl.pdl_wait()  # sm_90+: nothing is read before the previous kernel has finished
    hl.pdl_launch_dependents()
    for tile_c, tile_l, tile_p in hl.tile([chunks, num_layers, n], block_size=[1, 1, 1]):
        c = tile_c.begin
        layer = tile_l.begin
        pair = tile_p.begin
        s = src[pair]
        d = dst[pair]
        # a padding pair's programs stop here. (src in the condition keeps its load ahead of the branch, which ptxas
        # otherwise sinks behind it: a memory round trip more for every real pair. A padding pair with src < -1 runs
        # the body and changes nothing.)
        if (d >= 0) | (s < -1):
            s_in = (s >= 0) & (s < num_slots)
            d_in = (d >= 0) & (d < num_slots)
            s64 = torch.where(s_in, s, 0).to(torch.int64)
            d64 = torch.where(d_in, d, 0).to(torch.int64)
            l64 = (s * 0 + layer).to(torch.int64)
            # 1. this chunk of every tensor's source block, issued before the verdict
            o_ck = c * ckpt_block + hl.arange(ckpt_block)
            x_ck = hl.load(ckpt_w, [l64 * ckpt_ls + s64 * ckpt_ss + o_ck],
                           extra_mask=torch.where(s_in, o_ck < ckpt_words, False))
            o_d = c * d_block + hl.arange(d_block)
            x_d = hl.load(d_w, [l64 * d_ls + s64 * d_ss + o_d], extra_mask=torch.where(s_in, o_d < d_words, False))
            o_k = c * k_block + hl.arange(k_block)
            x_k = hl.load(k_w, [l64 * k_ls + s64 * k_ss + o_k], extra_mask=torch.where(s_in, o_k < k_words, False))
            o_g = c * g_block + hl.arange(g_block)
            x_g = hl.load(g_w, [l64 * g_ls + s64 * g_ss + o_g], extra_mask=torch.where(s_in, o_g < g_words, False))
            if has_conv:
                o_cv = c * conv_block + hl.arange(conv_block)
                x_cv = hl.load(conv_w, [l64 * conv_ls + s64 * conv_ss + o_cv],
                               extra_mask=torch.where(s_in, o_cv < conv_words, False))
            # 2. the verdict (lifecycle.pair_verdict): in range, allocated; among the non-padding pairs, ``src`` no
            # pair's ``dst`` (several pairs may read one source) and ``dst`` one pair's ``dst`` and no pair's ``src``
            cur_s = cursors[torch.where(s_in, s, num_slots)]
            cur_d = cursors[torch.where(d_in, d, num_slots)]
            named_s = s * 0
            named_d = s * 0
            for nb in hl.grid(0, n, named_block):
                j = nb + hl.arange(named_block)
                live = j < n
                src_j = hl.load(src, [j], extra_mask=live)
                dst_j = hl.load(dst, [j], extra_mask=live)
                counted = live & (dst_j >= 0)
                named_s = named_s + torch.sum(torch.where(counted & (dst_j == s), 1, 0), dim=0).to(torch.int32)
                named_d = named_d + torch.sum(torch.where(counted & (src_j == d), 1, 0)
                                              + torch.where(counted & (dst_j == d), 1, 0), dim=0).to(torch.int32)
            src_ok = s_in & (cur_s >= 0) & (cur_s < ring_length) & (named_s == 0)
            dst_ok = d_in & (cur_d >= 0) & (cur_d < ring_length) & (named_d == 1)
            ok = src_ok & dst_ok
            # 3. the chunks into dst, for a good pair only
            hl.store(ckpt_w, [l64 * ckpt_ls + d64 * ckpt_ss + o_ck], x_ck,
                     extra_mask=torch.where(ok, o_ck < ckpt_words, False))
            hl.store(d_w, [l64 * d_ls + d64 * d_ss + o_d], x_d, extra_mask=torch.where(ok, o_d < d_words, False))
            hl.store(k_w, [l64 * k_ls + d64 * k_ss + o_k], x_k, extra_mask=torch.where(ok, o_k < k_words, False))
            hl.store(g_w, [l64 * g_ls + d64 * g_ss + o_g], x_g, extra_mask=torch.where(ok, o_g < g_words, False))
            if has_conv:
                hl.store(conv_w, [l64 * conv_ls + d64 * conv_ss + o_cv], x_cv,
                         extra_mask=torch.where(ok, o_cv < conv_words, False))
            if (c == 0) & (layer == 0):  # the pair's first program: the cursor, or the record of a refused pair
                if ok:
                    cursors[d64] = cur_s
                if (d >= 0) & (ok == 0):
                    code = call_code[0]
                    first = hl.atomic_cas(slot_errors, [0], 0, code)  # the first bad call owns the record
                    hl.atomic_add(slot_errors, [2], 1)
                    if (first == 0) | (first == code):
                        at = hl.atomic_add(slot_errors, [1], 1)
                        if at < 8:  # kernels.guard.RECORDED_ROWS
                            slot_errors[4 + 2 * at] = s * 0 + pair
                            slot_errors[5 + 2 * at] = torch.where(src_ok, d, s)
    return cursors


# Offsets into a pool exceed int32 in large pools; sizes (pairs) vary per call and one compile serves them.
_SETTINGS = dict(static_shapes=False, index_dtype=torch.int64)

# The largest chunk of one tensor a program copies (int32 words): 16 KiB, 16 words (four 16-byte vectors) per thread
# of 8 warps, so a program keeps ~21 KiB in flight and a slot-layer of the largest tensor spreads over many programs.
MAX_BLOCK = 4096
MIN_BLOCK = 32
WORDS_PER_THREAD = 16
NAMED_BLOCK_MAX = 256  # pairs per step of the scan


@dataclasses.dataclass(frozen=True)
class ForkPlan:
    """How a fork launch is compiled: ``chunks`` (``C``) programs per pair and layer, ``blocks`` the words per chunk
    of each of :data:`FORK_TENSORS` (powers of two), ``num_warps``."""

    chunks: int
    blocks: tuple[int, int, int, int, int]
    num_warps: int

    @property
    def config(self) -> helion.Config:
        return _config(self.num_warps)


@functools.lru_cache(maxsize=None)
def _config(num_warps: int) -> helion.Config:
    return helion.Config(block_sizes=[], indexing="pointer", num_warps=num_warps, num_stages=1)


def _pow2_at_least(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


@functools.lru_cache(maxsize=None)
def plan_fork(words: tuple[int, ...]) -> ForkPlan:
    """The plan for slot blocks of ``words`` int32 words per tensor (0: no such tensor): ``C = ceil(max(words) /
    MAX_BLOCK)``; each tensor's block the power of two ``>= ceil(words / C)`` (at least ``MIN_BLOCK``), so it spans
    at most ``C`` chunks; ``num_warps`` = the largest block / ``WORDS_PER_THREAD`` threads, in ``[1, 8]`` warps."""
    if len(words) != len(FORK_TENSORS) or min(words) < 0 or max(words) <= 0:
        raise ValueError(f"plan_fork: `words` must be {len(FORK_TENSORS)} counts >= 0, not all 0; got {words}")
    chunks = -(-max(words) // MAX_BLOCK)
    blocks = tuple(max(MIN_BLOCK, _pow2_at_least(-(-w // chunks))) for w in words)
    warps = min(8, max(1, max(blocks) // (32 * WORDS_PER_THREAD)))
    return ForkPlan(chunks=chunks, blocks=blocks, num_warps=warps)  # type: ignore[arg-type]


def word_view(t: torch.Tensor) -> tuple[torch.Tensor, int, int, int] | None:
    """``(words, W, ls, ss)`` of a pool tensor ``t [NL, S', ...]``: a 1-D int32 view ``words`` of its storage from
    its first element, the words per slot block ``t[layer, slot]``, and the layer and slot strides in words. None
    when a slot block is not contiguous or not a whole number of words, or a stride or the start is not
    word-aligned (the fork then runs the torch ops)."""
    if t.dim() < 2 or t.shape[0] == 0 or t.shape[1] == 0:
        return None
    es = t.element_size()
    block = t[0, 0]
    nbytes = block.numel() * es
    ls, ss, start = t.stride(0) * es, t.stride(1) * es, t.storage_offset() * es
    if nbytes == 0 or not block.is_contiguous() or any(x % 4 for x in (nbytes, ls, ss, start, t.data_ptr())):
        return None
    span = (t.shape[0] - 1) * ls + (t.shape[1] - 1) * ss + nbytes
    words = t.detach().as_strided((span // es,), (1,), t.storage_offset()).view(torch.int32)
    return words, nbytes // 4, ls // 4, ss // 4


@dataclasses.dataclass(frozen=True)
class PoolWords:
    """A pool's tensors as words for the fork: ``views[i]`` the word view of :data:`FORK_TENSORS` ``[i]`` (None for
    an absent conv state), ``geometry[i]`` its ``(W, ls, ss)`` (zeros when absent), and the plan."""

    views: tuple[torch.Tensor | None, ...]
    geometry: tuple[tuple[int, int, int], ...]
    plan: ForkPlan


def pool_words(pool: ReplaySSMStatePool) -> PoolWords | None:
    """The pool's :class:`PoolWords`, cached on the pool (rebuilt when a tensor's address, shape or strides
    change), or None when some tensor cannot be copied as words."""
    tensors = tuple(getattr(pool, name) for name in FORK_TENSORS)
    meta = tuple(None if t is None else (t.data_ptr(), t.shape, t.stride(), t.dtype) for t in tensors)
    key = id(pool)
    hit = _POOL_WORDS.get(key)
    if hit is not None and hit[0]() is pool and hit[1] == meta:
        return hit[2]
    views, geometry = [], []
    words: PoolWords | None = None
    for name, t in zip(FORK_TENSORS, tensors):
        w = None if t is None else word_view(t)
        if w is None and t is not None and not (name == "conv_state" and t.numel() == 0):  # (W = 1: no window)
            logger.info("fork: %s %s %s is not copyable as int32 words; fork runs the torch ops", name,
                        tuple(t.shape), t.dtype)
            break
        views.append(None if w is None else w[0])
        geometry.append((0, 0, 0) if w is None else w[1:])
    else:
        words = PoolWords(tuple(views), tuple(geometry), plan_fork(tuple(g[0] for g in geometry)))
    _POOL_WORDS[key] = (weakref.ref(pool, lambda _, key=key: _POOL_WORDS.pop(key, None)), meta, words)
    return words


# id(pool) -> (weakref to it, its tensors' metadata, its PoolWords or None)
_POOL_WORDS: dict[int, tuple] = {}


@functools.lru_cache(maxsize=None)
def fork_kernel_for(config: helion.Config) -> helion.Kernel:
    """The fork kernel pinned to ``config`` (one kernel object per config)."""
    logger.debug("fork kernel: %s", config)
    return helion.kernel(fork_kernel, config=config, **_SETTINGS)


def fork_bytes(words: Sequence[int], num_layers: int, pairs: int) -> int:
    """The bytes a fork of ``pairs`` good pairs moves (its floor): per pair and layer every tensor's slot block
    (``words`` int32 words each) read and written, and the cursor read and written."""
    return pairs * (2 * 4 * sum(words) * num_layers + 2 * 4)


DIRECT_PLANS = direct.PlanCache("fork")
_PARAMS = tuple(inspect.signature(fork_kernel).parameters)


def launch_fork(pool: ReplaySSMStatePool, words: PoolWords, src: torch.Tensor, dst: torch.Tensor,
                guard: SlotGuard) -> None:
    """One launch for validated ``src``, ``dst [n]`` int32 on the pool's device (``n >= 1``); ``guard``: where
    refused pairs are recorded. On CUDA, repeated calls of the same metadata launch the compiled kernel directly
    (:mod:`.direct`; the key holds the plan and the pool's sizes, which with the tensors' metadata determine every
    integer the launch passes)."""
    plan = words.plan
    n = src.shape[0]
    named_block = min(NAMED_BLOCK_MAX, max(16, _pow2_at_least(n)))
    cursors = pool.cursors
    conv = words.views[4]
    inputs = (src, dst, cursors, pool.checkpoint, pool.d_cache, pool.k_cache, pool.g_cache,
              pool.conv_state if conv is not None else cursors, *guard)
    kern = fork_kernel_for(plan.config)

    def make_args() -> direct.LaunchArgs:
        """The kernel's arguments in its signature's order; each tensor tagged with the input it views."""
        tensors = {  # name -> (value, index of the input it views)
            "src": (src, 0), "dst": (dst, 1), "cursors": (cursors, 2), "ckpt_w": (words.views[0], 3),
            "d_w": (words.views[1], 4), "k_w": (words.views[2], 5), "g_w": (words.views[3], 6),
            "conv_w": (cursors[:1], 7) if conv is None else (conv, 7),  # (a distinct view: matched by identity)
            "slot_errors": (guard.errors, 8), "call_code": (guard.code, 9)}
        scalars = dict(num_slots=pool.num_slots, ring_length=pool.ring_length, num_layers=pool.num_layers,
                       chunks=plan.chunks, has_conv=conv is not None, named_block=named_block)
        for prefix, (w, ls, ss), block in zip(("ckpt", "d", "k", "g", "conv"), words.geometry, plan.blocks):
            scalars.update({f"{prefix}_words": w, f"{prefix}_ls": ls, f"{prefix}_ss": ss, f"{prefix}_block": block})
        values = tuple(tensors[p][0] if p in tensors else scalars[p] for p in _PARAMS)
        sources = tuple(tensors[p][1] if p in tensors else None for p in _PARAMS)
        return direct.LaunchArgs(values, sources, {})

    DIRECT_PLANS.launch(kern, plan.config, make_args, inputs, src.device,
                        (plan, *(v for g in words.geometry for v in g), pool.num_slots, pool.ring_length,
                         pool.num_layers, named_block))
