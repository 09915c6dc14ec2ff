"""Readable PyTorch reference of speculative decoding (verify, then commit), and the library's path for CPU tensors.

:func:`verify_rows` is one layer's verify of ``T`` draft tokens per row, in place; :func:`commit_rows` moves every
layer's state of the rows to the accepted drafts. ``docs/spec.md`` states the contract; in short, for a row with
committed cursor ``c`` (entries ``j < c`` live) and the step's ``T``:

- ``fold = c + T > L - 1`` (the drafts would not fit), ``base = 0 if fold else c``. Each layer's verify folds its own
  committed ring into its checkpoint when ``fold`` (the state after the ``c`` committed entries), and writes draft
  ``t``'s ring entries at position ``base + t``. No cursor moves in verify: every layer sees the same ``c`` and ``T``,
  so every layer decides the same, and ``commit`` moves the cursor to ``base + n`` for ``n`` accepted drafts. Until
  the commit the layer's ``folded[slot]`` is 1 (``pool.read_state`` then reads the checkpoint alone).
- A draft's entries are those a decode of it would append after its ancestors: its delta, its key and gate
  (sglang layout), or its cumulative gate along its own path ``G_t = G_parent + g_t`` and key ``k_t * exp(-G_t)``
  (pre-decayed layout; ``G_root's parent`` is the committed ``G_{c-1}``, or 0 after a fold).
- Pre-decayed layout: a (row, value head) whose drafts' cumulative gate would fall below ``-PREDECAYED_MAX_LOG_DECAY``
  in some key lane, without a fold and with ``c > 0``, rebases its committed ring first, as a decode would: the
  head's checkpoint becomes its committed state, its deltas ``j < c`` zero and ``G_{c-1}`` zero (a new base the
  drafts' gates then start from). The state a reader sees does not change.

Outputs are what sequential decode of each draft after its ancestors gives; the node states are materialized here
(``[n, T, HV, V, K]``), which is fine for a reference. Rows whose slot is out of range, free or named twice, or whose
``parents`` row is not a forest in topological order (``-1 <= parents[b, t] < t``), get zero outputs and change
nothing; ``guard`` records them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .kernels.guard import SlotGuard, record_bad_rows
from .reference import kda_gate, l2norm, last_cumulative_gate, replay_predecayed_ring, replay_ring
from .spec_validation import VerifyCall, VerifyDims
from .validation import PREDECAYED_MAX_LOG_DECAY, resolve_scale

__all__ = ["chain_parents", "commit_rows", "conv_windows_after", "parents_valid", "path_valid", "slot_verdict",
           "tree_conv", "verify_rows"]


# ---- trees ---------------------------------------------------------------------------------------------------------


def chain_parents(batch: int, drafts: int, device: torch.device) -> torch.Tensor:
    """``[B, T]`` long: the parents of a chain, ``parents[b, t] = t - 1``."""
    return (torch.arange(drafts, device=device) - 1).expand(batch, drafts)


def parents_valid(parents: torch.Tensor) -> torch.Tensor:
    """``[B]`` bool: every ``parents[b, t]`` (long ``[B, T]``) is -1 (the committed state) or an earlier node."""
    t = torch.arange(parents.shape[1], device=parents.device)
    return ((parents >= -1) & (parents < t)).all(dim=1)


def path_valid(parents: torch.Tensor, path: torch.Tensor, num_accepted: torch.Tensor) -> torch.Tensor:
    """``[B]`` bool: ``0 <= num_accepted[b] <= T`` and ``path[b, :num_accepted[b]]`` is a root-first parent chain of the
    tree ``parents`` (``path[b, 0]`` a root, each node the parent of the next). Entries past ``num_accepted`` are
    ignored. All long tensors: ``parents``, ``path [B, T]``, ``num_accepted [B]``."""
    B, T = parents.shape
    i = torch.arange(T, device=parents.device)
    active = i[None, :] < num_accepted[:, None]
    node_ok = (path >= 0) & (path < T)
    parent_of = parents.gather(1, path.clamp(0, T - 1))
    expected = torch.cat([torch.full((B, 1), -1, dtype=path.dtype, device=path.device), path[:, :-1]], dim=1)
    ok = ~active | (node_ok & (parent_of == expected))
    return ok.all(dim=1) & (num_accepted >= 0) & (num_accepted <= T)


def slot_verdict(slots: torch.Tensor, cursors: torch.Tensor, ring_length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(ok [B] bool, idx [B] long)``: rows whose slot is in range, allocated (cursor in ``[0, L-1]``) and named once in
    the call; the slot each row addresses (the scratch entry ``S`` of ``cursors [S + 1]`` for out-of-range rows)."""
    S = cursors.shape[0] - 1
    in_range = (slots >= 0) & (slots < S)
    idx = torch.where(in_range, slots, S).long()
    named = torch.zeros(S + 1, dtype=torch.int32, device=slots.device).index_add_(0, idx, in_range.int())
    cur = cursors.index_select(0, idx)
    ok = in_range & (named.index_select(0, idx) == 1) & (cur >= 0) & (cur < ring_length)
    return ok, idx


