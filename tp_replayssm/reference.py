"""Readable PyTorch reference of the KDA ReplaySSM decode, and the library's path for CPU tensors.

:func:`replayssm_decode` has the op's signature and in-place behaviour (:func:`tp_replayssm.ops.replayssm_decode`),
vectorized over rows and heads (no Python loop per row or head), runnable on any device; all math is fp32. The tests
hold the Helion kernel to it, and both to an independent float64 recurrence (:class:`tp_replayssm.testing.PlainKDA`).
:func:`decode_rows` is the same math for the pool's calls (cursors read by slot, the fused advance), which the
library runs on CPU tensors (:mod:`tp_replayssm.kernels.backend`). The contract: docs/contract.md.

Shapes (local to one shard): ``B`` rows, ``H`` q/k heads, ``HV = r*H`` value heads, head dims ``K`` and ``V``, ring
length ``L``, ``S`` slots.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .kernels.guard import SlotGuard, record_bad_rows
from .validation import PREDECAYED_MAX_LOG_DECAY, DecodeCall, DecodeDims, resolve_scale, validate_decode


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """``x / sqrt(sum(x*x) + eps)`` over the last dim."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def kda_gate(
    a: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor, lower_bound: float | None
) -> torch.Tensor:
    """Log-gate ``g [B, HV, K]`` from raw logits ``a [B, HV, K]``, ``A_log [HV]``, ``dt_bias [HV, K]``."""
    x = a.float() + dt_bias.float()
    A = A_log.float().exp()[:, None]
    if lower_bound is None:
        return -A * F.softplus(x, beta=1.0, threshold=20.0)
    return lower_bound * torch.sigmoid(A * x)


def replay_ring(
    S0: torch.Tensor,
    d: torch.Tensor,
    k: torch.Tensor,
    g: torch.Tensor,
    cursor: torch.Tensor,
) -> torch.Tensor:
    """Reconstruct the current state ``Sc [n, HV, V, K]`` (fp32) from a checkpoint and its ring.

    ``S0 [n, HV, V, K]``, ``d [n, HV, L, V]``, ``k [n, HV, L, K]`` (already expanded to value heads),
    ``g [n, HV, L, K]``, ``cursor [n]``: entries ``j < cursor`` are valid.
    ``Sc = S0 * exp(sum_{j<c} g_j) + sum_{j<c} d_j (outer) (k_j * exp(sum_{j<i<c} g_i))``.
    """
    L = d.shape[2]
    valid = (torch.arange(L, device=cursor.device)[None, :] < cursor[:, None].long())[:, None, :, None]
    g = torch.where(valid, g.float(), 0.0)
    after = g.flip(2).cumsum(2).flip(2) - g  # after[j] = sum_{j<i<c} g_i
    total = g.sum(2)  # [n, HV, K]
    k_decayed = torch.where(valid, k.float() * after.exp(), 0.0)
    d = torch.where(valid, d.float(), 0.0)
    return S0.float() * total.exp()[:, :, None, :] + torch.einsum("nhlv,nhlk->nhvk", d, k_decayed)


def last_cumulative_gate(G: torch.Tensor, cursor: torch.Tensor) -> torch.Tensor:
    """``tot = G_{c-1} [n, HV, K]`` (fp32) of a pre-decayed g ring ``G [n, HV, L, K]`` at ``cursor [n]``: the sum of
    the ring's live gates, 0 for an empty ring (entry 0 is then never read: it may hold anything)."""
    c = cursor.long()
    last = (c - 1).clamp(min=0)[:, None, None, None].expand(-1, G.shape[1], 1, G.shape[3])
    return torch.where(c[:, None, None] > 0, G.float().gather(2, last)[:, :, 0], 0.0)


