"""FLA's speculative-decoding verify, the scheme vLLM runs for KDA, as a ``bench_spec.py --forms fla`` row.

FLA 0.6.0's ``fused_recurrent_kda_fwd`` verifies ``T`` tokens per row from a pool of full states (fp32 or bf16): with
``ssm_state_indices [B, T]`` and ``num_accepted_tokens [B]`` it starts row ``b`` from the state block
``ssm_state_indices[b, num_accepted[b] - 1]`` (the last accepted token's state of the previous step) and writes the
state after every token ``t`` to block ``ssm_state_indices[b, t]``. The commit is the next step's choice of
``num_accepted``: no kernel. So a step reads one state and writes ``T`` states per row, against ours reading the
checkpoint once and writing ``T`` ring entries. Its inputs are split beforehand (FLA gets its best case: contiguous
``q``, ``k``, ``v``); the gate, beta's sigmoid and the l2 norm run inside FLA's kernel, as in ``bench_decode.py``'s
FLA rows.

``check`` sets each row's starting block to the pool's committed state (``pool.read_state``) and compares FLA's
outputs with the pool's verify outputs for the same drafts, before anything is timed.
"""

from __future__ import annotations

import dataclasses
import importlib
from typing import Any, Callable

import torch

FLA_SPEC_FN = "fla.ops.kda.fused_recurrent:fused_recurrent_kda_fwd"


def load_fla_fwd(spec: str = FLA_SPEC_FN) -> Callable[..., Any]:
    """FLA's recurrent KDA forward (``module:function``)."""
    module, name = spec.split(":")
    return getattr(importlib.import_module(module), name)


def split_inputs(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, H: int, HV: int, K: int, V: int
                 ) -> dict[str, torch.Tensor]:
    """FLA's inputs from the pool's ``x [B, T, 2*H*K + HV*V]``, ``a [B, T, HV*K]``, ``b [B, T, HV]``: contiguous
    ``q, k [B, T, H, K]``, ``v [B, T, HV, V]``, ``g [B, T, HV, K]`` and ``beta [B, T, HV]``."""
    B, T = x.shape[:2]
    q, k, v = torch.split(x, [H * K, H * K, HV * V], dim=-1)
    return dict(q=q.reshape(B, T, H, K).contiguous(), k=k.reshape(B, T, H, K).contiguous(),
                v=v.reshape(B, T, HV, V).contiguous(), g=a.reshape(B, T, HV, K).contiguous(), beta=b.contiguous())


@dataclasses.dataclass
class FlaSpecState:
    """The state blocks of ``n_sets`` slot sets: row ``b`` of set ``s`` owns the ``T`` blocks
    ``indices[s][b]``; every row starts from its ``accepted``-th block (``accepted`` in ``1..T``)."""
    blocks: torch.Tensor  # [n_sets * B * T, HV, V, K] in the state dtype (FLA's state_v_first layout)
    indices: list[torch.Tensor]  # per set: [B, T] int32
    accepted: torch.Tensor  # [B] int32

    @classmethod
    def make(cls, n_sets: int, B: int, T: int, HV: int, K: int, V: int, accepted: int, device: torch.device | str,
             dtype: torch.dtype = torch.float32, generator: torch.Generator | None = None) -> FlaSpecState:
        if not 1 <= accepted <= T:
            raise ValueError(f"FlaSpecState: `accepted` must be in 1..T={T}; got {accepted}")
        blocks = (0.05 * torch.randn(n_sets * B * T, HV, V, K, device=device, generator=generator)).to(dtype)
        ids = torch.arange(n_sets * B * T, device=device, dtype=torch.int32).view(n_sets, B, T)
        return cls(blocks, [ids[s].contiguous() for s in range(n_sets)],
                   torch.full((B,), accepted, device=device, dtype=torch.int32))