# ---- the short convolution over a tree ---------------------------------------------------------------------------


def tree_conv(x: torch.Tensor, window: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
              parents: torch.Tensor, activation: str | None) -> torch.Tensor:
    """The causal depthwise conv of draft inputs ``x [B, T, D]`` continuing the committed ``window [B, D, W-1]``
    (oldest first) along each node's ancestors (``parents [B, T]`` long): node ``t`` sees the window, then its
    ancestors' inputs root first, then its own. ``weight [D, W]``, ``bias [D]``. Returns ``y [B, T, D]`` fp32."""
    B, T, D = x.shape
    W = weight.shape[1]
    xf, w = x.float(), weight.float()
    before = torch.empty(B, T, D, W - 1, dtype=torch.float32, device=x.device)  # each node's window
    rows = torch.arange(B, device=x.device)
    ys = []
    for t in range(T):
        p = parents[:, t]
        pc = p.clamp(min=0)
        if W > 1:
            grown = torch.cat([before[rows, pc][..., 1:], xf[rows, pc][..., None]], dim=-1)
            before[:, t] = torch.where((p >= 0)[:, None, None], grown, window.float())
        u = torch.cat([before[:, t], xf[:, t, :, None]], dim=-1)  # [B, D, W]
        y = (u * w[None]).sum(-1) + (0.0 if bias is None else bias.float()[None])
        ys.append(F.silu(y) if activation == "silu" else y)
    return torch.stack(ys, dim=1)


def conv_windows_after(window: torch.Tensor, staged: torch.Tensor, path: torch.Tensor,
                       taken: torch.Tensor) -> torch.Tensor:
    """The windows ``[..., B, D, W-1]`` after appending, in order, the staged draft inputs ``staged [..., B, T, D]``
    of the nodes ``path[b, i]`` (long ``[B, T]``) for ``i < taken[b]``."""
    B, T = path.shape
    rows = torch.arange(B, device=path.device)
    win = window.float()
    for i in range(T):
        xi = staged[..., rows, path[:, i].clamp(0, T - 1), :].float()  # [..., B, D]
        grown = torch.cat([win[..., 1:], xi[..., None]], dim=-1)
        win = torch.where((i < taken)[:, None, None], grown, win)
    return win


# ---- verify --------------------------------------------------------------------------------------------------------


def verify_rows(call: VerifyCall, dims: VerifyDims, *, ring_layout: str, guard: SlotGuard | None = None) -> None:
    """One layer's verify of a validated call, in place (module docstring): ``call.out [B, T, HV, V]``, the draft
    ring entries, folds and rebases, ``call.folded``. Not CUDA-graph safe (it selects the live rows on the host)."""
    predecayed = ring_layout == "predecayed"
    B, T, H, HV, K, V, L, r = (dims.batch, dims.drafts, dims.num_q_heads, dims.num_v_heads, dims.key_dim,
                               dims.value_dim, dims.ring_length, dims.group)
    x = call.mixed_qkv.float()
    q = x[..., : H * K].reshape(B, T, H, K)
    k = x[..., H * K: 2 * H * K].reshape(B, T, H, K)
    v = x[..., 2 * H * K:].reshape(B, T, HV, V)
    if call.use_qk_l2norm_in_kernel:
        q, k = l2norm(q), l2norm(k)
    q = q * resolve_scale(call.scale, K)
    g = kda_gate(call.a.reshape(B * T, HV, K), call.A_log, call.dt_bias.reshape(HV, K),
                 call.lower_bound).reshape(B, T, HV, K)
    beta = torch.sigmoid(call.b.float())  # [B, T, HV]
    parents = chain_parents(B, T, x.device) if call.parents is None else call.parents.long()

    live, idx = slot_verdict(call.slots, call.cursors, L)
    live = live & parents_valid(parents)
    if guard is not None:
        record_bad_rows(guard.errors, guard.code, (call.slots >= 0) & ~live, call.slots)
    out = torch.zeros(B, T, HV, V, dtype=torch.float32, device=x.device)
    rows = live.nonzero().squeeze(1)
    if rows.numel():
        _verify_live(call, rows, idx[rows], q[rows], k[rows], v[rows], g[rows], beta[rows], parents[rows], out,
                     predecayed, T, L, r)
    call.out.copy_(out.to(call.out.dtype))


