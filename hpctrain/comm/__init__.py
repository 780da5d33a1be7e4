"""Communication: ring allreduce, bucket fusion, parameter-server protocol.

Everything here takes an MPI communicator and contiguous 1-D arrays, nothing
else (no model, no optimizer), so each piece can be tested on its own:

    mpirun -n 3 python -m pytest --with-mpi tests/test_ring.py
"""
