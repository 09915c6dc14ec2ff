"""Helpers of the tensor-core verify kernel (:mod:`tp_replayssm.kernels.verify_mma`), traced by Helion as ordinary
Python and torch code: their loops over the ``T`` drafts run at trace time, so every list they build holds one value
per draft (or per pair of drafts) and the kernel gets straight-line code.

Notation (docs/spec.md): draft ``t`` has the parent ``par_t`` (``-1``: the committed state), keys ``k_t``, queries
``q_t`` (scaled), log-gates ``g_t`` and ``beta_t``; ``anc[t][u]`` is 1 where ``u`` is a strict ancestor of ``t``;
``Gam_t = g_t + sum_{u anc t} g_u`` the gate sum along its own path. None of them indexes a kernel argument (Helion
lowers loads and stores in the kernel body only); the products of split operands (:func:`exact_products`,
:func:`part_products`) are ``hl.dot`` calls on tiles the kernel loaded.
"""

from __future__ import annotations

import torch

import helion.language as hl

from .decode_math import qk_math

__all__ = ["add_tuple", "ancestry", "bf16_parts", "column_matrix", "combination", "coupling_products", "couplings",
           "draft_qk", "exact_products", "merged_terms", "min_log_decay", "min_tuple", "output_columns", "pair_terms",
           "part_products", "path_sums", "solve_chunk", "stack_rows", "value_matrix"]


def add_tuple(a, b):  # noqa: ANN001, ANN201 - traced by Helion
    """``hl.reduce``'s combine function of a sum over a tuple of tensors: one reduction (one exchange through shared
    memory behind one barrier across the warps) for all of them, where separate sums take one each."""
    return tuple(x + y for x, y in zip(a, b))


def min_tuple(a, b):  # noqa: ANN001, ANN201 - traced by Helion
    """:func:`add_tuple` for a minimum."""
    return tuple(torch.minimum(x, y) for x, y in zip(a, b))


def draft_qk(q_in, k_in, scale: float, use_l2norm: bool, T: int, batched: bool):  # noqa: ANN001, ANN201
    """``(qs, ks)``: each draft's query (scaled) and key, fp32 ``[K]``, l2-normalized when asked, from the loaded
    inputs ``q_in[t]``, ``k_in[t]``; with ``batched`` the ``2T`` norms' sums are one reduction over a tuple."""
    if not (batched and use_l2norm):  # draft by draft
        qk = [qk_math(q_in[t].to(torch.float32), k_in[t].to(torch.float32), scale, use_l2norm) for t in range(T)]
        return [qk[t][0] for t in range(T)], [qk[t][1] for t in range(T)]
    qf = [q_in[t].to(torch.float32) for t in range(T)]
    kf = [k_in[t].to(torch.float32) for t in range(T)]
    sq = hl.reduce(add_tuple, tuple([x * x for x in qf] + [x * x for x in kf]), dim=0)
    return ([qf[t] * torch.rsqrt(sq[t] + 1e-6) * scale for t in range(T)],
            [kf[t] * torch.rsqrt(sq[T + t] + 1e-6) for t in range(T)])


def ancestry(parents, T: int):  # noqa: ANN001, ANN201 - traced by Helion
    """``anc[t][u]`` (fp32 0-d tensors, ``u < t``) from the parents ``parents[t]`` (int32 0-d tensors, each ``-1`` or
    an earlier node): ``u`` is an ancestor of ``t`` if it is ``t``'s parent or an ancestor of that parent."""
    anc = []
    for t in range(T):
        row = []
        for u in range(t):
            a = torch.where(parents[t] == u, 1.0, 0.0)
            for w in range(u + 1, t):
                a = a + torch.where(parents[t] == w, 1.0, 0.0) * anc[w][u]
            row.append(a)
        anc.append(row)
    return anc


def path_sums(gates, anc, T: int):  # noqa: ANN001, ANN201 - traced by Helion
    """``Gam_t [K] = g_t + sum_{u anc t} g_u``: each draft's log-decay from the committed state."""
    gam = []
    for t in range(T):
        s = gates[t]
        for u in range(t):
            s = s + anc[t][u] * gates[u]
        gam.append(s)
    return gam


def min_log_decay(tot, gam, T: int, batched: bool = False):  # noqa: ANN001, ANN201 - traced by Helion
    """The smallest cumulative gate ``min_{t, k} (tot + Gam_t)[k]`` of the drafts (the pre-decayed rebase test); with
    ``batched`` the ``T`` minima over ``K`` are one reduction over a tuple."""
    if batched:
        lows = hl.reduce(min_tuple, tuple(tot + gam[t] for t in range(T)), dim=0)
        low = lows[0]
        for t in range(1, T):
            low = torch.minimum(low, lows[t])
        return low
    low = torch.amin(tot + gam[0], dim=0)
    for t in range(1, T):
        low = torch.minimum(low, torch.amin(tot + gam[t], dim=0))
    return low


