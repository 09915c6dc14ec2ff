"""The model ``launch/serve.py`` serves: a small Kimi-Linear-style decoder with seeded random weights.

``embed -> N x [RMSNorm -> KDA -> residual -> RMSNorm -> MLP -> residual] -> RMSNorm -> lm_head``. The KDA layers
are the library's :class:`tp_replayssm.layers.TPKimiDeltaAttention` over one :class:`ReplaySSMStatePool`; the MLP is
a dense stand-in for Kimi-Linear's MoE and MLA layers (column-parallel ``up``, SiLU, row-parallel ``down`` and an
all-reduce); embedding, norms and ``lm_head`` are replicated.

Weights: :class:`SeededWeights` is a checkpoint whose tensors are generated on demand from a seed, block by block,
under Kimi-Linear's names (``layers.{i}.attn.f_a_proj.weight``, ``A_log [1, 1, HV, 1]``, ...). Every rank gets the
same values, and a rank that reads its slices (the layer's loader does) generates only the blocks they cover.

References (one process, full weights): :class:`PlainModel`, the same model in float64 with a plain token-by-token
KDA recurrence written here from the layer's formulas (no library code, no pool), and :class:`FLAModel`, the same
model with flash-linear-attention's ``KimiDeltaAttention`` layers. Both return teacher-forced logits of a sequence.
"""

from __future__ import annotations

import dataclasses
import zlib
from collections.abc import Iterator, Mapping
from typing import Any

import torch
import torch.nn.functional as F

BLOCK = 32  # generation block along the first two dims of every weight


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """``vocab``, ``hidden``, ``layers``; KDA ``heads`` (H), ``v_heads`` (HV), ``head_dim`` (K = V = the gate
    rank), ``conv`` kernel; MLP ``ffn`` width; RMSNorm ``eps``; weight ``seed``."""

    vocab: int = 256
    hidden: int = 64
    layers: int = 2
    heads: int = 2
    v_heads: int = 4
    head_dim: int = 16
    conv: int = 4
    ffn: int = 128
    eps: float = 1e-6
    seed: int = 0

    def kda(self) -> Any:
        from tp_replayssm.layers import KDALayerConfig

        return KDALayerConfig(self.hidden, self.heads, self.v_heads, self.head_dim, self.head_dim, self.head_dim,
                              conv_size=self.conv, gate_bias=False, norm_eps=1e-5)


