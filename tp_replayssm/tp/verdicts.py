"""What a rank checks and how the verdicts read: the placement check's local rules and its error text.

:class:`PoolFingerprint` is what every rank of a group must agree on; :func:`local_problems` is one rank's own
verdict (tensors on the expected device, that device current, its shard index), :func:`cross_rank_problems` what
only the gathered verdicts show (two ranks on one GPU, fingerprints that disagree), and
:func:`format_placement_error` the one text every rank raises, a pure function of the gathered
:class:`RankReport` objects.
The collective protocol that exchanges them is :mod:`.placement`.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from . import devices

__all__ = ["PoolFingerprint", "RankReport", "cross_rank_problems", "format_placement_error", "local_problems",
           "text_digest"]

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
    debug: bool = False  # debug mode as at the check (pool.checks sets it): its calls are collective in a group

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


@functools.lru_cache(maxsize=64)
def _fingerprint_digest(fp: PoolFingerprint) -> int:
    return text_digest(repr(sorted(fp.agreement().items())))


def text_digest(text: str) -> int:
    """A stable (process-independent) 63-bit digest of ``text``: what ranks compare instead of the text."""
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
    extra_problems: Sequence[str] = (),
) -> RankReport:
    """Never raises: an exception in the local check becomes this rank's problem. ``extra_problems``: the caller's
    own findings (e.g. the pool's replaced tensors), reported as this rank's problems."""
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
    problems = [*problems, *extra_problems]
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
