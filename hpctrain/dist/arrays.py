"""What hpctrain.dist's collectives accept and give back: NumPy arrays, and
anything else that holds host memory, without a copy where none is needed.

- a NumPy array is used as it is (its own memory);
- a PyTorch CPU tensor through `tensor.numpy()` (zero-copy: the array is a
  view of the tensor's storage), detached first; torch is never imported
  here, the object's type says what it is;
- any other object with the buffer protocol (array.array, bytearray,
  memoryview, an ml_dtypes or h5py array read into memory) through
  memoryview, also zero-copy;
- Python scalars and lists as a new array (results only, not in place).

Device memory (`__cuda_array_interface__`: CuPy, a CUDA tensor) is refused
with one line: hpctrain.dist moves host memory.

    python -c "from hpctrain.dist.arrays import host_array; import array; print(host_array(array.array('f', [1, 2])))"
"""
import numpy as np

from .errors import DistError


def is_torch(x):
    return type(x).__module__.split(".")[0] == "torch" and hasattr(x, "numpy")


def host_array(x, what="a collective", writable=False):
    """x as a NumPy array over the same memory (a copy only for Python
    scalars and lists, which `writable` refuses: nothing to write back to)."""
    if isinstance(x, np.ndarray):
        arr = x
    elif is_torch(x):
        if x.device.type != "cpu":
            raise DistError(f"{what}: a {x.device.type} tensor; hpctrain.dist moves host memory "
                            f"(tensor.cpu(), or the torch side's own device path)")
        arr = x.detach().numpy()
    elif hasattr(x, "__cuda_array_interface__"):
        raise DistError(f"{what}: a GPU array ({type(x).__name__}); hpctrain.dist moves host memory "
                        f"(copy it to the host first)")
    else:
        try:
            arr = np.asarray(memoryview(x))
        except TypeError:
            if writable:
                raise DistError(f"{what} in place needs an array, got {type(x).__name__}") from None
            arr = np.asarray(x)
    if writable and not arr.flags.writeable:
        raise DistError(f"{what} in place: the array is read-only")
    return arr


def like(x, result):
    """result (a NumPy array) as x's kind: a torch tensor for a torch tensor
    (zero-copy, torch.from_numpy), else the array itself."""
    if is_torch(x):
        import sys
        return sys.modules["torch"].from_numpy(np.ascontiguousarray(result))
    return result
