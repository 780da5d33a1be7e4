"""Optimizers over flat buffers and ranges of them (optimizers.py: SGD,
momentum, Adam(W), sharded, on a device; decay.py: where weight decay
applies), the learning-rate schedule
(lr_schedule.py), and gradient clipping by the global norm (clipping.py). Never
imports MPI.

    python -m pytest -q tests/test_optim.py
"""
