"""Accelerators the planner and MFU know: dense peaks, memory and link bandwidths."""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

from jaxshard.errors import ConfigError
from jaxshard.options import flag, option

GB = 1e9


@dataclass(frozen=True)
class Device:
    """An accelerator in a typical 8-GPU host: what the time model prices work and transfers at.

    Every number is a physical quantity with its source in :data:`SOURCES`; none is fitted.
    Datasheet figures are ceilings; where a measurement of what is achieved is published (a
    large matmul, a stream over HBM, NCCL's ring bus bandwidth) the time model uses that."""

    name: str
    memory: float  # bytes
    bf16_tflops: float  # dense datasheet peak
    fp32_tflops: float  # TF32 tensor cores where the device has them
    intra_host_gbs: float  # NVLink (or PCIe) GB/s per device, one direction
    inter_host_gbs: float  # network GB/s per device, one direction (one NIC per GPU: 400 Gb/s NDR = 50 GB/s)
    per_host: int
    # The rate a large bf16 matmul of a transformer layer's shapes runs at, measured; None where
    # no measurement is published (the dense peak is then the ceiling, an upper bound).
    matmul_tflops: float | None = None
    hbm_gbs: float | None = None  # HBM bandwidth, GB/s (datasheet)
    hbm_achieved_gbs: float | None = None  # measured: BabelStream's triad
    intra_busbw_gbs: float | None = None  # measured: nccl-tests ring bus bandwidth within a host
    inter_busbw_gbs: float | None = None  # measured: per device across hosts
    note: str = ""  # what sets this device apart (a power limit, a cloud's network)
    fp8_tflops: float | None = None  # dense float8 tensor-core peak; None: no float8 tensor cores

    def peak(self, compute_dtype: str, fp8: bool = False) -> float:
        """The dense peak matmuls run at: float8's where ``fp8`` (``--fp8``) and the device has
        float8 tensor cores (elsewhere XLA computes float8 dots in a wider type), else the
        compute dtype's."""
        if fp8 and self.fp8_tflops is not None:
            return 1e12 * self.fp8_tflops
        return 1e12 * (self.bf16_tflops if compute_dtype != "float32" else self.fp32_tflops)

    def matmul_flops(self, compute_dtype: str) -> float:
        """FLOP/s of a large matmul: the measured ceiling (scaled with the peak for float32's
        TF32), or the peak where none is published."""
        if self.matmul_tflops is None:
            return self.peak(compute_dtype)
        return self.peak(compute_dtype) * self.matmul_tflops / self.bf16_tflops

    @property
    def hbm(self) -> float | None:
        """Bytes/s a stream over HBM moves: measured, else the datasheet's (None if neither)."""
        gbs = self.hbm_achieved_gbs or self.hbm_gbs
        return None if gbs is None else gbs * GB

    @property
    def intra(self) -> float:
        """Bytes/s a ring within a host moves per device: NCCL's measured bus bandwidth, else NVLink's."""
        return (self.intra_busbw_gbs or self.intra_host_gbs) * GB

    @property
    def inter(self) -> float:
        """Bytes/s per device across hosts: measured, else the NIC's line rate."""
        return (self.inter_busbw_gbs or self.inter_host_gbs) * GB


_H100 = dict(matmul_tflops=794.5, intra_busbw_gbs=367.2, fp8_tflops=1979)
# Dense (no sparsity) datasheet peaks; typical 8-GPU HGX/DGX hosts (sources below).
KNOWN_DEVICES = {
    "h100": Device("h100", 80 * GB, 989, 494, 450, 50, 8, hbm_gbs=3350, hbm_achieved_gbs=2970,
                   inter_busbw_gbs=47, **_H100),
    "h100-hbm2e-500w": Device("h100-hbm2e-500w", 96 * GB, 989, 494, 450, 50, 8, hbm_gbs=2400,
                              inter_busbw_gbs=47, note="Meta's Grand Teton H100 (torchtitan's benchmarks): "
                              "96 GB HBM2e at 2.4 TB/s, 500 W power limit (700 W TDP); its matmul rate at "
                              "500 W is not published, so the 700 W MAMF stands (an upper bound)", **_H100),
    "h100-a3-high": Device("h100-a3-high", 80 * GB, 989, 494, 450, 12.5, 8, hbm_gbs=3350, hbm_achieved_gbs=2970,
                           inter_busbw_gbs=41.33 / 8, note="Google Cloud A3 High (a3-highgpu-8g): 4 x 200 Gb/s "
                           "GPUDirect-TCPX NICs for 8 GPUs", **_H100),
    "h200": Device("h200", 141 * GB, 989, 494, 450, 50, 8, hbm_gbs=4800, hbm_achieved_gbs=4150,
                   inter_busbw_gbs=47, **_H100),
    "a100-80gb": Device("a100-80gb", 80 * GB, 312, 156, 300, 25, 8, matmul_tflops=250, hbm_gbs=2039,
                        hbm_achieved_gbs=1700, intra_busbw_gbs=234.9, inter_busbw_gbs=24),
    "a100-40gb": Device("a100-40gb", 40 * GB, 312, 156, 300, 25, 8, matmul_tflops=250, hbm_gbs=1555,
                        hbm_achieved_gbs=1378, intra_busbw_gbs=234.9, inter_busbw_gbs=24),
    "v100": Device("v100", 32 * GB, 125, 15.7, 150, 12.5, 8, hbm_gbs=900),
}

