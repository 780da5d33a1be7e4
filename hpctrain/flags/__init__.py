"""The flags, in one place: the parser (arguments.py), the one definition of every flag
(cli.py), the model names --model takes and the parallel flags' refusals.

    python -m hpctrain.train --help-all
"""
