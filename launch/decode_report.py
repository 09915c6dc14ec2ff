"""The decode engine's checks and summary (``launch/decode.py``): sampled rows against the float64 oracle, the
oracle following every request (``--fork-prob``, ``--preempt-prob``), the state traffic of a step, and the summary
rank 0 prints.

:func:`verify` runs tp_replayssm.testing.PlainKDA per layer on the sampled rows from the state they started the step
with (``before``, per layer ``[n, HV_l, V, K]``, from :func:`starting_states`) and the step's inputs (``seen``, per
layer the pre-conv ``mixed_qkv [B, D_l]``, ``a [B, HV_l*K]``, ``b [B, HV_l]`` and the decode's output
``[B, 1, HV_l, V]``); with ``--conv-size W`` the conv is computed in float64 from the window the step started with
(``windows``, per layer ``[n, D_l, W-1]``), and the window after the step must hold the step's inputs. A row whose
relative error exceeds the tolerance counts as a mismatch; :func:`summary` then ends without "RESULT: OK" and every
rank raises.
"""

from __future__ import annotations

import logging
import resource
from typing import Any

import torch
import torch.distributed as dist

log = logging.getLogger("decode")

__all__ = ["follow", "starting_states", "summary", "traffic_bytes", "verify"]


def traffic_bytes(engine: Any, live: list[int], flush_h: list[int]) -> int:
    """Bytes the decode moves per row and layer: the checkpoint and the ``c`` valid ring entries
    read, and either one ring entry or the checkpoint written; the conv window read and written."""
    m = engine.pool.memory
    L = engine.args.ring_length
    entry = m.ring_per_slot_layer // L
    total = 0
    for i in live:
        c = engine.rows[i].cursor
        flushed = flush_h[i] or c == L - 1
        per_layer = m.checkpoint_per_slot_layer + c * entry + (m.checkpoint_per_slot_layer if flushed else entry)
        per_layer += 2 * m.conv_per_slot_layer  # the conv window, read and written
        total += per_layer * engine.num_layers
    return total