def predecay_rings(k: torch.Tensor, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """sglang-layout rings of entries all live, ``k [n, HV, L, K]`` (already per value head) and log-gates
    ``g [n, HV, L, K]``, in the pre-decayed layout: ``(k_j * exp(-G_j), G_j = g_0 + ... + g_j)``, fp32."""
    G = g.float().cumsum(2)
    return k.float() * torch.exp(-G), G


def replay_predecayed_ring(
    S0: torch.Tensor,
    d: torch.Tensor,
    kt: torch.Tensor,
    G: torch.Tensor,
    cursor: torch.Tensor,
) -> torch.Tensor:
    """:func:`replay_ring` for the pre-decayed layout (``ring_layout="predecayed"``): ``kt [n, HV, L, K]``
    holds ``k_j * exp(-G_j)``, ``G [n, HV, L, K]`` the cumulative gates ``G_j = g_0 + ... + g_j``. With
    ``tot = G_{c-1}`` (0 for an empty ring): ``Sc = (S0 + sum_{j<c} d_j (outer) kt_j) * exp(tot)``."""
    L = d.shape[2]
    valid = (torch.arange(L, device=cursor.device)[None, :] < cursor[:, None].long())[:, None, :, None]
    tot = last_cumulative_gate(G, cursor)  # [n, HV, K]
    kt = torch.where(valid, kt.float(), 0.0)
    d = torch.where(valid, d.float(), 0.0)
    return (S0.float() + torch.einsum("nhlv,nhlk->nhvk", d, kt)) * tot.exp()[:, :, None, :]


def replayssm_decode(
    mixed_qkv: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    scale: float | None,
    initial_state: torch.Tensor,
    d_cache: torch.Tensor,
    k_cache: torch.Tensor,
    g_cache: torch.Tensor,
    out: torch.Tensor,
    ssm_state_indices: torch.Tensor,
    write_pos: torch.Tensor,
    force_flush: torch.Tensor | None = None,
    use_qk_l2norm_in_kernel: bool = False,
    lower_bound: float | None = None,
    *,
    ring_layout: str = "sglang",
) -> tuple[torch.Tensor, torch.Tensor]:
    """One decode token per row; writes ``out [B, 1, HV, V]`` and the rows' slots in place. Returns
    ``(out, initial_state)``.

    A row whose cursor ``write_pos`` is ``L-1`` or whose ``force_flush`` is nonzero writes its new state into the
    checkpoint; any other row appends ``(delta, k, g)`` at ring position ``write_pos``. Padding rows (slot < 0) get
    zeros and touch nothing; so does a row whose slot is ``>= S`` or whose cursor is outside ``[0, L-1]`` (it would
    address memory outside its slot). ``ring_layout="predecayed"``: the pre-decayed rings (:func:`decode_rows`)."""
    call = DecodeCall(mixed_qkv, a, b, A_log, dt_bias, scale, initial_state, d_cache, k_cache, g_cache, out,
                      ssm_state_indices, write_pos, force_flush, use_qk_l2norm_in_kernel, lower_bound)
    dims = validate_decode(call, ring_layout=ring_layout, where="reference.replayssm_decode")
    decode_rows(call, dims, ring_layout=ring_layout)
    return out, initial_state


def decode_rows(call: DecodeCall, dims: DecodeDims, *, ring_layout: str, cursor_table: bool = False,
                advance: bool = False, guard: SlotGuard | None = None) -> None:
    """The decode of a validated call, in place (see :func:`replayssm_decode`).

    ``cursor_table``: ``call.write_pos`` is the pool's cursor table ``[S + 1]`` (row ``b`` reads
    ``write_pos[slot_b]``); ``advance`` then moves those cursors afterwards (0 after a flush, else ``c + 1``). With the
    table, a row whose slot another row of the call also names is a padding row too, and so is a row whose slot is
    free (its cursor is ``FREE_CURSOR``); ``guard`` records every such bad row.
    In the pre-decayed layout ``k_cache [S, HV, L, K]`` holds ``k_j * exp(-G_j)`` per value head and ``g_cache`` the
    cumulative gates ``G_j``; an append at ``c`` writes ``G_c = G_{c-1} + g`` and ``k * exp(-G_c)``. Where ``G_c``
    falls below ``-PREDECAYED_MAX_LOG_DECAY`` (-75) in some key lane, that (row, value head) REBASES instead of
    appending: its new state goes to the checkpoint, its ring entries ``j <= c`` get ``d_j = 0`` and ``G_c = 0``,
    ``k_c = 0`` (the cursor still moves on). Under ``(L-1) * |lower_bound| <= 75`` no rebase can happen."""
    (mixed_qkv, a, b, A_log, dt_bias, scale, initial_state, d_cache, k_cache, g_cache, out, ssm_state_indices,
     write_pos, force_flush, use_qk_l2norm_in_kernel, lower_bound) = call
    predecayed = ring_layout == "predecayed"
    B, H, HV, K, V, L, S, r = (dims.batch, dims.num_q_heads, dims.num_v_heads, dims.key_dim,
                               dims.value_dim, dims.ring_length, dims.num_slots, dims.group)
    x = mixed_qkv.float()
    q = x[:, : H * K].reshape(B, H, K)
    k = x[:, H * K : 2 * H * K].reshape(B, H, K)
    v = x[:, 2 * H * K :].reshape(B, HV, V)
    if use_qk_l2norm_in_kernel:
        q, k = l2norm(q), l2norm(k)
    q = q * resolve_scale(scale, K)
    g = kda_gate(a.reshape(B, HV, K), A_log, dt_bias.reshape(HV, K), lower_bound)  # [B, HV, K]
    beta = torch.sigmoid(b.float())  # [B, HV]

    slots_all = ssm_state_indices.long()
    in_range = (slots_all >= 0) & (slots_all < S)
    if cursor_table:
        c_all = write_pos.long()[torch.where(in_range, slots_all, S)]
    else:
        c_all = write_pos.long()
    live = in_range & (c_all >= 0) & (c_all <= L - 1)  # anything else would address outside its slot: padding
    if cursor_table:  # the pool's calls: a slot named by two rows is refused for both
        idx = torch.where(in_range, slots_all, S)
        named = torch.zeros(S + 1, dtype=torch.long, device=idx.device).index_add_(0, idx, in_range.long())
        live = live & (named[idx] == 1)
        if guard is not None:
            record_bad_rows(guard.errors, guard.code, (slots_all >= 0) & ~live, ssm_state_indices)
    rows = live.nonzero().squeeze(1)
    s = slots_all[rows]
    c = c_all[rows]
    qv = q[rows].repeat_interleave(r, dim=1)  # [n, HV, K]
    kv = k[rows].repeat_interleave(r, dim=1)
    gv = g[rows]
    if predecayed:
        Sc = replay_predecayed_ring(initial_state[s], d_cache[s], k_cache[s], g_cache[s], c)
    else:
        Sc = replay_ring(initial_state[s], d_cache[s], k_cache[s].repeat_interleave(r, dim=1), g_cache[s], c)
    S_decayed = Sc * gv.exp()[:, :, None, :]
    delta = beta[rows][:, :, None] * (v[rows] - (S_decayed @ kv[..., None])[..., 0])  # [n, HV, V]
    S_new = S_decayed + delta[..., None] * kv[:, :, None, :]
    o = (S_new @ qv[..., None])[..., 0]  # [n, HV, V]

    flush = c == L - 1
    if force_flush is not None:
        flush = flush | (force_flush[rows] != 0)
    out_full = torch.zeros(B, HV, V, dtype=torch.float32, device=out.device)
    out_full[rows] = o
    out.copy_(out_full[:, None].to(out.dtype))

    f, nf = flush.nonzero().squeeze(1), (~flush).nonzero().squeeze(1)
    initial_state[s[f]] = S_new[f].to(initial_state.dtype)
    if predecayed:  # per (row, value head): append G_c = G_{c-1} + g and k * exp(-G_c), or rebase
        g_cum = last_cumulative_gate(g_cache[s], c) + gv  # G_c [n, HV, K]
        rebase = ~flush[:, None] & (g_cum.amin(-1) < -PREDECAYED_MAX_LOG_DECAY)  # [n, HV]
        rr, hh = (~flush[:, None] & ~rebase).nonzero(as_tuple=True)
        d_cache[s[rr], hh, c[rr]] = delta[rr, hh].to(d_cache.dtype)
        g_cache[s[rr], hh, c[rr]] = g_cum[rr, hh]
        k_cache[s[rr], hh, c[rr]] = (kv[rr, hh] * torch.exp(-g_cum[rr, hh])).to(k_cache.dtype)
        # a rebase: the head's new state goes to the checkpoint, ring entries j <= c get delta 0, and G_c = 0
        # (with k_c = 0) is the base the next appends accumulate from; the cursor moves on as for an append
        rr, hh = rebase.nonzero(as_tuple=True)
        initial_state[s[rr], hh] = S_new[rr, hh].to(initial_state.dtype)
        emptied = torch.arange(L, device=c.device)[None, :, None] <= c[rr][:, None, None]  # [m, L, 1]
        d_cache[s[rr], hh] = torch.where(emptied, 0.0, d_cache[s[rr], hh].float()).to(d_cache.dtype)
        g_cache[s[rr], hh, c[rr]] = 0.0
        k_cache[s[rr], hh, c[rr]] = 0.0
    else:
        d_cache[s[nf], :, c[nf]] = delta[nf].to(d_cache.dtype)
        g_cache[s[nf], :, c[nf]] = gv[nf]
        # every value head of a q/k head carries the same key: store it once per q/k head
        k_cache[s[nf], :, c[nf]] = k[rows][nf].to(k_cache.dtype)
    if advance:  # (bad rows are recorded once, above)
        from .kernels.cursor import advance_torch

        advance_torch(write_pos, ssm_state_indices, force_flush, L)
