"""Spare KV pages (`HybridStatePool(spare_pages=...)`) against none, in one process, on the demo Qwen3.5.

    python tools/bench_spare_pages.py OUT_DIR [REPS [MAX_LEN]]     # -> OUT_DIR/spare-pages[-MAX_LEN].json

For batch 1, 8 and 32 it builds a plain, an MTP (S=3) and an oracle engine (`bench_decode.oracle_registry`:
every draft right), then alternates REPS times between every engine pool with `ENGINE_SPARE_PAGES` spares
and the same pools with none (a host-bound step drifts by tens of percent over a minute on a lent machine:
only alternating runs in one process compare). Reports decode tok/s (`bench_decode.hyspec_decode`, first to
last token), the page-mapping events (`RequestTable.set_pages_many` calls that map a page) and the greedy
agreement with the plain engine. With a MAX_LEN below 4096 the pools are sized for their requests (as the
other demo benchmarks' are: 400 tokens, 208 KV pages at batch 8) and their prefix caches, filled by the
first runs, hold every other page.
"""

from __future__ import annotations

import gc
import json
import statistics
import sys
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from hyspec_statepool.pool import ENGINE_SPARE_PAGES, HybridStatePool  # noqa: E402
from hyspec_statepool.request_table import RequestTable  # noqa: E402

from tools.bench_decode import agreement, hyspec_decode, make_llm, oracle_registry  # noqa: E402
from tools.bench_round import S, prompts  # noqa: E402

NEW = 256
# a served model's context: a pool sized for max_num_seqs full contexts of 4096 tokens (spares may hold a
# 64th of it: 4 pages per request); the 400 tokens these requests reach would leave them almost none
MAX_LEN = 4096


class MapCounter:
    """Counts the `set_pages_many` calls that map at least one page (every pool of the process)."""

    def __init__(self) -> None:
        self.count = 0
        inner = RequestTable.set_pages_many

        def counted(table: RequestTable, updates: list[tuple[int, int, list[int]]]) -> None:
            self.count += any(u[2] for u in updates)
            inner(table, updates)

        RequestTable.set_pages_many = counted  # type: ignore[method-assign]


def set_spares(k: int) -> None:
    for o in gc.get_objects():
        if type(o) is HybridStatePool:
            o.spare_pages = k


def main() -> None:
    out = Path(sys.argv[1])
    reps = int(sys.argv[2]) if len(sys.argv) > 2 else 3
    max_len = int(sys.argv[3]) if len(sys.argv) > 3 else MAX_LEN
    from transformers import AutoTokenizer

    path = ROOT / "packages/server/src/hyspec_server/demo_models/qwen3_5"
    ps = prompts(AutoTokenizer.from_pretrained(str(path)), 8, 128)
    maps = MapCounter()
    res: dict[str, Any] = {"device": torch.cuda.get_device_name(), "new": NEW, "reps": reps, "runs": {}}
    res["max_model_len"] = max_len
    for b in (1, 8, 32):
        rows = [ps[i % len(ps)] for i in range(b)]

        def make(spec: dict[str, Any] | None, drafters: Any = None) -> Any:
            return make_llm(
                path, spec=spec, drafters=drafters, max_num_seqs=max(b, 8), max_len=max_len,
                kv_cache_bytes=2 << 30 if max_len >= MAX_LEN else None,
            )  # fmt: skip

        llms = {"plain": make(None)}
        ref = hyspec_decode(llms["plain"], rows, NEW)["tokens"]
        llms["mtp"] = make({"method": "mtp", "num_speculative_tokens": S})
        oracle = oracle_registry([r + o for r, o in zip(rows, ref, strict=True)], S)
        llms["oracle"] = make({"method": "ngram", "num_speculative_tokens": S}, oracle)
        for llm in llms.values():
            hyspec_decode(llm, rows, NEW)  # first use
        res[f"kv_pages/b{b}"] = [o.plan.num_kv_pages for o in gc.get_objects() if type(o) is HybridStatePool]
        each: dict[str, dict[str, Any]] = {}
        for _ in range(reps):
            for spare in (ENGINE_SPARE_PAGES, 0):
                set_spares(spare)
                for name, llm in llms.items():
                    maps.count = 0
                    r = hyspec_decode(llm, rows, NEW)
                    e = each.setdefault(f"{name}/spare{spare}", {"tok_s": [], "maps": [], "agreement": []})
                    e["tok_s"].append(r["decode_tok_s"])
                    e["maps"].append(maps.count)
                    e["agreement"].append(
                        sum(agreement(x, y) for x, y in zip(r["tokens"], ref, strict=True)) / (b * NEW)
                    )
                    e["mean_accept_length"] = r.get("mean_accept_length")
        for key, e in each.items():
            e["median_tok_s"] = statistics.median(e["tok_s"])
            res["runs"][f"{key}/b{b}"] = e
        for name in llms:
            on, off = each[f"{name}/spare{ENGINE_SPARE_PAGES}"], each[f"{name}/spare0"]
            ratio = [x / y for x, y in zip(on["tok_s"], off["tok_s"], strict=True)]
            res["runs"][f"{name}/b{b}/ratio"] = ratio
            print(b, name, "spare/none tok/s", [round(x, 3) for x in ratio], "maps", on["maps"], off["maps"])
        for llm in llms.values():
            llm.close()
    out.mkdir(parents=True, exist_ok=True)
    name = "spare-pages.json" if max_len == MAX_LEN else f"spare-pages-{max_len}.json"
    (out / name).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
