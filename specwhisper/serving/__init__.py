"""Serving: the OpenAI-compatible HTTP server and bulk transcription on Ray."""
