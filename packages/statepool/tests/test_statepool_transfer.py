"""Host-to-device copies (`hyspec_statepool.transfer`): small ones from pageable memory, large ones pinned;
either way the host source may change right after the call and the device gets the values it had then."""

from __future__ import annotations

import pytest
import torch
from hyspec_kernels.transfer import PAGEABLE_COPY_MAX_BYTES
from hyspec_statepool.transfer import host_staging, pin_for, to_device, upload, write_into


def test_pin_for_pins_only_large_copies_to_cuda() -> None:
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert not pin_for(4, cuda) and not pin_for(PAGEABLE_COPY_MAX_BYTES, cuda)
    assert pin_for(PAGEABLE_COPY_MAX_BYTES + 1, cuda)
    assert not pin_for(1 << 30, cpu)  # nothing is pinned for a CPU device


@pytest.mark.parametrize("n", [3, PAGEABLE_COPY_MAX_BYTES // 4 + 5])  # pageable, then pinned (int32)
def test_copies_on_the_cpu_keep_the_values_of_the_call(n: int) -> None:
    dev = torch.device("cpu")
    src = torch.arange(n, dtype=torch.int32)
    out = to_device(src, dtype=torch.int64, device=dev)
    buf = torch.full((n + 2,), -9, dtype=torch.int32)
    view = write_into(buf, src)
    src.fill_(7)  # the caller reuses its tensor at once
    assert out.tolist() == list(range(n)) and view.tolist() == list(range(n)) and buf[n:].tolist() == [-9, -9]
    staged = host_staging((n,), dtype=torch.int32, device=dev)
    staged.copy_(torch.arange(n, dtype=torch.int32))
    assert upload(staged, buf).tolist() == list(range(n))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("n", [3, PAGEABLE_COPY_MAX_BYTES // 4 + 5])
def test_cuda_copies_queue_behind_work_without_a_sync_and_keep_the_values_of_the_call(n: int) -> None:
    dev = torch.device("cuda")
    a = torch.randn(2048, 2048, device=dev)
    buf = torch.full((n,), -9, dtype=torch.int32, device=dev)
    src = torch.arange(n, dtype=torch.int32)
    pinned_src = torch.arange(n, dtype=torch.int32).pin_memory()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # any synchronising copy raises
    try:
        for _ in range(8):
            a = a @ a.T / 2048  # queued work the copies wait behind
        out = to_device(src, dtype=torch.int32, device=dev)
        from_pinned = to_device(pinned_src, dtype=torch.int32, device=dev)
        view = write_into(buf, src)
        src.fill_(7)
        pinned_src.fill_(7)  # a caller's pinned tensor too: it was copied during the call
    finally:
        torch.cuda.set_sync_debug_mode("default")
    want = list(range(n))
    assert out.tolist() == want and from_pinned.tolist() == want and view.tolist() == want
