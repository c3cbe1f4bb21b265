"""The host allocator keeps a pass's freed activations: the next pass does not page-fault them in again."""

import subprocess
import sys

# Passes 2.. of an MLP over 1,024 tokens (each [1024, 1536] fp32 activation is 6 MiB, above
# glibc's first mmap threshold): how many minor page faults they took.
PROBE = """
import resource, sys, torch
import torch.nn.functional as F
if sys.argv[1] == "keep":
    from worker.model.host_memory import keep_freed_memory
    assert keep_freed_memory() and keep_freed_memory()  # applied once, True again
up, down = torch.randn(1536, 576) * 0.01, torch.randn(576, 1536) * 0.01
faults = []
for _ in range(8):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    x = torch.randn(1024, 576)
    for _ in range(4):
        h = F.linear(x, up)
        x = x + F.linear(F.silu(h) * h, down)
    del x, h
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(sum(faults[2:]))
"""


def faults(mode: str) -> int:
    out = subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True, check=True)
    return int(out.stdout.strip())


def test_freed_blocks_are_kept_for_the_next_pass():
    default, kept = faults("default"), faults("keep")
    assert default > 6 * 1536  # at least one 6 MiB block (1,536 pages) mapped anew per pass
    assert kept * 10 < default  # reused from the heap

