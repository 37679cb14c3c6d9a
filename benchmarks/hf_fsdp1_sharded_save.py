"""What a GPU holds while the Trainer saves an FSDP1 checkpoint as SHARDED_STATE_DICT, after a
training step, for PEFT's FSDP QLoRA guide (docs/source/accelerate/fsdp.md at 6008f27): its
two published figures (19.6 GB with fsdp_offload_params, 35.6 GB without) sit 5 GiB above the
step's own peak, and this is the one point of that run that holds more.

The run's save, read at the guide's releases:
- fsdp_config_qlora.yaml sets fsdp_state_dict_type SHARDED_STATE_DICT, and the launch command
  --save_strategy "epoch": transformers 4.39.0 trainer.py:2752-2758 (_save_checkpoint under
  FSDP) calls accelerate's save_fsdp_model(..., adapter_only=True) and save_fsdp_optimizer.
- accelerate 0.28.0 utils/fsdp_utils.py:54-67: under FSDP.state_dict_type(model,
  SHARDED_STATE_DICT, state_dict_config) it builds _get_model_state_dict(model, adapter_only),
  which for a PEFT model is peft's get_peft_model_state_dict, whose first act is
  ``model.state_dict()`` (peft 0.10.0 utils/save_and_load.py); the plugin leaves
  state_dict_config None for SHARDED_STATE_DICT (utils/dataclasses.py set_state_dict_type sets
  one only for FULL_STATE_DICT), so FSDP's ShardedStateDictConfig(offload_to_cpu=False) holds.
- torch's FSDP1 _state_dict_utils.py _sharded_pre_state_dict_hook unshards each unit's flat
  parameter on the device ("Setting offload_to_cpu here does not work even if offload_to_cpu is
  True"), and _sharded_post_state_dict_hook replaces every parameter by a ShardedTensor whose
  local shard is ``chunks[rank].clone()`` (_shard_utils.py _create_chunk_sharded_tensor) of the
  gathered tensor, on the device: the whole state dict's local chunks (a rank's share of every
  parameter, offloaded or not) are alive together until the dict is dropped.
  The hooks measured are torch 2.13's; an FSDP1 older than the rows' torch 2.2
  (pytorch/pytorch@00c0db4e, still on _module_handles) has the same unshard and the same clone.

The other two saves accelerate makes (--full, --sharded-to-cpu), measured the same way:
- FULL_STATE_DICT, accelerate's default under FSDP1 (0.28.0 utils/dataclasses.py:1101-1103;
  1.10.1 :1973-1977), with FullStateDictConfig(offload_to_cpu=True, rank0_only=True) on several
  processes (save_fsdp_model): rank 0 moves each gathered flat parameter to the host
  (_unshard_param_utils.py _unshard_fsdp_state_params, flat_param_to) and clones it there.
- SHARDED_STATE_DICT from accelerate 0.31.0 (67308ca, #2762: ShardedStateDictConfig(offload_to_cpu=True)):
  each ShardedTensor goes to the host (``sharded_tensor.cpu()``) as soon as it is made.
The fake run has one device, where ``.to("cpu")`` and ``.cpu()`` copy nothing: both moves are
made copies there, and the copies (with the full state dict's clones of them) are left out of
the count as the host's (_host_moves_on_one_device).

Here: the model, wrapping and one Trainer step of zeroplan.frameworks.hf_fsdp1_step (bitsandbytes'
Linear4bit under PEFT, accelerate's FSDP1 arguments with use_orig_params=False as the yaml
sets, fake tensors, a fake process group), then ``model.state_dict()`` under SHARDED_STATE_DICT,
every storage made and freed counted (StorageTrace; under CPU offload the host's storages left
out as the step's record does). The step runs at micro-batch 1 of 256 tokens: its activations
are freed before the save, and what the save starts from (flat shards, AdamW's states, the
QuantStates) does not depend on the batch. Records go to
benchmarks/framework-fsdp1-sharded-save-records.

    python benchmarks/hf_fsdp1_sharded_save.py [--offload] [--no-offload] [--full | --sharded-to-cpu]
    (both offloads by default; SHARDED_STATE_DICT with offload_to_cpu False by default)

About a minute a run on 2 cores.
"""

from __future__ import annotations

import contextlib
import json
import sys
import time
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from zeroplan.atomic import write_text_atomic  # noqa: E402
from zeroplan.frameworks import hf_fsdp1_step as fsdp1  # noqa: E402
from zeroplan.frameworks.autocast_query import autocast_query_on_device  # noqa: E402
from zeroplan.frameworks.build import _hf_llama  # noqa: E402
from zeroplan.frameworks.lora import hf_sharded_qlora_llama  # noqa: E402
from zeroplan.presets.models import get_model  # noqa: E402
from zeroplan.simulate import _torch_private as private  # noqa: E402
from zeroplan.simulate.alloc_trace import recording_storages  # noqa: E402
from zeroplan.simulate.fake_world import DEVICE, fake_process_group  # noqa: E402
from zeroplan.specs import StrategyKind  # noqa: E402
from zeroplan.specs.finetune import FineTuneSpec  # noqa: E402

