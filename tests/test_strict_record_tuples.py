"""A record is read back strictly (zeroplan.harness.record.read_record), and what the harness
wrote is read back whole: every tuple field a record's description can carry, non-empty, survives
the harness's writer and reader and validate's load path, also where a before-validator
(RunDescription's on ``training``, PlanRequest's own) hands the nested JSON on as Python values.
Strictness stays otherwise: a string for a count or a flag is still refused. Reads JSON only; no
torch."""

from __future__ import annotations

import json
import typing
from pathlib import Path

import pytest
from pydantic import BaseModel

from zeroplan.errors import ZeroplanError
from zeroplan.harness.record import RankRecord, read_record, write_record
from zeroplan.presets.gpus import get_gpu
from zeroplan.simulate.record import SimulationRecord
from zeroplan.specs import PlanRequest, StrategySpec, cluster_from_gpus
from zeroplan.specs.finetune import FineTuneSpec, LoraTarget, SavedModule
from zeroplan.specs.framework import Framework
from zeroplan.specs.lengths import VaryingLengths
from zeroplan.specs.model import ModelSpec
from zeroplan.validate.load import load_record_files

RECORDS = Path(__file__).resolve().parents[1] / "benchmarks" / "records" / "tiny-llama-zero1-zeroplan-fp32-n2"


def _tuple_fields(root: type[BaseModel]) -> set[tuple[str, str]]:
    """(model, field) of every field reachable from ``root`` whose type is a tuple, or a tuple
    or None."""
    found: set[tuple[str, str]] = set()
    seen: set[type] = set()

    def visit(model: type[BaseModel]) -> None:
        if model in seen:
            return
        seen.add(model)
        for name, info in model.model_fields.items():
            def types(annotation: object) -> typing.Iterator[object]:
                yield annotation
                for argument in typing.get_args(annotation):
                    yield from types(argument)
            for kind in types(info.annotation):
                if typing.get_origin(kind) is tuple:
                    found.add((model.__name__, name))
                if isinstance(kind, type) and issubclass(kind, BaseModel):
                    visit(kind)

    visit(root)
    return found


def _filled(spec: BaseModel, fields: set[tuple[str, str]]) -> set[tuple[str, str]]:
    """Which of ``fields`` hold a non-empty tuple somewhere in ``spec`` (every nested model)."""
    filled: set[tuple[str, str]] = set()
    for name, value in spec:
        if (type(spec).__name__, name) in fields and isinstance(value, tuple) and value:
            filled.add((type(spec).__name__, name))
        for item in value if isinstance(value, (tuple, list)) else (value,):
            if isinstance(item, BaseModel):
                filled |= _filled(item, fields)
    return filled


def _record(moe: bool) -> RankRecord:
    """A committed record (as tests/harness/test_multinode.py builds its records) whose
    description is, on batches of varying length, a MoE model with dense blocks (``moe``) or the
    dense model trained under LoRA with named targets and modules to save (the planner models
    LoRA on dense models only): between them, every tuple field non-empty."""
    base = read_record(RECORDS / "rank00000.json")
    described = base.description
    model, training = described.model, described.training
    if moe:
        model = ModelSpec.model_validate({**model.model_dump(), "num_experts": 4, "experts_per_token": 2,
                                          "dense_layers": (0, 2)})
    else:
        finetune = FineTuneSpec(lora_rank=8, lora_targets=(LoraTarget.q, LoraTarget.v, LoraTarget.down),
                                modules_to_save=(SavedModule.embed, SavedModule.head))
        # modules_to_save is PEFT's: framework hf.
        training = training.model_copy(update={"finetune": finetune, "framework": Framework.hf})
    batch = described.batch.model_copy(update={"varying_lengths": VaryingLengths(mean_tokens=100.0, sd_tokens=30.0,
                                                                                  min_tokens=8, samples=1000)})
    # The planner models modules_to_save under DDP only.
    description = type(described).model_validate({**described.model_dump(), "model": model, "training": training,
                                                   "batch": batch, **({} if moe else {"strategy": "ddp"})})
    return base.model_copy(update={"description": description})


def test_the_records_below_fill_every_tuple_field_a_record_can_carry() -> None:
    """A new tuple field reachable from a record fails here until a record below fills it."""
    tuple_fields = _tuple_fields(RankRecord)
    assert _filled(_record(moe=True), tuple_fields) | _filled(_record(moe=False), tuple_fields) == tuple_fields >= {
        ("ModelSpec", "dense_layers"), ("FineTuneSpec", "lora_targets"), ("FineTuneSpec", "modules_to_save")}
    # zeroplan simulate's records describe the run with the same specs.
    assert _tuple_fields(SimulationRecord) <= tuple_fields


