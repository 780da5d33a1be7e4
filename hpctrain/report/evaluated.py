"""What a run evaluates and saves, as the report and the frame ask for it.
`Evaluated`: what every layout shares, written once over the layout's
parts (state/layouts.py): "every parameter finite" and the --save /
--keep-best file (report/params.write_params), by the chief alone from
what it holds whole, or, `collective` (a layout that no rank holds whole),
by every rank together, the chief writing what the writers send tensor by
tensor (state/consumers.ToChief). What differs per layout is the
evaluation alone: `WholeModel`, a model every worker holds whole (ring and
ps mode: the chief evaluates it alone; a shared evaluation splits the test
set over the workers); --zero 3's (loops/ring_zero3.ShardedModel),
--tensor-parallel's (loops/ring_tensor.TensorModel) and a pipeline's
(pipeline/whole.Pipelined) evaluate on every rank together.

The interface: `collective`; `finite()` (every parameter finite);
`share_state()` (the chief's non-trainable state to every worker before a
shared evaluation); `evaluate(split)` (loss sum, correct, count over the
whole test set or "val" part); `evaluate_parts(inputs)` (the same, each
worker its part, summed over all); `write(path, step, attrs)` (--save,
--keep-best; OSError where it cannot).

    mpirun -n 2 python -m hpctrain.mnist --steps 100 --eval-every 50 --save p.h5
"""
import numpy as np
from mpi4py import MPI

from ..base import device
from ..data.splits import held_out
from ..comm.device_buffers import bcast
from ..nn.sequential import eval_forward
from ..state.consumers import ToChief, finite, parameters
from ..state.layouts import buffer_parts
from .params import chief_text, write_params, written_by_chief


class Evaluated:
    """finite, agree and write over `parts` (this rank's, state/layouts.py:
    the parameters' and the model state's; a callable giving them, asked
    when needed, taking layouts' `spread`); comm: None (the chief holds every part whole and does
    each alone) or the communicator of every rank (`collective`: each call
    made by all)."""

    def __init__(self, world, plan, spec, parts, comm=None):
        self.world, self.plan, self.spec, self.held, self.comm = world, plan, spec, parts, comm
        self.collective = comm is not None
        # samples an evaluation runs forward at once: a training step's (nn/sequential.eval_forward)
        self.forward = eval_forward(spec, plan.data.batch_size)

    def finite(self):
        device.synchronize(self.world.xp)
        return finite(parameters(self.held(), self.spec), self.comm, self.world.waiting)

    def agree(self, text):
        """The chief's text (None: nothing to say) on every rank (report/params.chief_text)."""
        return chief_text(self.world, text) if self.collective else text

    def write(self, path, step, attrs=None):
        """--save, --keep-best: report/params.py's file, the whole tensors.
        Collective: the chief writes each writer's parts as they arrive.
        OSError on the chief when it cannot (the others learn it from `agree`)."""
        device.synchronize(self.world.xp)
        parts, world = self.held(False), self.world   # the chief's replica writes what it holds: less to send
        if not self.collective:
            write_params(path, self.spec, ((p.name, p.box, device.to_host(p.view)) for p in parts), self.plan, step,
                         attrs)
            return
        full = self.spec.full
        names = [name for name, _, _, _ in full.tensors + full.state]
        stream = ToChief(self.comm, world.chief_in(self.comm), [p for p in parts if p.name in set(names)], names,
                         world.waiting)
        written_by_chief(world.chief, stream,
                         lambda: write_params(path, self.spec, stream.tensors(), self.plan, step, attrs))


class WholeModel(Evaluated):
    """A model every worker holds whole (nn/sequential.Sequential)."""

    def __init__(self, world, plan, model):
        spec = model.spec
        super().__init__(world, plan, spec, lambda spread=True: buffer_parts(spec, [(0, spec.num_params)], model.params)
                         + buffer_parts(spec, [(0, spec.num_state)], model.state, of="state"))
        self.model = model
        self._full = {}   # split -> the whole split (uint8), read once (the chief's)

    def share_state(self):
        """The chief's non-trainable state (batch-norm running statistics) to
        every worker before the evaluation they share. Each worker's own
        statistics follow its own batches; the chief's are the model's (what
        it evaluates alone, checkpoints and saves): DDP's broadcast_buffers,
        once at the end instead of at every step."""
        if not self.model.state.size:
            return
        world = self.world
        device.synchronize(world.xp)
        with world.waiting("model state broadcast", peer=world.cluster.chief_rank):
            bcast(world.cluster.worker_comm, self.model.state, root=0)

    def evaluate(self, split="test"):
        """(loss sum, correct, count) over the whole split, this rank alone."""
        if split not in self._full:
            data_dir = self.plan.data.dir
            with self.world.waiting(f"reading the {split} part of {data_dir}", peer="the file system"):
                self._full[split] = held_out(data_dir, 0, 1, self.plan.data.block_size, split=split,
                                             eval_tokens=self.plan.data.eval_tokens)
        x, y = self._full[split]
        xp = self.world.xp
        sums = self.model.evaluate(xp.asarray(x), xp.asarray(y), forward=self.forward)
        return sums["loss"], sums.get("correct", 0), sums["count"]

    def evaluate_parts(self, inputs):
        """Every worker its part of the test set (run/inputs.Inputs.test_part), one Allreduce of the sums."""
        world, xp = self.world, self.world.xp
        x, y = inputs.test_part()
        sums = self.model.evaluate(xp.asarray(x), xp.asarray(y), forward=self.forward)
        totals = np.array([sums["loss"], sums.get("correct", 0), sums["count"]], np.float64)
        with world.waiting("evaluation allreduce", peer=None):
            world.cluster.worker_comm.Allreduce(MPI.IN_PLACE, totals, op=MPI.SUM)
        return totals[0], totals[1], int(totals[2])
