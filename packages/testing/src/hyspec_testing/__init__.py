"""Test support for the hyspec packages, kept out of what `pip install hyspec-*` ships.

Modules, by the package they support: `tiny` (tiny random checkpoints of every architecture, with MTP
layers), `tiny_tokenizer` (their tokenizer), `harness` (a model on a real pool and backend, with CUDA
graphs) and `hf_reference` (transformers references) for hyspec_models; `toy_stack` (a synthetic GDN +
short-conv + attention stack, no model) for hyspec_attn_backends; `tiny_drafts` (tiny EAGLE-3 /
DFlash drafts) and `spec` (drafter cases, a reference generation loop, forced drafters) for
hyspec_spec_workers; `server` (toy engines on the real pool) for hyspec_server. Each imports only the
packages it supports, so a lower package's tests need nothing above it. Nothing in a shipped package
imports this one (`packages/server/tests/test_layering.py`).
"""

__version__ = "0.1.0"
