"""Measurement harness: real PyTorch runs whose per-rank memory and communication are recorded,
as an independent check of the analytical planner.

This package imports torch and ``zeroplan.specs``, never ``zeroplan.core``: a measurement
must not share formulas with the prediction it checks. ``zeroplan.harness.cli`` defers its torch
import, so the main command line can register ``zeroplan measure`` without torch installed.
"""
