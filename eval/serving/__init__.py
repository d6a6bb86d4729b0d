"""The serving benchmark behind ``draftsmith serve-bench`` (its command line: :mod:`draftsmith.cli.serve_bench`):

- :mod:`.metrics`: figures from vLLM's benchmark JSON and the server's spec-decode counters
  (docs/conventions.md, "Acceptance metrics"), summaries over concurrency levels, the K recommendation;
- :mod:`.client`: prompt sets per level and vLLM's ``bench serve`` run in a subprocess;
- :mod:`.guidellm`: GuideLLM (its own venv) as the alternative load generator, its report read as vLLM's;
- :mod:`.run`: the configurations compared and the study over them, written as
  :class:`draftsmith.eval.results.ServeResults`.
"""
