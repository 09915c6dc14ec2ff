"""The PyTorch form of a KDA prefill: the short convolution over packed sequences, the activations, and the chunked
delta-rule recurrence with an initial state. It runs on any device and in any float dtype (the tests run it in
float64); the layer uses it on CPU, and on CUDA when flash-linear-attention is not installed.

Packed sequences: ``T`` tokens of ``n`` sequences back to back, ``cu_seqlens = [0, T_1, T_1 + T_2, ..., T]``
(host ints here; every sequence has at least one token).

The recurrence, per value head (``S [V, K]``, V before K as in the pool; ``g_t [K]`` log-gates ``<= 0``)::

    S_t = S_{t-1} * exp(g_t)[None, :];   u_t = beta_t * (v_t - S_t @ k_t);   S_t += u_t (outer) k_t;   o_t = S_t @ q_t

:func:`chunk_kda_torch` computes it ``C`` tokens at a time. Within a chunk with inclusive cumulative gates ``G_t``
and entry state ``S0``, every decay it needs is ``exp(G_t - G_s)`` with ``s <= t`` (never above 1, so nothing
overflows whatever the gates)::

    A[t, s] = sum_c k_t[c] k_s[c] exp(G_t[c] - G_s[c])     (s < t)
    (I + diag(beta) A) U = diag(beta) (V - (k * exp(G)) @ S0^T)          (unit lower triangular: one solve)
    o_t = S0 @ (q_t * exp(G_t)) + sum_{s <= t} U_s (q_t . (k_s * exp(G_t - G_s)))
    S_C = S0 * exp(G_C)[None, :] + sum_s U_s (outer) (k_s * exp(G_C - G_s))

``U`` holds the deltas ``u_t`` the plain recurrence writes, so the chunked result is the recurrence itself, in another
order of sums.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["chunk_kda_torch", "kda_activations", "packed_conv", "recurrent_kda_torch"]

L2NORM_EPS = 1e-6  # inside the square root, as FLA's kernels and the decode kernel


def packed_conv(x: torch.Tensor, window: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                cu_seqlens: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The causal depthwise convolution with SiLU over packed sequences, each continuing its window.

    ``x [T, D]`` pre-conv inputs; ``window [n, D, W-1]`` each sequence's last ``W-1`` earlier inputs, oldest first;
    ``weight [D, W]`` (``weight[:, W-1]`` multiplies the newest input), ``bias [D]`` or None. Returns ``(y [T, D]`` in
    ``x.dtype``, ``new_window [n, D, W-1]`` fp32 or wider``)``: ``y[t] = silu(sum_j weight[:, j] * u[t - (W-1) + j]
    + bias)`` where ``u`` is the sequence's window followed by its tokens, and the new window is the last ``W-1``
    entries of ``u``. The math is in fp32 (float64 for float64 inputs)."""
    T, D = x.shape
    W = weight.shape[1]
    n = len(cu_seqlens) - 1
    acc = torch.promote_types(x.dtype, torch.float32)
    dev = x.device
    lens = torch.tensor([cu_seqlens[i + 1] - cu_seqlens[i] for i in range(n)], device=dev)
    seq = torch.repeat_interleave(torch.arange(n, device=dev), lens, output_size=T)  # [T] sequence of each token
    starts = torch.tensor(cu_seqlens[:-1], device=dev)
    ends = torch.tensor(cu_seqlens[1:], device=dev)
    xf, wf = x.to(acc), window.to(acc)

    def inputs_at(pos: torch.Tensor, rows: torch.Tensor, start: torch.Tensor) -> torch.Tensor:
        """``u`` at packed position ``pos`` of sequence ``rows``: a token of the sequence, or an entry of its window
        (``start - pos`` steps before the first token: window entry ``W-1 - (start - pos)``)."""
        inside = pos >= start
        tok = xf.index_select(0, pos.clamp(min=0))
        win = wf[rows, :, ((W - 1) - (start - pos)).clamp(0, W - 2)]
        return torch.where(inside[:, None], tok, win)

    t = torch.arange(T, device=dev)
    start_t = starts[seq]
    y = torch.zeros(T, D, dtype=acc, device=dev) if bias is None else bias.to(acc).expand(T, D).clone()
    for j in range(W):
        y += weight[:, j].to(acc) * inputs_at(t - (W - 1) + j, seq, start_t)
    rows = torch.arange(n, device=dev)
    new_window = torch.stack([inputs_at(ends - (W - 1) + m, rows, starts) for m in range(W - 1)], dim=2)
    return F.silu(y).to(x.dtype), new_window