def step(fwd: Callable[..., Any], state: FlaSpecState, s: int, inputs: dict[str, torch.Tensor], A_log: torch.Tensor,
         dt_bias: torch.Tensor, lower_bound: float | None, out: torch.Tensor) -> torch.Tensor:
    """One verify of slot set ``s``: ``out [B, T, HV, V]``; the ``T`` states go to the set's blocks in place."""
    fwd(**inputs, A_log=A_log, dt_bias=dt_bias, initial_state=state.blocks, scale=None, output_final_state=False,
        inplace_final_state=True, state_v_first=True, ssm_state_indices=state.indices[s],
        num_accepted_tokens=state.accepted, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
        use_beta_sigmoid_in_kernel=True, lower_bound=lower_bound, out=out)
    return out


def check(fwd: Callable[..., Any], pool: Any, slots: torch.Tensor, state: FlaSpecState, x: torch.Tensor,
          a: torch.Tensor, b: torch.Tensor, params: Any, lower_bound: float | None) -> float:
    """FLA's outputs against the pool's verify of the same drafts from the same committed state (set 0 is
    ``slots``; the state rounded to the blocks' dtype); the relative error (Frobenius). The pool's step is then
    committed with no draft accepted."""
    heads = pool.local_heads
    start = state.indices[0][torch.arange(slots.shape[0], device=slots.device), state.accepted.long() - 1]
    state.blocks[start.long()] = pool.read_state(0, slots).to(state.blocks.dtype)
    inputs = split_inputs(x, a, b, heads.num_q_heads, heads.num_v_heads, heads.key_dim, heads.value_dim)
    got = step(fwd, state, 0, inputs, params.A_log, params.dt_bias, lower_bound, torch.empty_like(inputs["v"]))
    want = pool.verify(0, x, a, b, params.A_log, params.dt_bias, slots, lower_bound=lower_bound)
    pool.commit(slots, torch.zeros_like(slots))
    return float((got.float() - want.float()).norm() / want.float().norm())


def time_row(rec: dict[str, Any], pool: Any, sets: list[torch.Tensor], inputs: dict[str, list[torch.Tensor]],
             params: Any, lower_bound: float | None, accepted: int, state_dtype: torch.dtype, period: int,
             kernel_times: Callable[[list], dict[str, float]], graph_us: Callable[[list, float, int], float],
             rep_ms: float, seed: int) -> None:
    """``bench_spec.py``'s row of the FLA form into ``rec``: the check, then one FLA verify per slot set (the steps
    of a graph, as ours), ``verify_us`` the graph's time per step."""
    fwd = load_fla_fwd()
    heads = pool.local_heads
    H, HV, K, V = heads.num_q_heads, heads.num_v_heads, heads.key_dim, heads.value_dim
    B, T = inputs["x"][0].shape[:2]
    gen = torch.Generator(device=pool.device).manual_seed(seed)
    state = FlaSpecState.make(len(sets), B, T, HV, K, V, accepted, pool.device, state_dtype, gen)
    rec["plan"] = f"FLA {FLA_SPEC_FN}: one {state_dtype} state block per draft"
    rec["check_rel_err"] = check(fwd, pool, sets[0], state, inputs["x"][0], inputs["a"][0], inputs["b"][0], params,
                                 lower_bound)
    n_in = len(inputs["x"])
    split = [split_inputs(inputs["x"][j], inputs["a"][j], inputs["b"][j], H, HV, K, V) for j in range(n_in)]
    outs = [torch.empty_like(s["v"]) for s in split]

    def one(i: int) -> Callable[[], None]:
        def fn() -> None:
            step(fwd, state, i, split[i % n_in], params.A_log, params.dt_bias, lower_bound, outs[i % n_in])
        return fn

    rec["kernel_us"] = kernel_times([one(i) for i in range(min(len(sets), 2 * period))])
    rec["verify_us"] = graph_us([one(i) for i in range(len(sets))], rep_ms, period)
