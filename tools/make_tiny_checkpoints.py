"""Write tiny random checkpoints of every supported hybrid architecture (thin CLI over hyspec_testing.tiny).

    python tools/make_tiny_checkpoints.py --out DIR [--arch ARCH ...] [--seed N] [--check] [--drafts]

Writes DIR/<arch>/ for each architecture (default: all) and, for the architectures with a built-in MTP
draft (the Qwen families), also DIR/<arch>-mtp3/ with three MTP layers. ``--check`` reloads every
checkpoint with transformers (model and tokenizer) and runs a short forward pass. ``--drafts`` also writes
a tiny random EAGLE-3 draft (DIR/<arch>-eagle3/) and DFlash draft (DIR/<arch>-dflash/) for each target
(hyspec_testing.tiny_drafts).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from hyspec_testing.tiny import ARCHS, MTP_ARCHS, build_tiny_checkpoint, iter_checkpoint_files


def _describe(path: Path) -> str:
    cfg = json.loads((path / "config.json").read_text(encoding="utf-8"))
    text = cfg.get("text_config", cfg)
    size = sum(f.stat().st_size for f in iter_checkpoint_files(path))
    return (
        f"{path}: {cfg['architectures'][0]} ({cfg['model_type']}), layers={text['layer_types']}, "
        f"mtp_layers={text.get('mtp_num_hidden_layers', 0)}, tied={text.get('tie_word_embeddings')}, "
        f"{size / 1024:.0f} KiB"
    )


def _check(path: Path) -> str:
    import torch
    from hyspec_testing.hf_reference import hf_logits, load_hf_model
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    text = "Hello, wörld ✓"
    ids = tok.encode(text, add_special_tokens=False)
    if tok.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False) != text:
        raise SystemExit(f"{path}: tokenizer does not round-trip {text!r}")
    model = load_hf_model(path)
    logits = hf_logits(model, ids)
    if not bool(torch.isfinite(logits).all()):
        raise SystemExit(f"{path}: non-finite logits")
    return f"  check ok: {type(model).__name__}, logits {tuple(logits.shape)}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, required=True, help="output directory")
    parser.add_argument("--arch", nargs="+", choices=ARCHS, default=list(ARCHS), help="architectures")
    parser.add_argument("--seed", type=int, default=0, help="random seed (same seed -> identical files)")
    parser.add_argument("--check", action="store_true", help="reload each checkpoint with transformers")
    parser.add_argument("--drafts", action="store_true", help="also write tiny EAGLE-3 and DFlash drafts")
    args = parser.parse_args(argv)

    for arch in dict.fromkeys(args.arch):  # de-duplicated, order kept
        variants = [(arch, None)] + ([(f"{arch}-mtp3", 3)] if arch in MTP_ARCHS else [])
        for name, mtp_layers in variants:
            path = build_tiny_checkpoint(args.out / name, arch, seed=args.seed, mtp_layers=mtp_layers)
            print(_describe(path), flush=True)
            if args.check:
                print(_check(path), flush=True)
        if args.drafts:
            from hyspec_testing.tiny_drafts import build_tiny_dflash, build_tiny_eagle3

            base = args.out / arch
            for name, build in (("eagle3", build_tiny_eagle3), ("dflash", build_tiny_dflash)):
                draft = build(args.out / f"{arch}-{name}", base, seed=args.seed)
                print(f"{draft}: tiny random {name} draft for {base}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