@pytest.mark.parametrize("moe", [True, False], ids=["moe", "lora"])
def test_a_record_with_its_tuple_fields_set_is_read_back_as_written(tmp_path: Path, moe: bool) -> None:
    record = _record(moe)
    path = write_record(tmp_path, record)
    written = json.loads(path.read_text(encoding="utf-8"))["description"]
    assert written["batch"]["varying_lengths"]["min_tokens"] == 8
    if moe:
        assert written["model"]["dense_layers"] == [0, 2]
    else:
        assert written["training"]["finetune"]["lora_targets"] == ["q", "v", "down"]
        assert written["training"]["finetune"]["modules_to_save"] == ["embed", "head"]
    read = read_record(path)
    assert read == record
    if moe:
        assert read.description.model.dense_layers == (0, 2)
    else:
        assert read.description.training.finetune.lora_targets == (LoraTarget.q, LoraTarget.v, LoraTarget.down)
        assert read.description.training.finetune.modules_to_save == (SavedModule.embed, SavedModule.head)
    # validate's load path (zeroplan validate, its merge) reads the same file.
    ((loaded_path, loaded),) = load_record_files([str(tmp_path)])
    assert loaded_path == path and loaded == record


def test_requests_with_every_tuple_field_set_are_read_back_strictly_from_their_json() -> None:
    """PlanRequest's before-validators hand the nested JSON on as Python values: its tuple fields
    (achievable bus bandwidths among them) are read back from a strict JSON read."""
    gpu = get_gpu("h100-80gb")
    requests = [PlanRequest(model=described.model, cluster=cluster_from_gpus(gpu, 8), strategy=StrategySpec(kind=described.strategy),
                            training=described.training, batch=described.batch)
                for described in (_record(moe=True).description, _record(moe=False).description)]
    tuple_fields = _tuple_fields(PlanRequest)
    assert set().union(*(_filled(request, tuple_fields) for request in requests)) == tuple_fields >= {
        ("GpuSpec", "achievable"), ("ModelSpec", "dense_layers"), ("FineTuneSpec", "lora_targets")}
    for request in requests:
        assert PlanRequest.model_validate_json(request.model_dump_json(), strict=True) == request


def _edited(tmp_path: Path, moe: bool, edit: typing.Callable[[dict], None]) -> Path:
    path = write_record(tmp_path, _record(moe))
    document = json.loads(path.read_text(encoding="utf-8"))
    edit(document["description"])
    path.write_text(json.dumps(document), encoding="utf-8")
    return path


# The MoE record's model and the LoRA record's training (behind RunDescription's before-validator
# on ``training``), each with the tuple fields filled.
@pytest.mark.parametrize("moe,where,edit", [
    (True, "description.world_size", lambda d: d.update(world_size="2")),
    (True, "description.model.hidden_size", lambda d: d["model"].update(hidden_size="384")),
    (True, "description.model.bias", lambda d: d["model"].update(bias="yes")),
    (True, "description.model.dense_layers.0", lambda d: d["model"].update(dense_layers=["0", 2])),
    (True, "description.model.dense_layers", lambda d: d["model"].update(dense_layers="0")),
    (False, "description.training.finetune.lora_rank", lambda d: d["training"]["finetune"].update(lora_rank="8")),
    (False, "description.training.finetune.dora", lambda d: d["training"]["finetune"].update(dora="yes")),
    (False, "description.training.finetune.lora_targets.0",
     lambda d: d["training"]["finetune"].update(lora_targets=["qq"])),
    (False, "description.training.finetune.lora_targets", lambda d: d["training"]["finetune"].update(lora_targets="q")),
    (False, "description.training.finetune.modules_to_save",
     lambda d: d["training"]["finetune"].update(modules_to_save={"embed": 1})),
    (False, "description.training.compile", lambda d: d["training"].update(compile="yes")),
    (False, "description.batch.varying_lengths.min_tokens", lambda d: d["batch"]["varying_lengths"].update(min_tokens="8")),
], ids=lambda value: value if isinstance(value, str) else None)
def test_a_string_for_a_count_a_flag_or_an_array_is_still_refused(tmp_path: Path, moe: bool, where: str, edit) -> None:
    path = _edited(tmp_path, moe, edit)
    with pytest.raises(ZeroplanError) as caught:
        load_record_files([str(path)])
    message = str(caught.value)
    assert "\n" not in message and f"({where}: " in message, message