def pair_terms(qs, ks, gam, anc, betas, T: int, batched: bool = False):  # noqa: ANN001, ANN201 - traced by Helion
    """The drafts' couplings through their ancestors' deltas (0-d fp32 tensors):
    ``nk[t][u] = beta_t * anc[t][u] * k_u . (exp(Gam_t - Gam_u) k_t)`` (u < t) and ``mq[t][u] = anc[t][u] * q_t .
    (exp(Gam_t - Gam_u) k_u)`` (u < t), ``mq[t][t] = q_t . k_t``. The exponent of a non-ancestor is masked to 0 before
    the exp (it may be positive), so every term is finite. With ``batched`` the ``T^2`` dot products over ``K`` are
    one reduction over a tuple."""
    nk, mq = [], []
    if not batched:  # each sum where its product is made
        for t in range(T):
            nrow, qrow = [], []
            for u in range(t):
                decay = torch.exp(torch.where(anc[t][u] > 0.5, gam[t] - gam[u], 0.0))
                ku_dec = ks[u] * decay
                nrow.append(betas[t] * anc[t][u] * torch.sum(ku_dec * ks[t], dim=0))
                qrow.append(anc[t][u] * torch.sum(ku_dec * qs[t], dim=0))
            qrow.append(torch.sum(ks[t] * qs[t], dim=0))
            nk.append(nrow)
            mq.append(qrow)
        return nk, mq
    dots = hl.reduce(add_tuple, tuple(coupling_products(qs, ks, gam, anc, T)), dim=0)
    return couplings(dots, anc, betas, T)


def coupling_products(qs, ks, gam, anc, T: int):  # noqa: ANN001, ANN201 - traced by Helion
    """The ``[K]`` products whose sums are the drafts' couplings (:func:`pair_terms`), in :func:`couplings`' order:
    per ``t``, ``(k_u . k_t, k_u . q_t)`` for each ``u < t`` with ``k_u`` decayed to ``t``, then ``q_t . k_t``."""
    prods = []
    for t in range(T):
        for u in range(t):
            ku_dec = ks[u] * torch.exp(torch.where(anc[t][u] > 0.5, gam[t] - gam[u], 0.0))
            prods += [ku_dec * ks[t], ku_dec * qs[t]]
        prods.append(ks[t] * qs[t])
    return prods


def couplings(dots, anc, betas, T: int, rq=None, rk=None):  # noqa: ANN001, ANN201 - traced by Helion
    """``(nk, mq)`` of :func:`pair_terms` from the sums ``dots`` of :func:`coupling_products` (more may follow them);
    with ``rq``, ``rk`` (per draft) the sums are of raw vectors and ``q_t`` / ``k_t`` scale by ``rq[t]`` / ``rk[t]``."""
    nk, mq = [], []
    i = 0
    for t in range(T):
        nrow, qrow = [], []
        for u in range(t):
            if rk is None:
                nrow.append(betas[t] * anc[t][u] * dots[i])
                qrow.append(anc[t][u] * dots[i + 1])
            else:
                nrow.append(betas[t] * anc[t][u] * (dots[i] * (rk[u] * rk[t])))
                qrow.append(anc[t][u] * (dots[i + 1] * (rk[u] * rq[t])))
            i += 2
        qrow.append(dots[i] if rk is None else dots[i] * (rk[t] * rq[t]))
        i += 1
        nk.append(nrow)
        mq.append(qrow)
    return nk, mq


