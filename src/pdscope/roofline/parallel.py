"""Tensor parallelism on the roofline: a dense model split T ways, and what the split costs.

Megatron-style TP gives each of T GPUs 1/T of every matmul (attention heads and MLP columns
split, the LM head split by vocabulary), so each GPU reads 1/T of the weights and does 1/T of
the FLOPs. The KV cache splits by KV head: with fewer KV heads than GPUs the heads are copied
(vLLM replicates them), so the KV split is ``min(T, kv_heads)``; MLA's latent is one shared
vector per token and is not split at all. The price is two all-reduces of the step's
activations per layer (after the attention output projection and after the MLP), each timed on
the GPUs' link as a ring: ``latency + 2 (T - 1) / T x bytes / bandwidth``.

Link figures are per GPU and per direction, the vendors' peaks; the latency is one collective
call's fixed cost (launch and synchronisation), an assumption stated in docs/disaggregation.md
and overridable (``--tp-link-gb-s``, ``--tp-link-latency-us``).
"""

from __future__ import annotations

from dataclasses import dataclass

from pdscope.roofline.arithmetic import weight_bytes
from pdscope.specs import Device, ModelSpec, SpecError, WeightPrecision
from pdscope.specs.devices import GIB


@dataclass(frozen=True)
class Link:
    """A GPU-to-GPU link: bandwidth per GPU per direction, and one collective's fixed cost."""

    name: str
    bandwidth_gb_s: float
    latency_s: float
    label: str = ""

    def __post_init__(self) -> None:
        if not self.bandwidth_gb_s > 0:
            raise SpecError(f"link bandwidth must be > 0 GB/s, got {self.bandwidth_gb_s}")
        if self.latency_s < 0:
            raise SpecError(f"link latency must be >= 0, got {self.latency_s}")

    @property
    def bandwidth_bytes_s(self) -> float:
        return self.bandwidth_gb_s * 1e9


# Peaks per GPU and direction (half the bidirectional figures vendors quote).
LINKS: dict[str, Link] = {
    link.name: link
    for link in (
        Link("nvlink3", 300.0, 10e-6, "NVLink 3 (A100 SXM: 600 GB/s both ways)"),
        Link("nvlink4", 450.0, 10e-6, "NVLink 4 (H100/H200 SXM: 900 GB/s both ways)"),
        Link("nvlink5", 900.0, 10e-6, "NVLink 5 (B200: 1.8 TB/s both ways)"),
        Link("xgmi", 448.0, 10e-6, "AMD Infinity Fabric (MI300X/MI325X: 7 x 64 GB/s)"),
        Link("gaudi3-roce", 525.0, 15e-6, "Gaudi 3 scale-up RoCE (21 x 200 GbE)"),
        Link("pcie4", 32.0, 20e-6, "PCIe 4.0 x16"),
        Link("pcie5", 64.0, 20e-6, "PCIe 5.0 x16"),
    )
}

# The link a catalog device's GPUs usually share inside one server.
DEVICE_LINKS: dict[str, str] = {
    "a100-80gb-sxm": "nvlink3",
    "a100-40gb": "nvlink3",
    "h100-sxm": "nvlink4",
    "h200": "nvlink4",
    "b200": "nvlink5",
    "mi300x": "xgmi",
    "mi325x": "xgmi",
    "gaudi3": "gaudi3-roce",
    "h100-pcie": "pcie5",
    "rtx-5090": "pcie5",
}
DEFAULT_LINK = "pcie4"


def default_link(device: Device) -> Link:
    """The catalog's link for ``device``; PCIe 4.0 for anything the table does not name."""
    return LINKS[DEVICE_LINKS.get(device.name, DEFAULT_LINK)]


def ring_allreduce_s(nbytes: float, size: int, link: Link) -> float:
    """One ring all-reduce of ``nbytes`` per GPU over ``size`` GPUs (0 for one GPU): each GPU
    sends and receives 2 (T - 1) / T of the buffer, plus one fixed latency."""
    if size <= 1:
        return 0.0
    return link.latency_s + 2 * (size - 1) / size * nbytes / link.bandwidth_bytes_s


@dataclass(frozen=True)
class TensorParallel:
    """How one replica's model is split. ``size`` 1 (the default) is no split and no cost."""

    size: int = 1
    kv_split: int = 1  # ways the KV cache and its reads split: min(T, KV heads); 1 for MLA
    link: Link | None = None
    activation_bytes: int = 2  # 16-bit activations, whatever the weights' precision

    def comm_s(self, model: ModelSpec, tokens: int) -> float:
        """Two all-reduces per layer of the step's ``tokens`` activations (hidden_size each)."""
        if self.size == 1 or self.link is None:
            return 0.0
        nbytes = tokens * model.hidden_size * self.activation_bytes
        return 2 * model.num_layers * ring_allreduce_s(nbytes, self.size, self.link)


NO_TP = TensorParallel()  # one GPU: the cost model's default


def _kv_heads(model: ModelSpec) -> int | None:
    """KV heads of the first layer, or None for MLA (a latent shared by every head)."""
    layer = model.layers[0]
    if layer.decode_attention is not None:
        return None
    return max(1, layer.kv_values_per_token // (2 * layer.attention.qk_head_dim))


def tensor_parallel(model: ModelSpec, size: int, link: Link | None) -> TensorParallel:
    """Check that ``model`` splits ``size`` ways as vLLM would allow, and describe the split."""
    if size < 1:
        raise SpecError(f"--tensor-parallel-size must be >= 1, got {size}")
    if size == 1:
        return NO_TP
    if model.is_moe:
        raise SpecError(
            f"--tensor-parallel-size {size}: {model.name} is a mixture of experts; tensor "
            "parallelism is modelled for dense models only"
        )
    heads = model.layers[0].attention.num_heads
    if heads % size:
        raise SpecError(
            f"--tensor-parallel-size {size} does not divide {model.name}'s {heads} attention heads"
        )
    if link is None:
        raise SpecError("tensor parallelism needs a link between the GPUs")
    kv_heads = _kv_heads(model)
    return TensorParallel(size, 1 if kv_heads is None else min(size, kv_heads), link)


@dataclass(frozen=True)
class GpuMemory:
    """One GPU's share of a replica split ``tp.size`` ways."""

    memory_bytes: float
    weight_bytes: float  # this GPU's slice of the weights
    pool_bytes: float  # memory x utilization - weight slice (<= 0: does not fit)
    kv_bytes_per_token: float  # this GPU's slice of one token's KV


def gpu_memory(
    model: ModelSpec,
    device: Device,
    weights: WeightPrecision,
    kv_bytes_per_token: int,
    tp: TensorParallel,
    gpu_memory_utilization: float,
) -> GpuMemory:
    """What one GPU of a TP group holds. Norms are copied on every GPU but are a rounding
    error; the embedding and LM head split by vocabulary like the rest."""
    if device.memory_gb is None:
        raise SpecError(f"device {device.name} has no memory size: pass --memory")
    memory = device.memory_gb * GIB
    slice_bytes = weight_bytes(model, weights) / tp.size
    return GpuMemory(
        memory_bytes=memory,
        weight_bytes=slice_bytes,
        pool_bytes=memory * gpu_memory_utilization - slice_bytes,
        kv_bytes_per_token=kv_bytes_per_token / tp.kv_split,
    )
