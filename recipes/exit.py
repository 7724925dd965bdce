"""Leave the process without interpreter finalization once a run has finished.

Note (why the recipe ends with ``os._exit``): a finished run was sometimes reported as failed
by torchrun, one rank aborting at exit with ``terminate called without an active exception``
(SIGABRT, exit code -6) after its last line. A core dump of it (4 ranks, activation
checkpointing, gdb) shows the cause: the main thread in ``Py_FinalizeEx`` (its last garbage
collection) and one of gloo's worker threads (``ProcessGroupGloo::runLoop``) dropping the last
reference to a finished all-gather (``~AsyncAllgatherWork``); its tensors' Python objects were
already dropped by Python, so freeing them takes the GIL (``TensorImpl::decref_pyobject``),
and CPython ends a thread that asks for the GIL while the interpreter finalizes with
``pthread_exit``, whose forced unwinding through torch's ``noexcept`` frames calls
``std::terminate``. The worker drops the work a moment after the collective completes, so a
collective just before the exit (the last step's log line gathers every rank's memory) races
finalization whenever that thread is descheduled, as on a loaded machine: rare and timing
dependent (pytorch/pytorch issue 190489: torch guards that GIL acquisition with
``Py_IsInitialized()`` only). ``destroy_process_group`` does not prevent it: after it (and
a ``gc.collect()``) a rank still runs two of gloo's worker threads, of a group something
still references. Without finalization there is no race.

So, once ``main`` has returned (every collective done, ``destroy_process_group`` returned) or
stopped with ``sys.exit(code)``, :func:`run_and_exit` does what finalization would have done
that matters, in its order, and leaves with ``os._exit(code)``:

1. wait for the non-daemon threads, and run their exit hooks (``threading._shutdown``: what
   the interpreter does first; a ``ThreadPoolExecutor``'s workers end there);
2. run the ``atexit`` handlers: fsdp2's exit drain (same-host peers may still read this
   process's memory: it waits for their acknowledgements and joins its gloo waiter threads),
   ``logging.shutdown`` (flushes every handler), multiprocessing's;
3. flush ``sys.stdout`` and ``sys.stderr``.

What it skips: freeing the remaining objects and the C++ static destructors, which write
nothing a run keeps (the recipe closes its files and writers before ``main`` returns).

Exit codes are those the interpreter would give: ``main`` returning is 0, ``sys.exit(n)`` is
``n`` (``None`` 0; a message is printed and gives 1). Any other exception (a crash, an
uncaught ``KeyboardInterrupt``) propagates unchanged: its traceback, torchrun's error report
and a restart under ``--max-restarts`` are as before, and so is finalization.
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
from typing import Callable, NoReturn

__all__ = ["exit_code", "finish", "run_and_exit"]


def run_and_exit(main: Callable[[], object]) -> NoReturn:
    """Run ``main``; once it returns or calls ``sys.exit``, leave through :func:`finish`."""
    try:
        main()
    except SystemExit as e:
        finish(exit_code(e.code))
    finish(0)


def exit_code(code: object) -> int:
    """The status the interpreter gives ``sys.exit(code)`` (a message goes to stderr: 1)."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF  # (what the OS keeps of it)
    print(code, file=sys.stderr)
    return 1


def finish(code: int) -> NoReturn:
    """Threads, ``atexit`` handlers, stdio flushed as at a normal exit; then ``os._exit(code)``."""
    shutdown = getattr(threading, "_shutdown", None)  # (CPython; absent: join the threads ourselves)
    if shutdown is not None and threading.current_thread() is threading.main_thread():
        shutdown()
    else:
        for thread in threading.enumerate():
            if thread is not threading.current_thread() and not thread.daemon:
                thread.join()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (AttributeError, OSError, ValueError):  # closed or replaced: nothing left to write
            pass
    os._exit(code)