def _verify_live(call: VerifyCall, rows: torch.Tensor, s: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                 v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, parents: torch.Tensor, out: torch.Tensor,
                 predecayed: bool, T: int, L: int, r: int) -> None:
    """:func:`verify_rows` for the live rows ``rows`` (slots ``s``); ``q .. parents`` are already those rows'."""
    n = rows.shape[0]
    c = call.cursors.index_select(0, s).long()
    S0, d, kr, gr = (t.index_select(0, s) for t in (call.initial_state, call.d_cache, call.k_cache, call.g_cache))
    if predecayed:
        Sc = replay_predecayed_ring(S0, d, kr, gr, c)  # the committed state [n, HV, V, K]
        tot = last_cumulative_gate(gr, c)  # G_{c-1} [n, HV, K]
    else:
        Sc = replay_ring(S0, d, kr.repeat_interleave(r, dim=1), gr, c)
    qv, kv = q.repeat_interleave(r, dim=2), k.repeat_interleave(r, dim=2)  # [n, T, HV, K]
    states = torch.empty((T, *Sc.shape), dtype=torch.float32, device=Sc.device)  # each node's state
    gamma = torch.empty((T, *g.shape[:1], *g.shape[2:]), dtype=torch.float32, device=Sc.device)  # path gate sums
    deltas = torch.empty(T, n, v.shape[2], v.shape[3], dtype=torch.float32, device=Sc.device)
    ar = torch.arange(n, device=Sc.device)
    for t in range(T):
        p = parents[:, t]
        has = (p >= 0)[:, None, None]
        S_parent = torch.where(has[..., None], states[p.clamp(min=0), ar], Sc) if t else Sc
        g_parent = torch.where(has, gamma[p.clamp(min=0), ar], 0.0) if t else 0.0
        S_decayed = S_parent * g[:, t].exp()[:, :, None, :]
        delta = beta[:, t, :, None] * (v[:, t] - (S_decayed @ kv[:, t, ..., None])[..., 0])  # [n, HV, V]
        states[t] = S_decayed + delta[..., None] * kv[:, t, :, None, :]
        out[rows, t] = (states[t] @ qv[:, t, ..., None])[..., 0]
        gamma[t] = g_parent + g[:, t]
        deltas[t] = delta

    fold = c + T > L - 1
    base = torch.where(fold, 0, c)
    f = fold.nonzero().squeeze(1)
    call.initial_state[s[f]] = Sc[f].to(call.initial_state.dtype)  # the fold: the committed state, checkpointed
    call.folded[s] = fold.to(call.folded.dtype)
    pos = base[:, None] + torch.arange(T, device=c.device)  # [n, T] the drafts' ring positions
    s2 = s[:, None].expand(n, T)
    call.d_cache[s2, :, pos] = deltas.transpose(0, 1).to(call.d_cache.dtype)  # [n, T, HV, V]
    if predecayed:
        # a head whose drafts would pass the bound from the committed base rebases its committed ring first
        low = (tot[None] + gamma).amin(dim=-1).amin(dim=0)  # [n, HV]
        rebase = (~fold & (c > 0))[:, None] & (low < -PREDECAYED_MAX_LOG_DECAY)
        rr, hh = rebase.nonzero(as_tuple=True)
        call.initial_state[s[rr], hh] = Sc[rr, hh].to(call.initial_state.dtype)
        emptied = torch.arange(L, device=c.device)[None, :, None] < c[rr][:, None, None]  # [m, L, 1]
        call.d_cache[s[rr], hh] = torch.where(emptied, 0.0, call.d_cache[s[rr], hh].float()).to(call.d_cache.dtype)
        call.g_cache[s[rr], hh, c[rr] - 1] = 0.0
        G_base = torch.where((fold[:, None] | rebase)[..., None], 0.0, tot)  # [n, HV, K]
        G = G_base[:, None] + gamma.transpose(0, 1)  # [n, T, HV, K]
        call.g_cache[s2, :, pos] = G
        call.k_cache[s2, :, pos] = (kv * torch.exp(-G)).to(call.k_cache.dtype)
    else:
        call.g_cache[s2, :, pos] = g
        call.k_cache[s2, :, pos] = k.to(call.k_cache.dtype)  # one key per q/k head