OUT = ROOT / "benchmarks" / "framework-fsdp1-sharded-save-records"
WORLD_SIZE = 2
SEQ_LEN = 256
"""The step before the save: its activations are gone by the save (see the module's text)."""

# PEFT's FSDP QLoRA guide: r 8, alpha 16, dropout 0.1 on all linears, nf4 with double
# quantization stored in bf16 (examples/sft/run_peft_qlora_fsdp.sh at 6008f27).
PEFT_FSDP_QLORA = FineTuneSpec(lora_rank=8, lora_alpha=16, lora_dropout=0.1,
                               lora_targets=["q", "k", "v", "o", "gate", "up", "down"], quantize="nf4",
                               double_quant=True, base_dtype="bf16", kbit_fp32_cast=False)
GIB = 2**30
HOST_COPIES_NOTE = ("offload_to_cpu: FULL_STATE_DICT's flat_param_to('cpu') and SHARDED_STATE_DICT's "
                    "ShardedTensor.cpu() made as copies on the fake run's one device (they copy nothing on a CPU), "
                    "their storages left out of the count as the host's")


SAVES = ("sharded", "full", "sharded-to-cpu")
"""The save measured: SHARDED_STATE_DICT as accelerate before 0.31.0 configures it (the default),
FULL_STATE_DICT as accelerate configures it on several processes, SHARDED_STATE_DICT from 0.31.0."""


def _state_dict_config(save: str):  # noqa: ANN202 (a torch config)
    """(StateDictType, config) of ``save`` as accelerate's save_fsdp_model passes them."""
    from torch.distributed.fsdp import FullStateDictConfig, ShardedStateDictConfig, StateDictType

    if save == "full":
        return StateDictType.FULL_STATE_DICT, FullStateDictConfig(offload_to_cpu=True, rank0_only=True)
    if save == "sharded-to-cpu":
        return StateDictType.SHARDED_STATE_DICT, ShardedStateDictConfig(offload_to_cpu=True)
    return StateDictType.SHARDED_STATE_DICT, None


@contextlib.contextmanager
def _host_moves_on_one_device(recorder: object) -> Iterator[set[int]]:
    """The two moves to the host an offloading save makes, as copies on the fake run's one device;
    yields the trace ids of the copies (the host's storages).

    torch 2.13 distributed/fsdp/_flat_param.py FlatParamHandle.to_cpu (FULL_STATE_DICT with
    offload_to_cpu, _unshard_param_utils.py _unshard_fsdp_state_params) runs
    ``flat_param_to(torch.device("cpu"))`` and then frees the device's gathered flat parameter,
    gathering it again when the unit's state dict is done; on one CPU device ``.to("cpu")``
    copies nothing and the free would take the parameter's only storage. Here it is a copy.
    _shard/sharded_tensor/api.py ShardedTensor.cpu (SHARDED_STATE_DICT with offload_to_cpu,
    _state_dict_utils.py _sharded_post_state_dict_hook) returns the tensor itself when its shards
    are on the CPU already; here it copies the local shard, as it does from a GPU."""
    from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor
    from torch.distributed.fsdp._flat_param import FlatParamHandle

    made: set[int] = set()
    moved, cpu = FlatParamHandle.flat_param_to, ShardedTensor.cpu

    def host_copy(tensor: torch.Tensor) -> torch.Tensor:
        copy = tensor.clone()
        made.add(recorder.trace_id(copy.untyped_storage()))
        return copy

    def flat_param_to(self, *args, **kwargs):  # noqa: ANN001, ANN202 (torch's signature)
        if torch.device(args[0] if args else kwargs["device"]).type != "cpu":
            return moved(self, *args, **kwargs)
        self.flat_param.data = host_copy(self.flat_param)
        if self._use_orig_params:
            self._use_unsharded_views(as_params=True)
        return None

    def sharded_cpu(self, *args, **kwargs):  # noqa: ANN001, ANN202
        shards = [Shard(tensor=host_copy(shard.tensor), metadata=shard.metadata) for shard in self.local_shards()]
        return ShardedTensor._init_from_local_shards_and_global_metadata(
            shards, sharded_tensor_metadata=self.metadata(), process_group=self._process_group)

    FlatParamHandle.flat_param_to, ShardedTensor.cpu = flat_param_to, sharded_cpu
    try:
        yield made
    finally:
        FlatParamHandle.flat_param_to, ShardedTensor.cpu = moved, cpu


