"""Optimizers over flat buffers and ranges of them (one module each: sgd.py,
momentum.py, adam.py, over base.py; sharded.py and on_device.py wrap one;
optimizers.py names them and makes one; decay.py: where weight decay
applies), the learning-rate schedule
(lr_schedule.py), and gradient clipping by the global norm (clipping.py). Never
imports MPI.

    python -m pytest -q tests/test_optim.py
"""
