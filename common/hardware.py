"""Per-device peak figures used for MFU and by the analytic estimator.

All FLOP/s figures are *dense* tensor-core peaks (no 2:4 structured sparsity), per GPU, from
the vendors' datasheets:
- H100 SXM5 80 GB: NVIDIA H100 Tensor Core GPU datasheet: BF16 989 TFLOP/s, FP8 1979 TFLOP/s,
  TF32 495 TFLOP/s dense (the datasheet's 1979/3958 headline figures are with sparsity);
  HBM3 3.35 TB/s; NVLink 4 900 GB/s total bidirectional per GPU (450 GB/s each way).
- H200 SXM 141 GB: NVIDIA H200 datasheet: same tensor cores as H100 SXM (BF16 989, FP8 1979
  dense); HBM3e 4.8 TB/s; NVLink 900 GB/s bidirectional.
- A100 SXM4 80 GB: NVIDIA A100 datasheet: BF16 312 TFLOP/s, TF32 156 dense; no FP8;
  HBM2e 2.039 TB/s; NVLink 3 600 GB/s bidirectional.
- H100 96 GB (HBM2e) at 500 W, the GPU of torchtitan's benchmarks (pytorch/torchtitan
  benchmarks/llama3_h100_202412_torchtitan.md, "Hardware": 96 GB HBM2e at 2.4 TB/s, NVLink, 400 Gb/s
  RDMA per GPU, the default 500 W power limit). Its dense peak at that power is not published (the
  file's footnote: "between SXM and NVL, and we don't know its exact value"), so the SXM figures stand
  for the tensor cores: an upper bound on the clocks.
- H800 SXM5 80 GB: the H100 SXM die with NVLink cut to 400 GB/s bidirectional (DeepSeek-AI, "Insights
  into DeepSeek-V3", arXiv:2505.09343, the cluster DeepSeek-V3 trained on; the 400 GB/s figure as read
  in philisun.com's "NVIDIA H800 vs H100" comparison); tensor cores, HBM3 and PCIe as the H100 SXM's.
Network figures are per-GPU NIC: 400 Gb/s InfiniBand NDR (50 GB/s) for H100/H200 systems,
200 Gb/s HDR (25 GB/s) for A100 systems (DGX H100 / DGX A100 reference architectures).

Figures the analytic estimator (``analysis/estimator/``) also uses:
- FP32 without tensor cores (what PyTorch runs when TF32 is off, its default for matmuls):
  H100/H200 SXM 67 TFLOP/s, A100 19.5 TFLOP/s (same datasheets). FP16 tensor-core peaks equal
  the BF16 ones on all three.
- Host link: PCIe Gen5 x16 on H100/H200 SXM (128 GB/s bidirectional, 64 GB/s each way), PCIe Gen4
  x16 on A100 SXM4 (64 GB/s bidirectional, 32 GB/s each way) (same datasheets).
- Host memory per GPU: DGX H100 and DGX H200 ship 2 TB of system memory for 8 GPUs (256 GiB per
  GPU); DGX A100 ships 1 TB for 8 (128 GiB per GPU) (DGX user guides). 8 GPUs per node on all.
- ``family``: the tensor-core generation (ampere: A100; hopper: H100, H200); the estimator's fitted
  GEMM efficiency is per family (docs/estimator.md).

``SYSTEMS`` are whole machines: a device with the interconnect of the cluster it was measured on
(each entry names its source). Published measurements (analysis/published/) name one.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class DeviceSpec:
    name: str
    bf16_tflops: float  # dense
    fp8_tflops: float | None  # dense; None where the tensor cores have no FP8
    tf32_tflops: float  # dense
    hbm_gib: float
    hbm_tb_s: float
    nvlink_gb_s: float  # total bidirectional per GPU, as datasheets quote it
    network_gb_s: float  # per GPU, one direction
    fp32_tflops: float  # without tensor cores (TF32 off)
    pcie_gb_s: float  # host link, one direction
    host_mem_gib: float  # system memory per GPU, for activation offload
    gpus_per_node: int = 8
    family: str = "hopper"  # tensor-core generation: ampere or hopper

    @property
    def fp16_tflops(self) -> float:
        return self.bf16_tflops  # equal on every device in the table

    @property
    def nvlink_one_way_gb_s(self) -> float:
        return self.nvlink_gb_s / 2


DEVICES: dict[str, DeviceSpec] = {
    "H100": DeviceSpec(
        "H100 SXM5 80GB", 989.0, 1979.0, 495.0, 80.0, 3.35, 900.0, 50.0,
        fp32_tflops=67.0, pcie_gb_s=64.0, host_mem_gib=256.0,
    ),
    "H200": DeviceSpec(
        "H200 SXM 141GB", 989.0, 1979.0, 495.0, 141.0, 4.8, 900.0, 50.0,
        fp32_tflops=67.0, pcie_gb_s=64.0, host_mem_gib=256.0,
    ),
    "H100-96GB": DeviceSpec(
        "H100 96GB HBM2e (500 W)", 989.0, 1979.0, 495.0, 96.0, 2.4, 900.0, 50.0,
        fp32_tflops=67.0, pcie_gb_s=64.0, host_mem_gib=256.0,
    ),
    "H800": DeviceSpec(
        "H800 SXM5 80GB", 989.0, 1979.0, 495.0, 80.0, 3.35, 400.0, 50.0,
        fp32_tflops=67.0, pcie_gb_s=64.0, host_mem_gib=256.0,
    ),
    "A100": DeviceSpec(
        "A100 SXM4 80GB", 312.0, None, 156.0, 80.0, 2.039, 600.0, 25.0,
        fp32_tflops=19.5, pcie_gb_s=32.0, host_mem_gib=128.0, family="ampere",
    ),
}


@dataclass(frozen=True)
class System:
    """A cluster as a published measurement ran on it: the device, its interconnect, and the source."""

    name: str
    device: DeviceSpec
    source: str


SYSTEMS: dict[str, System] = {
    # 8 A100 80GB per DGX node on NVLink 3 + NVSwitch; 8 HDR 200 Gb/s InfiniBand HCAs per node for
    # application traffic = 25 GB/s per GPU each way.
    "selene": System("Selene (DGX A100 80GB, 8x HDR 200 Gb/s per node)", DEVICES["A100"],
                     "Narayanan et al. 2021, section 5: 'eight NVIDIA Mellanox 200Gbps HDR Infiniband HCAs' per node"),
    # 1600 Gb/s per 8-GPU node over RoCE = 200 GB/s per node = 25 GB/s per GPU.
    "mosaicml-a100": System("MosaicML A100 80GB, 1600 Gb/s RoCE per node", DEVICES["A100"],
                            "llm-foundry scripts/train/benchmarking/README.md, table heading 'A100 80GB with 1600 "
                            "Gbps node-node interconnect (RoCE)'"),
    # The H100 tables do not name the interconnect; taken as a DGX H100's 8 x 400 Gb/s NDR per node.
    "mosaicml-h100": System("MosaicML H100 80GB (interconnect not stated: DGX H100 NDR assumed)", DEVICES["H100"],
                            "llm-foundry scripts/train/benchmarking/README.md, tables 'H100 80GB BF16' and 'FP8'"),
    # DGX H100: NVLink 4 (900 GB/s bidirectional per GPU), 8 ConnectX-7 400 Gb/s NDR per node = 50 GB/s per GPU.
    "dgx-h100": System("DGX H100 (NVLink 4, 8x NDR 400 Gb/s per node)", DEVICES["H100"],
                       "NeMo performance summary 'System: DGX-H100'; DGX H100 datasheet for its links"),
    # Meta's Grand Teton: 8 H100 80GB HBM3 (700 W) per server on NVLink, RoCE at 400 Gb/s per GPU.
    "grand-teton": System("Grand Teton H100 80GB, RoCE 400 Gb/s per GPU", DEVICES["H100"],
                          "The Llama 3 Herd of Models, section 3.3.1"),
    # torchtitan's benchmark machines: the same platform with H100 96GB HBM2e (2.4 TB/s) at a 500 W cap;
    # the dense peak at 500 W is not published (between the SXM and NVL figures), so the SXM figure stands.
    "grand-teton-96gb-500w": System("Grand Teton H100 96GB HBM2e at 500 W, RDMA 400 Gb/s per GPU", DEVICES["H100-96GB"],
                                    "torchtitan benchmarks/llama3_h100_202412_torchtitan.md, 'Hardware'"),
}


def lookup_device(device_name: str) -> DeviceSpec | None:
    """Match a torch.cuda.get_device_name() string ('NVIDIA H100 80GB HBM3') to the table."""
    upper = device_name.upper()
    for key, spec in DEVICES.items():
        if key in upper:
            return spec
    return None


def peak_tflops_for(device_name: str, precision_mode: str) -> tuple[float | None, str]:
    """Dense peak TFLOP/s to divide achieved FLOP/s by, and a short reason for the log.

    Returns (None, reason) when MFU is not meaningful: unknown device, CPU, or FP8, where
    GEMMs run at the FP8 rate while attention and norms run at BF16, so no single peak applies.
    """
    if precision_mode == "fp8":
        return None, "MFU n/a: fp8 mixes FP8 and BF16 tensor-core rates"
    spec = lookup_device(device_name)
    if spec is None:
        return None, f"MFU n/a: no peak known for device {device_name!r} (set train.peak_tflops)"
    if precision_mode == "fp32":
        return spec.tf32_tflops, f"peak {spec.tf32_tflops:g} TFLOP/s (dense TF32, {spec.name})"
    return spec.bf16_tflops, f"peak {spec.bf16_tflops:g} TFLOP/s (dense BF16, {spec.name})"
