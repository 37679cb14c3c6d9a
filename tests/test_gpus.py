"""The GPU catalog (zeroplan.presets.gpus): entries, names, custom GPU files and flags."""

from __future__ import annotations

import json

import pytest

from zeroplan.errors import ZeroplanError
from zeroplan.presets.gpus import _ALIASES, custom_gpu, get_gpu, gpu_names, load_gpu_file
from zeroplan.specs.hardware import ClusterSpec, GpuSpec
from zeroplan.units import GB, GiB, MiB

REQUIRED = [
    "v100-16gb", "v100-32gb", "a100-40gb", "a100-80gb", "h100-80gb", "h200-141gb",
    "b200", "mi300x", "l40s", "a10g", "rtx-4090",
    # Boards often named by published fine-tuning runs.
    "rtx-3090", "rtx-a6000", "a40", "a10", "l40", "l4", "t4", "a100-pcie-40gb", "a100-pcie-80gb", "a800-80gb",
    "h100-pcie", "h100-nvl", "h800-80gb", "v100-pcie-16gb", "v100-pcie-32gb", "mi325x",
]


def _as_dict(gpu: GpuSpec) -> dict:
    return json.loads(gpu.model_dump_json())


def _write(tmp_path, content: str):
    path = tmp_path / "gpu.json"
    path.write_text(content)
    return path


def test_catalog_has_the_required_gpus() -> None:
    assert set(REQUIRED) <= set(gpu_names())
    assert gpu_names() == sorted(gpu_names())


@pytest.mark.parametrize("name", REQUIRED)
def test_every_entry_validates_and_is_consistent(name: str) -> None:
    gpu = get_gpu(name)
    assert GpuSpec.model_validate(_as_dict(gpu)) == gpu
    assert gpu.name == name == name.lower()
    assert isinstance(gpu.memory_bytes, int) and gpu.memory_bytes % MiB == 0
    assert 10 * GiB < gpu.memory_bytes <= 256 * GiB  # the MI325X's 256 GB HBM3E
    assert 50e12 <= gpu.peak_bf16_flops_per_s <= 5e15
    assert gpu.source.strip() and gpu.display_name.strip()
    # The network is never faster than the links inside a node, and latencies are microseconds.
    assert gpu.inter_node_link.bandwidth_bytes_per_s <= gpu.intra_node_link.bandwidth_bytes_per_s
    for link in (gpu.intra_node_link, gpu.inter_node_link, gpu.host_link):
        assert 1e-7 < link.latency_s < 1e-4
    assert gpu.intra_node_link.latency_s <= gpu.inter_node_link.latency_s
    # A cluster of it is valid (the CUDA context fits).
    assert ClusterSpec(gpu=gpu).usable_memory_bytes > 0


@pytest.mark.parametrize(
    "name,memory",
    [
        ("a100-80gb", 85_899_345_920),
        ("a100-40gb", 40 * GiB),
        ("h100-80gb", 81_559 * MiB),
        ("h200-141gb", 143_771 * MiB),
        ("mi300x", 192 * GiB),
        ("l40s", 46_068 * MiB),
        ("a10g", 23_028 * MiB),
        ("rtx-4090", 24_564 * MiB),
        # Published nvidia-smi / NVML totals (GeForce without ECC; data-center GDDR cards with ECC on).
        ("rtx-3090", 24_576 * MiB),
        ("rtx-a6000", 49_140 * MiB),
        ("a10", 24_146_608_128),
        ("l40", 46_068 * MiB),
        ("l4", 23_034 * MiB),
        ("t4", 15_360 * MiB),
        ("h100-pcie", 81_559 * MiB),
        ("h100-nvl", 95_830 * MiB),
        ("a800-80gb", 81_920 * MiB),
        ("v100-pcie-32gb", 32_510 * MiB),
        # Derived (docs/gpus.md): the A40's 49,140 MiB less ECC's 1/16; the MI325X's as the MI300X's.
        ("a40", 46_068 * MiB),
        ("mi325x", 256 * GiB),
    ],
)
def test_memory_is_exact_driver_bytes(name: str, memory: int) -> None:
    assert get_gpu(name).memory_bytes == memory


