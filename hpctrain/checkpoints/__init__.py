"""Checkpoints: a checkpoint directory's listing, pruning and header stamps
(file.py), folders of named tensors written by their owners and read by
boxes (named.py), the old flat files read back and the newest valid
checkpoint of either form (read_back.py) and what
they trust (trust.py), and the orchestration of a run's checkpoints and
its resume over the layout's parts (resume.py).

    python -m hpctrain.checkpoint DIR      # lists DIR's checkpoints and checks each
"""
