"""Checkpoints: the flat file format and its writing (file.py), checkpoints
of named tensors written by their owners (named.py), their reading back
(read_back.py) and what it trusts (trust.py), and the orchestration of a
run's checkpoints and its resume over the layout's parts (resume.py).

    python -m hpctrain.checkpoint DIR      # lists DIR's checkpoints and checks each
"""