def test_headline_figures() -> None:
    assert get_gpu("a100-80gb").peak_bf16_flops_per_s == 312e12
    assert get_gpu("h100-80gb").peak_bf16_flops_per_s == 989e12
    assert get_gpu("v100-32gb").peak_bf16_flops_per_s == 125e12
    # NVLink is quoted bidirectionally; the catalog holds one direction.
    assert get_gpu("a100-80gb").intra_node_link.bandwidth_bytes_per_s == 300 * GB
    assert get_gpu("h100-80gb").intra_node_link.bandwidth_bytes_per_s == 450 * GB
    assert get_gpu("a100-80gb").inter_node_link.bandwidth_bytes_per_s == 25 * GB
    assert get_gpu("h100-80gb").inter_node_link.bandwidth_bytes_per_s == 50 * GB
    # Dense figures: half the sparse headline; GeForce's with fp32 accumulate; the T4's fp16.
    assert get_gpu("rtx-3090").peak_bf16_flops_per_s == 71e12
    assert get_gpu("rtx-a6000").peak_bf16_flops_per_s == 154.8e12
    assert get_gpu("h100-pcie").peak_bf16_flops_per_s == 756e12
    assert get_gpu("h100-nvl").peak_bf16_flops_per_s == 835.5e12
    assert get_gpu("l4").peak_bf16_flops_per_s == 121e12
    assert get_gpu("t4").peak_bf16_flops_per_s == 65e12
    # The export parts keep NVSwitch at 400 GB/s bidirectional.
    assert get_gpu("a800-80gb").intra_node_link.bandwidth_bytes_per_s == 200 * GB
    assert get_gpu("h800-80gb").intra_node_link.bandwidth_bytes_per_s == 200 * GB


@pytest.mark.parametrize("name", ["rtx-3090", "rtx-a6000", "a40", "a100-pcie-80gb", "h100-pcie", "h100-nvl"])
def test_a_pair_bridged_pcie_board_talks_over_pcie(name: str) -> None:
    # An NVLink bridge joins two cards, not the node: the catalog's one intra-node link is PCIe.
    gpu = get_gpu(name)
    assert gpu.intra_node_link.name.startswith("PCIe") and not gpu.nvswitch
    assert gpu.intra_node_link == gpu.host_link


def test_each_new_board_takes_its_architectures_branches() -> None:
    from zeroplan.core.algorithms import multicast_capable
    from zeroplan.specs.hardware import FLOAT8_ARCHITECTURES
    from zeroplan.core.default_efficiency import SDPA_MEMORY_EFFICIENT, attention_class
    from zeroplan.specs.training import TrainingSpec

    # Turing: no bf16 tensor cores, no FlashAttention-2, no float8.
    t4 = get_gpu("t4")
    assert not t4.has_bf16_tensor_cores and t4.architecture not in FLOAT8_ARCHITECTURES
    assert attention_class(TrainingSpec(), t4) == SDPA_MEMORY_EFFICIENT
    assert attention_class(TrainingSpec(), get_gpu("rtx-3090")) != SDPA_MEMORY_EFFICIENT
    assert get_gpu("rtx-3090").has_bf16_tensor_cores and get_gpu("rtx-3090").architecture not in FLOAT8_ARCHITECTURES
    assert get_gpu("l4").architecture in FLOAT8_ARCHITECTURES
    # NVLS needs Hopper behind NVSwitches: the H800's HGX board, not a PCIe H100.
    assert multicast_capable(get_gpu("h800-80gb"))
    assert not multicast_capable(get_gpu("h100-pcie")) and not multicast_capable(get_gpu("h100-nvl"))
    assert not multicast_capable(get_gpu("a800-80gb"))  # Ampere: no NVLS


