"""Placement guarantees and the collective placement check (docs/contract.md, placement).

:func:`collective_placement_check` is what the pool calls on construction, on the first ``decode`` of
each layer and from ``verify_placement()``. Protocol, identical on every rank of ``group``:

1. **Local verdict, never raising.** Each rank checks its own tensors (every one on
   ``expected_device``), that ``expected_device`` is its current device, and its fingerprint
   (``tp_rank`` == rank in group, ``tp_size`` == group size). The whole local check is wrapped in
   ``try/except``: a rank whose check itself throws reports the exception as its problem instead of
   raising before the exchange (a rank raising early would leave its peers waiting in a collective).
2. **One small fixed-shape collective on the success path.** Each rank contributes an ``int64[5]``
   row (protocol magic, status, digest of the fingerprint without ``tp_rank``, digest of its
   ``(host, CUDA device)``, group rank) to one ``all_gather``. From the gathered ``[world, 5]`` table
   every rank decides *the same thing*: all statuses ok, all fingerprint digests equal, no two CUDA
   ranks with the same device digest -> done.
3. **Only on failure, a second exchange of the texts** (``all_gather_object`` of a
   :class:`RankReport` per rank: host, device, fingerprint, local problems). Every rank then formats
   the message with :func:`format_placement_error` from the same gathered list, so every rank raises
   a :class:`PlacementError` with the *same* text, naming each offending rank, tensor, expected and
   actual device.

**Which group carries the exchange.** Always a lazily created CPU *gloo* group over the same ranks
(cached per ``(default group, ranks)``; ``new_group(..., use_local_synchronization=True)`` so ranks
outside a TP subgroup need not take part), never the main group, even when that is NCCL:

- a misplaced tensor or a wrong current device never needs a device collective: an NCCL collective
  issued while the current device is wrong would create a CUDA context on (or hang against) the wrong
  GPU, which is exactly the situation the check is there to diagnose;
- the check group has its own short timeout (``TP_REPLAYSSM_PLACEMENT_TIMEOUT_S``, default 60 s), so a
  rank that never arrives (crashed, or stuck in model loading) turns into an error within that bound
  instead of NCCL's 10-minute watchdog, and the check never interleaves with async traffic on the
  main group;
- the exchange tensors live in host memory, so the check costs no device sync and no allocation on
  the device; its success path is one ``int64[world, 5]`` gloo ``all_gather`` (measured 0.3-0.8 ms
  between two CPU processes on a busy 2-core VM, about the latency of the gloo collective itself).

With ``group=None`` the same local rules run (no collective, no rank rules), and a problem still
raises :class:`PlacementError`.

**Current device.** For a CUDA pool, ``torch.cuda.current_device()``. A CPU pool is on its rank's
current device when the machine has no CUDA or the group communicates over gloo only (a gloo CPU job
on a GPU host is legitimate); a CPU pool in an NCCL group, or a pool on any other device type
(``meta``, ...), is not. :func:`tp_replayssm.tp.devices.current_cuda_device` is the single hook for this (tests patch it to
emulate ``cuda:N`` with ``FakeTensorMode`` on a CPU machine).

**(host, device).** A CUDA device is identified by its UUID where the real device is visible (ranks
launched with per-rank ``CUDA_VISIBLE_DEVICES`` all see their GPU as ``cuda:0`` and are *not*
duplicates), else by ``host/cuda:N``. Several CPU ranks on one host are fine.
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import hashlib
import logging
import os
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist

from ..errors import PlacementError
from . import devices

log = logging.getLogger(__name__)

TIMEOUT_ENV = "TP_REPLAYSSM_PLACEMENT_TIMEOUT_S"
DEFAULT_TIMEOUT_S = 60.0
_MAGIC = 0x7470_5253_0001  # "tpRS" + protocol version 1
_ROW = 5  # magic, status, fingerprint digest, device digest, group rank
_MAX_NAMES = 8  # tensor names listed per (rank, actual device) before "... and N more"


@dataclasses.dataclass(frozen=True)
class PoolFingerprint:
    """What every rank of a TP group must agree on (all but ``tp_rank``), plus the shard index."""

    num_q_heads: int
    num_v_heads: int
    key_dim: int
    value_dim: int
    tp_size: int
    tp_rank: int
    num_layers: int
    num_slots: int
    ring_length: int
    state_dtype: str
    cache_dtype: str
    ring_layout: str = "predecayed"  # the rings' layout: "predecayed" or "sglang" (ReplaySSMStatePool)
    conv_kernel_size: int = 0  # the conv state's kernel (0: none)
    conv_dtype: str = ""  # the conv windows' dtype ("" without conv state)

    def as_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    def agreement(self) -> dict[str, Any]:
        """The fields every rank must have equal (everything but ``tp_rank``)."""
        d = self.as_dict()
        d.pop("tp_rank")
        return d

    def digest(self) -> int:
        """Stable (process-independent) 63-bit digest of :meth:`agreement` (cached per value)."""
        return _fingerprint_digest(self)


@dataclasses.dataclass(frozen=True)
class RankReport:
    """One rank's verdict, as exchanged on the failure path (picklable, plain data only)."""

    rank: int  # rank in the group
    global_rank: int
    host: str
    device: str  # the pool's (expected) device
    device_key: str  # identity of the physical CUDA device, "" when not CUDA
    fingerprint: dict[str, Any] | None
    problems: tuple[str, ...]
    context: str = ""
    fingerprint_digest: int = 0  # digest of the fingerprint without tp_rank (0: none)


