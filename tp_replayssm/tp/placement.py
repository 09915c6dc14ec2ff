"""Placement guarantees and the collective placement check (docs/contract.md, placement).

:func:`collective_placement_check` is what the pool calls on construction, on the first ``decode`` of
each layer and from ``verify_placement()``. Protocol, identical on every rank of ``group``:

1. **Local verdict, never raising.** Each rank checks its own tensors (every one on
   ``expected_device``), that ``expected_device`` is its current device, and its fingerprint
   (``tp_rank`` == rank in group, ``tp_size`` == group size). The whole local check is wrapped in
   ``try/except``: a rank whose check itself throws reports the exception as its problem instead of
   raising before the exchange (a rank raising early would leave its peers waiting in a collective).
2. **One small fixed-shape collective on the success path.** Each rank contributes an ``int64[6]``
   row (protocol magic, the exchange's kind, status, digest of the fingerprint without ``tp_rank``,
   digest of its ``(host, CUDA device)``, group rank) to one ``all_gather``. From the gathered
   ``[world, 6]`` table every rank decides *the same thing*: all statuses ok, all fingerprint digests
   equal, no two CUDA ranks with the same device digest -> done. Every exchange on the check group
   (this one, :func:`gather_texts`, :func:`gather_if_different`) starts with such a row naming its
   kind: ranks in different exchanges all see it and all raise ``RankMismatchError`` naming each
   rank's check, where collectives of different sizes would make gloo abort.
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
  main group; an exchange that fails (a timeout closes gloo's connections) drops the cached group,
  and the next check creates a new one, which every rank of the group must reach;
- the exchange tensors live in host memory, so the check costs no device sync and no allocation on
  the device; its success path is one ``int64[world, 6]`` gloo ``all_gather`` (measured 0.3-0.8 ms
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

import datetime
import logging
import os
import time
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist

from ..errors import PlacementError, RankMismatchError
from .verdicts import (PoolFingerprint, RankReport, _local_report, cross_rank_problems, format_placement_error,
                       local_problems, text_digest)

__all__ = ["PlacementError", "PoolFingerprint", "RankReport", "check_timeout_s", "collective_placement_check",
           "cross_rank_problems", "format_placement_error", "gather_if_different", "gather_texts", "local_problems",
           "placement_check_stats", "reset_check_groups"]

log = logging.getLogger(__name__)

TIMEOUT_ENV = "TP_REPLAYSSM_PLACEMENT_TIMEOUT_S"
DEFAULT_TIMEOUT_S = 60.0
_MAGIC = 0x7470_5253_0002  # "tpRS" + protocol version 2
_ROW = 7  # magic, kind, three values of the kind, digest of the call, group rank: every exchange's first message
# what an exchange is, by the kind its first message carries: every exchange starts with the same fixed-shape
# all-gather, so ranks in different exchanges (one in a placement check, one in a debug call's comparison) learn it
# from that table and all raise, instead of pairing collectives of different sizes (gloo aborts on that)
_PLACEMENT, _TEXTS, _AGREEMENT = 1, 2, 3


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
    dev_digest = text_digest(report.device_key) if report.device_key else 0
    rows = _first_round(pg, _PLACEMENT, (1 if report.problems else 0, fp_digest, dev_digest),
                        f"placement check during {report.context}")
    cuda_devs = [r[4] for r in rows if r[4] != 0]
    ok = (
        not any(r[2] for r in rows)
        and all(r[3] == rows[0][3] for r in rows)
        and len(set(cuda_devs)) == len(cuda_devs)
    )
    if ok:
        return None
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, report, group=pg)
    return gathered


def _first_round(pg: Any, kind: int, values: tuple[int, int, int], context: str) -> list[list[int]]:
    """The first message of an exchange of ``kind`` on check group ``pg``: every rank's ``[magic, kind, *values,
    digest of context, rank]``. Ranks in different exchanges (another kind, another call, another protocol version)
    all see that in the table and all raise :class:`RankMismatchError` naming each rank's ``context`` (one more
    all-gather, of those texts, with each rank's global rank)."""
    world, rank = dist.get_world_size(pg), dist.get_rank(pg)
    row = torch.tensor([_MAGIC, kind, *values, text_digest(context), rank], dtype=torch.int64)
    table = torch.empty(world, _ROW, dtype=torch.int64)
    dist.all_gather(list(table.unbind(0)), row, group=pg)
    rows = table.tolist()
    if all(r[0] == _MAGIC and r[1] == kind and r[5] == rows[0][5] for r in rows):
        return rows
    contexts: list[Any] = [None] * world
    dist.all_gather_object(contexts, (context, dist.get_rank()), group=pg)
    raise RankMismatchError("the ranks of the group are in different collective checks: "
                            + "; ".join(f"{rank_name(r, g)}: {c}" for r, (c, g) in enumerate(contexts))
                            + " (every rank must make the same pool calls in the same order)")


def rank_name(group_rank: int, global_rank: int) -> str:
    """``rank r``, with the global rank where the group's ranks are not the global ones."""
    return f"rank {group_rank}" if group_rank == global_rank else f"rank {group_rank} (global rank {global_rank})"