@pytest.mark.parametrize(
    "alias,canonical",
    [("h200", "h200-141gb"), ("a100", "a100-80gb"), ("h100", "h100-80gb"), ("4090", "rtx-4090"),
     ("3090", "rtx-3090"), ("rtx3090", "rtx-3090"), ("a6000", "rtx-a6000"), ("a100-pcie", "a100-pcie-80gb"),
     ("v100-pcie", "v100-pcie-32gb"), ("a800", "a800-80gb"), ("h800", "h800-80gb")],
)
def test_aliases_resolve(alias: str, canonical: str) -> None:
    assert get_gpu(alias) is get_gpu(canonical)
    assert alias not in gpu_names()


def test_names_are_case_insensitive() -> None:
    assert get_gpu("H200") is get_gpu("h200-141gb")
    assert get_gpu(" A100-80GB ") is get_gpu("a100-80gb")
    assert get_gpu("RTX_4090") is get_gpu("rtx-4090")
    assert get_gpu("RTX-A6000") is get_gpu("rtx-a6000") and get_gpu("H100_NVL") is get_gpu("h100-nvl")


def test_every_alias_points_at_an_entry() -> None:
    assert set(_ALIASES.values()) <= set(gpu_names())


def test_unknown_gpu_is_one_line_with_a_suggestion() -> None:
    with pytest.raises(ZeroplanError) as caught:
        get_gpu("a100-80g")
    message = str(caught.value)
    assert caught.value.field == "gpu"
    assert message.startswith("gpu: unknown 'a100-80g'; did you mean 'a100-80gb'")
    assert "\n" not in message


def test_a_near_miss_of_a_new_board_suggests_it(zeroplan_cli) -> None:
    code, out, err = zeroplan_cli("fit", "llama-2-7b", "--gpus", "1", "--gpu", "rtx-309")
    assert code == 2 and not out and err.count("\n") == 1
    assert "gpu: unknown 'rtx-309'; did you mean 'rtx-3090'" in err


def test_a_new_board_plans_through_the_cli(zeroplan_cli) -> None:
    code, out, _ = zeroplan_cli("fit", "llama-2-7b", "--gpus", "2", "--gpu", "3090", "--strategies", "fsdp-full-shard",
                                "--lora-rank", "8", "--activation-checkpointing", "full")
    assert code == 0, out
    assert "2 x NVIDIA GeForce RTX 3090, 23.5 GiB usable per GPU" in out
    # No published row ran on a 3090 nor on its die: the flat HFU, said so, and no fit claimed.
    assert "step time: flat HFU 0.4 (rtx-3090, " in out and "fitted default HFU" not in out
    code, out, _ = zeroplan_cli("fit", "llama-2-7b", "--gpus", "1", "--gpu", "t4", "--strategies", "ddp")
    assert code == 0 and "fp16-mixed" in out  # no bf16 tensor cores: the framework's fp16 AMP


def test_unknown_gpu_lists_the_allowed_names() -> None:
    with pytest.raises(ZeroplanError) as caught:
        get_gpu("tpu-v5")
    assert all(name in str(caught.value) for name in REQUIRED)


def test_custom_gpu_file_round_trips(tmp_path) -> None:
    gpu = get_gpu("a100-80gb").model_copy(update={"name": "lab-card", "memory_bytes": 96 * GiB})
    assert load_gpu_file(_write(tmp_path, gpu.model_dump_json())) == gpu
    assert load_gpu_file(str(tmp_path / "gpu.json")) == gpu


_VALID = _as_dict(get_gpu("l40s"))


