"""The run's state as named whole tensors, whatever the layout holds of it
(issue 55): the one interface between the layouts (plain ring, ZeRO-1/2/3,
tensor parallelism, pipeline stages, their products on the mesh, ps's
servers) and everything that reads or writes state outside the step
(checkpoints, --save, --keep-best, the evaluated model, "every parameter
finite", and the next issues' export, import and in-memory recovery).

The contract (state/parts.py): a layout is the list of `Part`s this rank
holds, each a box of one whole named tensor and the local array that holds
it, with a flag saying whether this rank is the box's writer (of the ranks
holding copies of the same box, exactly one writes). Over every rank, the
writers' boxes tile each tensor exactly once. Then:

- out: `[p for p in parts if p.writer]`, each (name, box, values);
- in: for every part, `p.view[...] = read(p.name, p.box)`, each rank
  reading only the boxes it holds, whatever layout wrote them.

Names are the model's tensor names (nn/spec.ModelSpec.tensors of the whole,
unsplit model: `layer3/attn.Wqkv`), its non-trainable state's
(`ModelSpec.state`), and the optimizer state by the same names under the
optimizer's (`adam.m/layer3/attn.Wqkv`).

    mpirun -n 4 python -m mpi4py -m pytest -q --only-mpi tests/test_state_layouts.py
"""
