"""This rank's data for one run: where it is (`ensure_data`: --data, or the
bundled sample prepared on first use), what it is (`data_identity`: the
manifest's digest and the shapes the model is built for), and, once the
loop knows its place, the training-batch reader and this worker's part of
the test set (`Inputs`), each opened under agreement so that a bad shard
is one line on every rank.

    mpirun -n 2 python -m hpctrain.mnist --data data/mnist --steps 20
"""
import functools
import hashlib
import json

from .. import data as data_mod
from ..comm.agree import agreed
from ..data.blend import BlendReader, describe_blend
from ..data.splits import held_out, training_reader
from ..base.errors import HpctrainError


def ensure_data(given, cluster, watchdog):
    """The shard directory to train from. Without --data (given None):
    data/mnist, prepared from the bundled sample on first use by rank 0
    while the others wait."""
    if given:
        return given
    path = data_mod.default_data_dir()

    def prepare_once():
        if cluster.rank == 0 and not data_mod.is_prepared(path):
            print(f"preparing {path} from the bundled MNIST sample "
                  f"({data_mod.bundled_sample_dir()}), first use only", flush=True)
            try:
                data_mod.prepare(data_mod.bundled_sample_dir(), path, log=None)
            except HpctrainError:
                if not data_mod.is_prepared(path):  # another job may have won the race
                    raise
    agreed(cluster.comm, prepare_once, watchdog=watchdog, what="preparing the bundled sample")
    return path


def data_identity(data_dir, block_size):
    """(digest, (input shape, classes), manifest): the data this rank trains
    on, as a digest of its manifest's content (not its path: two paths may
    hold the same data, one path on two nodes different data), and the
    shapes the model is built for (text: block_size tokens, --block-size)."""
    manifest = data_mod.load_manifest(data_dir)
    try:
        shape = data_mod.model_shape(manifest, block_size)
    except HpctrainError as e:
        raise HpctrainError(f"{data_dir}: {e}") from None
    return hashlib.sha256(json.dumps(manifest, sort_keys=True).encode()).hexdigest()[:16], shape, manifest


def blend_identity(sets, block_size):
    """(digest, start line) of --data A:0.7,B:0.3: its sets' manifests and
    weights as one digest (what ranks and checkpoints compare: a resume on
    another mix is other data), and the mix in a line, once the sets are
    checked (one vocabulary, a window each: data/blend.check_blend)."""
    line = describe_blend(sets, block_size)
    parts = [f"{data_identity(path, block_size)[0]}:{weight!r}" for path, weight in sets]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16], f"blend: {line}"


class Inputs:
    """The training reader and the test part of one run (world: run/world.World;
    data: run/plan.Data)."""

    def __init__(self, world, data, compute):
        self.world, self.data, self.compute = world, data, compute   # compute: the batches' dtype (plan.precision)
        self._test = None

    def reader(self, comm, index, count, arrays=None):
        """Worker `index` of `count`'s training-batch reader (data/splits.py:
        images or token windows; arrays: the shard datasets it reads, None
        for all), agreed over comm; then this worker's test part is read too,
        before training memory is touched."""
        data = self.data
        given = {} if arrays is None else {"arrays": arrays}
        if data.blend is not None:   # the held-out part stays the first set's (data.dir)
            read = functools.partial(BlendReader, **given)
            reader = self.world.agreed(comm, read, data.blend, index, count, data.batch_size, data.seed,
                                       data.block_size)
            self.test_part()
            return reader
        read = functools.partial(training_reader, augment=data.augment or None, dtype=self.compute, **given)
        reader = self.world.agreed(comm, read, data.dir, index, count, data.batch_size, data.seed, data.block_size)
        self.test_part()
        return reader

    def test_part(self):
        """This worker's part of the test set (uint8 pixels, or token windows), read once."""
        if self._test is None:
            cluster = self.world.cluster
            self._test = self.world.agreed(cluster.worker_comm, held_out, self.data.dir, cluster.worker_index,
                                           cluster.num_workers, self.data.block_size, "test",
                                           self.data.eval_tokens)
        return self._test