@pytest.mark.parametrize(
    "content,field",
    [
        ("{oops", "gpu"),
        ("", "gpu"),
        ("[1, 2]", "gpu"),
        (json.dumps({"name": "x"}), "gpu.display_name"),
        (json.dumps({**_VALID, "memory_bytes": -1}), "gpu.memory_bytes"),
        (json.dumps({**_VALID, "memory_bytes": "lots"}), "gpu.memory_bytes"),
        (json.dumps({**_VALID, "colour": "red"}), "gpu.colour"),
        (json.dumps({**_VALID, "host_link": {**_VALID["host_link"], "latency_s": -1}}), "gpu.host_link.latency_s"),
        # Past any real device, or not of the field's type (no coercion from a JSON file).
        (json.dumps({**_VALID, "host_link": {**_VALID["host_link"], "latency_s": 1e9}}), "gpu.host_link.latency_s"),
        (json.dumps({**_VALID, "memory_bytes": 10**30}), "gpu.memory_bytes"),
        (json.dumps({**_VALID, "peak_bf16_flops_per_s": 1e300 * 10}), "gpu.peak_bf16_flops_per_s"),
        (json.dumps({**_VALID, "nvswitch": "yes"}), "gpu.nvswitch"),
        (json.dumps({**_VALID, "memory_bytes": "85899345920"}), "gpu.memory_bytes"),
    ],
)
def test_bad_gpu_file_is_one_line_error_naming_the_field(tmp_path, content: str, field: str) -> None:
    with pytest.raises(ZeroplanError) as caught:
        load_gpu_file(_write(tmp_path, content))
    assert caught.value.field == field
    assert str(caught.value).startswith(f"{field}: ")
    assert "\n" not in str(caught.value)


def test_missing_gpu_file_is_one_line_error(tmp_path) -> None:
    with pytest.raises(ZeroplanError) as caught:
        load_gpu_file(tmp_path / "absent.json")
    assert caught.value.field == "gpu" and "absent.json" in str(caught.value)
    assert "\n" not in str(caught.value)


def test_custom_gpu_from_numbers() -> None:
    gpu = custom_gpu("lab-card", 64 * GiB, 500e12, 200 * GB, 25 * GB)
    assert gpu.memory_bytes == 64 * GiB and gpu.peak_bf16_flops_per_s == 500e12
    assert gpu.intra_node_link.bandwidth_bytes_per_s == 200 * GB
    assert gpu.inter_node_link.bandwidth_bytes_per_s == 25 * GB
    assert gpu.host_link.bandwidth_bytes_per_s == 32 * GB
    assert 0 < gpu.intra_node_link.latency_s < gpu.inter_node_link.latency_s
    assert gpu.display_name == "lab-card"


def test_custom_gpu_overrides() -> None:
    gpu = custom_gpu(
        "lab-card", 64 * GiB, 500e12, 200 * GB, 25 * GB, 64 * GB,
        display_name="Lab card", inter_latency_s=2e-6,
    )
    assert gpu.host_link.bandwidth_bytes_per_s == 64 * GB
    assert gpu.inter_node_link.latency_s == 2e-6 and gpu.display_name == "Lab card"


@pytest.mark.parametrize(
    "kwargs,field",
    [
        ({"memory_bytes": 0}, "gpu.memory_bytes"),
        ({"peak_bf16_flops_per_s": -1.0}, "gpu.peak_bf16_flops_per_s"),
        ({"inter_bandwidth_bytes_per_s": 0.0}, "gpu.inter_node_link.bandwidth_bytes_per_s"),
    ],
)
def test_custom_gpu_bad_numbers_name_the_field(kwargs: dict, field: str) -> None:
    args = {
        "name": "bad", "memory_bytes": GiB, "peak_bf16_flops_per_s": 1e12,
        "intra_bandwidth_bytes_per_s": 1e9, "inter_bandwidth_bytes_per_s": 1e9, **kwargs,
    }
    with pytest.raises(ZeroplanError) as caught:
        custom_gpu(**args)
    assert caught.value.field == field and "\n" not in str(caught.value)