ML_ENGINEERING = "S. Bekman, Machine Learning Engineering (github.com/stas00/ml-engineering, commit 744d01e)"
SOURCES = {
    "bf16_tflops, fp32_tflops, memory, hbm_gbs": "NVIDIA datasheets: A100 Tensor Core GPU (SXM4: 312 "
        "TFLOPS bf16, 156 TF32, 1,555 GB/s 40 GB, 2,039 GB/s 80 GB), H100 Tensor Core GPU (SXM5: 989 bf16, "
        "494 TF32, 3.35 TB/s), H200 (SXM: 989 bf16, 4.8 TB/s, 141 GB), V100 (SXM2: 125 tensor, 15.7 fp32, "
        "900 GB/s); h100-hbm2e-500w: torchtitan docs/performance.md (Grand Teton: 96 GB HBM2e, 2.4 TB/s, "
        "500 W)",
    "fp8_tflops": "NVIDIA datasheets, dense (half the 'with sparsity' figure): H100 SXM5 3,958 -> 1,979 TFLOPS "
                  "FP8, H200 SXM the same; A100 and V100 have no float8 tensor cores",
    "intra_host_gbs": "NVLink per GPU, half the datasheets' bidirectional total: V100 300 GB/s, A100 600, "
                      "H100/H200 900",
    "inter_host_gbs": "one NIC per GPU as in DGX systems: DGX A100 8 x 200 Gb/s HDR (25 GB/s), DGX H100 8 x "
                      "400 Gb/s NDR (50 GB/s), DGX-2 8 x 100 Gb/s EDR (12.5 GB/s); Google Cloud A3 High: "
                      "4 x 200 Gb/s for 8 GPUs (12.5 GB/s) (" + ML_ENGINEERING + ", network/README.md)",
    "matmul_tflops": "bf16 matmuls of transformer layers' shapes, measured. A100 SXM4-80GB: 245-254 TFLOP/s "
                     "at M 16384-32768 tokens, K and N 4096-16384 (NVIDIA ai-dynamo/aiconfigurator, "
                     "systems/data/a100_sxm/gemm/sglang/0.5.10/gemm_perf.parquet, commit 4fabb77): 250, "
                     "below the best shape's 271.2 (Maximum Achievable Matmul FLOPS, mamf-finder.py, "
                     + ML_ENGINEERING + ", compute/accelerator/README.md). H100 SXM: the best shape's "
                     "794.5 (same table; 'H200 is the same'), which the same shapes reach too (776-801, "
                     "aiconfigurator h100_sxm trtllm 1.3.0rc20). None for V100",
    "hbm_achieved_gbs": "BabelStream triad, measured: A100 SXM 80GB 1.70 TB/s, H100 SXM 2.97, H200 4.15 "
                        "(Azure/AI-benchmarking-guide, Azure_Results/ND_A100_v4, ND_H100_v5, ND_H200_v5); "
                        "A100-SXM4-40GB 1.378 (argonne-lcf/ALCFBeginnersGuide, polaris/02_profiling.md)",
    "intra_busbw_gbs": "nccl-tests ring bus bandwidth, 8 GPUs, 16 GiB: A100 all-reduce 234.89 GB/s; H100/H200 "
                       "(NVLink4) all-reduce with NCCL_NVLS_ENABLE=0 367.2, all-gather 361.4, reduce-scatter "
                       "362.9 (" + ML_ENGINEERING + ", network/README.md); NCCL's maintainer: ~370 on NVLink4 "
                       "after the ring protocol's ~20% (NVIDIA/nccl-tests issue 212)",
    "inter_busbw_gbs": "per NIC, NCCL across hosts: HDR 200 Gb/s 24 GB/s (DGX A100: 192 GB/s all-reduce bus "
                       "bandwidth over 8 NICs, NVIDIA/nccl issue 812), NDR 400 Gb/s 46-48 GB/s (NVIDIA/nccl-tests "
                       "issue 290); A3 High (TCPX): all-gather bus bandwidth 41.33 GB/s per VM over 2 VMs "
                       "(GoogleCloudPlatform/cluster-toolkit PR 3644), over its 8 GPUs",
}


@dataclass(frozen=True, slots=True)
class PeakConfig:
    """The dense peak a run's MFU divides by: a known device's, or a number."""

    device: str | None = option(None, "accelerator for MFU: " + ", ".join(KNOWN_DEVICES),
                                default_text="detected on GPUs; none on CPU", run_only=True)
    peak_tflops: float | None = option(None, "dense peak TFLOP/s per device for MFU (overrides --device)",
                                       run_only=True)

    def __post_init__(self) -> None:
        if self.device is not None and self.device.lower() not in KNOWN_DEVICES:
            raise ConfigError(f"unknown {flag(PeakConfig, 'device')} '{self.device}'; known: "
                              f"{', '.join(KNOWN_DEVICES)} (or give {flag(PeakConfig, 'peak_tflops')})")
        if self.peak_tflops is not None and self.peak_tflops <= 0:
            raise ConfigError(f"{flag(PeakConfig, 'peak_tflops')} must be > 0, got {self.peak_tflops}")


