"""Starting MPI under a deadline: MPI_Init_thread called so that the
watchdog's thread can still run while it waits.

mpi4py's own MPI_Init (on `from mpi4py import MPI`, or MPI.Init_thread())
holds Python's GIL for as long as MPI_Init waits for the other ranks, so no
Python thread can notice that a rank never arrived: a job whose rank stalled
before or in MPI_Init hung silently. Calling MPI_Init_thread through ctypes
releases the GIL for the call; mpi4py then finds MPI initialized and
finalizes it at exit. Where libmpi cannot be found by path (a static build),
mpi4py initializes as usual and the deadline starts after MPI_Init.

    python -c "from hpctrain.comm.start import start_mpi"   # used by hpctrain.mnist
"""
import ctypes


def start_mpi(watchdog, inherit_errhandler=False):
    """Initialize MPI (THREAD_MULTIPLE requested) under watchdog; return the
    mpi4py.MPI module. On return the watchdog aborts through MPI_Abort.
    inherit_errhandler: communicators keep their parent's error handler
    (MPI's rule) instead of mpi4py's ERRORS_RETURN on each new one, so that
    --on-failure shrink's handler on the world reaches every communicator
    made from it (run/survival.revoke_on_failure)."""
    import mpi4py
    mpi4py.rc.initialize = False
    if inherit_errhandler:
        mpi4py.rc.errors = "default"
    mpi4py.rc.finalize = True
    from mpi4py import MPI
    from .cuda_aware import loaded_libmpi   # imports mpi4py.MPI: only now, with initialize off
    if not MPI.Is_initialized():
        paths = loaded_libmpi()
        with watchdog.waiting("MPI start-up (MPI_Init)", peer="the launcher or another rank"):
            if paths:
                provided = ctypes.c_int(-1)
                init = ctypes.CDLL(paths[0]).MPI_Init_thread   # CDLL: the GIL is released
                init.restype = ctypes.c_int
                if init(None, None, ctypes.c_int(MPI.THREAD_MULTIPLE), ctypes.byref(provided)) != 0:
                    raise RuntimeError("MPI_Init_thread failed")
            else:
                MPI.Init_thread(MPI.THREAD_MULTIPLE)
    watchdog.mpi_started(MPI.COMM_WORLD.Get_rank(), abort=MPI.COMM_WORLD.Abort)
    return MPI


def stop_survivors(watchdog, comm, code=0):
    """The way out of a run that lost ranks and went on (--on-failure shrink):
    the survivors' barrier, then this process ends with 0 without
    MPI_Finalize, which in Open MPI 5.0.11 with ULFM sometimes waited for the
    lost rank until the deadline (exit 3 after a finished run: 1 run in 3
    here); mpirun --with-ft ulfm reports 0 for it. code: the exit status
    (a run that ended with an error after the loss: its code). comm None:
    a survivor the run went on without leaves alone (run/survival.py)."""
    import os
    import sys
    if comm is not None:
        with watchdog.last_barrier(), watchdog.waiting("shutdown: every surviving rank", peer=None):
            comm.Barrier()
    watchdog.stop_using_mpi(abort=os._exit)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def stop_mpi(watchdog, guard=None):
    """A barrier of every rank, then MPI_Finalize, both under watchdog
    (MPI_Finalize waits for the other ranks in some libraries), GIL released
    as in start_mpi. The barrier comes first because a rank that leaves is
    gone for good: one that hangs on its way out after the others left would
    hold the launcher forever, so no rank leaves before every rank is here,
    and in the barrier the roll call still names a rank that does not come
    (the job then ends with exit 3; the results are written before). Then
    the watchdog's thread stops calling MPI, and from here on ends only this
    process; a process that stands still altogether (stopped, stuck in the
    kernel) is ended by `guard`, the watcher outside it (exit_guard.py),
    armed right after the barrier."""
    import os
    from mpi4py import MPI
    from .cuda_aware import loaded_libmpi
    if not MPI.Is_initialized() or MPI.Is_finalized():
        return
    with watchdog.last_barrier(), watchdog.waiting("shutdown: every rank before MPI_Finalize", peer=None):
        MPI.COMM_WORLD.Barrier()
    if guard is not None:   # from here on, a process that stops moving is ended from outside (exit_guard.py)
        guard.arm(finished=watchdog.note is not None)
    watchdog.stop_using_mpi(abort=os._exit)
    paths = loaded_libmpi()
    with watchdog.waiting("shutdown (MPI_Finalize)", peer="the other ranks"):
        if paths:
            ctypes.CDLL(paths[0]).MPI_Finalize()
        else:
            MPI.Finalize()
