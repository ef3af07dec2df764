import cProfile, pstats, sys, time
import torch
sys.path.insert(0, "packages/attn-backends/tests")
from test_backend_metadata import _backend, D
from hyspec_kernels import advance_verify

be = _backend("cuda", move_batches=True)
ids = ["r2"]
rows = be.pool.req_rows(ids)
tok = torch.zeros(1, dtype=torch.int64, device="cuda")
vtok = torch.zeros(1, D, dtype=torch.int64, device="cuda")

def dec(i):
    return be.prepare_decode(req_rows=rows, input_ids=tok, prefix_lens=[10 + i % 200], pad_to=1)

def ver(i):
    return be.prepare_verify(req_rows=rows, block_tokens=vtok, prefix_lens=[10 + i % 200], pad_to=1)

for name, fn in (("decode", dec), ("verify", ver)):
    for i in range(200):
        fn(i)
    torch.cuda.synchronize()
    t = time.perf_counter()
    for i in range(2000):
        fn(i)
    torch.cuda.synchronize()
    print(f"{name}: {(time.perf_counter() - t) / 2000 * 1e6:.1f} us per call")
b = ver(0)
args = dict(positions=b.positions, kv_slots=b.kv_slots.tensor, prefix_lens=b.prefix_lens, kv_lens=b.kv_lens,
            q_lens=b.q_lens, cu_seqlens_q=b.cu_seqlens_q, has_initial_state=b.has_initial_state,
            page_table=b.page_table, prefix=torch.tensor([12], dtype=torch.int32, device="cuda"),
            input_ids=b.input_ids, tokens=vtok, page_size=4)
for _ in range(100):
    advance_verify(**args)
torch.cuda.synchronize()
t = time.perf_counter()
for _ in range(2000):
    advance_verify(**args)
torch.cuda.synchronize()
print(f"advance_verify alone: {(time.perf_counter() - t) / 2000 * 1e6:.1f} us per call")
from hyspec_kernels.advance.triton_kernel import advance_verify_triton
import inspect
print(inspect.signature(advance_verify_triton))
t = time.perf_counter()
for _ in range(2000):
    torch.tensor([12], dtype=torch.int32).to("cuda", non_blocking=True)
torch.cuda.synchronize()
print(f"small to_device: {(time.perf_counter() - t) / 2000 * 1e6:.1f} us per call")
pr = cProfile.Profile()
pr.enable()
for i in range(2000):
    dec(i)
pr.disable()
torch.cuda.synchronize()
pstats.Stats(pr).sort_stats("tottime").print_stats(25)
