"""Calibrate the alpha-beta link model from nccl-tests output (``zeroplan calibrate``)."""
