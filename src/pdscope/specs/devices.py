"""The device catalog (``data/devices.toml``) and user-described devices."""

from __future__ import annotations

import math
import tomllib
from dataclasses import dataclass, replace
from functools import cache
from importlib import resources

from pdscope.specs.errors import SpecError, unknown_name

GIB = 1024**3


@dataclass(frozen=True)
class Device:
    """Peak figures of one device. ``None`` means unknown (the catalog does not list it)."""

    name: str
    bandwidth_gb_s: float
    # The advertised "GB" figure, read as GiB (see memory_bytes); named as the catalog and
    # the JSON output name it.
    memory_gb: float | None = None
    tflops_bf16: float | None = None
    tflops_fp8: float | None = None
    kind: str = "gpu"
    label: str = ""  # display name, e.g. "NVIDIA H100 SXM"
    aliases: tuple[str, ...] = ()
    source: str = ""

    @property
    def bandwidth_bytes_s(self) -> float:
        return self.bandwidth_gb_s * 1e9

    @property
    def memory_bytes(self) -> float | None:
        """Accelerator memory in bytes; the advertised "GB" figure is read as GiB (see catalog)."""
        return None if self.memory_gb is None else self.memory_gb * GIB

    def peak_flops(self, compute: str = "bf16") -> float | None:
        """Dense peak FLOP/s for the compute type (fp8 weights use fp8 tensor cores if any)."""
        tflops = self.tflops_fp8 if compute == "fp8" and self.tflops_fp8 else self.tflops_bf16
        return None if tflops is None else tflops * 1e12

    def ridge_flops_per_byte(self, compute: str = "bf16") -> float | None:
        """Arithmetic intensity where the roofline turns from memory-bound to compute-bound."""
        peak = self.peak_flops(compute)
        return None if peak is None else peak / self.bandwidth_bytes_s


def _check_positive(label: str, value: float | None) -> None:
    if value is not None and (not math.isfinite(value) or value <= 0):
        raise SpecError(f"{label} must be a positive number, got {value}")


@cache
def catalog() -> tuple[Device, ...]:
    """Every catalog device, in file order (the seed article's six first)."""
    text = resources.files("pdscope.specs").joinpath("data/devices.toml").read_text()
    entries = tomllib.loads(text)["device"]
    return tuple(
        Device(
            name=e["name"],
            bandwidth_gb_s=float(e["bandwidth_gb_s"]),
            memory_gb=e.get("memory_gb"),
            tflops_bf16=e.get("tflops_bf16"),
            tflops_fp8=e.get("tflops_fp8"),
            kind=e.get("kind", "gpu"),
            label=e.get("label", e["name"]),
            aliases=tuple(e.get("aliases", [])),
            source=e.get("source", ""),
        )
        for e in entries
    )


SEED_DEVICES = ("cpu-ddr5-5600x2", "a10g", "l40s", "rtx-4090", "a100-80gb-sxm", "h100-sxm")


def get_device(name: str) -> Device:
    """A catalog device by name or alias (case-insensitive)."""
    wanted = name.lower()
    names: list[str] = []
    for device in catalog():
        keys = [device.name, *device.aliases]
        if wanted in (k.lower() for k in keys):
            return device
        names.extend(keys)
    raise unknown_name("device", name, names)


def resolve_device(
    name: str | None,
    bandwidth_gb_s: float | None = None,
    tflops: float | None = None,
    memory_gb: float | None = None,
) -> Device:
    """A catalog device, with any of its figures overridden by flags, or a user device.

    With no name, the flags describe a device named ``custom``; bandwidth is then required.
    """
    for label, value in (
        ("--bandwidth", bandwidth_gb_s),
        ("--tflops", tflops),
        ("--memory", memory_gb),
    ):
        _check_positive(label, value)
    if name is None:
        if bandwidth_gb_s is None:
            raise SpecError("a custom device needs --bandwidth (GB/s); or name one with --device")
        return Device(
            name="custom",
            bandwidth_gb_s=bandwidth_gb_s,
            memory_gb=memory_gb,
            tflops_bf16=tflops,
            kind="custom",
            label="custom device",
            source="given on the command line",
        )
    device = get_device(name)
    changes: dict[str, float] = {}
    if bandwidth_gb_s is not None:
        changes["bandwidth_gb_s"] = bandwidth_gb_s
    if tflops is not None:
        changes["tflops_bf16"] = tflops
        changes["tflops_fp8"] = tflops
    if memory_gb is not None:
        changes["memory_gb"] = memory_gb
    if changes:
        device = replace(
            device, source=f"{device.source}; overridden: {sorted(changes)}", **changes
        )
    return device
