"""Machine tuning: where a call's route changes; no logic lives here.

The thresholds decide only *where* the routes of :mod:`._kernels` pay off, never what a call
computes: every route's result is within the same float64-derived bound, so a retune (or turning
the fast paths off) changes speed, not behaviour. The CPU's were measured on two CPUs (AMD EPYC and
Xeon, AVX-512) and will move with hardware; the device route's is predicted from a count.
"""

from __future__ import annotations

import torch

from . import _state

# Where the FP32 training fast path pays: at one torch thread its dozen small ops pay back on inputs
# of half a million values with at least 1536 per channel. Measured fwd+bwd, fast / reference, one
# thread (AMD EPYC, AVX512): (16,256,14,14) 0.66, (64,240,6,6) 0.82, (16,64,28,28) 0.84; but
# (8,256,14,14) 1.18, (8,16,48,48) 1.40 and (4,4,128,128) 1.43 (0.26 to 0.4 million values); on a
# Xeon (AVX512): (8,240,12,12) 1.20 (1152 per channel). With more threads the reference's few large
# ops split across them while the fast path's many ops each pay a fork and join, so the size it
# needs grows with the thread count, faster than linearly (:func:`min_values`).
MIN_VALUES = 1 << 19
MIN_PER_CHANNEL = 1536
# Values per FP32 chunk and torch thread in the fast path's forward and backward (1 MiB each):
# small enough to stay in each core's cache, and each elementwise op on a chunk splits it between
# the threads, so a chunk grows with them (fewer, larger parallel ops).
CHUNK = 1 << 18
# Where the FP32 route without an input copy pays on the route a CUDA call takes: it launches three
# more small kernels than the reference (FP32 copy, FP32 kernel) and moves 10 bytes less per value
# in a training forward, 8 less in eval (counted by ``amp_bn_fix.testing.count_kernels``). A launch
# costs a few microseconds of host time, which a busy GPU hides and a small batch does not; at about
# 3 TB/s a million values' 10 MB take about as long as three launches. A prediction from the count
# until a GPU measures it: below this, the reference.
DEVICE_MIN_VALUES = 1 << 20


def min_values() -> int:
    """The fewest values the FP32 fast path takes: ``MIN_VALUES`` times the square of the thread count.

    Measured fwd+bwd at two threads (AMD EPYC, AVX512), fast / reference: (32,64,56,56) 0.56-0.76,
    (32,128,28,28) 0.70 (3.2 to 6.4 million values); (32,256,14,14) 0.89 to 1.25 from run to run
    and (8,64,56,56) 0.93 (1.6 million); (16,256,14,14) 1.19, (32,512,7,7) 1.04, (64,240,6,6)
    1.22, (8,96,24,24) 1.45 (0.4 to 0.8 million), most of which win at one thread. So at two
    threads it starts at 2 million values; beyond two nothing was measured, and the square keeps
    it to inputs where each thread's share is still a few million values.
    """
    threads = torch.get_num_threads()
    return MIN_VALUES * threads * threads


def host_route(tensor: torch.Tensor) -> bool:
    """Whether a call on ``tensor`` may read tensor values on the host and use the CPU fast paths.

    Never under ``amp_bn_fix.testing.device_route()``: CPU calls then take the route a CUDA call takes.
    """
    return tensor.is_cpu and not _state.device_route