# ---- commit --------------------------------------------------------------------------------------------------------


def commit_rows(cursors: torch.Tensor, slots: torch.Tensor, num_accepted: torch.Tensor,
                parents: torch.Tensor | None, path: torch.Tensor | None, drafts: int, rings: tuple[torch.Tensor, ...],
                folded: torch.Tensor, guard: SlotGuard | None = None,
                conv: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """The commit of a step as torch ops, in place; no host sync, CUDA-graph capturable. Returns ``n_eff [B]`` long
    (drafts taken per row).

    ``cursors [S + 1]``, ``slots``, ``num_accepted [B]`` int32, ``parents`` / ``path [B, T]`` int32 or None (a chain),
    ``drafts = T``, ``rings``: every layer's ``(d_cache, k_cache, g_cache)`` ``[NL, S, heads, L, ...]``, ``folded
    [NL, S + 1]``, ``conv``: ``(conv_state [NL, S + 1, D, W-1], staged [NLc, B, T, D], layers [NLc] long)`` or None.

    A row is *verified* when its slot is good and its parents a valid tree (exactly the rows its verify ran: a step's
    slots can be neither freed nor, when free, handed out before its commit, so their verdict holds); a
    verified row with ``num_accepted`` outside ``0..T`` or a path that is not a root-first parent chain takes no draft
    (as ``num_accepted = 0``) and is recorded; so is every other row with ``slot >= 0``, which changes nothing."""
    B, T = slots.shape[0], drafts
    L = rings[0].shape[3]
    dev = slots.device
    ok, idx = slot_verdict(slots, cursors, L)
    par = chain_parents(B, T, dev) if parents is None else parents.long()
    pth = torch.arange(T, device=dev).expand(B, T) if path is None else path.long()
    verified = ok & parents_valid(par)
    n = num_accepted.long()
    accept = verified & path_valid(par, pth, n)
    taken = torch.where(accept, n, 0)
    if guard is not None:
        record_bad_rows(guard.errors, guard.code, (slots >= 0) & ~accept, slots)
    cur = cursors.index_select(0, idx).long()
    base = torch.where(cur + T > L - 1, 0, cur)
    if path is not None:  # the accepted nodes' entries into ring order: position base + path[i] -> base + i
        _compact(rings, idx, verified, base, pth, taken, T)
    if conv is not None:
        conv_state, staged, layers = conv
        windows = conv_state[layers][:, idx]  # [NLc, B, D, W-1]
        after = conv_windows_after(windows, staged, pth, taken)
        conv_state[layers[:, None], idx[None, :]] = torch.where(verified[None, :, None, None], after,
                                                               windows.float()).to(conv_state.dtype)
    folded.index_copy_(1, idx, torch.where(verified[None, :], 0, folded.index_select(1, idx)))
    cursors.index_copy_(0, idx, torch.where(verified, base + taken, cur).to(cursors.dtype))
    return taken


def _compact(rings: tuple[torch.Tensor, ...], idx: torch.Tensor, verified: torch.Tensor, base: torch.Tensor,
             path: torch.Tensor, taken: torch.Tensor, T: int) -> None:
    """Gather every layer's entries at ``base + path[b, i]`` and write them at ``base + i`` for ``i < taken[b]``. The
    other (row, i) pairs write back what slot 0 holds at ring position ``L-1``, which no draft or committed entry
    uses (so duplicate writes agree and no live write is overwritten)."""
    L = rings[0].shape[3]
    i = torch.arange(T, device=idx.device)
    active = verified[:, None] & (i[None, :] < taken[:, None])  # [B, T]
    s = torch.where(active, idx[:, None], 0)
    src = torch.where(active, base[:, None] + path, L - 1)
    dst = torch.where(active, base[:, None] + i[None, :], L - 1)
    for ring in rings:
        values = ring[:, s, :, src]  # [B, T, NL, heads, X]: every read before any write
        ring[:, s, :, dst] = values
