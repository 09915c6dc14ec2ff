"""A decode engine with oracle checks and fault injection: tensor-parallel KDA ReplaySSM decode, run with torchrun.

    torchrun --standalone --nproc-per-node 2 launch/decode.py                      # CPU, gloo, tiny
    torchrun --standalone --nproc-per-node 8 launch/decode.py --device cuda --shape kimi-linear
    torchrun --standalone --nproc-per-node 2 launch/decode.py --inject-fault cache-device

Every rank builds its shard of a multi-layer ReplaySSMStatePool (collective construction = the first placement
check), then runs an engine loop: requests arrive (``alloc`` and a prefill by ``load_state`` with random states),
every step runs a tiny TP KDA layer stack around the pool (RMSNorm, column-parallel q/k/v/a/b projections of the
rank's heads from the hidden vector ``x [B, D]``, ``pool.decode`` (which first runs the short convolution over the
pre-conv q/k/v with the rank's slice of the conv weights, ``--conv-size``, its window held in the pool), row-parallel
output projection
``[B, HV_l*V] @ [HV_l*V, D]`` and an ``all_reduce``, residual), ``pool.advance`` (or, ``--fused-advance``, the last
layer's decode moves the cursors), and requests finish (their last token force-flushes the ring) and free their
slot. Rows without a request are padding rows (slot -1), so the batch shape never changes. Every rank checks a
sample of rows against the float64 oracle tp_replayssm.testing.PlainKDA (outputs from the state ``read_state`` gave
before the step, and the state after it); the conv is computed in float64 from the window ``read_conv_state`` gave
before the step, and the window after it must hold the step's inputs. On CPU tensors the library runs its PyTorch
path; no environment variable is needed.

A request's life beyond decoding: with ``--fork-prob P`` a new request sometimes shares a running request's prefix
(``pool.fork`` from its slot instead of a prefill; both then continue), and with ``--preempt-prob P`` a running
request is sometimes preempted (``pool.export_state`` to CPU, asynchronous on CUDA, and its slot freed) and later
resumed in a newly allocated slot (``pool.import_state``): launch/decode_lifecycle.py. With either option the oracle
follows every request from its prefill through forks and preemptions (a float64 state per request, forked with it),
and the sampled rows are checked against that state instead of the one ``read_state`` gave.

All ranks draw the same scheduling and activation random numbers (one seed), so row b is the same request on every
rank; weights are generated per head block, so each rank materializes only its own column/row slices.
``--inject-fault KIND`` makes the last rank misplaced or disagreeing to demonstrate each placement error: every rank
then raises the same PlacementError. ``--debug`` runs the pools in debug mode (slot ids checked at each call, and the
ranks' calls compared: ``--inject-fault rank-mismatch --debug`` makes every rank raise the same RankMismatchError).

Output: rank 0 prints a summary (tokens/s, achieved state GB/s, memory per rank, placement-check cost) that ends
with "RESULT: OK". On any error (a placement fault, a sampled row that mismatched the oracle) every rank logs the
error's text once, prints one line "RESULT: FAIL <ErrorType>: <first line of the message>" and exits with status 1;
the traceback is logged at DEBUG level (--log-level DEBUG). The oracle checks and the summary are in
launch/decode_report.py.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from typing import TYPE_CHECKING, Any

from cli import HelpFormatter, RankParser, exit_rank

if TYPE_CHECKING:
    import torch

    from decode_lifecycle import Request
    from tp_replayssm.tp.distributed import DistEnv

SHAPES = {
    # H q/k heads, HV value heads, K, V, layers, hidden size D
    "tiny": dict(num_q_heads=2, num_v_heads=4, key_dim=16, value_dim=16, num_layers=2, hidden=32),
    "kimi-linear": dict(num_q_heads=32, num_v_heads=32, key_dim=128, value_dim=128, num_layers=20, hidden=2304),
}
FAULTS = ("pool-device", "cache-device", "activation-device", "same-device", "ring-length", "num-slots",
          "num-layers", "state-dtype", "cache-dtype", "tp-rank", "bad-slot", "rank-mismatch")
RING_LAYOUTS = ("predecayed", "sglang")  # tp_replayssm.validation.RING_LAYOUTS (not imported: --help stays fast)

log = logging.getLogger("decode")


def build_parser() -> argparse.ArgumentParser:
    p = RankParser(description=__doc__.split("\n\n")[0] + "\n\n" + __doc__.split("\n\n")[1],
                   formatter_class=HelpFormatter)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="cpu (gloo) or cuda (NCCL)")
    p.add_argument("--shape", choices=tuple(SHAPES), default="tiny",
                   help="head geometry and layer count: tiny (H=2 HV=4 K=V=16, 2 layers) or kimi-linear "
                        "(H=HV=32 K=V=128, 20 layers)")
    p.add_argument("--layers", type=int, default=None, help="override the shape's layer count")
    p.add_argument("--steps", type=int, default=8, help="decode steps")
    p.add_argument("--batch", type=int, default=4, help="rows per step (padding rows included)")
    p.add_argument("--slots", type=int, default=None, help="pool slots (None: 2 * batch)")
    p.add_argument("--ring-length", type=int, default=4, help="ring length L of the pools")
    p.add_argument("--state-dtype", choices=("float32", "bfloat16"), default="float32", help="checkpoint dtype")
    p.add_argument("--cache-dtype", choices=("bfloat16", "float16", "float32"), default="bfloat16",
                   help="ring dtype (float16 needs --ring-layout sglang)")
    p.add_argument("--lower-bound", type=float, default=None,
                   help="decode with this bounded gate (lower_bound); None: the softplus gate")
    p.add_argument("--ring-layout", choices=RING_LAYOUTS, default="predecayed",
                   help="the pools' ring layout (ReplaySSMStatePool(ring_layout=...)): keys pre-decayed by "
                        "cumulative gates (the fastest), or the per-step keys and gates SGLang's kernels use")
    p.add_argument("--conv-size", type=int, default=4,
                   help="kernel W of the short convolution before the recurrence (its last W-1 inputs per slot live "
                        "in the pool: conv_kernel_size); 0: no convolution")
    p.add_argument("--fused-advance", action="store_true",
                   help="the last layer's decode moves the cursors (pool.decode(..., advance=True)) instead of a "
                        "pool.advance call per step")
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default=None,
                   help="activation dtype (None: float32 on cpu, bfloat16 on cuda)")
    p.add_argument("--min-len", type=int, default=2, help="shortest request (tokens to decode)")
    p.add_argument("--max-len", type=int, default=6, help="longest request")
    p.add_argument("--arrival", type=float, default=0.7, help="chance an empty row admits a request per step")
    p.add_argument("--fork-prob", type=float, default=0.0,
                   help="chance a new request shares a running request's prefix: pool.fork from its slot instead "
                        "of a prefill (both then continue)")
    p.add_argument("--preempt-prob", type=float, default=0.0,
                   help="chance per step that a running request is preempted: exported to CPU "
                        "(pool.export_state), its slot freed, and resumed later in a new slot (pool.import_state)")
    p.add_argument("--check-every", type=int, default=1, help="verify sampled rows every N steps (0: never)")
    p.add_argument("--check-rows", type=int, default=2, help="rows sampled per checked step")
    p.add_argument("--log-every", type=int, default=2, help="rank 0 logs progress every N steps")
    p.add_argument("--log-level", choices=("DEBUG", "INFO", "WARNING"), default="INFO",
                   help="log level (DEBUG also logs the traceback of an error)")
    p.add_argument("--seed", type=int, default=0, help="seed of the scheduling, activations and weights")
    p.add_argument("--timeout", type=float, default=300.0, help="main process group timeout, seconds")
    p.add_argument("--inject-fault", choices=FAULTS, default=None,
                   help="demonstrate a placement error (the last rank is misplaced or disagrees; same-device needs "
                        "--device cuda), or with bad-slot a slot id out of range in step 1 on every rank (the kernels "
                        "refuse the row; pool.check() raises SlotError), or with rank-mismatch the last rank's slots "
                        "of step 1 shifted by a row (with --debug every rank raises RankMismatchError; without, the "
                        "sampled rows' check fails)")
    p.add_argument("--debug", action="store_true",
                   help="the pools' debug mode: every call's slot ids checked on the host (a sync), and the ranks "
                        "compare every pool call's arguments (a gloo all-gather; also TP_REPLAYSSM_DEBUG=1)")
    p.add_argument("--corrupt-output", action="store_true",
                   help="self-test of the verification: the last rank perturbs one decode output (exits non-zero)")
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = build_parser()
    args = p.parse_args(argv)
    if args.inject_fault == "same-device" and args.device != "cuda":
        p.error("--inject-fault same-device needs --device cuda (several CPU ranks per host are fine)")
    if args.conv_size < 0:
        p.error("--conv-size must be >= 0 (0: no convolution)")
    for name in ("steps", "batch", "ring_length", "min_len", "max_len"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.max_len < args.min_len:
        p.error("--max-len must be >= --min-len")
    for name in ("arrival", "fork_prob", "preempt_prob"):
        if not 0.0 <= getattr(args, name) <= 1.0:
            p.error(f"--{name.replace('_', '-')} must be in [0, 1]; got {getattr(args, name)}")
    for name in ("check_every", "check_rows"):
        if getattr(args, name) < 0:
            p.error(f"--{name.replace('_', '-')} must be >= 0; got {getattr(args, name)}")
    if args.log_every < 1:
        p.error(f"--log-every must be >= 1; got {args.log_every}")
    if args.corrupt_output and (args.check_every < 1 or args.check_rows < 1):
        p.error("--corrupt-output tests the sampled rows' check: it needs --check-every >= 1 and --check-rows >= 1")
    if not 0.0 < args.timeout < float("inf"):
        p.error(f"--timeout must be a number of seconds > 0; got {args.timeout}")
    if args.cache_dtype == "float16" and args.ring_layout == "predecayed":
        p.error("--cache-dtype float16 needs --ring-layout sglang (the pre-decayed keys overflow fp16)")
    ranks = int(os.environ.get("WORLD_SIZE", "1"))  # (the sharding rule, docs/contract.md, with the flags named)
    heads, v_heads = SHAPES[args.shape]["num_q_heads"], SHAPES[args.shape]["num_v_heads"]
    if v_heads % ranks or (heads % ranks and ranks % heads):
        p.error(f"--shape {args.shape} ({heads} q/k heads, {v_heads} value heads) does not shard over {ranks} ranks "
                f"(--nproc-per-node): the value heads must split evenly, the q/k heads split evenly or divide the "
                f"ranks' number")
    return args


def main(argv: list[str] | None = None) -> int:
    """Run one rank; return its exit status (0: the run verified; 1: it failed, see the RESULT line)."""
    args = parse_args(argv)
    rank_tag = os.environ.get("RANK", "?")
    logging.basicConfig(level=getattr(logging, args.log_level), stream=sys.stdout,
                        format=f"%(asctime)s [rank {rank_tag}] %(levelname)s %(name)s: %(message)s")
    logging.getLogger("helion").setLevel(logging.WARNING)  # its INFO lines name generated-code files
    try:
        _run(args)
    except Exception as exc:  # noqa: BLE001 - every rank reports its error in one line and exits non-zero
        text = str(exc).strip() or "(no message)"
        log.debug("traceback of the failure", exc_info=True)
        if "\n" in text:  # the whole text once (a PlacementError names the ranks, tensors and devices below)
            log.error("%s: %s", type(exc).__name__, text)
        print(f"RESULT: FAIL {type(exc).__name__}: {text.splitlines()[0]}", flush=True)
        return 1
    return 0


def _run(args: argparse.Namespace) -> None:
    from tp_replayssm.tp.distributed import distributed_session

    with distributed_session(args.device, timeout_s=args.timeout) as env:
        Engine(args, env).run()


class Engine:
    """One rank's engine: pool, TP layer stack and step loop (scheduling: decode_lifecycle; checks and summary:
    decode_report)."""

    def __init__(self, args: argparse.Namespace, env: DistEnv) -> None:
        import torch
        import torch.distributed as dist

        from tp_replayssm import KDAHeads, ReplaySSMStatePool, shard_heads

        self.torch, self.dist, self.args, self.env = torch, dist, args, env
        shape = dict(SHAPES[args.shape])
        if args.layers is not None:
            shape["num_layers"] = args.layers
        self.num_layers, self.hidden = shape.pop("num_layers"), shape.pop("hidden")
        self.heads = KDAHeads(**shape)
        self.device = env.device
        self.act_dtype = getattr(torch, args.dtype or ("bfloat16" if env.device.type == "cuda" else "float32"))
        self.rank, self.world = env.rank, env.world_size
        self.shard = shard_heads(self.heads, self.world, self.rank)
        self.last = self.world - 1  # the rank faults are injected on
        fault = args.inject_fault if self.rank == self.last else None
        num_slots = args.slots or 2 * args.batch
        kw = dict(num_layers=self.num_layers, num_slots=num_slots, ring_length=args.ring_length,
                  state_dtype=getattr(torch, args.state_dtype), cache_dtype=getattr(torch, args.cache_dtype),
                  group=dist.group.WORLD, device=self.device, ring_layout=args.ring_layout,
                  conv_kernel_size=args.conv_size, debug=True if args.debug else None)
        if args.inject_fault == "same-device":  # every rank on cuda:0 (forgot set_device(local_rank))
            torch.cuda.set_device(0)
            kw["device"] = torch.device("cuda", 0)
        fault_kw = {"pool-device": ("device", self._wrong_device()), "ring-length": ("ring_length", args.ring_length + 1),
                    "num-slots": ("num_slots", num_slots + 1), "num-layers": ("num_layers", self.num_layers + 1),
                    "state-dtype": ("state_dtype", torch.bfloat16 if args.state_dtype == "float32" else torch.float32),
                    "cache-dtype": ("cache_dtype", torch.float32 if args.cache_dtype != "float32" else torch.bfloat16),
                    "tp-rank": ("tp_rank", 0)}
        if fault in fault_kw:
            key, value = fault_kw[fault]
            log.warning("injecting fault %s on rank %d: %s=%s", fault, self.rank, key, value)
            kw[key] = value
        t0 = time.perf_counter()
        self.pool = ReplaySSMStatePool(self.heads, **kw)
        self.build_s = time.perf_counter() - t0
        if fault == "cache-device":  # a cache left behind on another device after construction
            log.warning("injecting fault cache-device on rank %d: d_cache -> %s", self.rank, self._wrong_device())
            self.pool.d_cache = self.pool.d_cache.to(self._wrong_device())
        self.pool.verify_placement()  # collective: every rank
        self.shard = self.pool.shard  # the pool's sharding rule is the one source of truth
        self.fault = fault
        self.corrupted = False
        self.first_decode: list[tuple[int, float]] = []
        self.later_decode: list[tuple[int, float]] = []
        self._make_weights()
        self.rows: list[Request | None] = [None] * args.batch
        self.next_rid = 0
        self.sched = torch.Generator().manual_seed(args.seed)  # same stream on every rank
        self.stats = dict(tokens=0, engine_s=0.0, warm_s=0.0, warm_tokens=0, warm_bytes=0, checked_rows=0,
                          mismatches=0, max_err=0.0, admitted=0, finished=0, steps=0, forks=0, preempted=0,
                          resumed=0, lineage_rows=0)
        # forks and preemptions draw from their own stream (the same on every rank), so without them the
        # scheduling is the one it always was; with them the oracle follows each request (self.shadow)
        self.life = torch.Generator().manual_seed(args.seed * 7177 + 3)
        self.lineage = args.fork_prob > 0 or args.preempt_prob > 0
        self.shadow: dict[int, list[torch.Tensor]] = {}  # request id -> float64 state per layer [HV_l, V, K]
        self.shadow_win: dict[int, list[torch.Tensor]] = {}  # request id -> conv window per layer [D_l, W-1]
        self.waiting: list[tuple[Request, Any]] = []  # preempted requests and their StateShard, oldest first

    # ---- setup ------------------------------------------------------------------------------

    def _wrong_device(self) -> torch.device:
        torch = self.torch
        if self.device.type == "cuda":
            n = torch.cuda.device_count()
            return torch.device("cuda", (self.device.index + 1) % n) if n > 1 else torch.device("cpu")
        return torch.device("meta")

    def _block(self, layer: int, kind: int, head: int, shape: tuple[int, ...], scale: float) -> torch.Tensor:
        """A weight block of one head, identical on every rank that holds that head."""
        g = self.torch.Generator().manual_seed(((self.args.seed * 1009 + layer) * 17 + kind) * 100003 + head)
        return (self.torch.randn(*shape, generator=g) * scale)

    def _make_weights(self) -> None:
        """Per layer: column slices ``W_qkv [D, 2H_l*K + HV_l*V]``, ``W_a [D, HV_l*K]``, ``W_b [D, HV_l]``;
        row slice ``W_o [HV_l*V, D]``; ``A_log [HV_l]``, ``dt_bias [HV_l*K]`` (fp32); with ``--conv-size W`` the conv
        weights ``[2H_l*K + HV_l*V, W]`` and bias of the rank's q/k/v channels, in ``mixed_qkv``'s column order (one
        block per head, like the projections: what ``HeadShard.slice_conv_weight`` takes from the global weight)."""
        torch, D = self.torch, self.hidden
        h = self.heads
        K, V = h.key_dim, h.value_dim
        s_in, s_out = D ** -0.5, (h.num_v_heads * V) ** -0.5
        self.layers = []
        for l in range(self.num_layers):
            q = [self._block(l, 0, i, (D, K), s_in) for i in self.shard.q_heads]
            k = [self._block(l, 1, i, (D, K), s_in) for i in self.shard.q_heads]
            v = [self._block(l, 2, i, (D, V), s_in) for i in self.shard.v_heads]
            a = [self._block(l, 3, i, (D, K), s_in) for i in self.shard.v_heads]
            b = [self._block(l, 4, i, (D, 1), s_in) for i in self.shard.v_heads]
            o = [self._block(l, 5, i, (V, D), s_out) for i in self.shard.v_heads]
            A_log = torch.cat([self._block(l, 6, i, (1,), 1.0).clamp(-1, 0.5) for i in self.shard.v_heads])
            dt = torch.cat([self._block(l, 7, i, (K,), 1.0).clamp(-4, 0) for i in self.shard.v_heads])
            dev, dt_ = self.device, self.act_dtype
            conv = {}
            W = self.args.conv_size
            if W:  # one [dim, W + 1] block per head and kind: W taps, then the bias
                blocks = ([self._block(l, 8, i, (K, W + 1), W ** -0.5) for i in self.shard.q_heads]
                          + [self._block(l, 9, i, (K, W + 1), W ** -0.5) for i in self.shard.q_heads]
                          + [self._block(l, 10, i, (V, W + 1), W ** -0.5) for i in self.shard.v_heads])
                wb = torch.cat(blocks, 0)
                conv = dict(conv_w=wb[:, :W].contiguous().to(dev, dt_), conv_b=(wb[:, W] * 0.2).to(dev, dt_))
            self.layers.append(dict(**conv,
                w_qkv=torch.cat(q + k + v, 1).to(dev, dt_), w_a=torch.cat(a, 1).to(dev, dt_),
                w_b=torch.cat(b, 1).to(dev, dt_), w_o=torch.cat(o, 0).to(dev, dt_),
                A_log=A_log.float().to(dev), dt_bias=dt.float().to(dev)))

    # ---- one step ---------------------------------------------------------------------------

    def _step(self, step: int, check: bool) -> None:
        from decode_report import follow, starting_states, traffic_bytes, verify

        torch, dist, args = self.torch, self.dist, self.args
        B, dev = args.batch, self.device
        live = [i for i, r in enumerate(self.rows) if r is not None]
        slots_h = [r.slot if r is not None else -1 for r in self.rows]
        flush_h = [1 if r is not None and r.remaining == 1 else 0 for r in self.rows]
        if args.inject_fault == "bad-slot" and step == 1:  # as a scheduler bug would: every rank, one row
            row = next((i for i, r in enumerate(self.rows) if r is None), B - 1)
            log.warning("injecting fault bad-slot: row %d names slot %d of a %d-slot pool", row,
                        self.pool.num_slots + 3, self.pool.num_slots)
            slots_h[row] = self.pool.num_slots + 3
        if self.fault == "rank-mismatch" and step == 1:  # the last rank alone: its heads of row i use row i+1's slot
            log.warning("injecting fault rank-mismatch on rank %d: step 1's slots shifted by one row", self.rank)
            slots_h = slots_h[1:] + slots_h[:1]
        sample = live[: args.check_rows] if check else []
        before, windows = starting_states(self, sample)  # what the oracle starts the sampled rows from
        g = torch.Generator().manual_seed(args.seed * 7919 + step)
        x = torch.randn(B, self.hidden, generator=g)
        x[[i for i in range(B) if self.rows[i] is None]] = 0.0
        self._sync()
        t0 = time.perf_counter()
        x = x.to(dev, self.act_dtype)
        slots = torch.tensor(slots_h, dtype=torch.int32, device=dev)
        force = torch.tensor(flush_h, dtype=torch.int32, device=dev)
        seen = []
        for l, w in enumerate(self.layers):
            h = x.float()
            h = (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)).to(self.act_dtype)
            mixed_qkv, a, b = h @ w["w_qkv"], h @ w["w_a"], h @ w["w_b"]
            if self.fault == "activation-device" and step == 0 and l == 0:
                log.warning("injecting fault activation-device on rank %d: mixed_qkv -> %s", self.rank,
                            self._wrong_device())
                mixed_qkv = mixed_qkv.to(self._wrong_device())
            t_dec = time.perf_counter()
            out = self.pool.decode(l, mixed_qkv, a, b, w["A_log"], w["dt_bias"], slots, force_flush=force,
                                   lower_bound=args.lower_bound,
                                   advance=args.fused_advance and l == self.num_layers - 1,
                                   conv_weight=w.get("conv_w"), conv_bias=w.get("conv_b"))
            # host time of the call: a layer's first decode runs the collective check (layer 0's also
            # compiles the kernel); later ones run none (the default check mode)
            (self.first_decode if step == 0 else self.later_decode).append((l, time.perf_counter() - t_dec))
            if args.corrupt_output and self.rank == self.last and sample and not self.corrupted:
                out[sample[0]] += 0.5 * out[sample[0]].abs().max() + 1e-3  # as a broken kernel would
                self.corrupted = True
            y = out.reshape(B, -1) @ w["w_o"]  # row-parallel: partial sum of this rank's heads
            dist.all_reduce(y)
            x = x + y
            if sample or self.lineage:
                seen.append((mixed_qkv, a, b, out))
        if not args.fused_advance:
            self.pool.advance(slots, force)
        self._sync()
        dt = time.perf_counter() - t0
        self.pool.check()  # a sync point anyway: report any bad slot id of this step (SlotError)
        self.stats["engine_s"] += dt
        self.stats["tokens"] += len(live)
        traffic = traffic_bytes(self, live, flush_h)
        if step > 0 or args.steps == 1:  # step 0 compiles the kernel and runs the first-decode checks
            self.stats["warm_s"] += dt
            self.stats["warm_tokens"] += len(live)
            self.stats["warm_bytes"] += traffic
        if sample:
            verify(self, sample, before, seen, windows)
        if self.lineage:
            follow(self, live, seen)
        for i in live:
            r = self.rows[i]
            r.remaining -= 1
            r.cursor = 0 if (flush_h[i] or r.cursor == args.ring_length - 1) else r.cursor + 1

    def _sync(self) -> None:
        if self.device.type == "cuda":
            self.torch.cuda.synchronize(self.device)

    # ---- the run ----------------------------------------------------------------------------

    def run(self) -> None:
        args, dist = self.args, self.dist
        from decode_lifecycle import admit, finish, preempt
        from decode_report import summary
        from tp_replayssm.tp.placement import placement_check_stats

        log.info("pool: %s; local heads H=%d HV=%d; %s", self.pool, self.shard.num_q_heads_local,
                 self.shard.num_v_heads_local, self.pool.memory.describe())
        t_run = time.perf_counter()
        for step in range(args.steps):
            admit(self)
            check = args.check_every > 0 and step % args.check_every == 0
            self._step(step, check)
            finish(self)
            preempt(self)
            self.stats["steps"] += 1
            if self.rank == 0 and ((step + 1) % args.log_every == 0 or step + 1 == args.steps):
                s = self.stats
                log.info("step %d/%d: %d live rows, admitted %d, finished %d, %.1f tok/s, max rel err %.1e",
                         step + 1, args.steps, sum(r is not None for r in self.rows), s["admitted"],
                         s["finished"], s["tokens"] / max(s["engine_s"], 1e-9), s["max_err"])
        wall = time.perf_counter() - t_run
        # steady-state cost of the collective check (every rank calls it together)
        reps = 10
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(reps):
            self.pool.verify_placement()
        verify_us = (time.perf_counter() - t0) / reps * 1e6
        summary(self, wall, verify_us, placement_check_stats())


if __name__ == "__main__":
    if os.path.dirname(os.path.abspath(__file__)) == sys.path[0]:  # run as a script: find the package
        sys.path.insert(1, os.path.dirname(sys.path[0]))
    exit_rank(main())
