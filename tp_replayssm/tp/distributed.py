"""Process-group setup from torchrun's environment (as torchtitan does it), and teardown.

- The global rank and world size come from ``RANK`` / ``WORLD_SIZE`` (through ``env://``); the local
  device from ``LOCAL_RANK``. ``LOCAL_RANK`` is never used as the global rank.
- On CUDA, ``torch.cuda.set_device(local_rank)`` runs *before* ``init_process_group(backend="nccl",
  device_id=...)``, so NCCL's communicator (eagerly created thanks to ``device_id``) and every later
  allocation land on the rank's own GPU. ``NCCL_NVLS_ENABLE=0`` is default-set (NVLink multicast off).
- On CPU, gloo (no ``device_id``).
- :func:`init_distributed` is idempotent: a second call returns the same :class:`DistEnv`.
- :func:`distributed_session` is the context manager that tears down in ``finally``: on a clean exit a
  barrier (with the group's timeout) then ``destroy_process_group``; after an exception no barrier
  (peers may be dead or failing too), the group is destroyed directly for NCCL and left to process
  exit for gloo (``destroy_process_group`` on gloo after a failure can abort with "terminate called
  without an active exception").
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import logging
import os
from collections.abc import Iterator

import torch
import torch.distributed as dist

from . import placement

log = logging.getLogger(__name__)


class DistributedInitError(ValueError, RuntimeError):
    """The environment or the arguments do not describe a usable process (missing or invalid torchrun variables, a
    device type this machine lacks): a ``ValueError`` naming what is wrong (a ``RuntimeError`` too)."""


@dataclasses.dataclass(frozen=True)
class DistEnv:
    """What one rank knows about its job: global rank/size, local rank, device and backend."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    device: torch.device
    backend: str

    @property
    def is_main(self) -> bool:
        return self.rank == 0


_ENV: DistEnv | None = None


def _env_int(name: str, default: int | None = None) -> int:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        if default is None:
            raise DistributedInitError(
                f"environment variable {name} is not set; launch with "
                "`torchrun --nproc-per-node N ...` (or set RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT)"
            )
        return default
    try:
        return int(raw)
    except ValueError as exc:
        raise DistributedInitError(f"environment variable {name}={raw!r} is not an integer") from exc


def rank_device(device_type: str, local_rank: int) -> torch.device:
    """The rank's device: ``cuda:<local_rank>`` (checked against the visible devices) or CPU."""
    if device_type == "cpu":
        return torch.device("cpu")
    if device_type != "cuda":
        raise DistributedInitError(f"device type must be 'cuda' or 'cpu', got {device_type!r}")
    if not torch.cuda.is_available():
        raise DistributedInitError("device 'cuda' requested but torch.cuda.is_available() is False")
    visible = torch.cuda.device_count()
    if not 0 <= local_rank < visible:
        raise DistributedInitError(
            f"LOCAL_RANK={local_rank} but only {visible} CUDA device(s) are visible "
            f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', '<unset>')}); "
            "use --nproc-per-node <= the number of GPUs"
        )
    return torch.device("cuda", local_rank)


def init_distributed(
    device_type: str | None = None,
    *,
    timeout_s: float = 600.0,
    init_method: str | None = None,
) -> DistEnv:
    """Initialize the default process group from torchrun's environment; return the :class:`DistEnv`.

    ``device_type``: ``"cuda"`` (NCCL), ``"cpu"`` (gloo) or None (CUDA when available). Safe to call
    twice (the second call checks it agrees and returns the same env). ``init_method`` defaults to
    ``env://`` (``MASTER_ADDR``/``MASTER_PORT``); a ``file://`` URL also works (tests).
    """
    global _ENV
    if device_type is None:
        device_type = "cuda" if torch.cuda.is_available() else "cpu"
    if _ENV is not None and dist.is_initialized():
        if _ENV.device.type != device_type:
            raise DistributedInitError(
                f"already initialized for {_ENV.device.type} ({_ENV.backend}); asked for {device_type}"
            )
        return _ENV
    rank = _env_int("RANK")
    world_size = _env_int("WORLD_SIZE")
    local_rank = _env_int("LOCAL_RANK")
    local_world_size = _env_int("LOCAL_WORLD_SIZE", world_size)
    if not 0 <= rank < world_size:
        raise DistributedInitError(f"RANK={rank} not in [0, WORLD_SIZE={world_size})")
    if not 0 <= local_rank < local_world_size:
        raise DistributedInitError(f"LOCAL_RANK={local_rank} not in [0, LOCAL_WORLD_SIZE={local_world_size})")
    device = rank_device(device_type, local_rank)
    timeout = datetime.timedelta(seconds=timeout_s)
    if device.type == "cuda":
        os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
        torch.cuda.set_device(device)  # before init_process_group: NCCL binds to the current device
        backend = "nccl"
    else:
        backend = "gloo"
    if dist.is_initialized():  # initialized by someone else: adopt it, but it must match the env
        if dist.get_rank() != rank or dist.get_world_size() != world_size:
            raise DistributedInitError(
                f"process group already initialized as rank {dist.get_rank()}/{dist.get_world_size()}, "
                f"environment says {rank}/{world_size}"
            )
        backend = str(dist.get_backend())
    else:
        kwargs: dict = {"backend": backend, "timeout": timeout, "rank": rank, "world_size": world_size,
                        "init_method": init_method or "env://"}
        if device.type == "cuda":
            kwargs["device_id"] = device
        dist.init_process_group(**kwargs)
    _ENV = DistEnv(rank, world_size, local_rank, local_world_size, device, backend)
    log.info("rank %d/%d (local %d) on %s, backend %s", rank, world_size, local_rank, device, backend)
    return _ENV


def teardown_distributed(*, clean: bool = True) -> None:
    """Barrier (when ``clean``) then ``destroy_process_group``; a no-op when not initialized."""
    global _ENV
    if not dist.is_initialized():
        _ENV = None
        return
    backend = str(dist.get_backend())
    placement.reset_check_groups()
    try:
        if clean:
            dist.barrier()
            dist.destroy_process_group()
        elif "nccl" in backend:
            dist.destroy_process_group()
        # gloo after a failure: leave the group to process exit (see module docstring)
    except Exception as exc:  # noqa: BLE001 - teardown must not mask the real error
        log.warning("process group teardown failed: %s", exc)
    finally:
        _ENV = None


@contextlib.contextmanager
def distributed_session(
    device_type: str | None = None, *, timeout_s: float = 600.0, init_method: str | None = None
) -> Iterator[DistEnv]:
    """``with distributed_session("cpu") as env: ...``: init, then teardown in ``finally``."""
    env = init_distributed(device_type, timeout_s=timeout_s, init_method=init_method)
    clean = False
    try:
        yield env
        clean = True
    finally:
        teardown_distributed(clean=clean)
