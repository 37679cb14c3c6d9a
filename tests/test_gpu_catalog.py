"""The GPU catalog and custom GPUs."""

from __future__ import annotations

import json

import pytest

from zeroplan.errors import ZeroplanError
from zeroplan.presets.gpus import custom_gpu, get_gpu, gpu_names, load_gpu_file
from zeroplan.units import GiB, MiB

REQUIRED = ["v100-16gb", "v100-32gb", "a100-40gb", "a100-80gb", "h100-80gb", "h200-141gb", "b200", "mi300x", "l40s", "a10g", "rtx-4090"]


def test_catalog_has_the_required_gpus() -> None:
    assert set(REQUIRED) <= set(gpu_names())


@pytest.mark.parametrize("name,memory", [("a100-80gb", 80 * GiB), ("a100-40gb", 40 * GiB), ("h100-80gb", 80 * GiB), ("h200-141gb", 143_771 * MiB)])
def test_memory_is_exact_bytes(name: str, memory: int) -> None:
    assert get_gpu(name).memory_bytes == memory


def test_links_are_ordered_sensibly() -> None:
    for name in gpu_names():
        gpu = get_gpu(name)
        assert gpu.intra_node_link.bandwidth_bytes_per_s >= gpu.inter_node_link.bandwidth_bytes_per_s, name


def test_aliases_and_case() -> None:
    assert get_gpu("H100") is get_gpu("h100-80gb")
    assert get_gpu("A100") is get_gpu("a100-80gb")


def test_unknown_gpu_suggests_close_match() -> None:
    with pytest.raises(ZeroplanError) as caught:
        get_gpu("h100-80g")
    assert caught.value.field == "gpu" and "'h100-80gb'" in str(caught.value)


def test_custom_gpu_file_round_trips(tmp_path) -> None:
    gpu = get_gpu("a100-80gb").model_copy(update={"name": "my-gpu", "memory_bytes": 96 * GiB})
    path = tmp_path / "gpu.json"
    path.write_text(gpu.model_dump_json())
    assert load_gpu_file(path) == gpu


@pytest.mark.parametrize(
    "content,field",
    [("{oops", "gpu"), (json.dumps({"name": "x"}), "gpu.display_name"), (json.dumps({**json.loads(get_gpu("l40s").model_dump_json()), "memory_bytes": -1}), "gpu.memory_bytes"),
     (json.dumps({**json.loads(get_gpu("l40s").model_dump_json()), "colour": "red"}), "gpu.colour")],
)
def test_bad_gpu_file_is_one_line_error(tmp_path, content: str, field: str) -> None:
    path = tmp_path / "gpu.json"
    path.write_text(content)
    with pytest.raises(ZeroplanError) as caught:
        load_gpu_file(path)
    assert caught.value.field == field and "\n" not in str(caught.value)


def test_custom_gpu_from_numbers() -> None:
    gpu = custom_gpu("lab-card", 64 * GiB, 500e12, 200e9, 25e9)
    assert gpu.memory_bytes == 64 * GiB and gpu.inter_node_link.bandwidth_bytes_per_s == 25e9
    with pytest.raises(ZeroplanError, match="gpu.memory_bytes"):
        custom_gpu("bad", 0, 1e12, 1e9, 1e9)