def merged_terms(q_in, k_in, gam, anc, betas, scale: float, use_l2norm: bool, T: int,  # noqa: ANN001, ANN201
                 tot=None):  # noqa: ANN001
    """:func:`draft_qk` and :func:`pair_terms` (batched) from ONE reduction over a tuple: ``(qs, ks, nk, mq, below)``.
    The couplings' dot products are taken on the raw inputs and scaled by the norms afterwards (a dot product of
    l2-normalized vectors is the raw one times both ``rsqrt(|x|^2 + 1e-6)``), so they need not wait for the norms'
    reduction: the ``2T`` squared norms and the ``T^2`` couplings are summed together, right after the gates (the
    decays need ``Gam``). Equal to the two reductions' result up to fp32 rounding. With ``tot`` (``G_{c-1} [K]``) the
    same reduction counts the drafts' cumulative gates below the rebase bound, ``below`` = the number of ``(t, k)``
    with ``tot + Gam_t < -75`` (fp32, exact): > 0 exactly where :func:`min_log_decay` is below it; else None."""
    qf = [q_in[t].to(torch.float32) for t in range(T)]
    kf = [k_in[t].to(torch.float32) for t in range(T)]
    prods = coupling_products(qf, kf, gam, anc, T)
    if use_l2norm:
        prods += [x * x for x in qf] + [x * x for x in kf]
    n = len(prods) - (2 * T if use_l2norm else 0)
    if tot is not None:  # the rebase test's count, last
        count = torch.where(tot + gam[0] < -75.0, 1.0, 0.0)  # -validation.PREDECAYED_MAX_LOG_DECAY
        for t in range(1, T):
            count = count + torch.where(tot + gam[t] < -75.0, 1.0, 0.0)
        prods.append(count)
    sums = hl.reduce(add_tuple, tuple(prods), dim=0)
    if use_l2norm:
        rq = [torch.rsqrt(sums[n + t] + 1e-6) * scale for t in range(T)]
        rk = [torch.rsqrt(sums[n + T + t] + 1e-6) for t in range(T)]
    else:
        rq, rk = [scale] * T, [1.0] * T
    nk, mq = couplings(sums, anc, betas, T, rq, rk)
    below = sums[len(prods) - 1] if tot is not None else None
    return [qf[t] * rq[t] for t in range(T)], [kf[t] * rk[t] for t in range(T)], nk, mq, below


def solve_chunk(pk, pq, vs, betas, nk, mq, T: int):  # noqa: ANN001, ANN201 - traced by Helion
    """The forward substitution in its readable form (the kernel runs it folded into its operands,
    :func:`combination`; tests check the two agree): one value chunk's draft deltas and outputs (``[Vc]`` each) from
    the products with the committed state
    ``pk[t] = S_c' @ k_t``, ``pq[t]`` likewise with ``q_t``: forward substitution along each draft's ancestors,
    ``delta_t = beta_t (v_t - pk_t) - sum_{u<t} nk[t][u] delta_u`` and
    ``out_t = pq_t + sum_{u<=t} mq[t][u] delta_u``."""
    deltas, outs = [], []
    for t in range(T):
        d = betas[t] * (vs[t] - pk[t])
        for u in range(t):
            d = d - nk[t][u] * deltas[u]
        deltas.append(d)
        o = pq[t] + mq[t][t] * d
        for u in range(t):
            o = o + mq[t][u] * deltas[u]
        outs.append(o)
    return deltas, outs


def combination(betas, nk, mq, T: int):  # noqa: ANN001, ANN201 - traced by Helion
    """:func:`solve_chunk`'s forward substitution done once, on the per-program scalars: with the residuals ``r_u =
    v_u - pk_u``, ``delta_t = sum_{u<=t} alpha[t][u] r_u`` and ``out_t = pq_t + sum_{u<=t} gamma[t][u] r_u``, where
    ``alpha[t][t] = beta_t``, ``alpha[t][u] = -sum_{u<=w<t} nk[t][w] alpha[w][u]`` and ``gamma[t][u] = sum_{u<=w<=t}
    mq[t][w] alpha[w][u]`` (0-d fp32 tensors, lower-triangular lists)."""
    alpha = []
    for t in range(T):
        row = []
        for u in range(t):
            s = -nk[t][u] * alpha[u][u]
            for w in range(u + 1, t):
                s = s - nk[t][w] * alpha[w][u]
            row.append(s)
        row.append(betas[t])
        alpha.append(row)
    gamma = []
    for t in range(T):
        row = []
        for u in range(t + 1):
            s = mq[t][u] * alpha[u][u]
            for w in range(u + 1, t + 1):
                s = s + mq[t][w] * alpha[w][u]
            row.append(s)
        gamma.append(row)
    return alpha, gamma


def output_columns(aks, aqs, alpha, gamma, T: int):  # noqa: ANN001, ANN201 - traced by Helion
    """The columns whose products with the committed state give the deltas and outputs directly (``[K, 1]`` each):
    ``delta_t = S' @ (-sum_u alpha[t][u] ak_u) + sum_u alpha[t][u] v_u`` and ``out_t = S' @ (aq_t - sum_u gamma[t][u]
    ak_u) + sum_u gamma[t][u] v_u``; the value terms are :func:`value_matrix`'s."""
    cols_d, cols_o = [], []
    for t in range(T):
        d = -alpha[t][0] * aks[0]
        o = aqs[t] - gamma[t][0] * aks[0]
        for u in range(1, t + 1):
            d = d - alpha[t][u] * aks[u]
            o = o - gamma[t][u] * aks[u]
        cols_d.append(d)
        cols_o.append(o)
    return cols_d, cols_o


