"""Checkpoints: the file format and its writing (file.py), its reading back
(read_back.py) and what it trusts (trust.py), the orchestration of a run's
checkpoints and its resume (resume.py), and a sharded optimizer's state
gathered and scattered (sharded.py).

    python -m hpctrain.checkpoint DIR      # lists DIR's checkpoints and checks each
"""