def collective_placement_check(
    *,
    group: Any,
    expected_device: torch.device,
    require_current_device: bool,
    fingerprint: PoolFingerprint,
    tensors: Mapping[str, torch.Tensor | None],
    context: str,
    extra_problems: Sequence[str] = (),
) -> None:
    """Check placement on every rank of ``group``; raise the same :class:`PlacementError` on all.

    ``tensors``: name -> tensor (None entries are skipped), e.g. ``layer3.d_cache`` or ``mixed_qkv``;
    every one must be on ``expected_device`` (the pool's device). ``fingerprint``: this rank's pool
    description; all ranks must agree on everything but ``tp_rank``, which must equal the rank in
    ``group``, and ``tp_size`` must equal the group size. ``group=None``: local rules only.
    Collective when ``group`` is given: every rank of the group must call it at the same point.
    ``extra_problems``: this rank's own findings beyond the tensors' devices, reported like the others.
    """
    t0 = time.perf_counter()
    try:
        if group is None:
            _STATS["local"] += 1
            report = _local_report(
                expected_device=expected_device, require_current_device=require_current_device,
                fingerprint=fingerprint, tensors=tensors, context=context, group_rank=0, global_rank=0,
                group_size=None, group_backend=None, extra_problems=extra_problems,
            )
            msg = format_placement_error([report], None) if report.problems else None
        else:
            _STATS["collective"] += 1
            with _no_fake_mode():
                msg = _collective(group, expected_device, require_current_device, fingerprint, tensors, context,
                                  extra_problems)
    finally:
        dt = time.perf_counter() - t0
        _STATS["total_s"] += dt
        _STATS["last_s"] = dt
    if msg is not None:
        _STATS["failed"] += 1
        raise PlacementError(msg)
    log.debug("placement check ok (%s) in %.1f us", context, dt * 1e6)


def gather_texts(group: Any, text: str | None, context: str) -> list[str | None]:
    """Every rank's optional ``text`` (e.g. its ``SlotError``), in group rank order, over the check group: a flag per
    rank first, the texts only when some rank has one. Collective over ``group``; a peer that does not take part
    within the check timeout raises :class:`PlacementError` naming ``context``."""
    texts = _gather_when(group, _TEXTS, 0 if text is None else 1, text, context, any,
                         f"Local result: {text or 'ok'}")
    return [None] * len(dist.get_process_group_ranks(group)) if texts is None else texts


def gather_if_different(group: Any, digest: int, payload: Any, context: str, local: str) -> list[Any] | None:
    """Every rank's ``payload`` in group rank order when the ranks' ``digest`` values (63-bit ints) differ, else None:
    one all-gather of the digests, the payloads only on a difference. Collective over ``group``; a peer that does
    not take part within the check timeout raises :class:`PlacementError` naming ``context`` and ending with
    ``local`` (what this rank brought)."""
    return _gather_when(group, _AGREEMENT, digest, payload, context, lambda words: len(set(words)) > 1, local)


def _gather_when(group: Any, kind: int, word: int, payload: Any, context: str, wanted: Any,
                 local: str) -> list[Any] | None:
    """An exchange of ``kind``: one int64 ``word`` per rank over the check group; when ``wanted(words)``, all-gather
    the ranks' ``payload`` objects and return them (group rank order), else None."""
    with _no_fake_mode():
        try:
            pg = _check_group(group)  # (made again after a failed exchange: a late peer fails it here)
            world = dist.get_world_size(pg)
            rows = _first_round(pg, kind, (word, 0, 0), context)
            if not wanted([r[2] for r in rows]):
                return None
            gathered: list[Any] = [None] * world
            dist.all_gather_object(gathered, payload, group=pg)
        except RankMismatchError:  # every rank raises it alike (the exchange itself worked)
            raise
        except Exception as exc:  # noqa: BLE001 - a peer died or never called the exchange
            raise _exchange_failed(group, context, exc, local) from exc
    return gathered


def _exchange_failed(group: Any, context: str, exc: Exception, local: str) -> PlacementError:
    """The error of an exchange that did not complete (a peer died, never called, or was late past the timeout).
    The check group is dropped: gloo closes a group's connections on a timeout, so the next check creates a new one
    (collectively: every rank of the group must reach it)."""
    _forget_check_group(group)
    return PlacementError(
        f"{context}: {rank_name(dist.get_rank(group), dist.get_rank())} could not exchange its check's result with "
        f"its group (the check's timeout is {check_timeout_s():.0f} s; {type(exc).__name__}: {exc}); another rank "
        f"probably failed, is late, or is not running the same call. {local}")


def _forget_check_group(group: Any) -> None:
    hit = _BY_GROUP.pop(id(group), None)
    if hit is not None:
        for key, pg in list(_CHECK_GROUPS.items()):
            if pg is hit[1]:
                del _CHECK_GROUPS[key]


def _collective(
    group: Any,
    expected_device: Any,
    require_current_device: bool,
    fingerprint: Any,
    tensors: Any,
    context: str,
    extra_problems: Sequence[str] = (),
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
        global_rank=global_rank, group_size=size, group_backend=backend, extra_problems=extra_problems,
    )
    try:
        gathered = _exchange(_check_group(group), report)
    except RankMismatchError:  # every rank raises it alike (the exchange itself worked)
        raise
    except Exception as exc:  # noqa: BLE001 - a peer died or never called the check
        raise _exchange_failed(group, f"placement check during {context}", exc,
                               f"Local verdict: {'; '.join(report.problems) or 'ok'}") from exc
    if gathered is None:
        return None
    msg = format_placement_error(gathered, size)
    if msg is None:  # the table said "problem" but the texts show none: never silently pass
        msg = (
            f"placement check failed during {context} ({size} ranks): the ranks' verdict rows "
            "disagree (mixed tp_replayssm versions?)"
        )
    return msg
