"""The shared helpers every part of hpctrain stands on: errors and exit codes, files written
whole, chunks, the device and precision, the CPU tuning, the outputs-over-inputs check.

    python -m hpctrain.base.device      # what --device auto would pick
"""
