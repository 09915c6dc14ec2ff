"""The commit of a speculative step (:meth:`tp_replayssm.pool.ReplaySSMStatePool.commit`): two small Helion kernels.

1. :func:`commit_cursor_kernel`, ONE program (one CTA) over all ``B`` rows, like the cursor advance kernel
   (:mod:`.cursor`): each row's verdict (slot in range, allocated, named once; ``parents`` a forest in topological
   order; ``0 <= num_accepted <= T`` and ``path[:num_accepted]`` a root-first parent chain), the drafts it takes,
   its ring base (0 when its verify folded, else its cursor ``c``), the cursor moved to ``base + taken``, the fold
   marks of every layer cleared, bad rows recorded, and ``(base or -1, taken)`` per row in a small plan tensor. The
   phases are ordered by CTA barriers (count the rows naming each slot, read, store), hence the one program.
2. :func:`commit_compact_kernel` (trees only): one program per (row, layer, value head) moves the accepted nodes'
   ring entries (delta, gate, key) from ``base + path[i]`` to ``base + i`` in every layer: it loads all of them,
   then (behind a CTA barrier: Helion orders read-after-write only) stores them.

A chain needs only the first launch: its accepted drafts already sit at ``base .. base + taken - 1``. The conv windows
(pools with a conv) roll by torch ops (:func:`tp_replayssm.reference_spec.conv_windows_after`) over the staged
drafts. Everything is device work without a host sync (CUDA-graph capturable). On CPU tensors the torch ops of
:func:`tp_replayssm.reference_spec.commit_rows` run unless the interpreter backend is chosen; batches above
:data:`MAX_ROWS` rows use them too.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import torch

import helion
import helion.language as hl

from .guard import SlotGuard
from ..reference_spec import commit_rows, conv_windows_after
from . import direct
from .args import rows_view
from .backend import runs_kernel
from .cursor import MAX_ROWS, launch_choice, record_rows

if TYPE_CHECKING:
    from ..pool.pool import ReplaySSMStatePool

__all__ = ["commit_compact_kernel", "commit_cursor_kernel", "run_commit"]

_BARRIER = "tl.debug_barrier()"


def commit_cursor_kernel(
    cursors: torch.Tensor,  # [S + 1] int32, entry S is the scratch entry
    slots: torch.Tensor,  # [B] int32
    num_accepted: torch.Tensor,  # [B] int32
    parents: torch.Tensor,  # [B * T] int32 (read when tree)
    path: torch.Tensor,  # [B * T] int32 (read when has_path)
    folded: torch.Tensor,  # [NL * (S + 1)] int32
    plan: torch.Tensor,  # [2 * B] int32 out: base (-1: not verified), then taken
    slot_errors: torch.Tensor,  # [ERROR_WORDS] int32
    call_code: torch.Tensor,  # [1] int32
    ring_length: int,
    num_layers: int,
    drafts: hl.constexpr,
    tree: hl.constexpr,
    has_path: hl.constexpr,
) -> torch.Tensor:
    """Verdicts, cursors, fold marks and the plan of one commit (module docstring); one program."""
    B = slots.size(0)
    scratch = cursors.size(0) - 1
    hl.pdl_wait()
    hl.pdl_launch_dependents()
    for tile_b in hl.tile(B):
        slot = slots[tile_b]
        rowi = tile_b.index
        in_range = (slot >= 0) & (slot < scratch)
        idx = torch.where(in_range, slot, scratch)
        hl.atomic_add(cursors, [idx], torch.where(in_range, 65536, 0))  # count the rows naming each slot
        hl.inline_triton(_BARRIER, args=(), output_like=None)
        word = hl.load(cursors, [idx])
        c = word & 65535
        ok = in_range & (word < 131072) & (c < ring_length)
        n = num_accepted[tile_b]
        good = (n >= 0) & (n <= drafts)
        prev = rowi * 0 - 1  # the previous accepted node (-1: the committed state)
        for i in hl.static_range(drafts):
            if tree:
                p_i = hl.load(parents, [rowi * drafts + i])
                ok = ok & (p_i >= -1) & (p_i < i)
            if has_path:
                node = hl.load(path, [rowi * drafts + i])
            else:
                node = rowi * 0 + i
            in_tree = (node >= 0) & (node < drafts)
            if tree:
                up = hl.load(parents, [rowi * drafts + torch.where(in_tree, node, 0)])
            else:
                up = node - 1
            good = good & ((n <= i) | (in_tree & (up == prev)))
            prev = node
        accept = ok & good
        taken = torch.where(accept, n, 0)
        base = torch.where(c + drafts > ring_length - 1, 0, c)
        hl.inline_triton(_BARRIER, args=(), output_like=None)  # every read before any store
        hl.store(cursors, [idx], torch.where(ok, base + taken, c))
        for layer in hl.grid(num_layers):
            hl.store(folded, [layer * (scratch + 1) + idx], rowi * 0, extra_mask=ok)
        hl.store(plan, [rowi], torch.where(ok, base, -1))
        hl.store(plan, [rowi + B], taken)
        # record the bad rows only when there are any: a clean step issues no atomic on the record's words (B
        # same-address atomics would serialize in L2)
        bad = torch.where((slot >= 0) & (accept == 0), 1, 0).to(torch.int32)
        n_bad = torch.sum(bad, dim=0).to(torch.int32)
        if n_bad > 0:
            record_rows(slot_errors, call_code[0], bad, n_bad, rowi, slot)
    return cursors


def commit_compact_kernel(
    d_rows: torch.Tensor,  # every layer's d ring, rows view [span, V] of [NL * S, HV, L, V]
    k_rows: torch.Tensor,  # k ring rows [span, K] of [NL * S, HV or H, L, K]
    g_rows: torch.Tensor,  # g ring rows [span, K] of [NL * S, HV, L, K]
    slots: torch.Tensor,  # [B] int32
    path: torch.Tensor,  # [B * T] int32
    plan: torch.Tensor,  # [2 * B] int32 (commit_cursor_kernel's)
    num_layers: int,
    num_slots: int,
    num_v_heads: int,
    k_heads: int,  # heads of the k ring (HV, or H in the sglang layout)
    dr_s: int, dr_h: int, dr_l: int,
    kr_s: int, kr_h: int, kr_l: int,
    gr_s: int, gr_h: int, gr_l: int,
    drafts: hl.constexpr,
    draft_block: hl.constexpr,
) -> torch.Tensor:
    """The accepted tree nodes' entries into ring order, every layer (module docstring)."""
    B = slots.size(0)
    hl.pdl_wait()
    hl.pdl_launch_dependents()
    for tile_b, tile_l, tile_h in hl.tile([B, num_layers, num_v_heads], block_size=[1, 1, 1]):
        row = tile_b.begin
        layer = tile_l.begin
        hv = tile_h.begin
        base = plan[row]
        taken = plan[row + B]
        if (base >= 0) & (taken > 0):
            s64 = (layer * num_slots + slots[row]).to(torch.int64)
            tt = hl.arange(draft_block)
            act = tt < taken
            node = hl.load(path, [row * drafts + tt], extra_mask=act)
            src = base + node
            dst = base + tt
            d_e = hl.load(d_rows, [s64 * dr_s + hv * dr_h + src * dr_l, slice(None)], extra_mask=act[:, None])
            g_e = hl.load(g_rows, [s64 * gr_s + hv * gr_h + src * gr_l, slice(None)], extra_mask=act[:, None])
            k_act = act & ((tt * 0 + hv) < k_heads)  # (a tensor comparison: the interpreter takes no Python bool mask)
            k_e = hl.load(k_rows, [s64 * kr_s + hv * kr_h + src * kr_l, slice(None)], extra_mask=k_act[:, None])
            hl.inline_triton(_BARRIER, args=(), output_like=None)  # every load before any store (write-after-read)
            hl.store(d_rows, [s64 * dr_s + hv * dr_h + dst * dr_l, slice(None)], d_e, extra_mask=act[:, None])
            hl.store(g_rows, [s64 * gr_s + hv * gr_h + dst * gr_l, slice(None)], g_e, extra_mask=act[:, None])
            hl.store(k_rows, [s64 * kr_s + hv * kr_h + dst * kr_l, slice(None)], k_e, extra_mask=k_act[:, None])
    return d_rows


