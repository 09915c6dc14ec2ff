"""The serving job's check and summary (``launch/serve.py``): every request's greedy tokens and logits against a
reference model on rank 0, and the summary rank 0 prints.

The reference (``--reference``) is the same model on one rank with the full weights: flash-linear-attention's
``KimiDeltaAttention`` layers in fp32 (:class:`serve_model.FLAModel`; on a CPU in Triton's interpreter) or the plain
float64 model (:class:`serve_model.PlainModel`). Each request is run teacher-forced on ``prompt + generated[:-1]``
and its logits from the prompt's last token on are the reference's prediction of each generated token. That holds
for forks and preempted requests alike: a fork's prompt is the prefix it shares (launch/serve_lifecycle.py), and a
preempted request's tokens are those it would have had without the preemption.
"""

from __future__ import annotations

import logging
import math
import time
import zlib
from typing import Any

import torch

log = logging.getLogger("serve")

__all__ = ["check_tokens", "reference", "steady_rate", "summary", "tokens_digest"]


def steady_rate(stats: dict[str, Any], first: tuple[int, float], kind: str) -> tuple[float, str]:
    """Tokens/s of ``kind``'s steps after its first (which compiles the kernels), and the words saying so; all steps
    when there is only one."""
    tokens, seconds, steps = stats[f"{kind}_tokens"], stats[f"{kind}_s"], stats[f"{kind}_steps"]
    if steps < 2:
        return tokens / max(seconds, 1e-9), ""
    return ((tokens - first[0]) / max(seconds - first[1], 1e-9),
            f"; the rate leaves out the first step, {first[0]} tokens in {first[1]:.3f} s")


def reference(engine: Any) -> tuple[Any, str]:
    """The reference model and its description: FLA's layers with ``--reference fla`` (and with ``auto`` on CUDA
    when FLA is importable), else the plain float64 model."""
    from serve_model import FLAModel, PlainModel

    kind, device = engine.args.reference, engine.device
    if kind == "fla" or (kind == "auto" and device.type == "cuda"):
        try:
            where = "one rank" if device.type == "cuda" else "one rank, Triton's interpreter"
            return FLAModel(engine.cfg, engine.weights, device), f"FLA KimiDeltaAttention layers, fp32, {where}"
        except ImportError as exc:
            if kind == "fla":
                raise
            log.info("FLA's layers are not importable (%s): checking against the plain model", exc)
    return PlainModel(engine.cfg, engine.weights), "plain float64 model, full recurrence, no pool, one rank"


def check_tokens(engine: Any) -> dict[str, Any]:
    """Rank 0: every finished request's logits and greedy tokens against the reference run teacher-forced on the
    request's prompt and tokens. A token that is not the reference's argmax fails unless the two logits lie within
    the tolerance (a near tie). The verdict goes to every rank."""
    verdict: list[Any] = [None]
    if engine.rank == 0:
        t0 = time.perf_counter()
        ref, what = reference(engine)
        exact = engine.dtype == torch.float32 and engine.pool.cache_dtype == torch.float32
        tol = 1e-4 if exact else 5e-2
        err, mismatches, ties, tokens = 0.0, [], 0, 0
        for r in engine.finished:
            want = ref.logits(r.prompt + r.generated[:-1])[len(r.prompt) - 1:]  # [n_gen, vocab]
            got = torch.stack(r.logits).double()
            scale = float(want.abs().max())
            err = max(err, float((got - want).abs().max()) / scale)
            for j, tok in enumerate(r.generated):
                best = int(want[j].argmax())
                tokens += 1
                if tok != best:
                    if float(want[j, best] - want[j, tok]) <= tol * scale:
                        ties += 1
                    else:
                        mismatches.append((r.rid, j, tok, best))
        ok = err <= tol and not mismatches
        reason = None if ok else (f"logits rel err {err:.2e} (tol {tol:.0e}), {len(mismatches)} greedy tokens "
                                  f"differ from the reference {mismatches[:3]}")
        verdict[0] = dict(ok=ok, reason=reason, what=what, err=err, tol=tol, tokens=tokens, ties=ties,
                          mismatches=len(mismatches), seconds=time.perf_counter() - t0)
    engine.dist.broadcast_object_list(verdict, src=0)
    return verdict[0]


