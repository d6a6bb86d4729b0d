"""Serving with a trained draft in production: :mod:`.proxy` (``draftsmith proxy``, an OpenAI-compatible
proxy that logs what it serves and swaps drafts without failing a request; :mod:`.managed` its
``vllm serve`` processes, :mod:`.traffic_writer` its log file) and :mod:`.adapt` (``draftsmith adapt``:
continue a deployed draft on that traffic and swap it in). Downstream of ``eval``."""
