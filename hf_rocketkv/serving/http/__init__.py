"""The OpenAI-compatible HTTP server (FastAPI, the optional ``serve`` extra): wire format, app, start-up, metrics.

It talks to a ``GenerationManager`` only; no engine, scheduler or lockstep module is imported here (an import-linter
contract in pyproject.toml).
"""
