"""How unimae waits between OpenMP parallel regions, and why one thread should run the model.

PyTorch's CPU kernels run on OpenMP (libgomp in the torch wheel). After a parallel region a worker
spins for ``GOMP_SPINCOUNT`` iterations before it sleeps, so the next region starts without a wake-up.
A 135M model's decode step is a few hundred small regions (a linear layer each, attention), so this
wait decides much of its speed. On an idle CPU, libgomp's default spin (300,000 iterations) and our
``GOMP_SPINCOUNT=10000`` decode equally fast and a throttled or passive wait (no spinning) is clearly
slower; on CPUs shared with another job the default spin is by far the slowest (it spins on a descheduled
peer). ``benchmarks/generation.py`` measures the decode rate; the timings behind this choice are in
docs/results.md ("Speed on a quiet machine", the OpenMP bullet).

libgomp *throttles* the spin to 100 iterations whenever it manages more threads than there are CPUs:
on a 2-core machine, as soon as two threads of a process have each run a parallel region (each gets its
own team). So the model's forwards should all run on one thread: the caller's in ``Encoder``, ``unimae
ask`` and ``generate_stream`` (no worker thread), and in ``unimae serve`` the one thread of
:class:`unimae.serving.model_lock.ModelLock`, which runs the embedding chunks, prefills and decode steps.

:func:`default_spin` sets ``GOMP_SPINCOUNT=10000`` before torch is imported (``import unimae`` calls it),
unless ``GOMP_SPINCOUNT`` or ``OMP_WAIT_POLICY`` is set: as fast as libgomp's default on an idle machine,
far less time lost when other processes share the cores. Set ``OMP_WAIT_POLICY=passive`` on a machine
you share with other heavy jobs (no spinning at all), or ``GOMP_SPINCOUNT`` to your own value. It has no
effect when torch was imported before unimae (libgomp reads it once, when it loads).
"""

from __future__ import annotations

import os
import sys

DEFAULT_SPIN = "10000"


def default_spin() -> bool:
    """Set ``GOMP_SPINCOUNT`` to :data:`DEFAULT_SPIN` unless the user chose a wait policy; True if set now.

    Only before torch is imported: libgomp reads its environment once, when it loads."""
    if "torch" in sys.modules or "GOMP_SPINCOUNT" in os.environ or "OMP_WAIT_POLICY" in os.environ:
        return False
    os.environ["GOMP_SPINCOUNT"] = DEFAULT_SPIN
    return True