def kda_activations(q: torch.Tensor, k: torch.Tensor, a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor,
                    dt_bias: torch.Tensor, *, lower_bound: float | None = None, scale: float | None = None,
                    dtype: torch.dtype | None = None) -> tuple[torch.Tensor, ...]:
    """The recurrence's inputs from the layer's (post-conv) projections, per token.

    ``q, k [T, H, K]``; ``a [T, HV, K]`` forget-gate logits; ``b [T, HV]`` beta logits; ``A_log [HV]``; ``dt_bias
    [HV*K]``. Returns ``(q, k, g, beta)`` in ``dtype`` (None: fp32, or float64 for float64 inputs): ``q, k [T, HV, K]``
    l2-normalized (``x / sqrt(sum x^2 + 1e-6)``), ``q`` times ``scale`` (``K ** -0.5``), each value head reading q/k
    head ``hv // (HV // H)``; ``g [T, HV, K]`` the log-gates ``-exp(A_log) * softplus(a + dt_bias)`` (softplus
    linear above 20), or ``lower_bound * sigmoid(exp(A_log) * (a + dt_bias))``; ``beta = sigmoid(b) [T, HV]``."""
    dtype = dtype or torch.promote_types(q.dtype, torch.float32)
    T, H, K = q.shape
    HV = a.shape[1]
    scale = K ** -0.5 if scale is None else scale
    q, k = (x.to(dtype) for x in (q, k))
    q = q / torch.sqrt((q * q).sum(-1, keepdim=True) + L2NORM_EPS) * scale
    k = k / torch.sqrt((k * k).sum(-1, keepdim=True) + L2NORM_EPS)
    q, k = (x.repeat_interleave(HV // H, dim=1) for x in (q, k))
    x = a.to(dtype) + dt_bias.to(dtype).view(HV, K)
    A = torch.exp(A_log.to(dtype))[:, None]
    g = lower_bound * torch.sigmoid(A * x) if lower_bound is not None else -A * F.softplus(x, threshold=20.0)
    return q, k, g, torch.sigmoid(b.to(dtype))


def _padded(x: torch.Tensor, cu_seqlens: list[int], length: int) -> torch.Tensor:
    """Packed ``x [T, ...]`` as ``[n, length, ...]``, zeros past each sequence's end."""
    n = len(cu_seqlens) - 1
    out = x.new_zeros(n, length, *x.shape[1:])
    for i in range(n):
        a, b = cu_seqlens[i], cu_seqlens[i + 1]
        out[i, : b - a] = x[a:b]
    return out


def chunk_kda_torch(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                    initial_state: torch.Tensor, cu_seqlens: list[int], *,
                    chunk_size: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    """The recurrence over packed sequences, ``chunk_size`` tokens at a time (module docstring).

    ``q, k [T, HV, K]`` (normalized and scaled, per value head), ``v [T, HV, V]``, ``g [T, HV, K]`` log-gates,
    ``beta [T, HV]`` (:func:`kda_activations`), ``initial_state [n, HV, V, K]``. Returns ``(o [T, HV, V],
    final_state [n, HV, V, K])`` in the inputs' dtype (the math runs in it). Sequences are padded to whole chunks
    with ``g = 0`` and ``beta = 0``, steps that change nothing."""
    n = len(cu_seqlens) - 1
    C = chunk_size
    longest = max(cu_seqlens[i + 1] - cu_seqlens[i] for i in range(n))
    Tp = -(-longest // C) * C
    # [n, HV, Tp, .] with padding steps that neither decay nor write
    qp, kp, vp, gp = (_padded(x, cu_seqlens, Tp).transpose(1, 2) for x in (q, k, v, g))
    bp = _padded(beta, cu_seqlens, Tp).transpose(1, 2)
    S = initial_state.to(q.dtype).clone()
    causal = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()
    strict = torch.ones(C, C, dtype=torch.bool, device=q.device).tril(-1)
    eye = torch.eye(C, dtype=q.dtype, device=q.device)
    outs = []
    for c0 in range(0, Tp, C):
        qc, kc, vc, gc, bc = (x[:, :, c0:c0 + C] for x in (qp, kp, vp, gp, bp))
        G = gc.cumsum(2)  # [n, HV, C, K] inclusive
        diff = G[:, :, :, None, :] - G[:, :, None, :, :]  # [n, HV, t, s, K]: G_t - G_s
        decay = torch.exp(torch.where(causal[:, :, None], diff, float("-inf")))  # 0 where s > t
        A = torch.einsum("nhtk,nhsk,nhtsk->nhts", kc, kc, decay).masked_fill(~strict, 0.0)
        Qk = torch.einsum("nhtk,nhsk,nhtsk->nhts", qc, kc, decay)  # s <= t
        eG = torch.exp(G)
        rhs = bc[..., None] * (vc - torch.einsum("nhvk,nhtk->nhtv", S, kc * eG))
        U = torch.linalg.solve_triangular(eye + bc[..., None] * A, rhs, upper=False, unitriangular=True)
        outs.append(torch.einsum("nhvk,nhtk->nhtv", S, qc * eG) + torch.einsum("nhts,nhsv->nhtv", Qk, U))
        G_end = G[:, :, -1:]
        S = S * torch.exp(G_end) + torch.einsum("nhtv,nhtk->nhvk", U, kc * torch.exp(G_end - G))
    o = torch.cat(outs, dim=2).transpose(1, 2)  # [n, Tp, HV, V]
    packed = torch.cat([o[i, : cu_seqlens[i + 1] - cu_seqlens[i]] for i in range(n)])
    return packed, S


def recurrent_kda_torch(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                        initial_state: torch.Tensor, cu_seqlens: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The same recurrence token by token (the plain form; :func:`chunk_kda_torch`'s arguments and results)."""
    n = len(cu_seqlens) - 1
    outs, finals = [], []
    for i in range(n):
        S = initial_state[i].to(q.dtype).clone()  # [HV, V, K]
        for t in range(cu_seqlens[i], cu_seqlens[i + 1]):
            S = S * torch.exp(g[t])[:, None, :]
            u = beta[t][:, None] * (v[t] - torch.einsum("hvk,hk->hv", S, k[t]))
            S = S + u[:, :, None] * k[t][:, None, :]
            outs.append(torch.einsum("hvk,hk->hv", S, q[t]))
        finals.append(S)
    return torch.stack(outs), torch.stack(finals)