def tokens_digest(requests: list[Any]) -> int:
    """crc32 of the requests' ids and generated tokens, in request order."""
    done = sorted(requests, key=lambda r: r.rid)
    return zlib.crc32(",".join(str(t) for r in done for t in [r.rid, *r.generated, -1]).encode())


def summary(engine: Any, wall: float, check: dict[str, Any]) -> None:
    """Gather every rank's memory and weights; rank 0 prints the summary. Raises RuntimeError when the check
    failed (on every rank)."""
    from serve_model import describe_bytes

    e = engine
    mine = dict(rank=e.rank, device=str(e.device), pool=e.pool.memory.total,
                per_slot_layer=e.pool.memory.per_slot_layer, params=e.model.parameter_bytes(),
                generated=e.generated_at_build, total=sum(math.prod(t.shape) for t in e.weights.values()))
    every: list[Any] = [None] * e.world
    e.dist.all_gather_object(every, mine)
    if e.rank == 0:
        s, a, c = e.stats, e.args, e.cfg
        rate = {kind: steady_rate(s, e.first[kind], kind) for kind in ("prefill", "decode")}
        lines = [
            "=" * 72,
            f"serve summary: {e.world} ranks on {e.device.type}, {c.layers} blocks, hidden {c.hidden}, KDA "
            f"H={c.heads} HV={c.v_heads} K=V={c.head_dim}, MLP {c.ffn}, vocab {c.vocab}, {e.dtype}, pool "
            f"{a.batch} slots, L={a.ring_length}, cache {e.pool.cache_dtype}",
            f"  requests {len(e.finished)}: prompts {sum(len(r.prompt) for r in e.finished)} tokens, "
            f"generated {sum(len(r.generated) for r in e.finished)} tokens, wall {wall:.2f} s",
            f"  prefill: {s['prefill_tokens']} tokens in {s['prefill_s']:.3f} s = {rate['prefill'][0]:.1f} tokens/s "
            f"({s['prefill_steps']} packed steps, chunk {a.prefill_chunk or 'whole prompt'}{rate['prefill'][1]})",
            f"  decode: {s['decode_tokens']} tokens in {s['decode_s']:.3f} s = {rate['decode'][0]:.1f} tokens/s "
            f"({s['decode_steps']} steps of {a.batch} rows, {s['decode_live'] / max(s['decode_rows'], 1):.0%} "
            f"live{rate['decode'][1]})",
        ]
        if e.spec is not None:
            lines.append(e.spec.summary(s["decode_tokens"], s["decode_live"]))
        if e.life.enabled:
            lines.append(e.life.summary(e.finished))
        line = f"  generated tokens: crc32 {tokens_digest(e.finished):08x} (every request's tokens in request order)"
        if e.life.enabled:
            stream = [r for r in e.finished if r.parent < 0]
            line += f"; the stream's {len(stream)} requests (forks left out): crc32 {tokens_digest(stream):08x}"
        lines.append(line)
        for r in every:
            lines.append(f"  rank {r['rank']} {r['device']}: pool {describe_bytes(r['pool'])} "
                         f"({r['per_slot_layer']} B per slot and layer); weights {describe_bytes(r['params'])} "
                         f"(made {r['generated']} of the checkpoint's {r['total']} elements: its slices and the "
                         f"replicated ones)")
        lines.append(f"  check against the {check['what']} ({check['seconds']:.1f} s): {check['tokens']} tokens, "
                     f"max logits rel err {check['err']:.2e} (tol {check['tol']:.0e}), {check['mismatches']} "
                     f"greedy mismatches, {check['ties']} near ties")
        lines.append("  RESULT: OK" if check["ok"] else f"  check FAILED: {check['reason']}")
        lines.append("=" * 72)
        print("\n".join(lines), flush=True)
    if not check["ok"]:
        raise RuntimeError(check["reason"])