def device_spec(name: str | None, *, memory: float | None = None, peak_tflops: float | None = None,
                intra_gbs: float | None = None, inter_gbs: float | None = None,
                per_host: int | None = None, hbm_gbs: float | None = None) -> Device:
    """A known device, with any of its numbers overridden; or one described wholly by flags."""
    if name is not None:
        key = name.lower()
        if key not in KNOWN_DEVICES:
            raise ConfigError(f"unknown device '{name}'; known: {', '.join(KNOWN_DEVICES)} "
                              "(or give --peak-tflops, --intra-bw, --inter-bw, --hbm-bw and --device-memory "
                              "instead of --device)")
        base = KNOWN_DEVICES[key]
    else:
        missing = [f for f, v in (("--peak-tflops", peak_tflops), ("--intra-bw", intra_gbs),
                                  ("--inter-bw", inter_gbs), ("--hbm-bw", hbm_gbs),
                                  ("--device-memory", memory)) if v is None]
        if missing:
            raise ConfigError(f"without --device, give {', '.join(missing)} (no silent defaults); "
                              f"known devices: {', '.join(KNOWN_DEVICES)}")
        base = Device("custom", memory, peak_tflops, peak_tflops, intra_gbs, inter_gbs, per_host or 8)
    # A figure given by flags replaces the measured one too: it is no longer that device.
    return replace(base, memory=memory or base.memory, bf16_tflops=peak_tflops or base.bf16_tflops,
                   fp32_tflops=peak_tflops or base.fp32_tflops, intra_host_gbs=intra_gbs or base.intra_host_gbs,
                   inter_host_gbs=inter_gbs or base.inter_host_gbs, per_host=per_host or base.per_host,
                   matmul_tflops=None if peak_tflops else base.matmul_tflops,
                   intra_busbw_gbs=None if intra_gbs else base.intra_busbw_gbs,
                   inter_busbw_gbs=None if inter_gbs else base.inter_busbw_gbs,
                   hbm_gbs=hbm_gbs or base.hbm_gbs, hbm_achieved_gbs=None if hbm_gbs else base.hbm_achieved_gbs)


def detect_device(device_kind: str, memory_bytes: float | None = None) -> Device | None:
    """The known device a backend's ``device_kind`` names ('NVIDIA H100 80GB HBM3'), if any."""
    kind = device_kind.lower()
    for key in ("h200", "h100", "v100"):
        if key in kind:
            return KNOWN_DEVICES[key]
    if "a100" in kind:
        big = "80gb" in kind or (memory_bytes or 0) > 50 * GB
        return KNOWN_DEVICES["a100-80gb" if big else "a100-40gb"]
    return None


def parse_bytes(text: str) -> float:
    """'80GB', '80 GiB', '1.5e9' -> bytes."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d*)?|\.\d+)(e\d+)?\s*([kmgt]i?b?|b)?\s*", text.lower())
    if m is None:
        raise ConfigError(f"cannot read a size from '{text}' (e.g. 80GB)")
    unit = (m[3] or "b").rstrip("b") or "b"
    scale = {"b": 1, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12,
             "ki": 2**10, "mi": 2**20, "gi": 2**30, "ti": 2**40}[unit]
    return float(m[1] + (m[2] or "")) * scale


def known_device(device: str | None, backend_device: object | None = None) -> Device | None:
    """The device a run is on, where it is known: a named ``--device``, or a recognised GPU."""
    if device is not None:
        return device_spec(device)
    kind = getattr(backend_device, "device_kind", "")
    if getattr(backend_device, "platform", "") == "gpu":
        return detect_device(kind)
    return None


def peak_flops(device: str | None, peak_tflops: float | None, compute_dtype: str,
               backend_device: object | None = None, fp8: bool = False) -> tuple[float | None, str]:
    """Dense peak FLOP/s of one device for MFU, and where the number came from. Never a guess:
    an explicit --peak-tflops, a named --device, a recognised GPU, or nothing. ``fp8``: the
    blocks' matmuls run in float8 (``--fp8``): the float8 peak where the device has one."""
    if peak_tflops is not None:
        return peak_tflops * 1e12, "--peak-tflops"
    found = known_device(device, backend_device)
    if found is None:
        return None, "unknown (give --peak-tflops or --device for MFU)"
    kind = " float8" if fp8 and found.fp8_tflops is not None else ""
    if device is not None:
        return found.peak(compute_dtype, fp8), f"--device {found.name}{kind}"
    return found.peak(compute_dtype, fp8), (f"detected {found.name}{kind} "
                                            f"({getattr(backend_device, 'device_kind', '')})")
