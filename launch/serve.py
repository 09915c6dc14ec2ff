"""The main job: a tensor-parallel Kimi-Linear-style model serving a stream of requests, run with torchrun.

    torchrun --standalone --nproc-per-node 2 launch/serve.py                    # CPU, gloo, a tiny model
    torchrun --standalone --nproc-per-node 8 launch/serve.py --device cuda --hidden 2304 --heads 32 --v-heads 32 \\
        --head-dim 128 --ffn 2048 --layers 4 --batch 64 --requests 256 --prompt-len 64 512 --new-tokens 16 64
    torchrun --standalone --nproc-per-node 2 launch/serve.py --corrupt-weight   # the check fails (exit status 1)
    torchrun --standalone --nproc-per-node 2 launch/serve.py --spec-tokens 3 --ring-length 8   # speculative decoding
    torchrun --standalone --nproc-per-node 2 launch/serve.py --fork-prob 0.3 --preempt-prob 0.1  # forks, preemptions

Every rank builds its shard of the model (launch/serve_model.py: embedding, N blocks of RMSNorm -> the library's
TPKimiDeltaAttention -> residual -> RMSNorm -> a dense MLP standing in for Kimi-Linear's MoE/MLA layers -> residual,
final norm, LM head) from seeded weights, reading only its slices of the KDA and MLP weights, over one
ReplaySSMStatePool with a conv window per layer. Requests with different prompt lengths arrive in a queue; the engine
admits them into free slots (``pool.alloc``), prefills their prompts packed with ``cu_seqlens`` (``--prefill-chunk``
tokens per request and step: longer prompts are prefilled in pieces, each continuing the slot's state), decodes
greedily one token per request and step (a fixed batch of one row per slot, padding rows for the others, the last
layer moving the cursors), and frees a slot when its request has its new tokens. With ``--spec-tokens T`` each decode
step is speculative (launch/serve_spec.py): ``T`` draft tokens per request from its own n-grams, one verify step of
the whole model on the next input token and the drafts (every layer's ``verify``), ``pool.commit`` of the accepted
ones, and the accepted drafts plus the model's next token emitted: the same greedy tokens, up to ``T + 1`` per step.
With ``--fork-prob P`` a free slot takes, with chance ``P``, a fork of a decoding request (``pool.fork``: the new
request shares its tokens so far and generates its own), and with ``--preempt-prob P`` each active request is
preempted with chance ``P`` per step (``pool.export_state`` to the CPU, ``pool.free``), sits out a step and is
resumed ahead of new arrivals (``pool.alloc``, ``pool.import_state``) where it stopped (launch/serve_lifecycle.py);
every rank takes the same decisions. Every prefill and decode step syncs with the host and runs ``pool.check()``
there. On CPU tensors the library runs its PyTorch path; on CUDA the prefill uses flash-linear-attention's chunk_kda
when it is installed.

Output: rank 0 shows a progress line on a terminal, then a summary (prefill and decode tokens/s, the drafts'
acceptance rate with ``--spec-tokens``, forks, preemptions and resumptions, checksums of the generated tokens, pool
memory and weights per rank) and checks every request's greedy tokens and logits against the same model run on rank
0 through FLA's layers (``--reference fla``: the default on CUDA when FLA is importable; on a CPU they run in
Triton's interpreter, about 10 s for the default sizes against 0.1 s for the plain model, so not by default) or a
plain float64 PyTorch model of the same weights with a full recurrence and no pool (``--reference plain``, always
available). It ends with "RESULT: OK"; on any failure every rank prints one line "RESULT: FAIL <ErrorType>:
<reason>" and exits with status 1 (under ``torchrun`` the first rank to exit non-zero makes torchrun stop the
others, whose status may then read -15).
"""

from __future__ import annotations

import argparse
import collections
import importlib.util
import logging
import os
import sys
import time
from typing import TYPE_CHECKING, Any

from cli import HelpFormatter, RankParser, exit_rank

