"""Train the demo models shipped as hyspec's embedded default, from scratch, on one GPU.

    python tools/train_demo.py --out OUT [--stages all] [--seconds qwen=300,lfm2=150,...] [--seed 0]

Corpus: the Python sources on the machine (stdlib + site-packages, tools/demo/corpus.py), ~1% held out by a
hash of the path. Tokenizer: byte-level BPE (6144 tokens) trained on it. Stages (each reads what earlier
stages wrote to OUT, so they can run in separate calls):

  qwen          Qwen3.5-architecture target (GDN + gated attention) with one MTP layer trained jointly
  lfm2          LFM2-architecture target (short convolutions + attention), smaller
  eagle3-qwen   EAGLE-3 draft of the frozen Qwen3.5 target
  dflash-qwen   DFlash block draft of the frozen Qwen3.5 target
  eagle3-lfm2   EAGLE-3 draft of the frozen LFM2 target

OUT gets one HF checkpoint directory per model (qwen3_5, lfm2, qwen3_5-eagle3, qwen3_5-dflash, lfm2-eagle3;
targets carry the tokenizer), quality.json (validation loss and bits per byte next to xz -9 on the same
bytes),
train_log.json and train_loss.png. Each stage trains for its wall-clock budget (--seconds) or, to reproduce a
run exactly, a fixed step count (--steps, as train_log.json recorded).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import hashlib
import json
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
# transformers' GDN takes flash-linear-attention when it imports; fla 0.6.0 raises in the GDN backward on
# Hopper with triton < 3.7.1 (wrong gradients there), so training always runs transformers' torch form
sys.modules["fla"] = None  # type: ignore[assignment]

from tools.demo import corpus, train  # noqa: E402

STAGES = ("qwen", "lfm2", "eagle3-qwen", "dflash-qwen", "eagle3-lfm2")
DEFAULT_SECONDS = {"qwen": 330, "lfm2": 170, "eagle3-qwen": 110, "dflash-qwen": 110, "eagle3-lfm2": 80}
ROWS = {"qwen": 64, "lfm2": 64, "eagle3-qwen": 32, "dflash-qwen": 32, "eagle3-lfm2": 32}


def parse_map(text: str | None, kind: type) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for item in (text or "").split(","):
        if item:
            k, v = item.split("=")
            if k not in STAGES:
                raise SystemExit(f"unknown stage {k!r} (stages: {', '.join(STAGES)})")
            out[k] = kind(v)
    return out


def merge_json(path: Path, key: str, value: Any) -> None:
    data = json.loads(path.read_text()) if path.is_file() else {}
    data[key] = value
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


class Data:
    """Corpus split, tokenizer, training tokens on the device and validation documents."""

    def __init__(
        self, out: Path, dev: torch.device, *, vocab: int, cache: Path | None, val_files: int | None
    ) -> None:
        t0 = time.perf_counter()
        files = corpus.list_sources()
        tr, val = corpus.split_sources(files)
        print(f"corpus: {len(files)} files, {len(tr)} train / {len(val)} validation", flush=True)
        tok_dir = out / "tokenizer"
        if (tok_dir / "tokenizer.json").is_file():
            from tokenizers import Tokenizer

            self.tok = Tokenizer.from_file(str(tok_dir / "tokenizer.json"))
        else:
            self.tok = corpus.train_tokenizer(tr, vocab_size=vocab)
            corpus.save_tokenizer(self.tok, tok_dir, model_max_length=4096)
        print(f"tokenizer ready ({time.perf_counter() - t0:.0f} s)", flush=True)
        val = val[:val_files]  # a smoke test on a CPU scores a few files only
        self.val_bytes = corpus.validation_bytes(val)
        pool = concurrent.futures.ThreadPoolExecutor(1)
        self.xz = pool.submit(
            corpus.xz_bits_per_byte, self.val_bytes
        )  # lzma drops the GIL: overlaps training
        # the cache is keyed on the tokenizer, so a retrained tokenizer never reads stale tokens
        key = hashlib.sha256(self.tok.to_str().encode()).hexdigest()[:16]
        cached = cache / f"train_tokens-{key}.npy" if cache is not None else None
        if cached is not None and cached.is_file():
            arr = np.load(cached)
        else:
            arr = corpus.encode_files(self.tok, tr)
            if cached is not None:
                cached.parent.mkdir(parents=True, exist_ok=True)
                np.save(cached, arr)
        self.tokens = torch.from_numpy(arr.astype(np.int32)).to(dev)
        eos = self.tok.token_to_id(corpus.EOS)
        self.val_docs = [[*e.ids, eos] for e in self.tok.encode_batch([corpus.read_text(f) for f in val])]
        self.ids = {
            "eos_token_id": eos,
            "pad_token_id": self.tok.token_to_id(corpus.PAD),
            "bos_token_id": eos,
        }
        self.mask_id = self.tok.token_to_id(corpus.MASK)
        self.stop_ids = [eos, self.tok.token_to_id("<|im_end|>")]
        n_val = sum(len(d) for d in self.val_docs)
        print(
            f"data: {self.tokens.numel() / 1e6:.1f}M train tokens, {n_val / 1e6:.2f}M validation tokens over "
            f"{len(self.val_bytes) / 1e6:.1f} MB ({time.perf_counter() - t0:.0f} s)",
            flush=True,
        )

    def copy_tokenizer(self, out: Path, target: Path) -> None:
        for f in (out / "tokenizer").iterdir():
            shutil.copy(f, target / f.name)


def quality(model: torch.nn.Module, data: Data) -> dict[str, float]:
    nats, count = train.evaluate(model, data.val_docs)
    n_bytes = len(data.val_bytes)
    bpb = nats / np.log(2) / n_bytes
    xz = data.xz.result()
    return {
        "val_loss_nats_per_token": nats / count,
        "val_tokens": count,
        "val_bytes": n_bytes,
        "bits_per_byte": bpb,
        "xz9_bits_per_byte": xz,
        "ratio_to_xz9": bpb / xz,
    }


def load_target(path: Path, dev: torch.device) -> torch.nn.Module:
    import transformers as tf

    if not (path / "config.json").is_file():
        raise SystemExit(f"{path}: train its target stage first")
    model = tf.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(dev)
    return train._frozen(model)


def plot(out: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not importable: no train_loss.png", flush=True)
        return
    log = json.loads((out / "train_log.json").read_text())
    fig, axes = plt.subplots(1, len(log), figsize=(4.2 * len(log), 3.4), squeeze=False)
    for ax, (name, h) in zip(axes[0], sorted(log.items()), strict=True):
        pts = h["points"]
        keys = [k for k in pts[0] if k not in ("step", "seconds")] if pts else []
        for k in keys:
            ax.plot([p["step"] for p in pts], [p[k] for p in pts], label=k, lw=1)
        ax.set_title(f"{name} ({h['steps']} steps, {h['seconds']:.0f} s)", fontsize=9)
        ax.set_xlabel("step")
        ax.set_ylabel("loss (nats / token)")
        ax.set_ylim(0, min(8.0, max((p["loss"] for p in pts), default=8.0)))
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
    fig.suptitle(f"hyspec demo models: training loss on {h.get('device', '')}", fontsize=10)
    fig.tight_layout()
    fig.savefig(out / "train_loss.png", dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--stages", default="all", help=f"comma list of {', '.join(STAGES)} (default all)")
    ap.add_argument("--seconds", help="per-stage wall-clock budgets, e.g. qwen=300,lfm2=150")
    ap.add_argument("--steps", help="per-stage fixed step counts (reproduce a logged run exactly)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--vocab", type=int, default=train.VOCAB)
    ap.add_argument("--cache", type=Path, help="keep the tokenized corpus here for later calls")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--rows", help="per-stage batch rows (testing on small machines)")
    ap.add_argument("--val-files", type=int, help="score only this many validation files (testing)")
    a = ap.parse_args()
    stages = STAGES if a.stages == "all" else tuple(a.stages.split(","))
    for s in stages:
        if s not in STAGES:
            raise SystemExit(f"unknown stage {s!r} (stages: {', '.join(STAGES)})")
    seconds = {**DEFAULT_SECONDS, **parse_map(a.seconds, float)}
    steps = parse_map(a.steps, int)
    rows = {**ROWS, **parse_map(a.rows, int)}
    dev = torch.device(a.device)
    torch.backends.cuda.matmul.allow_tf32 = True
    out: Path = a.out
    out.mkdir(parents=True, exist_ok=True)
    device_name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
    data = Data(out, dev, vocab=a.vocab, cache=a.cache, val_files=a.val_files)

    def budget(stage: str) -> train.Budget:
        return train.Budget(seconds=seconds[stage], steps=steps.get(stage))

    def stream(stage: str) -> train.TokenStream:
        return train.TokenStream(data.tokens, seed=a.seed * 1000 + STAGES.index(stage))

    def log(stage: str, hist: train.History) -> None:
        merge_json(
            out / "train_log.json",
            stage,
            {
                "points": hist.points,
                "steps": hist.steps,
                "seconds": hist.seconds,
                "tokens": hist.tokens,
                "rows": rows[stage],
                "seq": train.SEQ,
                "device": device_name,
                "seed": a.seed,
            },
        )

    for stage in stages:
        print(f"== {stage} ({seconds[stage]:.0f} s budget) on {device_name}", flush=True)
        if stage == "qwen":
            cfg = train.qwen_config(a.vocab, data.ids)
            model, mtp, hist = train.train_qwen(
                stream(stage), cfg, budget=budget(stage), rows=rows[stage], seed=a.seed
            )
            train.save_target(model, out / "qwen3_5", stop_ids=data.stop_ids, mtp=mtp)
            data.copy_tokenizer(out, out / "qwen3_5")
            merge_json(out / "quality.json", "qwen3_5", quality(load_target(out / "qwen3_5", dev), data))
        elif stage == "lfm2":
            cfg = train.lfm2_config(a.vocab, data.ids)
            model, hist = train.train_lfm2(
                stream(stage), cfg, budget=budget(stage), rows=rows[stage], seed=a.seed
            )
            train.save_target(model, out / "lfm2", stop_ids=data.stop_ids)
            data.copy_tokenizer(out, out / "lfm2")
            merge_json(out / "quality.json", "lfm2", quality(load_target(out / "lfm2", dev), data))
        elif stage.startswith("eagle3"):
            name = "qwen3_5" if stage.endswith("qwen") else "lfm2"
            target = load_target(out / name, dev)
            draft, hist, config = train.train_eagle3(
                stream(stage),
                target,
                train.EAGLE3_AUX[name],
                budget=budget(stage),
                rows=rows[stage],
                seed=a.seed,
                inter=512 if name == "qwen3_5" else 384,
            )
            train.save_draft(draft, config, out / f"{name}-eagle3")
        else:
            target = load_target(out / "qwen3_5", dev)
            draft, hist, config = train.train_dflash(
                stream(stage), target, data.mask_id, budget=budget(stage), rows=rows[stage], seed=a.seed
            )
            train.save_draft(draft, config, out / "qwen3_5-dflash")
        log(stage, hist)
        if (out / "quality.json").is_file():
            print(json.dumps(json.loads((out / "quality.json").read_text()), indent=1), flush=True)
    plot(out)
    sizes = {p.relative_to(out).as_posix(): p.stat().st_size for p in sorted(out.rglob("*.safetensors"))}
    print("weights:", json.dumps(sizes), f"total {sum(sizes.values()) / 1e6:.1f} MB", flush=True)


if __name__ == "__main__":
    main()