_STATS: dict[str, float] = {"collective": 0, "local": 0, "failed": 0, "total_s": 0.0, "last_s": 0.0}
_CHECK_GROUPS: dict[tuple[int, tuple[int, ...]], Any] = {}
_BY_GROUP: dict[int, tuple[Any, Any]] = {}  # id(group) -> (group, check group): the fast path


def placement_check_stats() -> dict[str, float]:
    """Counters of this process: ``collective``/``local`` checks run, ``failed``, ``total_s``, ``last_s``."""
    return dict(_STATS)


def reset_check_groups() -> None:
    """Forget the cached gloo check groups (call before ``destroy_process_group``)."""
    _CHECK_GROUPS.clear()
    _BY_GROUP.clear()


def check_timeout_s() -> float:
    """Timeout of the check group's collectives (env ``TP_REPLAYSSM_PLACEMENT_TIMEOUT_S``)."""
    try:
        return max(1.0, float(os.environ.get(TIMEOUT_ENV, DEFAULT_TIMEOUT_S)))
    except ValueError:
        return DEFAULT_TIMEOUT_S


@functools.lru_cache(maxsize=64)
def _fingerprint_digest(fp: PoolFingerprint) -> int:
    return _digest(repr(sorted(fp.agreement().items())))


def _digest(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little") >> 1


def _names(names: list[str]) -> str:
    shown = ", ".join(f"`{n}`" for n in names[:_MAX_NAMES])
    more = len(names) - _MAX_NAMES
    return shown + (f" and {more} more" if more > 0 else "")


def local_problems(
    *,
    expected_device: torch.device,
    require_current_device: bool,
    fingerprint: PoolFingerprint,
    tensors: Mapping[str, torch.Tensor | None],
    group_rank: int | None,
    group_size: int | None,
    group_backend: str | None = None,
) -> list[str]:
    """This rank's problems as text (may raise; :func:`collective_placement_check` wraps it).

    ``group_rank``/``group_size`` None: no group, so no rank rules (a pool may hold any shard).
    """
    problems: list[str] = []
    by_device: dict[str, list[str]] = {}
    for name, t in tensors.items():
        if t is None:
            continue
        dev = t.device
        if dev != expected_device:
            by_device.setdefault(str(dev), []).append(name)
    for dev, names in by_device.items():
        problems.append(f"{_names(names)} on {dev}, expected {expected_device}")

    if require_current_device:
        cur = devices.current_cuda_device()
        if expected_device.type == "cuda":
            if cur is None:
                problems.append(f"pool device {expected_device} is not usable: this machine has no CUDA device")
            elif cur != expected_device:
                problems.append(f"pool device {expected_device} is not this rank's current device {cur}")
        elif expected_device.type == "cpu":
            if cur is not None and (group_backend is None or "nccl" in group_backend):
                problems.append(
                    f"pool device cpu is not this rank's current device {cur} "
                    f"(group backend {group_backend or 'none'})"
                )
        else:
            problems.append(
                f"pool device {expected_device} is not this rank's current device "
                f"{cur if cur is not None else torch.device('cpu')}"
            )

    if not isinstance(fingerprint, PoolFingerprint):
        problems.append(f"fingerprint must be a PoolFingerprint, got {type(fingerprint).__name__}")
        return problems
    if not 0 <= fingerprint.tp_rank < fingerprint.tp_size:
        problems.append(f"tp_rank {fingerprint.tp_rank} not in [0, tp_size={fingerprint.tp_size})")
    if group_rank is not None and fingerprint.tp_rank != group_rank:
        problems.append(f"shard index tp_rank={fingerprint.tp_rank} != rank in group {group_rank}")
    if group_size is not None and fingerprint.tp_size != group_size:
        problems.append(f"tp_size={fingerprint.tp_size} != group size {group_size}")
    return problems


def _local_report(
    *,
    expected_device: Any,
    require_current_device: bool,
    fingerprint: Any,
    tensors: Any,
    context: str,
    group_rank: int,
    global_rank: int,
    group_size: int | None,
    group_backend: str | None,
) -> RankReport:
    """Never raises: an exception in the local check becomes this rank's problem."""
    host = "?"
    device = "?"
    device_key = ""
    fp: dict[str, Any] | None = None
    digest = 0
    try:
        host = devices.hostname()
        expected = devices.resolve_device(expected_device, strict=False)
        device = str(expected)
        device_key = devices.device_key(host, expected)
        if isinstance(fingerprint, PoolFingerprint):
            fp = fingerprint.as_dict()
            digest = fingerprint.digest()
        problems = local_problems(
            expected_device=expected,
            require_current_device=require_current_device,
            fingerprint=fingerprint,
            tensors=tensors,
            group_rank=group_rank if group_size is not None else None,
            group_size=group_size,
            group_backend=group_backend,
        )
    except Exception as exc:  # noqa: BLE001 - the point: report, don't raise before the exchange
        problems = [f"local placement check raised {type(exc).__name__}: {exc}"]
    return RankReport(group_rank, global_rank, host, device, device_key, fp, tuple(problems), context, digest)


def cross_rank_problems(reports: Sequence[RankReport]) -> dict[int, list[str]]:
    """Problems only visible across ranks: shared ``(host, CUDA device)``, fingerprint disagreement.

    Fingerprints are compared against the most common one (ties go to the lowest rank); each rank
    that differs is named with the differing fields.
    """
    out: dict[int, list[str]] = {}
    owners: dict[str, list[RankReport]] = {}
    for r in reports:
        if r.device_key:
            owners.setdefault(r.device_key, []).append(r)
    for same in owners.values():
        if len(same) > 1:
            ranks = ", ".join(str(r.rank) for r in same)
            for r in same:
                out.setdefault(r.rank, []).append(
                    f"ranks {ranks} all hold their pool on host {r.host} device {r.device} (one device per rank)"
                )
    fps = {r.rank: r.fingerprint for r in reports if r.fingerprint is not None}
    if fps:
        keyed = {rank: repr(sorted((k, v) for k, v in fp.items() if k != "tp_rank")) for rank, fp in fps.items()}
        counts = Counter(keyed.values())
        best = max(counts.values())
        ref_rank = min(rank for rank, key in keyed.items() if counts[key] == best)
        ref = fps[ref_rank]
        agree = sorted(rank for rank, key in keyed.items() if key == keyed[ref_rank])
        for rank, fp in sorted(fps.items()):
            if keyed[rank] == keyed[ref_rank]:
                continue
            diffs = ", ".join(
                f"{k}={fp.get(k)!r} (rank {ref_rank}: {ref.get(k)!r})"
                for k in ref
                if k != "tp_rank" and fp.get(k) != ref.get(k)
            )
            who = f"rank {agree[0]}" if len(agree) == 1 else f"ranks {', '.join(map(str, agree))}"
            out.setdefault(rank, []).append(f"disagrees with {who} on the pool: {diffs}")
    return out


def format_placement_error(reports: Sequence[RankReport], group_size: int | None = None) -> str | None:
    """The one message every rank raises, or None when nobody has a problem.

    A pure function of the gathered reports, so every rank formats the identical text.
    """
    reports = sorted(reports, key=lambda r: r.rank)
    per_rank: dict[int, list[str]] = {r.rank: list(r.problems) for r in reports}
    for rank, probs in cross_rank_problems(reports).items():
        per_rank.setdefault(rank, []).extend(probs)
    bad = [r for r in reports if per_rank.get(r.rank)]
    if not bad:
        return None
    contexts = sorted({r.context for r in reports})
    ctx = contexts[0] if len(contexts) == 1 else "; ".join(f"rank {r.rank}: {r.context}" for r in reports)
    size = group_size if group_size is not None else len(reports)
    where = f"{size} rank{'s' if size != 1 else ''}" if group_size is not None else "no group"
    lines = [
        f"placement check failed during {ctx} ({where}); offending rank(s): "
        + ", ".join(str(r.rank) for r in bad)
    ]
    if len(contexts) > 1:
        lines.append("  ranks ran different checks (not in lockstep)")
    for r in bad:
        glob = f", global rank {r.global_rank}" if r.global_rank != r.rank else ""
        lines.append(f"  rank {r.rank}{glob} (host {r.host}, pool device {r.device}):")
        lines.extend(f"    - {p}" for p in per_rank[r.rank])
    return "\n".join(lines)


def _check_group(group: Any) -> Any:
    """The cached CPU gloo group over ``group``'s ranks (created collectively on first use).

    A group over every rank is created the ordinary way (every rank takes part, as in the pool's construction). A
    subgroup is created by its members alone (``use_local_synchronization``), whose name torch derives from the ranks
    and the number of groups the process knows: members must have created the same number of groups before (true of
    the usual symmetric TP/DP layouts; docs/pitfalls.md)."""
    hit = _BY_GROUP.get(id(group))
    if hit is not None and hit[0] is group:
        return hit[1]
    ranks = tuple(dist.get_process_group_ranks(group))
    key = (id(dist.distributed_c10d._get_default_group()), ranks)
    pg = _CHECK_GROUPS.get(key)
    if pg is None:
        pg = dist.new_group(
            list(ranks),
            timeout=datetime.timedelta(seconds=check_timeout_s()),
            backend="gloo",
            use_local_synchronization=len(ranks) != dist.get_world_size(),
            group_desc="tp_replayssm_placement_check",
        )
        _CHECK_GROUPS[key] = pg
    _BY_GROUP[id(group)] = (group, pg)
    return pg


def _no_fake_mode() -> Any:
    """Context that makes the exchange use real CPU tensors even inside ``FakeTensorMode``."""
    try:
        from torch._subclasses.fake_tensor import unset_fake_temporarily
    except ImportError:  # pragma: no cover
        import contextlib

        return contextlib.nullcontext()
    return unset_fake_temporarily()


def _exchange(pg: Any, report: RankReport) -> list[RankReport] | None:
    """All-gather the fixed-shape verdicts; on any problem, all-gather the full reports."""
    world = dist.get_world_size(pg)
    fp_digest = report.fingerprint_digest
    dev_digest = _digest(report.device_key) if report.device_key else 0
    row = torch.tensor([_MAGIC, 1 if report.problems else 0, fp_digest, dev_digest, report.rank], dtype=torch.int64)
    table = torch.empty(world, _ROW, dtype=torch.int64)
    dist.all_gather(list(table.unbind(0)), row, group=pg)
    rows = table.tolist()
    cuda_devs = [r[3] for r in rows if r[3] != 0]
    ok = (
        all(r[0] == _MAGIC for r in rows)
        and not any(r[1] for r in rows)
        and all(r[2] == rows[0][2] for r in rows)
        and len(set(cuda_devs)) == len(cuda_devs)
    )
    if ok:
        return None
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, report, group=pg)
    return gathered


