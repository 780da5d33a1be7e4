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


def on_every_layout(size, look, layouts_of=None):
    """look(mesh) on a mesh of every layout, each freed after: what it saw,
    by layout. Every rank makes every mesh and runs every collective before
    a test asserts anything, so a rank whose assertion fails leaves no other
    waiting in a collective."""
    seen = {}
    for pipeline, tensor in (layouts_of or layouts)(size):
        mesh = Mesh(WORLD, pipeline, tensor)
        try:
            seen[pipeline, tensor] = look(mesh)
        finally:
            mesh.free()
    return seen


@pytest.mark.mpi(min_size=2)
def test_coordinates_count_tensor_fastest_then_data_then_pipeline():
    size, rank = WORLD.Get_size(), WORLD.Get_rank()
    seen = on_every_layout(size, lambda mesh: (
        tuple(mesh.shape), [mesh.size(a) for a in AXES], [tuple(mesh.coordinates(r)) for r in range(size)],
        [mesh.rank_of(pipeline=p, data=d, tensor=t) for p, d, t in map(mesh.coordinates, range(size))],
        mesh.coords, mesh.rank_of()))
    for (pipeline, tensor), (shape, sizes, coords, ranks, mine, me) in seen.items():
        data = size // (pipeline * tensor)
        assert shape == (pipeline, data, tensor) and sizes == [pipeline, data, tensor]
        # the rank order is this count: tensor fastest, then data, then pipeline
        assert coords == list(itertools.product(range(pipeline), range(data), range(tensor)))
        assert ranks == list(range(size))
        assert mine == coords[rank] and me == rank


@pytest.mark.mpi(min_size=2)
def test_each_axis_communicator_holds_the_line_through_this_rank_in_coordinate_order():
    size, rank = WORLD.Get_size(), WORLD.Get_rank()

    def look(mesh):
        return {axis: (mesh.comm(axis).Get_size(), mesh.comm(axis).Get_rank(), members(mesh.comm(axis)),
                       mesh.size(axis), getattr(mesh.coords, axis),
                       [mesh.rank_of(**{axis: i}) for i in range(mesh.size(axis))]) for axis in AXES}
    for layout, axes in on_every_layout(size, look).items():
        for axis, (comm_size, comm_rank, held, axis_size, coordinate, line) in axes.items():
            assert (comm_size, comm_rank) == (axis_size, coordinate), (layout, axis)
            assert held == line and rank in line, (layout, axis)


@pytest.mark.mpi(min_size=2)
def test_the_pipeline_grid_is_a_view_with_todays_placement():
    # Before the mesh, grid.py split the world itself: stage s = world ranks
    # [s R, (s + 1) R), replica = rank mod R. The view keeps that placement.
    size, rank = WORLD.Get_size(), WORLD.Get_rank()

    def look(mesh):
        grid = Grid(mesh)
        return (grid.stages, grid.replicas, grid.stage, grid.replica, grid.first, grid.last,
                grid.stage_comm is mesh.comm("data"), grid.pipe_comm is mesh.comm("pipeline"),
                members(grid.stage_comm), members(grid.pipe_comm),
                [[grid.world_rank(s, r) for r in range(grid.replicas)] for s in range(grid.stages)],
                grid.world_rank(grid.stages - 1))
    pipelines = on_every_layout(size, look, lambda n: [(p, 1) for p in range(1, n + 1) if n % p == 0])
    for (stages, _), (P, R, stage, replica, first, last, data_axis, pipe_axis, stage_members, pipe_members,
                      world_ranks, last_mine) in pipelines.items():
        replicas = size // stages
        assert (P, R) == (stages, replicas) and (stage, replica) == divmod(rank, replicas)
        assert (first, last) == (stage == 0, stage == stages - 1) and data_axis and pipe_axis
        assert stage_members == list(range(stage * replicas, (stage + 1) * replicas))
        assert pipe_members == [s * replicas + replica for s in range(stages)]
        assert world_ranks == [[s * replicas + r for r in range(replicas)] for s in range(stages)]
        assert last_mine == (stages - 1) * replicas + replica


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