def starting_states(engine: Any, sample: list[int]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The states (per layer ``[n, HV_l, V, K]``) and, with the conv, the windows (per layer ``[n, D_l, W-1]``) the
    sampled rows start the step with: those the oracle followed each request to (with ``--fork-prob`` or
    ``--preempt-prob``), else what ``read_state`` / ``read_conv_state`` give. Empty lists when nothing is sampled."""
    args = engine.args
    before: list[torch.Tensor] = []
    windows: list[torch.Tensor] = []
    if sample and engine.lineage:  # the state (and conv window) the oracle followed this request to
        before = [torch.stack([engine.shadow[engine.rows[i].rid][l] for i in sample])
                  for l in range(engine.num_layers)]
        if args.conv_size:
            windows = [torch.stack([engine.shadow_win[engine.rows[i].rid][l] for i in sample])
                       for l in range(engine.num_layers)]
        engine.stats["lineage_rows"] += sum(engine.rows[i].forked or engine.rows[i].resumed for i in sample)
    elif sample:  # the state each layer starts this step with (cursors are shared: valid for all)
        sidx = torch.tensor([engine.rows[i].slot for i in sample], dtype=torch.int32, device=engine.device)
        before = [engine.pool.read_state(l, sidx) for l in range(engine.num_layers)]
        if args.conv_size:  # and the conv windows
            windows = [engine.pool.read_conv_state(l, sidx) for l in range(engine.num_layers)]
    return before, windows


def verify(engine: Any, sample: list[int], before: list[torch.Tensor],
           seen: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]],
           windows: list[torch.Tensor]) -> None:
    """Outputs and new states of the sampled rows vs the float64 PlainKDA oracle, per layer. With the conv, the
    oracle's q/k/v are the float64 conv of the pre-conv ``mixed_qkv`` over the window ``read_conv_state`` gave
    before the step (so a wrong window fails the run), and the window after the step must be the old one moved
    on by this step's inputs (rounded to the window's dtype)."""
    from tp_replayssm.testing import DecodeInputs, HeadParams, PlainKDA, rel_err

    loc = engine.shard.local
    n = len(sample)
    rows = torch.tensor(sample, device=engine.device)
    sidx = torch.tensor([engine.rows[i].slot for i in sample], dtype=torch.int32, device=engine.device)
    lowp = engine.act_dtype != torch.float32 or engine.pool.cache_dtype != torch.float32 \
        or engine.pool.state_dtype != torch.float32
    tol = 2e-2 if lowp else 1e-4
    for l, (S0, (mixed_qkv, a, b, out)) in enumerate(zip(before, seen)):
        oracle = PlainKDA(n, loc.num_q_heads, loc.num_v_heads, loc.key_dim, loc.value_dim)
        oracle.load(list(range(n)), S0)
        e_win = 0.0
        if windows:  # the conv in float64: y = silu(sum_i w[:, i] * u[i] + bias), u = window then the input
            w = engine.layers[l]
            u = torch.cat([windows[l].double(), mixed_qkv[rows].double()[:, :, None]], dim=2)  # [n, D_l, W]
            y = (u * w["conv_w"].double()).sum(-1) + w["conv_b"].double()
            mixed_qkv = y * torch.sigmoid(y)  # [n, D_l], the post-conv q/k/v
            moved = u[:, :, 1:].to(engine.pool.conv_dtype)
            e_win = rel_err(engine.pool.read_conv_state(l, sidx), moved) if moved.numel() else 0.0
            inputs = DecodeInputs(mixed_qkv, a[rows], b[rows])
        else:
            inputs = DecodeInputs(mixed_qkv[rows], a[rows], b[rows])
        params = HeadParams(engine.layers[l]["A_log"], engine.layers[l]["dt_bias"])
        expect = oracle.step(inputs, params, list(range(n)), lower_bound=engine.args.lower_bound)
        e_out = rel_err(out[rows, 0], expect)
        e_state = rel_err(engine.pool.read_state(l, sidx), oracle.state)
        err = max(e_out, e_state, e_win)
        engine.stats["max_err"] = max(engine.stats["max_err"], err)
        engine.stats["checked_rows"] += n
        if not err <= tol:
            engine.stats["mismatches"] += n
            log.error("layer %d rows %s: rel err out %.2e state %.2e conv window %.2e > tol %.0e", l, sample,
                      e_out, e_state, e_win, tol)


def follow(engine: Any, live: list[int], seen: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]]
           ) -> None:
    """Step every live request's float64 oracle state (and conv window) with this step's inputs (with
    ``--fork-prob`` or ``--preempt-prob``)."""
    from tp_replayssm.testing import DecodeInputs, HeadParams, PlainKDA

    loc = engine.shard.local
    rows = torch.tensor(live, device=engine.device)
    for l, (mixed_qkv, a, b, _) in enumerate(seen):
        qkv = mixed_qkv[rows]
        if engine.args.conv_size:  # the conv in float64 over the followed window, which then moves on
            w = engine.layers[l]
            win = torch.stack([engine.shadow_win[engine.rows[i].rid][l] for i in live])
            u = torch.cat([win, qkv.double()[:, :, None]], dim=2)
            y = (u * w["conv_w"].double()).sum(-1) + w["conv_b"].double()
            qkv = y * torch.sigmoid(y)
            moved = u[:, :, 1:].to(engine.pool.conv_dtype).double()  # the window keeps its dtype's rounding
            for j, i in enumerate(live):
                engine.shadow_win[engine.rows[i].rid][l] = moved[j]
        oracle = PlainKDA(len(live), loc.num_q_heads, loc.num_v_heads, loc.key_dim, loc.value_dim)
        oracle.load(list(range(len(live))), torch.stack([engine.shadow[engine.rows[i].rid][l] for i in live]))
        oracle.step(DecodeInputs(qkv, a[rows], b[rows]),
                    HeadParams(engine.layers[l]["A_log"], engine.layers[l]["dt_bias"]), list(range(len(live))),
                    lower_bound=engine.args.lower_bound)
        for j, i in enumerate(live):
            engine.shadow[engine.rows[i].rid][l] = oracle.state[j].clone()


def summary(engine: Any, wall: float, verify_us: float, checks: dict[str, float]) -> None:
    """Gather every rank's memory, checks and errors; rank 0 prints the summary (ending with "RESULT: OK" when no
    sampled row mismatched); with mismatches every rank raises."""
    args = engine.args
    if engine.device.type == "cuda":
        peak = torch.cuda.max_memory_allocated(engine.device)
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    mine = dict(rank=engine.rank, device=str(engine.device), pool_bytes=engine.pool.memory.total, peak=peak,
                mismatches=engine.stats["mismatches"], checked=engine.stats["checked_rows"],
                max_err=engine.stats["max_err"], checks=checks, verify_us=verify_us)
    every: list[Any] = [None] * engine.world
    dist.all_gather_object(every, mine)
    bad = sum(r["mismatches"] for r in every)
    if engine.rank == 0:
        s = engine.stats
        warm_s = max(s["warm_s"], 1e-9)
        lines = [
            "=" * 72,
            f"decode summary: {engine.world} ranks on {engine.device.type}, shape {args.shape} "
            f"(H={engine.heads.num_q_heads} HV={engine.heads.num_v_heads} K={engine.heads.key_dim} "
            f"V={engine.heads.value_dim}, {engine.num_layers} layers), batch {args.batch}, "
            f"L={args.ring_length}, state {engine.pool.state_dtype}, cache {engine.pool.cache_dtype}, "
            f"activations {engine.act_dtype}, cursor advance "
            f"{'fused into the last decode' if args.fused_advance else 'by pool.advance'}, "
            f"{f'conv W={args.conv_size} (window in the pool)' if args.conv_size else 'no conv'}",
            f"  steps {s['steps']}, tokens {s['tokens']}, requests admitted {s['admitted']} finished "
            f"{s['finished']}, wall {wall:.2f} s",
            f"  throughput {s['warm_tokens'] / warm_s:.1f} tokens/s over the steps after the first "
            f"({s['warm_tokens']} tokens in {warm_s:.3f} s; all steps: {s['engine_s']:.3f} s); achieved state "
            f"traffic {s['warm_bytes'] / warm_s / 1e9:.3g} GB/s per rank "
            f"({s['warm_bytes'] / 2**20:.2f} MiB of checkpoint/ring reads+writes)",
            f"  pool build (collective check included) {engine.build_s * 1e3:.1f} ms on rank 0",
        ]
        if engine.lineage:
            lines.append(
                f"  lifecycle: forks {s['forks']} (--fork-prob {args.fork_prob}), preemptions "
                f"{s['preempted']} and resumptions {s['resumed']} (--preempt-prob {args.preempt_prob}), "
                f"{len(engine.waiting)} still waiting; sampled rows of forked or resumed requests "
                f"{s['lineage_rows']} (the float64 oracle followed every request through its forks and "
                "preemptions)")
        for r in every:
            c = r["checks"]
            lines.append(
                f"  rank {r['rank']} {r['device']}: pool {r['pool_bytes'] / 2**20:.2f} MiB, peak "
                f"{'allocated' if engine.device.type == 'cuda' else 'RSS'} {r['peak'] / 2**20:.1f} MiB; "
                f"placement checks {int(c['collective'])} ({c['total_s'] * 1e3:.1f} ms total), "
                f"verify_placement() {r['verify_us']:.0f} us; sampled rows {r['checked']} "
                f"max rel err {r['max_err']:.2e}, mismatches {r['mismatches']}")
        first = [t for l, t in engine.first_decode if l > 0] or [t for _, t in engine.first_decode]
        later = [t for _, t in engine.later_decode]
        if first and later:
            lines.append(
                f"  pool.decode host time on rank 0: first call of a layer (collective check) "
                f"{1e3 * sum(first) / len(first):.3f} ms vs later calls (no check) "
                f"{1e3 * sum(later) / len(later):.3f} ms")
            if engine.device.type != "cuda":  # the decode's own run hides the check's cost there
                lines.append("    (on CPU both include the decode's run on the PyTorch path, "
                             "so the checks' own cost is the 'placement checks' total above)")
        if bad:  # every rank raises below and prints its RESULT: FAIL line
            lines.append(f"  verification: {bad} sampled rows MISMATCHED")
        else:
            lines.append("  RESULT: OK")
        lines.append("=" * 72)
        print("\n".join(lines), flush=True)
    if bad:
        raise RuntimeError(f"{bad} sampled rows mismatched the float64 reference (see the log)")