def collective_placement_check(
    *,
    group: Any,
    expected_device: torch.device,
    require_current_device: bool,
    fingerprint: PoolFingerprint,
    tensors: Mapping[str, torch.Tensor | None],
    context: str,
) -> None:
    """Check placement on every rank of ``group``; raise the same :class:`PlacementError` on all.

    ``tensors``: name -> tensor (None entries are skipped), e.g. ``layer3.d_cache`` or ``mixed_qkv``;
    every one must be on ``expected_device`` (the pool's device). ``fingerprint``: this rank's pool
    description; all ranks must agree on everything but ``tp_rank``, which must equal the rank in
    ``group``, and ``tp_size`` must equal the group size. ``group=None``: local rules only.
    Collective when ``group`` is given: every rank of the group must call it at the same point.
    """
    t0 = time.perf_counter()
    try:
        if group is None:
            _STATS["local"] += 1
            report = _local_report(
                expected_device=expected_device, require_current_device=require_current_device,
                fingerprint=fingerprint, tensors=tensors, context=context, group_rank=0, global_rank=0,
                group_size=None, group_backend=None,
            )
            msg = format_placement_error([report], None) if report.problems else None
        else:
            _STATS["collective"] += 1
            with _no_fake_mode():
                msg = _collective(group, expected_device, require_current_device, fingerprint, tensors, context)
    finally:
        dt = time.perf_counter() - t0
        _STATS["total_s"] += dt
        _STATS["last_s"] = dt
    if msg is not None:
        _STATS["failed"] += 1
        raise PlacementError(msg)
    log.debug("placement check ok (%s) in %.1f us", context, dt * 1e6)


