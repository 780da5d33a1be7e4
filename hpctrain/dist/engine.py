"""The one thread that runs hpctrain.dist's collectives, in the order they
were called, and the handles the `_async` calls return.

Horovod's design: a call enqueues its work and returns a handle; a
background thread runs the work (MPI releases the GIL while it waits, so
the user's backward goes on meanwhile); `synchronize(handle)` waits for the
result. Every collective, synchronous or not, goes through the same queue,
so the order of calls is the order on the wire and each process set's
fingerprints (calls.py) come in the same order on every rank. An error in
the work is raised by synchronize(), and again by every later call: once
the ranks disagree, nothing after it can be trusted.

    python -c "from hpctrain.dist.engine import Engine; e = Engine(); print(e.wait(e.submit(lambda: 1, 'x'))); e.stop()"
"""
import queue
import threading


class Handle:
    """What an `_async` call returns: poll(handle) says whether it is done,
    synchronize(handle) waits for it and returns its result."""
    __slots__ = ("what", "done", "result", "error")

    def __init__(self, what):
        self.what, self.done, self.result, self.error = what, threading.Event(), None, None

    def __repr__(self):
        return f"Handle({self.what}, {'done' if self.done.is_set() else 'pending'})"


class Engine:
    def __init__(self):
        self._todo = queue.SimpleQueue()
        self._failed = None
        # Work submitted and not yet done. A synchronous call made when it is 0 runs
        # on the caller's thread, holding the lock (a later submit waits for it): the
        # same order, without two thread switches per call (100-150 us on loaded cores).
        self._pending = 0
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="hpctrain-dist", daemon=True)
        self._thread.start()

    def submit(self, work, what):
        """Run work() on the engine's thread after everything submitted before; a Handle."""
        if self._failed is not None:
            raise self._failed
        handle = Handle(what)
        with self._lock:
            self._pending += 1
            self._todo.put((work, handle))
        return handle

    def wait(self, handle):
        """The handle's result, once its work ran (its error raised here)."""
        while not handle.done.wait(0.5):   # wakes now and then: Ctrl-C reaches the main thread
            pass
        if handle.error is not None:
            raise handle.error
        return handle.result

    def now(self, work, what):
        """A Handle of work() run after everything submitted before: done on
        this thread when nothing is pending, else by the engine's thread."""
        with self._lock:
            if self._pending == 0:
                if self._failed is not None:
                    raise self._failed
                handle = Handle(what)
                self._do(work, handle)
                return handle
        return self.submit(work, what)

    def run(self, work, what):
        return self.wait(self.now(work, what))

    def stop(self):
        """After the work submitted so far; the thread ends."""
        self._todo.put(None)
        self._thread.join()

    def _run(self):
        while True:
            item = self._todo.get()
            if item is None:
                return
            work, handle = item
            self._do(work, handle)
            with self._lock:
                self._pending -= 1

    def _do(self, work, handle):
        if self._failed is not None:
            handle.error = self._failed
        else:
            try:
                handle.result = work()
            except BaseException as exc:   # raised in the caller's thread by wait()
                handle.error = exc
                if not getattr(exc, "collective", False):
                    # one rank's failure: the ranks may now disagree on what was sent.
                    # A collective error (every rank raised it at the same call) leaves them in step.
                    self._failed = exc
        handle.done.set()
