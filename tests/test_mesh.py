"""The mesh of process groups (run/mesh.py) on COMM_WORLD: every layout of
pipeline x data x tensor the world's size allows, each rank's coordinates
(tensor fastest, then data, then pipeline), each axis's communicator (its
members and their order), the pipeline's Grid as a view of it (stage s is
world ranks [s R, (s + 1) R), as before the mesh), and the communicators
freed once.

    mpirun -n 4 python -m mpi4py -m pytest -q --only-mpi tests/test_mesh.py   # and -n 2, -n 3
"""
import itertools

import pytest
from mpi4py import MPI

from hpctrain.pipeline.grid import Grid
from hpctrain.run.mesh import AXES, Mesh

WORLD = MPI.COMM_WORLD


def layouts(size):
    """Every (pipeline, tensor) that divides size."""
    return [(p, t) for p in range(1, size + 1) for t in range(1, size + 1) if size % (p * t) == 0]


def members(comm):
    """The world ranks of comm, in comm's rank order."""
    return comm.allgather(WORLD.Get_rank())


@pytest.mark.mpi(min_size=2)
def test_coordinates_count_tensor_fastest_then_data_then_pipeline():
    size = WORLD.Get_size()
    for pipeline, tensor in layouts(size):
        mesh = Mesh(WORLD, pipeline, tensor)
        try:
            data = size // (pipeline * tensor)
            assert tuple(mesh.shape) == (pipeline, data, tensor)
            assert [mesh.size(a) for a in AXES] == [pipeline, data, tensor]
            every = list(itertools.product(range(pipeline), range(data), range(tensor)))
            assert [tuple(mesh.coordinates(r)) for r in range(size)] == every   # rank order = this count
            assert [mesh.rank_of(pipeline=p, data=d, tensor=t) for p, d, t in every] == list(range(size))
            assert mesh.coords == mesh.coordinates(WORLD.Get_rank())
            assert mesh.rank_of() == WORLD.Get_rank()
        finally:
            mesh.free()


@pytest.mark.mpi(min_size=2)
def test_each_axis_communicator_holds_the_line_through_this_rank_in_coordinate_order():
    size, rank = WORLD.Get_size(), WORLD.Get_rank()
    for pipeline, tensor in layouts(size):
        mesh = Mesh(WORLD, pipeline, tensor)
        try:
            for axis in AXES:
                comm = mesh.comm(axis)
                assert comm.Get_size() == mesh.size(axis) and comm.Get_rank() == getattr(mesh.coords, axis)
                line = [mesh.rank_of(**{axis: i}) for i in range(mesh.size(axis))]
                assert members(comm) == line and rank in line, (pipeline, tensor, axis)
        finally:
            mesh.free()


@pytest.mark.mpi(min_size=2)
def test_the_pipeline_grid_is_a_view_with_todays_placement():
    # Before the mesh, grid.py split the world itself: stage s = world ranks
    # [s R, (s + 1) R), replica = rank mod R. The view keeps that placement.
    size, rank = WORLD.Get_size(), WORLD.Get_rank()
    for stages in [p for p in range(1, size + 1) if size % p == 0]:
        mesh = Mesh(WORLD, pipeline=stages)
        try:
            grid, replicas = Grid(mesh), size // stages
            assert (grid.stages, grid.replicas) == (stages, replicas)
            assert (grid.stage, grid.replica) == divmod(rank, replicas)
            assert (grid.first, grid.last) == (grid.stage == 0, grid.stage == stages - 1)
            assert grid.stage_comm is mesh.comm("data") and grid.pipe_comm is mesh.comm("pipeline")
            assert members(grid.stage_comm) == list(range(grid.stage * replicas, (grid.stage + 1) * replicas))
            assert members(grid.pipe_comm) == [s * replicas + grid.replica for s in range(stages)]
            assert all(grid.world_rank(s, r) == s * replicas + r for s in range(stages) for r in range(replicas))
            assert grid.world_rank(stages - 1) == (stages - 1) * replicas + grid.replica
        finally:
            mesh.free()


@pytest.mark.mpi(min_size=2)
def test_a_rank_is_described_by_its_coordinates():
    size = WORLD.Get_size()
    mesh = Mesh(WORLD, pipeline=size)
    try:
        assert mesh.describe(1) == "pipeline 1, data 0, tensor 0"
    finally:
        mesh.free()
    mesh = Mesh(WORLD, pipeline=1)   # ring mode: every rank a replica
    try:
        assert mesh.describe(size - 1) == f"pipeline 0, data {size - 1}, tensor 0"
    finally:
        mesh.free()
    if size == 4:
        mesh = Mesh(WORLD, pipeline=2, tensor=2)
        try:
            assert mesh.describe(3) == "pipeline 1, data 0, tensor 1"
        finally:
            mesh.free()


@pytest.mark.mpi(min_size=2)
def test_the_communicators_are_freed_once():
    mesh = Mesh(WORLD, pipeline=WORLD.Get_size())
    comms = [mesh.comm(axis) for axis in AXES]
    mesh.free()
    assert all(comm == MPI.COMM_NULL for comm in comms)   # Free sets the handle to MPI_COMM_NULL
    mesh.free()   # nothing left: no double free
    with pytest.raises(KeyError):
        mesh.comm("data")


@pytest.mark.mpi(min_size=2)
def test_a_layout_that_does_not_divide_the_world_or_an_unknown_axis_is_refused():
    size = WORLD.Get_size()
    with pytest.raises(ValueError, match="does not divide"):
        Mesh(WORLD, pipeline=size + 1)
    mesh = Mesh(WORLD)
    try:
        with pytest.raises(ValueError, match="no axis expert"):
            mesh.rank_of(expert=0)
    finally:
        mesh.free()
