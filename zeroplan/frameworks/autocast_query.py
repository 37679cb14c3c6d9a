"""peft's bitsandbytes adapters ask torch whether autocast is on without naming a device.

peft 0.17.1 tuners/lora/bnb.py Linear4bit.forward and Linear8bitLt.forward cast the adapter's
input to ``lora_A.weight.dtype`` only where ``torch.is_autocast_enabled()`` is False. With no
device type that call reads CUDA's autocast (torch 2.13 torch/_C/__init__.pyi; measured: under
torch.autocast("cpu") it answers False, is_autocast_enabled("cpu") True). On a GPU under the
Trainer's or accelerate's autocast(cuda) it is True and nothing is cast; a measurement on the CPU
runs under the CPU's autocast, so without this the question gets the other answer and each
adapter makes a copy of its input in the adapters' dtype that a GPU never makes.
"""

from __future__ import annotations

import contextlib

import torch


@contextlib.contextmanager
def autocast_query_on_device(device_type: str):
    """While entered, ``torch.is_autocast_enabled()`` with no argument answers for
    ``device_type`` (the device the measurement runs on), as it answers for CUDA on a GPU."""
    original = torch.is_autocast_enabled

    def on_device(*args: object) -> bool:
        return original(*args) if args else original(device_type)

    torch.is_autocast_enabled = on_device  # type: ignore[assignment]
    try:
        yield
    finally:
        torch.is_autocast_enabled = original  # type: ignore[assignment]