def measure(offload: bool, save: str = "sharded") -> dict[str, object]:
    """The device's live bytes just before the save and at its peak, rank 0 of WORLD_SIZE."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    model = get_model("llama-2-70b")
    start_s = time.perf_counter()
    built = hf_sharded_qlora_llama(model, model.num_layers, "full", PEFT_FSDP_QLORA, _hf_llama)
    lora_elements = sum(p.numel() for n, p in built.module.named_parameters() if "lora_" in n)
    marks: dict[str, int] = {}
    with (fake_process_group(WORLD_SIZE, 0), private.fsdp1_on_fake_tensors(), private.fake_tensor_mode(),
          fsdp1._bnb_quant_state_on_views(), fsdp1._offload_on_one_device(offload),
          autocast_query_on_device(torch.device(DEVICE).type), recording_storages() as recorder,
          fsdp1._offloaded_gradients_on_one_device(offload, recorder) as host_made):
        built.to_empty(DEVICE)
        root, sharding = fsdp1.hf_fsdp1_wrap(built.module, StrategyKind.fsdp_full_shard, peft=True, offload=offload,
                                             use_orig_params=False)
        trainable = [p for p in root.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(trainable, lr=1e-4, fused=True)
        tokens = torch.randint(0, model.vocab_size, (1, SEQ_LEN))
        fsdp1._trainer_step(root, optimizer, tokens, 1, recorder, marks, "first")
        save_begins = len(recorder.events)
        with (FullyShardedDataParallel.state_dict_type(root, *_state_dict_config(save)),
              _host_moves_on_one_device(recorder) as copies):
            state_dict = root.state_dict()
        entries = len(state_dict)
        if save == "full":
            # _full_post_state_dict_hook clones each parameter out of the flat parameter, which
            # to_cpu has put on the host: the clones are the host's too.
            copies |= {recorder.trace_id(t.untyped_storage()) for t in state_dict.values() if isinstance(t, torch.Tensor)
                       and t.untyped_storage().nbytes()}
        del state_dict
        save_ends = len(recorder.events)
        states = [t for state in optimizer.state.values() for t in state.values() if isinstance(t, torch.Tensor)]
        host = fsdp1._host_storage_ids(root, states, recorder) | host_made if offload else frozenset()
    sizes: dict[int, int] = {}
    live = 0
    for event in recorder.events[:save_begins]:
        live = fsdp1._apply(event, sizes, live, host)
    before = peak = live
    for event in recorder.events[save_begins:save_ends]:
        live = fsdp1._apply(event, sizes, live, host | frozenset(copies))
        peak = max(peak, live)
    row = f"peft-fsdp-docs-llama2-70b-qlora-{'offload-2x24gb' if offload else 'nooffload-2gpu'}"
    return {
        "row": row, "record": row if save == "sharded" else f"{row}-{save}", "save": save,
        "torch_version": torch.__version__, "model": model.name, "world_size": WORLD_SIZE, "rank": 0,
        "fsdp_cpu_offload": offload, "sharding": sharding, "state_dict_entries": entries,
        "lora_elements": lora_elements,
        # peft 0.10.0's bf16 adapters (the last note): 2 bytes an element less in this rank's
        # shard of them, in its clone and in each of AdamW's two states (only the clone is on the
        # device under offload; no clone is there under the two offloading saves).
        "save_peak_bf16_adapters_bytes": peak - (lora_elements // WORLD_SIZE) * ((2 if save == "sharded" else 0)
                                                                                + (0 if offload else 6)),
        "live_before_save_bytes": before, "save_peak_bytes": peak, "live_after_save_bytes": live,
        "live_before_save_gib": round(before / GIB, 3), "save_peak_gib": round(peak / GIB, 3),
        "wall_time_s": round(time.perf_counter() - start_s, 1),
        "notes": [fsdp1.STORAGE_TRACE_NOTE, fsdp1.QUANT_STATE_NOTE] + ([fsdp1.OFFLOAD_NOTE] if offload else []) + (
            [] if save == "sharded" else [HOST_COPIES_NOTE]) + [
            "the adapters are built as peft 0.17.1 builds them, in fp32 (autocast_adapter_dtype); peft 0.10.0's "
            "LoraLayer.update_layer casts them to the base weight's dtype, bf16 here (tuners/lora/layer.py: "
            "self.to(weight.device, dtype=weight.dtype)), two bytes an element less in the flat shard, its "
            "clone and each AdamW state"],
    }


def main(argv: list[str]) -> None:
    runs = [flag == "--offload" for flag in argv if flag in ("--offload", "--no-offload")] or [True, False]
    save = "full" if "--full" in argv else "sharded-to-cpu" if "--sharded-to-cpu" in argv else "sharded"
    OUT.mkdir(parents=True, exist_ok=True)
    for offload in runs:
        record = measure(offload, save)
        write_text_atomic(OUT / f"{record['record']}.json", json.dumps(record, indent=1) + "\n")
        print(f"{record['record']}: live before the save {record['live_before_save_gib']:.2f} GiB, "
              f"save peak {record['save_peak_gib']:.2f} GiB ({record['wall_time_s']} s)")


if __name__ == "__main__":
    main(sys.argv[1:])