_CURSOR_SETTINGS = dict(static_shapes=False, index_dtype=torch.int32)
_COMPACT_SETTINGS = dict(static_shapes=True, index_dtype=torch.int64)


@functools.lru_cache(maxsize=None)
def cursor_kernel_for(block: int, num_warps: int) -> helion.Kernel:
    """The commit's one-program kernel pinned to one ``(block, num_warps)``."""
    config = helion.Config(block_sizes=[block], indexing="pointer", num_warps=num_warps, num_stages=1)
    return helion.kernel(commit_cursor_kernel, config=config, **_CURSOR_SETTINGS)


@functools.lru_cache(maxsize=None)
def compact_kernel() -> helion.Kernel:
    config = helion.Config(block_sizes=[], indexing="pointer", num_warps=4, num_stages=1)
    return helion.kernel(commit_compact_kernel, config=config, **_COMPACT_SETTINGS)


CURSOR_PLANS = direct.PlanCache("commit_cursor")
COMPACT_PLANS = direct.PlanCache("commit_compact")
_PLAN_BUFFERS: dict[tuple[torch.device, int], torch.Tensor] = {}
_NO_TREE: dict[torch.device, torch.Tensor] = {}


def _plan_buffer(device: torch.device, batch: int) -> torch.Tensor:
    """The per-row ``(base, taken)`` scratch ``[2 * B]`` int32 (one per device and batch, reused every step)."""
    key = (device, batch)
    t = _PLAN_BUFFERS.get(key)
    if t is None:
        t = _PLAN_BUFFERS[key] = torch.zeros(2 * batch, dtype=torch.int32, device=device)
    return t


