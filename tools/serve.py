#!/usr/bin/env python
"""Serve a checkpoint over an OpenAI-compatible HTTP API with step-level continuous batching.

    python tools/serve.py --checkpoint runs/tiny_cpu --port 8000 --max-batch 8

Endpoints: POST /v1/completions, /v1/chat/completions, /v1/infill; GET /v1/models, /health, /metrics.
See setdiff_mega/serve.py and docs/guide/serving.md.
"""
from setdiff_mega.serve import cli

if __name__ == "__main__":
    cli()