class LazyTensor:
    """A seeded random tensor made on demand: ``shape``, and ``[index]`` (slices of the first two dims, anything
    after) generating only the ``BLOCK x BLOCK`` blocks the slices cover (module docstring)."""

    def __init__(self, name: str, shape: tuple[int, ...], init: tuple[str, float, float], seed: int) -> None:
        self.name, self.shape, self.init, self.seed = name, tuple(shape), init, seed
        self.generated = 0  # elements generated so far (the loader's reads, counted)

    def _block(self, bi: int, bj: int) -> torch.Tensor:
        rows = range(bi * BLOCK, min((bi + 1) * BLOCK, self.shape[0]))
        cols = range(bj * BLOCK, min((bj + 1) * BLOCK, self.shape[1])) if len(self.shape) > 1 else range(1)
        g = torch.Generator().manual_seed((self.seed * 1000003 + zlib.crc32(self.name.encode())) * 65537
                                          + bi * 4099 + bj)
        shape = (len(rows), *((len(cols),) if len(self.shape) > 1 else ()), *self.shape[2:])
        kind, a, b = self.init
        if kind == "uniform":
            t = torch.empty(shape).uniform_(a, b, generator=g)
        else:
            t = torch.randn(shape, generator=g) * a + b
        self.generated += t.numel()
        return t

    def __getitem__(self, index: Any) -> torch.Tensor:
        index = index if isinstance(index, tuple) else (index,)
        spans = []
        for d in range(min(2, len(self.shape))):
            s = index[d] if d < len(index) else slice(None)
            if not isinstance(s, slice) or s.step not in (None, 1):
                raise ValueError(f"LazyTensor {self.name}: only unit-step slices of the first two dims; got {s!r}")
            spans.append(range(*s.indices(self.shape[d])))
        r, c = spans[0], spans[1] if len(spans) > 1 else range(1)
        out = torch.cat([torch.cat([self._block(bi, bj) for bj in range(c.start // BLOCK, -(-c.stop // BLOCK))], 1)
                         if len(self.shape) > 1 else self._block(bi, 0)
                         for bi in range(r.start // BLOCK, -(-r.stop // BLOCK))], 0)
        out = out[r.start - r.start // BLOCK * BLOCK:][: len(r)]
        if len(self.shape) > 1:
            out = out[:, c.start - c.start // BLOCK * BLOCK:][:, : len(c)]
        rest = index[2:]
        return out[(slice(None), slice(None), *rest)] if rest else out


class SeededWeights(Mapping[str, LazyTensor]):
    """The model's checkpoint (module docstring): name -> :class:`LazyTensor`. KDA layers under
    ``layers.{i}.attn.`` with Kimi-Linear's names."""

    def __init__(self, cfg: ModelConfig) -> None:
        c = cfg
        H, HV, K, D = c.heads, c.v_heads, c.head_dim, c.hidden
        s_in, s_k = D ** -0.5, K ** -0.5
        spec: dict[str, tuple[tuple[int, ...], tuple[str, float, float]]] = {
            "embed.weight": ((c.vocab, D), ("normal", 1.0, 0.0)),
            "norm.weight": ((D,), ("normal", 0.1, 1.0)),
            "lm_head.weight": ((c.vocab, D), ("normal", s_in, 0.0)),
        }
        for i in range(c.layers):
            p = f"layers.{i}."
            a = p + "attn."
            spec.update({
                p + "attn_norm.weight": ((D,), ("normal", 0.1, 1.0)),
                p + "mlp_norm.weight": ((D,), ("normal", 0.1, 1.0)),
                p + "mlp.up.weight": ((c.ffn, D), ("normal", s_in, 0.0)),
                p + "mlp.down.weight": ((D, c.ffn), ("normal", 0.5 * c.ffn ** -0.5, 0.0)),
                a + "q_proj.weight": ((H * K, D), ("normal", s_in, 0.0)),
                a + "k_proj.weight": ((H * K, D), ("normal", s_in, 0.0)),
                a + "v_proj.weight": ((HV * K, D), ("normal", s_in, 0.0)),
                a + "q_conv1d.weight": ((H * K, 1, c.conv), ("normal", 0.5, 0.0)),
                a + "k_conv1d.weight": ((H * K, 1, c.conv), ("normal", 0.5, 0.0)),
                a + "v_conv1d.weight": ((HV * K, 1, c.conv), ("normal", 0.5, 0.0)),
                a + "f_a_proj.weight": ((K, D), ("normal", s_in, 0.0)),
                a + "f_b_proj.weight": ((HV * K, K), ("normal", s_k, 0.0)),
                a + "b_proj.weight": ((HV, D), ("normal", s_in, 0.0)),
                a + "g_a_proj.weight": ((K, D), ("normal", s_in, 0.0)),
                a + "g_b_proj.weight": ((HV * K, K), ("normal", s_k, 0.0)),
                a + "A_log": ((1, 1, HV, 1), ("uniform", -1.0, 0.5)),
                a + "dt_bias": ((HV * K,), ("uniform", -4.0, 0.0)),
                a + "o_norm.weight": ((K,), ("normal", 0.1, 1.0)),
                a + "o_proj.weight": ((D, HV * K), ("normal", 0.5 * (HV * K) ** -0.5, 0.0)),
            })
        self._t = {n: LazyTensor(n, shape, init, cfg.seed) for n, (shape, init) in spec.items()}

    def __getitem__(self, name: str) -> LazyTensor:
        return self._t[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._t)

    def __len__(self) -> int:
        return len(self._t)

    def full(self, name: str) -> torch.Tensor:
        """The whole tensor (references; replicated weights)."""
        return self._t[name][:]

    def generated(self) -> int:
        return sum(t.generated for t in self._t.values())


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float() if x.dtype != torch.float64 else x
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * w.to(xf.dtype)).to(x.dtype)


# ---- the tensor-parallel model ------------------------------------------------------------------------------------


class TPModel:
    """One rank's shard of the model on ``pool`` (one pool layer per KDA layer). ``group``: the tensor-parallel
    group (None: a single rank). Weights go to ``device`` in ``dtype``; each rank reads its slices of the KDA and MLP
    weights and the replicated ones whole."""

    def __init__(self, cfg: ModelConfig, weights: SeededWeights, pool: Any, *, group: Any, rank: int, world: int,
                 device: torch.device, dtype: torch.dtype) -> None:
        from tp_replayssm.layers import TPKimiDeltaAttention

        self.c, self.pool, self.group, self.device, self.dtype = cfg, pool, group, device, dtype
        if cfg.ffn % world:
            raise ValueError(f"--ffn {cfg.ffn} must split evenly over {world} ranks")
        f0, f1 = rank * cfg.ffn // world, (rank + 1) * cfg.ffn // world

        def put(t: torch.Tensor) -> torch.Tensor:
            return t.to(device=device, dtype=dtype).contiguous()

        self.embed, self.norm, self.lm_head = (put(weights.full(n)) for n in ("embed.weight", "norm.weight",
                                                                              "lm_head.weight"))
        self.blocks = []
        for i in range(cfg.layers):
            p = f"layers.{i}."
            attn = TPKimiDeltaAttention.from_state_dict(weights, cfg.kda(), pool=pool, layer_idx=i, prefix=p + "attn.",
                                                        group=group, dtype=dtype)
            self.blocks.append(dict(
                attn=attn, attn_norm=put(weights.full(p + "attn_norm.weight")),
                mlp_norm=put(weights.full(p + "mlp_norm.weight")),
                up=put(weights[p + "mlp.up.weight"][f0:f1]), down=put(weights[p + "mlp.down.weight"][:, f0:f1])))

    def parameter_bytes(self) -> int:
        ts = [self.embed, self.norm, self.lm_head]
        for b in self.blocks:
            ts += [b["attn_norm"], b["mlp_norm"], b["up"], b["down"], *b["attn"].parameters()]
        return sum(t.numel() * t.element_size() for t in ts)

    def _mlp(self, b: dict, h: torch.Tensor) -> torch.Tensor:
        y = F.silu(h @ b["up"].T) @ b["down"].T
        if self.group is not None:
            import torch.distributed as dist

            dist.all_reduce(y, group=self.group)
        return y

    def forward(self, tokens: torch.Tensor, slots: torch.Tensor, cu_seqlens: torch.Tensor | None = None
                ) -> torch.Tensor:
        """Decode (``tokens [B]``, one per slot) or prefill (``tokens [T]`` packed, ``cu_seqlens``); returns fp32
        logits ``[B, vocab]`` (decode) or of each sequence's last token ``[n, vocab]`` (prefill). The last KDA
        layer moves the cursors (``advance=True``): decode moves them on, a prefill sets them to 0."""
        c = self.c
        x = self.embed[tokens]
        for i, b in enumerate(self.blocks):
            h = rms_norm(x, b["attn_norm"], c.eps)
            x = x + b["attn"](h, slots, cu_seqlens, advance=i == len(self.blocks) - 1)
            x = x + self._mlp(b, rms_norm(x, b["mlp_norm"], c.eps))
        if cu_seqlens is not None:
            x = x[cu_seqlens[1:].long() - 1]
        return (rms_norm(x, self.norm, c.eps) @ self.lm_head.T).float()

    def verify(self, tokens: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """One speculative step's verify: ``tokens [B, T]`` per row (the next input token, then the drafts) through
        every KDA layer's ``verify``; returns fp32 logits ``[B, T, vocab]``, position ``t`` the model's prediction
        after tokens ``0..t``. Nothing moves until the caller's ``pool.commit(slots, num_accepted)`` (once, after
        this call: every layer verified)."""
        c = self.c
        x = self.embed[tokens]
        for b in self.blocks:
            x = x + b["attn"](rms_norm(x, b["attn_norm"], c.eps), slots, verify=True)
            x = x + self._mlp(b, rms_norm(x, b["mlp_norm"], c.eps))
        return (rms_norm(x, self.norm, c.eps) @ self.lm_head.T).float()


# ---- references -------------------------------------------------------------------------------------------------


class PlainModel:
    """The model in float64 on the CPU, with a plain KDA recurrence (no library code): teacher-forced logits."""

    def __init__(self, cfg: ModelConfig, weights: SeededWeights) -> None:
        self.c = cfg
        self.w = {n: weights.full(n).double() for n in weights}

    def _kda(self, i: int, xs: torch.Tensor) -> torch.Tensor:
        """One KDA layer over a whole sequence ``xs [T, D]`` from a zero state."""
        c, w, p = self.c, self.w, f"layers.{i}.attn."
        H, HV, K, W = c.heads, c.v_heads, c.head_dim, c.conv
        u = torch.cat([xs @ w[p + n + "_proj.weight"].T for n in "qkv"], dim=1)  # [T, Dqkv] raw
        cw = torch.cat([w[p + n + "_conv1d.weight"][:, 0] for n in "qkv"])  # [Dqkv, W], last tap = newest
        padded = torch.cat([torch.zeros(W - 1, u.shape[1], dtype=u.dtype), u])
        y = F.silu(sum(padded[j:j + xs.shape[0]] * cw[:, j] for j in range(W)))
        q = y[:, :H * K].view(-1, H, K).repeat_interleave(HV // H, 1)
        k = y[:, H * K:2 * H * K].view(-1, H, K).repeat_interleave(HV // H, 1)
        v = y[:, 2 * H * K:].view(-1, HV, K)
        q = q / torch.sqrt((q * q).sum(-1, keepdim=True) + 1e-6) * K ** -0.5
        k = k / torch.sqrt((k * k).sum(-1, keepdim=True) + 1e-6)
        f = (xs @ w[p + "f_a_proj.weight"].T @ w[p + "f_b_proj.weight"].T + w[p + "dt_bias"]).view(-1, HV, K)
        g = -torch.exp(w[p + "A_log"].view(HV))[:, None] * torch.where(f > 20, f, torch.log1p(torch.exp(f)))
        beta = torch.sigmoid(xs @ w[p + "b_proj.weight"].T)
        S = torch.zeros(HV, K, K, dtype=torch.float64)  # [HV, V, K]
        outs = []
        for t in range(xs.shape[0]):
            S = S * torch.exp(g[t])[:, None, :]
            S = S + beta[t][:, None, None] * torch.einsum("hv,hk->hvk", v[t] - torch.einsum("hvk,hk->hv", S, k[t]),
                                                          k[t])
            outs.append(torch.einsum("hvk,hk->hv", S, q[t]))
        o = torch.stack(outs)  # [T, HV, V]
        gate = (xs @ w[p + "g_a_proj.weight"].T @ w[p + "g_b_proj.weight"].T).view(-1, HV, K)
        o = o * torch.rsqrt((o * o).mean(-1, keepdim=True) + 1e-5) * w[p + "o_norm.weight"] * torch.sigmoid(gate)
        return o.reshape(xs.shape[0], -1) @ w[p + "o_proj.weight"].T

    def logits(self, tokens: list[int]) -> torch.Tensor:
        c, w = self.c, self.w
        x = w["embed.weight"][torch.tensor(tokens)]
        for i in range(c.layers):
            p = f"layers.{i}."
            x = x + self._kda(i, rms_norm(x, w[p + "attn_norm.weight"], c.eps))
            h = rms_norm(x, w[p + "mlp_norm.weight"], c.eps)
            x = x + F.silu(h @ w[p + "mlp.up.weight"].T) @ w[p + "mlp.down.weight"].T
        return rms_norm(x, w["norm.weight"], c.eps) @ w["lm_head.weight"].T


class FLAModel:
    """The model with flash-linear-attention's ``KimiDeltaAttention`` layers (fp32, on ``device``); the rest as
    :class:`PlainModel` in fp32. Needs ``fla``; on a CPU, Triton's interpreter (:func:`fla_on_cpu`), where the
    layers run their ``fused_recurrent`` mode at every length (the ``chunk`` mode they take above 64 tokens is many
    times slower there)."""

    def __init__(self, cfg: ModelConfig, weights: SeededWeights, device: torch.device) -> None:
        if device.type == "cpu":
            fla_on_cpu()
        from fla.layers import KimiDeltaAttention

        self.c, self.device = cfg, device
        self.w = {n: weights.full(n).float().to(device) for n in weights}
        ren = {"f_a_proj.weight": "f_proj.0.weight", "f_b_proj.weight": "f_proj.1.weight",
               "g_a_proj.weight": "g_proj.0.weight", "g_b_proj.weight": "g_proj.1.weight"}
        self.kda = []
        for i in range(cfg.layers):
            layer = KimiDeltaAttention(hidden_size=cfg.hidden, num_heads=cfg.heads, num_v_heads=cfg.v_heads,
                                       head_dim=cfg.head_dim, conv_size=cfg.conv, layer_idx=i,
                                       mode="fused_recurrent" if device.type == "cpu" else "chunk").to(device).eval()
            p = f"layers.{i}.attn."
            sd = {ren.get(n[len(p):], n[len(p):]): t for n, t in self.w.items() if n.startswith(p)}
            sd["A_log"] = sd["A_log"].reshape(-1)
            sd["g_proj.1.bias"] = torch.zeros(cfg.v_heads * cfg.head_dim, device=device)  # Kimi-Linear: no bias
            layer.load_state_dict(sd, strict=True)
            self.kda.append(layer)

    def logits(self, tokens: list[int]) -> torch.Tensor:
        c, w = self.c, self.w
        with torch.no_grad():
            x = w["embed.weight"][torch.tensor(tokens, device=self.device)]
            for i, layer in enumerate(self.kda):
                p = f"layers.{i}."
                x = x + layer(rms_norm(x, w[p + "attn_norm.weight"], c.eps)[None])[0][0]
                h = rms_norm(x, w[p + "mlp_norm.weight"], c.eps)
                x = x + F.silu(h @ w[p + "mlp.up.weight"].T) @ w[p + "mlp.down.weight"].T
            return (rms_norm(x, w["norm.weight"], c.eps) @ w["lm_head.weight"].T).double().cpu()


def fla_on_cpu() -> None:
    """Let FLA's Triton kernels run on a CPU, in Triton's interpreter (``TRITON_INTERPRET=1`` before triton's
    import: serve.py sets it for ``--reference fla`` on a CPU). Triton's autotuner benchmarks its configs through a
    GPU driver even there ("0 active drivers"), so every autotuned kernel keeps its first config only. The serving
    job's workaround (the tests' FLA helper, tests/_fla_cpu.py, does the same); idempotent."""
    import os
    import warnings

    import triton.runtime.autotuner as autotuner

    warnings.filterwarnings("ignore", message="Triton is not supported on current platform")  # FLA's, on import

    if os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError("FLA's layers on a CPU need Triton's interpreter: TRITON_INTERPRET=1 before triton is "
                           "imported (launch/serve.py sets it for --reference fla --device cpu)")
    if getattr(autotuner.Autotuner.prune_configs, "_first_config_only", False):
        return
    original = autotuner.Autotuner.prune_configs

    def first_config(self: Any, kwargs: Any, *args: Any, **kw: Any) -> Any:
        return original(self, kwargs, *args, **kw)[:1]

    first_config._first_config_only = True  # type: ignore[attr-defined]
    autotuner.Autotuner.prune_configs = first_config


def describe_bytes(n: float) -> str:
    return f"{n / 2**20:.2f} MiB" if n >= 2**20 else f"{n / 2**10:.1f} KiB"