def value_matrix(alpha, gamma, row, col, T: int):  # noqa: ANN001, ANN201 - traced by Helion
    """``E [N, N]`` fp32 (``row [N, 1]``, ``col [1, N]``): ``E[u, t] = alpha[t][u]``, ``E[u, T + t] = gamma[t][u]``
    (``u <= t``), the rest zero, so ``V @ E`` with the drafts' values in columns ``u < T`` of ``V [Vc, N]`` is the
    value part of every delta and output column (:func:`output_columns`)."""
    e = torch.where((row == 0) & (col == 0), alpha[0][0], 0.0)
    for t in range(T):
        for u in range(t + 1):
            if t > 0 or u > 0:
                e = e + torch.where((row == u) & (col == t), alpha[t][u], 0.0)
            e = e + torch.where((row == u) & (col == T + t), gamma[t][u], 0.0)
    return e


def column_matrix(aks, aqs, col, T: int):  # noqa: ANN001, ANN201 - traced by Helion
    """``A [K, N]`` fp32: column ``t`` holds ``aks[t]``, column ``T + t`` holds ``aqs[t]`` (``col [1, N]`` the column
    index, the vectors come as ``[K, 1]``), the rest zero; with ``col [N, 1]`` and ``[1, K]`` vectors, its transpose
    ``A^T [N, K]`` (the kernel's form: rows :func:`output_columns`)."""
    a = torch.where(col == 0, aks[0], 0.0)
    for t in range(T):
        if t > 0:
            a = a + torch.where(col == t, aks[t], 0.0)
        a = a + torch.where(col == T + t, aqs[t], 0.0)
    return a


def bf16_parts(x, parts: int):  # noqa: ANN001, ANN201 - traced by Helion
    """``x`` (fp32) as ``parts`` bf16 tensors whose sum is ``x`` to ~``2^(-8 parts)`` relative: ``hi = bf16(x)``,
    ``mid = bf16(x - hi)``, ``lo = bf16(x - hi - mid)``. Tensor-core products of exact bf16 operands with each part,
    accumulated in fp32, then give fp32-accurate products."""
    hi = x.to(torch.bfloat16)
    rest = x - hi.to(torch.float32)
    mid = rest.to(torch.bfloat16)
    if parts == 2:
        return hi, mid
    return hi, mid, (rest - mid.to(torch.float32)).to(torch.bfloat16)


def exact_products(parts, x, acc0, acc1, acc2, parts_n: int):  # noqa: ANN001, ANN201 - traced by Helion
    """``(acc_i + parts[i] @ x)`` for each bf16 part of the left operand, ``x`` an exact bf16 operand: one
    accumulator chain per part (independent, so their tensor-core latencies overlap), summed by the caller. An
    ``acc_i`` of None starts chain ``i``; with two parts ``acc2`` comes back as it went in."""
    acc0 = hl.dot(parts[0], x, acc=acc0)
    acc1 = hl.dot(parts[1], x, acc=acc1)
    if parts_n == 3:
        acc2 = hl.dot(parts[2], x, acc=acc2)
    return acc0, acc1, acc2


def part_products(lhs, rhs, acc0, acc1, acc2, parts_n: int):  # noqa: ANN001, ANN201 - traced by Helion
    """The chains of :func:`exact_products` for two split operands: every part pair ``lhs[a] @ rhs[b]`` above
    ``2^-(8 parts)``, chain ``a + b`` for ``a + b < parts_n`` (with three parts the ``1, 1`` pair joins chain 0)."""
    acc0 = hl.dot(lhs[0], rhs[0], acc=acc0)
    acc1 = hl.dot(lhs[0], rhs[1], acc=hl.dot(lhs[1], rhs[0], acc=acc1))
    if parts_n == 3:
        acc2 = hl.dot(lhs[0], rhs[2], acc=hl.dot(lhs[2], rhs[0], acc=acc2))
        acc0 = hl.dot(lhs[1], rhs[1], acc=acc0)
    return acc0, acc1, acc2


def stack_rows(vectors, tt, T: int):  # noqa: ANN001, ANN201 - traced by Helion
    """``[Tb, K]``: row ``t < T`` holds ``vectors[t]`` (each ``[1, K]``; ``tt [Tb, 1]`` the row index), the rest
    zero."""
    x = torch.where(tt == 0, vectors[0], 0.0)
    for t in range(1, T):
        x = x + torch.where(tt == t, vectors[t], 0.0)
    return x
