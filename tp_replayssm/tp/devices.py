"""Which device a rank's tensors belong on: the one place that resolves a device argument.

- :func:`resolve_device`: ``None`` is the rank's current device (the current CUDA device where CUDA is available,
  else the CPU); ``"cuda"`` without an index is the current CUDA device; a CUDA device on a machine without CUDA, or
  an index past the visible devices, is a ``ValueError`` that says so; ``"cpu:0"`` is ``"cpu"`` (torch's CPU tensors
  carry no index).
- :func:`current_cuda_device`: the current CUDA device, or None without CUDA (the placement check's hook; tests
  patch it to emulate ``cuda:N`` on a CPU machine).
- :func:`device_key`: the identity of a physical CUDA device (its UUID where visible), so two ranks that see their
  GPUs as ``cuda:0`` through ``CUDA_VISIBLE_DEVICES`` are not taken for one.
"""

from __future__ import annotations

import functools
import socket

import torch

__all__ = ["current_cuda_device", "device_key", "hostname", "resolve_device"]


def current_cuda_device() -> torch.device | None:
    """``cuda:<torch.cuda.current_device()>``, or None on a machine without CUDA."""
    if not torch.cuda.is_available():
        return None
    return torch.device("cuda", torch.cuda.current_device())


def resolve_device(device: torch.device | str | int | None, where: str = "device", *,
                   strict: bool = True) -> torch.device:
    """The device ``device`` names for this rank (module docstring). ``strict=False`` only fills in a missing CUDA
    index and never raises on CUDA devices this process cannot see (the placement check reports those itself)."""
    if device is None:
        cur = current_cuda_device()
        return cur if cur is not None else torch.device("cpu")
    if isinstance(device, int) and not isinstance(device, bool) and device >= 0:
        device = torch.device("cuda", device)  # an index names a CUDA device (as torch.device(0) does with CUDA)
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ValueError(f"{where}: `device` must name a torch device; got {device!r} ({exc})") from None
    if dev.type == "cuda":
        cur = current_cuda_device()
        if not strict:
            return cur if dev.index is None and cur is not None else dev
        if cur is None:
            raise ValueError(f"{where}: `device` is {dev} but this machine has no CUDA device "
                             "(torch.cuda.is_available() is False); use device='cpu' or leave it None")
        if dev.index is None:
            return cur
        if dev.index >= torch.cuda.device_count():
            raise ValueError(f"{where}: `device` is {dev} but only {torch.cuda.device_count()} CUDA device(s) are "
                             "visible")
        return dev
    if dev.type == "cpu":  # torch puts every CPU tensor on "cpu" (no index): "cpu:0" names the same device
        return torch.device("cpu")
    if strict and dev.type != "meta":  # (meta: tensors without data, for shape and placement checks)
        raise ValueError(f"{where}: `device` must be a cpu or cuda device; got {dev}")
    return dev


@functools.lru_cache(maxsize=1)
def hostname() -> str:
    return socket.gethostname()


def device_key(host: str, device: torch.device) -> str:
    """Identity of a CUDA device (UUID where visible, else ``host/cuda:N``); "" for other devices."""
    if device.type != "cuda":
        return ""
    if torch.cuda.is_available() and device.index is not None and device.index < torch.cuda.device_count():
        try:
            return f"uuid:{torch.cuda.get_device_properties(device.index).uuid}"
        except Exception:  # noqa: BLE001 - fall back to the index
            pass
    return f"{host}/{device}"