if TYPE_CHECKING:
    import torch

    from serve_lifecycle import Request
    from tp_replayssm.tp.distributed import DistEnv

log = logging.getLogger("serve")


def build_parser() -> argparse.ArgumentParser:
    p = RankParser(description=__doc__.split("\n\n")[0] + "\n\n" + __doc__.split("\n\n")[1],
                   formatter_class=HelpFormatter)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="cpu (gloo) or cuda (NCCL)")
    m = p.add_argument_group("model (seeded random weights, Kimi-Linear's parameter names)")
    m.add_argument("--layers", type=int, default=2, help="blocks (one KDA layer each)")
    m.add_argument("--hidden", type=int, default=64, help="hidden size")
    m.add_argument("--heads", type=int, default=2, help="KDA q/k heads H")
    m.add_argument("--v-heads", type=int, default=4, help="KDA value heads HV (a multiple of H and of the ranks)")
    m.add_argument("--head-dim", type=int, default=16, help="K = V = the low-rank gate width")
    m.add_argument("--ffn", type=int, default=128, help="MLP width (split evenly over the ranks)")
    m.add_argument("--vocab", type=int, default=256, help="vocabulary size")
    s = p.add_argument_group("serving")
    s.add_argument("--requests", type=int, default=12, help="requests in the stream")
    s.add_argument("--batch", type=int, default=4, help="pool slots = rows of a decode step")
    s.add_argument("--prompt-len", type=int, nargs=2, default=(3, 24), metavar=("MIN", "MAX"), help="prompt lengths")
    s.add_argument("--new-tokens", type=int, nargs=2, default=(2, 10), metavar=("MIN", "MAX"),
                   help="tokens generated per request")
    s.add_argument("--prefill-chunk", type=int, default=8,
                   help="prompt tokens per request and prefill step (0: whole prompts)")
    s.add_argument("--ring-length", type=int, default=4, help="ring length L of the pool")
    s.add_argument("--spec-tokens", type=int, default=0, metavar="T",
                   help="speculative decoding: draft tokens per request and decode step, verified with the next "
                        "input token in one step (T + 1 <= ring length - 1); 0: off")
    s.add_argument("--fork-prob", type=float, default=0.0, metavar="P",
                   help="chance that a free slot takes a fork of a decoding request (pool.fork: it shares the "
                        "request's tokens so far and generates its own --new-tokens) instead of the next waiting "
                        "request; at most --requests forks; 0: off")
    s.add_argument("--preempt-prob", type=float, default=0.0, metavar="P",
                   help="chance per step that an active request is preempted (pool.export_state to the CPU, "
                        "pool.free), sits out a step, then is resumed ahead of new arrivals when a slot is free "
                        "(pool.alloc, pool.import_state); 0: off")
    s.add_argument("--dtype", choices=("float32", "bfloat16"), default=None,
                   help="weights and activations (None: float32 on cpu, bfloat16 on cuda)")
    s.add_argument("--cache-dtype", choices=("float32", "bfloat16"), default=None,
                   help="ring and conv-window dtype (None: the activation dtype)")
    c = p.add_argument_group("check and run")
    c.add_argument("--reference", choices=("auto", "plain", "fla"), default="auto",
                   help="the model the tokens are checked against on rank 0: FLA's layers (fp32; on cpu in "
                        "Triton's interpreter, about 10 s for the default sizes), or the plain float64 model (auto: "
                        "fla on cuda when importable, else plain)")
    c.add_argument("--corrupt-weight", action="store_true",
                   help="self-test of the check: the last rank scales its shard of layer 0's o_proj by 1.5")
    c.add_argument("--inject-bad-slot", action="store_true",
                   help="self-test of the per-step pool.check(): the first decode step names a slot out of range in "
                        "one row on every rank; the pool refuses the row and that step's check fails (exit status 1)")
    c.add_argument("--debug", action="store_true",
                   help="the pool's debug mode: every call's slot ids checked on the host (a sync), and the ranks "
                        "compare every pool call's arguments (a gloo all-gather), all raising the same "
                        "RankMismatchError when one rank's differ (also TP_REPLAYSSM_DEBUG=1)")
    c.add_argument("--inject-rank-mismatch", action="store_true",
                   help="self-test of --debug: in decode step 1 the last rank passes its rows' slots shifted by one "
                        "row (as a scheduler bug on one rank would); with --debug every rank stops there with "
                        "RankMismatchError, without it the tokens' check fails at the end (exit status 1)")
    c.add_argument("--seed", type=int, default=0,
                   help="seed of the weights, the request stream and the fork and preemption draws")
    c.add_argument("--timeout", type=float, default=300.0, help="process group timeout, seconds")
    c.add_argument("--log-level", choices=("DEBUG", "INFO", "WARNING"), default="INFO", help="log level")
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = build_parser()
    args = p.parse_args(argv)
    for name in ("layers", "hidden", "heads", "v_heads", "head_dim", "ffn", "vocab", "requests", "batch",
                 "ring_length"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    for name in ("prompt_len", "new_tokens"):
        lo, hi = getattr(args, name)
        if not 1 <= lo <= hi:
            p.error(f"--{name.replace('_', '-')} needs 1 <= MIN <= MAX; got {lo} {hi}")
    ranks = int(os.environ.get("WORLD_SIZE", "1"))  # (the sharding rule, docs/contract.md, with the flags named)
    if args.v_heads % args.heads:
        p.error(f"--v-heads must be a multiple of --heads; got --heads {args.heads} --v-heads {args.v_heads}")
    if args.v_heads % ranks:
        p.error(f"--v-heads must split evenly over the {ranks} ranks (--nproc-per-node); got {args.v_heads}")
    if args.ffn % ranks:
        p.error(f"--ffn must split evenly over the {ranks} ranks (--nproc-per-node); got {args.ffn}")
    if args.heads % ranks and ranks % args.heads:
        p.error(f"--heads must split evenly over the {ranks} ranks (--nproc-per-node) or divide their number (each "
                f"q/k head then replicated); got {args.heads}")
    if args.reference == "fla" and importlib.util.find_spec("fla") is None:
        p.error("--reference fla needs flash-linear-attention 0.6.0 (pip install -e .[fla]); --reference plain "
                "needs nothing")
    for name in ("fork_prob", "preempt_prob"):
        if not 0.0 <= getattr(args, name) <= 1.0:
            p.error(f"--{name.replace('_', '-')} must be in [0, 1]; got {getattr(args, name)}")
    if args.prefill_chunk < 0:
        p.error("--prefill-chunk must be >= 0")
    if not 0.0 < args.timeout < float("inf"):
        p.error(f"--timeout must be a number of seconds > 0; got {args.timeout}")
    if args.spec_tokens < 0 or (args.spec_tokens and args.spec_tokens + 1 > args.ring_length - 1):
        p.error(f"--spec-tokens must be 0 (off) or T with T + 1 <= --ring-length - 1 = {args.ring_length - 1} (a "
                f"step verifies the next input token and T drafts); got {args.spec_tokens}")
    return args


def main(argv: list[str] | None = None) -> int:
    """Run one rank; return its exit status (0: every request checked; 1: see the RESULT line)."""
    args = parse_args(argv)
    rank_tag = os.environ.get("RANK", "?")
    logging.basicConfig(level=getattr(logging, args.log_level), stream=sys.stdout,
                        format=f"%(asctime)s [rank {rank_tag}] %(levelname)s %(name)s: %(message)s")
    logging.getLogger("helion").setLevel(logging.WARNING)
    if args.reference == "fla" and args.device == "cpu":  # FLA's Triton kernels on a CPU: before triton's import
        os.environ["TRITON_INTERPRET"] = "1"
    try:
        from tp_replayssm.tp.distributed import distributed_session

        with distributed_session(args.device, timeout_s=args.timeout) as env:
            Engine(args, env).run()
    except Exception as exc:  # noqa: BLE001 - every rank reports its error in one line and exits non-zero
        text = str(exc).strip() or "(no message)"
        log.debug("traceback of the failure", exc_info=True)
        if "\n" in text:
            log.error("%s: %s", type(exc).__name__, text)
        print(f"RESULT: FAIL {type(exc).__name__}: {text.splitlines()[0]}", flush=True)
        return 1
    return 0


class Engine:
    """One rank's serving loop: admit, prefill, decode, retire; then the summary and the check."""

    def __init__(self, args: argparse.Namespace, env: DistEnv) -> None:
        import torch
        import torch.distributed as dist

        from serve_lifecycle import Lifecycle, Request
        from serve_model import ModelConfig, SeededWeights, TPModel
        from tp_replayssm import ReplaySSMStatePool

        self.torch, self.dist, self.args, self.env = torch, dist, args, env
        self.rank, self.world, self.device = env.rank, env.world_size, env.device
        self.dtype = getattr(torch, args.dtype or ("bfloat16" if self.device.type == "cuda" else "float32"))
        cache = getattr(torch, args.cache_dtype) if args.cache_dtype else self.dtype
        self.cfg = ModelConfig(vocab=args.vocab, hidden=args.hidden, layers=args.layers, heads=args.heads,
                               v_heads=args.v_heads, head_dim=args.head_dim, ffn=args.ffn, seed=args.seed)
        self.weights = SeededWeights(self.cfg)
        group = dist.group.WORLD
        self.pool = ReplaySSMStatePool(self.cfg.kda().heads, num_layers=args.layers, num_slots=args.batch,
                                       ring_length=args.ring_length, cache_dtype=cache,
                                       conv_kernel_size=self.cfg.conv, group=group, device=self.device,
                                       debug=True if args.debug else None)
        self.model = TPModel(self.cfg, self.weights, self.pool, group=group, rank=self.rank, world=self.world,
                             device=self.device, dtype=self.dtype)
        self.spec = None
        if args.spec_tokens:
            from serve_spec import SpecDecoder

            self.spec = SpecDecoder(self.model, self.pool, args.spec_tokens, self.device)
        self.generated_at_build = self.weights.generated()  # weight elements this rank made (its slices)
        if args.corrupt_weight and self.rank == self.world - 1:
            log.warning("corrupting rank %d's shard of layer 0's o_proj (x1.5)", self.rank)
            self.model.blocks[0]["attn"].o_proj.data.mul_(1.5)
        g = torch.Generator().manual_seed(args.seed * 7919 + 1)  # the same stream on every rank
        lens = torch.randint(args.prompt_len[0], args.prompt_len[1] + 1, (args.requests,), generator=g).tolist()
        news = torch.randint(args.new_tokens[0], args.new_tokens[1] + 1, (args.requests,), generator=g).tolist()
        self.waiting = collections.deque(
            Request(i, torch.randint(0, args.vocab, (n,), generator=g).tolist(), m)
            for i, (n, m) in enumerate(zip(lens, news)))
        self.active: list[Request] = []
        self.finished: list[Request] = []
        self.life = Lifecycle(args, self.pool, self.device)
        self.stats = dict(prefill_tokens=0, prefill_s=0.0, prefill_steps=0, decode_tokens=0, decode_s=0.0,
                          decode_steps=0, decode_rows=0, decode_live=0)
        # each kind's first step (its tokens and seconds): it compiles the kernels (and FLA's chunk_kda autotunes on
        # its first call), so the rates leave it out where later steps exist
        self.first = dict(prefill=(0, 0.0), decode=(0, 0.0))
        self._last_progress = 0.0

    # ---- the loop ---------------------------------------------------------------------------------

    def run(self) -> None:
        t0 = time.perf_counter()
        while self.waiting or self.active or self.life.preempted:
            self.admit()
            if any(r.prefilled < len(r.prompt) for r in self.active):
                self.prefill_step()
            if any(r.decoding for r in self.active):
                self.decode_step()
            self.retire()
            self.active = self.life.preempt(self.active)
            self._progress()
        wall = time.perf_counter() - t0
        self._progress(final=True)
        self.pool.check()
        self._summary(wall, self._check())

    def admit(self) -> None:
        """Free slots take preempted requests (``pool.alloc``, ``pool.import_state``), then forks of decoding
        requests (``pool.fork``, with ``--fork-prob``) or waiting requests (``pool.alloc``: zero state, empty ring,
        zero conv window): :meth:`serve_lifecycle.Lifecycle.admit`."""
        self.active += self.life.admit(self.active, self.waiting)

    def prefill_step(self) -> None:
        """One packed prefill of the next ``--prefill-chunk`` prompt tokens of every request still prefilling (each
        continues its slot's state; the last layer sets the cursors to 0). A request whose prompt is done gets its
        first token from the logits of its last prompt token."""
        torch, chunk = self.torch, self.args.prefill_chunk
        reqs = [r for r in self.active if r.prefilled < len(r.prompt)]
        pieces = [r.prompt[r.prefilled: r.prefilled + chunk] if chunk else r.prompt[r.prefilled:] for r in reqs]
        cu = [0]
        for p in pieces:
            cu.append(cu[-1] + len(p))
        self._sync()
        t0 = time.perf_counter()
        tokens = torch.tensor([t for p in pieces for t in p], device=self.device)
        slots = torch.tensor([r.slot for r in reqs], dtype=torch.int32, device=self.device)
        logits = self.model.forward(tokens, slots, torch.tensor(cu, dtype=torch.int32, device=self.device))
        nxt = self._greedy(logits)
        self._check_slots("prefill")  # the step synced anyway (it read cu_seqlens; the greedy tokens went to the host)
        self._sync()
        self._count("prefill", cu[-1], time.perf_counter() - t0)
        for i, (r, p) in enumerate(zip(reqs, pieces)):
            r.prefilled += len(p)
            if r.prefilled == len(r.prompt):
                self._emit(r, nxt[i], logits[i])

    def decode_step(self) -> None:
        """Greedy tokens for every decoding request: a fixed batch of one row per slot (padding rows, slot -1, for
        the others). Without ``--spec-tokens`` one token per request, the last layer moving the cursors; with it one
        speculative step (:class:`serve_spec.SpecDecoder`: every layer's ``pool.verify`` on the next input token and
        the drafts, then ``pool.commit`` of the accepted ones), up to ``T + 1`` tokens per request."""
        torch = self.torch
        rows: list[Request | None] = [None] * self.pool.num_slots
        for r in self.active:
            if r.decoding:
                rows[r.slot] = r
        ids = [r.slot if r else -1 for r in rows]
        if self.args.inject_bad_slot and self.stats["decode_steps"] == 0:  # as a scheduler bug would: every rank
            row = next((i for i, r in enumerate(rows) if r is None), len(rows) - 1)
            ids[row] = self.pool.num_slots + 3
            log.warning("--inject-bad-slot: row %d of decode step 1 names slot %d of a %d-slot pool", row, ids[row],
                        self.pool.num_slots)
        if self.args.inject_rank_mismatch and self.stats["decode_steps"] == 0 and self.rank == self.world - 1:
            ids = ids[1:] + ids[:1]  # this rank alone: its heads of row i would read and write row i+1's slot
            log.warning("--inject-rank-mismatch: rank %d passes decode step 1's slots shifted by one row", self.rank)
        self._sync()
        t0 = time.perf_counter()
        if self.spec is None:
            tokens = torch.tensor([r.last_token if r else 0 for r in rows], device=self.device)
            slots = torch.tensor(ids, dtype=torch.int32, device=self.device)
            logits = self.model.forward(tokens, slots)
            nxt = self._greedy(logits)
            out = {i: ([nxt[i]], logits[i:i + 1]) for i, r in enumerate(rows) if r is not None}
        else:
            out = self.spec.step(rows, ids)
        self._check_slots("decode")  # the step synced anyway (the greedy tokens went to the host)
        self._sync()
        seconds = time.perf_counter() - t0
        self.stats["decode_rows"] += len(rows)
        self.stats["decode_live"] += len(out)
        emitted = 0
        for i, (toks, logits) in out.items():
            r = rows[i]
            for tok, row_logits in zip(toks, logits):
                if len(r.generated) < r.max_new:  # a speculative step may find more tokens than the request wants
                    self._emit(r, tok, row_logits)
                    emitted += 1
        self._count("decode", emitted, seconds)

    def _count(self, kind: str, tokens: int, seconds: float) -> None:
        """A finished step's tokens and time; the first step of each kind is also kept apart (and logged)."""
        if self.stats[f"{kind}_steps"] == 0:
            self.first[kind] = (tokens, seconds)
            log.info("first %s step: %d tokens in %.2f s (first calls compile or tune kernels; the rates leave it "
                     "out)", kind, tokens, seconds)
        self.stats[f"{kind}_tokens"] += tokens
        self.stats[f"{kind}_s"] += seconds
        self.stats[f"{kind}_steps"] += 1

    def retire(self) -> None:
        """Requests with all their tokens give their slot back (``pool.free``). (Preemptions, with
        ``--preempt-prob``, follow in :meth:`serve_lifecycle.Lifecycle.preempt`.)"""
        done = [r for r in self.active if r.prefilled == len(r.prompt) and len(r.generated) >= r.max_new]
        if done:
            self.pool.free([r.slot for r in done])
            self.active = [r for r in self.active if r not in done]
            self.finished += done

    # ---- helpers ----------------------------------------------------------------------------------

    def _greedy(self, logits: torch.Tensor) -> list[int]:
        """Argmax per row, rank 0's broadcast (so every rank feeds the same tokens even if its logits differed)."""
        nxt = logits.argmax(-1)
        self.dist.broadcast(nxt, src=0)
        return nxt.tolist()

    def _emit(self, r: Request, token: int, logits: torch.Tensor) -> None:
        r.generated.append(int(token))
        if self.rank == 0:
            r.logits.append(logits.detach().float().cpu())

    def _check_slots(self, kind: str) -> None:
        """``pool.check()`` in a prefill or decode step (it raises SlotError for a bad slot id); the log names the
        step."""
        from tp_replayssm import SlotError

        try:
            self.pool.check()
        except SlotError:
            log.error("pool.check() in %s step %d found bad slots", kind, self.stats[f"{kind}_steps"] + 1)
            raise

    def _sync(self) -> None:
        if self.device.type == "cuda":
            self.torch.cuda.synchronize(self.device)

    def _progress(self, final: bool = False) -> None:
        if self.rank != 0 or not sys.stderr.isatty():
            return
        now = time.perf_counter()
        if not final and now - self._last_progress < 0.1:
            return
        self._last_progress = now
        s, n = self.stats, self.args.requests + self.life.stats["forks"]
        line = (f"\r[serve] requests {len(self.finished)}/{n} done, {len(self.active)} active, {len(self.waiting)} "
                f"waiting, {len(self.life.preempted)} preempted | prefill {s['prefill_tokens']} tok | decode "
                f"{s['decode_tokens']} tok")
        sys.stderr.write(line + ("\n" if final else ""))
        sys.stderr.flush()

    # ---- the check and the summary ----------------------------------------------------------------

    def _check(self) -> dict[str, Any]:
        from serve_report import check_tokens

        return check_tokens(self)

    def _summary(self, wall: float, check: dict[str, Any]) -> None:
        from serve_report import summary

        summary(self, wall, check)

if __name__ == "__main__":
    if os.path.dirname(os.path.abspath(__file__)) == sys.path[0]:  # run as a script: find the package
        sys.path.insert(1, os.path.dirname(sys.path[0]))
    exit_rank(main())
