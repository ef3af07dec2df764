"""Small host-to-device copies: pinned against pageable source memory, and whether they wait for the stream.

    python tools/bench_h2d.py [--values 64] [--calls 200]

Queues about half a second of matmuls, then times `--calls` non-blocking copies of `--values` int32 host
values into a device buffer, each from a fresh host tensor: pinned (`torch.tensor(..., pin_memory=True)`,
what `hyspec_kernels.transfer` did for every copy before) and pageable (what it does now up to
`PAGEABLE_COPY_MAX_BYTES`). Then one pageable copy behind the queued work, timed alone (a copy that waited
for the stream would take as long as the queue), and a check that the device got the values the host
tensor held at the call even though the host changed it right after. CUDA only.
"""

from __future__ import annotations

import argparse
import time

import torch


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--values", type=int, default=64, help="int32 values per copy")
    ap.add_argument("--calls", type=int, default=200)
    a = ap.parse_args()
    dev = torch.device("cuda")
    x = torch.randn(8192, 8192, device=dev)
    vals = list(range(a.values))
    buf = torch.empty(a.values, dtype=torch.int32, device=dev)

    def busy() -> None:
        for _ in range(20):
            x @ x  # tens of ms each, queued

    def per_call(pinned: bool) -> float:
        torch.cuda.synchronize()
        busy()
        t0 = time.perf_counter()
        for _ in range(a.calls):
            buf.copy_(torch.tensor(vals, dtype=torch.int32, pin_memory=pinned), non_blocking=True)
        took: float = (time.perf_counter() - t0) / a.calls
        torch.cuda.synchronize()
        return took

    print(f"{torch.cuda.get_device_name()}, {a.values} int32 values per copy, {a.calls} calls")
    print(f"pinned source:   {per_call(True) * 1e6:.1f} us per call")
    print(f"pageable source: {per_call(False) * 1e6:.1f} us per call")
    torch.cuda.synchronize()
    busy()
    t0 = time.perf_counter()
    buf.copy_(torch.tensor(vals, dtype=torch.int32), non_blocking=True)
    one = time.perf_counter() - t0
    t0 = time.perf_counter()
    torch.cuda.synchronize()
    rest = time.perf_counter() - t0
    print(f"one pageable copy behind the queue: {one * 1e3:.3f} ms (then the queue: {rest * 1e3:.1f} ms)")
    host = torch.tensor(vals, dtype=torch.int32)
    busy()
    buf.copy_(host, non_blocking=True)
    host.fill_(-7)  # the caller reuses its tensor at once
    torch.cuda.synchronize()
    print(f"device got the values of the call: {buf.tolist() == vals}")


if __name__ == "__main__":
    main()