def _no_tree(device: torch.device) -> torch.Tensor:
    t = _NO_TREE.get(device)
    if t is None:
        t = _NO_TREE[device] = torch.full((1,), -1, dtype=torch.int32, device=device)
    return t


def _layer_rows(pool: ReplaySSMStatePool) -> tuple[tuple[torch.Tensor, tuple[int, int, int]], ...]:
    """Every layer's rings as ``[NL * S, heads, L, X]`` row views (cached on the pool)."""
    views = pool.__dict__.get("_spec_ring_rows")
    if views is None:
        NL, S = pool.num_layers, pool.num_slots
        flat = [t.view(NL * S, *t.shape[2:]) for t in (pool.d_cache, pool.k_cache, pool.g_cache)]
        views = pool._spec_ring_rows = (flat, tuple(rows_view(t) for t in flat))
    return views[1]


def run_commit(pool: ReplaySSMStatePool, slots: torch.Tensor, num_accepted: torch.Tensor,
               parents: torch.Tensor | None, path: torch.Tensor | None, drafts: int, guard: SlotGuard,
               conv: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None) -> None:
    """Commit the step of ``slots`` (validated) in place; no host sync (module docstring)."""
    B = slots.shape[0]
    if B == 0:
        return
    device = slots.device
    if not runs_kernel(device, "ReplaySSMStatePool.commit") or B > MAX_ROWS:
        commit_rows(pool.cursors, slots, num_accepted, parents, path, drafts,
                    (pool.d_cache, pool.k_cache, pool.g_cache), pool.spec_folded, guard, conv)
        return
    plan = _plan_buffer(device, B)
    none = _no_tree(device)
    par = none if parents is None else parents.view(-1)
    pth = none if path is None else path.view(-1)
    block, warps = launch_choice(B)
    kern = cursor_kernel_for(block, warps)
    L, NL = pool.ring_length, pool.num_layers
    tree, has_path = parents is not None, path is not None
    inputs = (pool.cursors, slots, num_accepted, par, pth, pool.spec_folded.view(-1), plan, *guard)
    CURSOR_PLANS.launch(kern, kern.configs[0],
                        lambda: direct.LaunchArgs((*inputs, L, NL, drafts, tree, has_path),
                                                  (0, 1, 2, 3, 4, 5, 6, 7, 8, None, None, None, None, None), {}),
                        inputs, device, (L, NL, drafts, tree, has_path))
    if path is not None:
        (d_rows, dr), (k_rows, kr), (g_rows, gr) = _layer_rows(pool)
        lh = pool.local_heads
        ck = compact_kernel()
        k_heads = pool.k_cache.shape[2]
        cin = (d_rows, k_rows, g_rows, slots, pth, plan)
        consts = (NL, pool.num_slots, lh.num_v_heads, k_heads, *dr, *kr, *gr, drafts,
                  max(16, 1 << (drafts - 1).bit_length()))
        COMPACT_PLANS.launch(ck, ck.configs[0],
                             lambda: direct.LaunchArgs((*cin, *consts), (0, 1, 2, 3, 4, 5) + (None,) * len(consts), {}),
                             (pool.d_cache, pool.k_cache, pool.g_cache, slots, pth, plan), device, consts)
    if conv is not None:
        conv_state, staged, layers = conv
        base, taken = plan[:B], plan[B:].long()
        verified = base >= 0
        S = pool.num_slots
        idx = torch.where((slots >= 0) & (slots < S), slots, S).long()
        pth_l = torch.arange(drafts, device=device).expand(B, drafts) if path is None else path.long()
        windows = conv_state[layers][:, idx]
        after = conv_windows_after(windows, staged, pth_l, taken)
        conv_state[layers[:, None], idx[None, :]] = torch.where(verified[None, :, None, None], after,
                                                               windows.float()).to(conv_state.dtype)
