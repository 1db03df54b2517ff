"""Serving: an OpenAI-compatible HTTP server with step-level continuous batching (sessions, job, scheduler,
protocol, metrics, app; the entry point is :mod:`setdiff_mega.serve`)."""