def _collective(
    group: Any,
    expected_device: Any,
    require_current_device: bool,
    fingerprint: Any,
    tensors: Any,
    context: str,
) -> str | None:
    rank = dist.get_rank(group)
    size = dist.get_world_size(group)
    global_rank = dist.get_rank()
    try:
        backend = str(dist.get_backend(group))
    except Exception:  # noqa: BLE001
        backend = None
    report = _local_report(
        expected_device=expected_device, require_current_device=require_current_device,
        fingerprint=fingerprint, tensors=tensors, context=context, group_rank=rank,
        global_rank=global_rank, group_size=size, group_backend=backend,
    )
    try:
        gathered = _exchange(_check_group(group), report)
    except Exception as exc:  # noqa: BLE001 - a peer died or never called the check
        raise PlacementError(
            f"placement check during {context}: rank {rank} could not exchange verdicts with its "
            f"group within {check_timeout_s():.0f} s ({type(exc).__name__}: {exc}); another rank "
            f"probably failed or is not running the same check. Local verdict: "
            f"{'; '.join(report.problems) or 'ok'}"
        ) from exc
    if gathered is None:
        return None
    msg = format_placement_error(gathered, size)
    if msg is None:  # the table said "problem" but the texts show none: never silently pass
        msg = (
            f"placement check failed during {context} ({size} ranks): the ranks' verdict rows "
            "disagree (mixed tp_replayssm versions?)"
        )
    return msg
